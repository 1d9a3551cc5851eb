"""Sharded loading: every fixture architecture at world sizes 1, 2, 3 and ep 2, against transformers.

Each rank's local shard must equal the checkpoint slice it covers exactly, and a forward
pass of the sharded model must match plain ``from_pretrained`` (fp32, max abs diff <= 1e-5).
Every box of these fp32 fixtures is one byte range of its file, so all are read with preadv.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks

ARCHS = ["llama", "qwen3_moe", "qwen3_moe_fused", "mixtral", "deepseek_v3", "vlm"]
MOE = ["qwen3_moe", "qwen3_moe_fused", "mixtral", "deepseek_v3"]


def reference_model(path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(path)
    cls = AutoModelForCausalLM if type(cfg) in AutoModelForCausalLM._model_mapping else AutoModelForImageTextToText
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def _load_and_compare(rank, world, paths: dict, ep: int):
    from sq.load.fill import local_box
    from sq.load.loader import load_sharded

    out = {}
    for name, path in paths.items():
        model = load_sharded(path, ep=ep, dtype=torch.float32)
        ref = reference_model(path)
        ref_sd = ref.state_dict()
        mismatched, local_numel, total_numel = [], 0, 0
        for n, p in model.named_parameters():
            local, off = local_box(p)
            want = ref_sd[n][tuple(slice(o, o + s) for o, s in zip(off, local.shape))]
            if not torch.equal(local, want):
                mismatched.append(n)
            local_numel += local.numel()
            total_numel += p.numel()
        torch.manual_seed(0)
        ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, 12))
        with torch.no_grad():
            diff = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
        reader = model.sq_plan.reader()
        out[name] = dict(mismatched=mismatched, diff=diff, local=local_numel, total=total_numel,
                         carried=list(model.sq_plan.carried), direct=reader.direct_reads, mapped=reader.mapped_reads,
                         views=reader.file_views)
    return out


@pytest.mark.parametrize("world,ep", [(1, 1), (2, 1), (3, 1), (2, 2)])
def test_sharded_load_matches_transformers(checkpoints, world, ep):
    names = ARCHS if ep == 1 else MOE
    paths = {n: str(checkpoints[n]) for n in names}
    results = run_ranks(_load_and_compare, world, paths, ep, timeout=400)
    for name in names:
        per_rank = [r[name] for r in results]
        for rank, r in enumerate(per_rank):
            assert r["mismatched"] == [], f"{name} rank {rank}: local shards differ: {r['mismatched'][:5]}"
            assert r["diff"] <= 1e-5, f"{name} rank {rank}: logits differ by {r['diff']}"
            # fp32 checkpoint, fp32 model: every box (row shard, expert, expert slice) is one byte
            # range: a whole local shard is mapped (load_sharded's default), a part of one read with preadv
            # (at 3 ranks FSDP2 pads the last rank's uneven shards: those are copied)
            assert (r["views"] > 0 or world == 3) and r["direct"] + r["views"] > 0 and r["mapped"] == 0, \
                f"{name} rank {rank}: {r['views']} shards mapped, " \
                f"{r['direct']} boxes read directly, {r['mapped']} through safetensors"
        # the shards partition the model: no rank holds everything once world > 1
        local = [r["local"] for r in per_rank]
        assert sum(local) == per_rank[0]["total"]
        if world > 1:
            assert max(local) < per_rank[0]["total"]


def _load_smollm2(rank, world, path):
    from sq.load.loader import load_sharded
    from transformers import AutoModelForCausalLM

    model = load_sharded(path, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.arange(3, 67).view(2, 32)
    with torch.no_grad():
        return (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()


@pytest.mark.slow
def test_smollm2_two_ranks_matches_transformers(smollm2_ckpt):
    diffs = run_ranks(_load_smollm2, 2, str(smollm2_ckpt), timeout=300)
    assert max(diffs) <= 1e-5, diffs
