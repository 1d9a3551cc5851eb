"""The sharded loader on CUDA with NCCL: same checks as the CPU suite."""

import pytest
import torch

from harness import run_ranks


def _load_cuda(rank, world, path):
    from sq.load.fill import local_box
    from sq.load.loader import load_sharded
    from transformers import AutoModelForCausalLM

    model = load_sharded(path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    sd = ref.state_dict()
    bad = []
    for n, p in model.named_parameters():
        local, off = local_box(p)
        if local.device.type != "cuda" or not torch.equal(local, sd[n][tuple(slice(o, o + s) for o, s in zip(off, local.shape))]):
            bad.append(n)
    ids = torch.arange(24, device="cuda").view(2, 12)
    with torch.no_grad():
        diff = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    return bad, diff


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_load_on_gpus(checkpoints, arch):
    world = min(torch.cuda.device_count(), 2)
    for bad, diff in run_ranks(_load_cuda, world, str(checkpoints[arch]), backend="nccl", timeout=300):
        assert bad == [] and diff <= 1e-4
