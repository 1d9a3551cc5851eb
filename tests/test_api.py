"""Python API: a 2-rank FSDP2 training loop quantizes its model in place and exports a checkpoint.

The model is trained for a few steps (real FSDP2 forward/backward/optimizer over gloo), then
``sq.quantize`` runs GPTQ on it without any checkpoint on disk.  transformers loads the output
with no missing or unexpected keys, and its logits equal those of the in-place fake-quantized
training model (gathered whole), which must differ from the trained fp model's.
"""

from __future__ import annotations

import json

import pytest
import torch

from harness import run_ranks

GS = 16


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _train_then_quantize(rank, world, out, tok_dir, algo):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoTokenizer

    import sq

    model = _tiny_llama(0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch: data parallel
    losses = []
    ids = torch.randint(0, 256, (4, 32), generator=g)  # one batch per rank, seen 5 times: loss must drop
    for _ in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    trained = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    calib = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(7))  # same on every rank
    report = sq.quantize(model, out, algo=algo, group_size=GS, calibration=calib,
                         tokenizer=AutoTokenizer.from_pretrained(tok_dir),
                         **({"iters": 20, "batch_size": 4} if algo == "signround" else {}))
    assert model.training, "the caller's train/eval mode is restored"
    quantized = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    if rank == 0:  # tensors go through files: the harness's queue carries plain objects
        from safetensors.torch import save_file

        save_file(trained, f"{out}.trained.safetensors")
        save_file(quantized, f"{out}.quantized.safetensors")
    dist.barrier()
    return {"losses": losses, "report": report}


@pytest.mark.parametrize("algo", ["gptq", "gptaq", "rtn", "signround", "awq"])
def test_train_quantize_export_2_ranks(checkpoints, tmp_path, algo):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "q"
    res = run_ranks(_train_then_quantize, 2, str(out), str(checkpoints["llama"]), algo, timeout=240)
    from safetensors.torch import load_file

    r0 = res[0]
    r0["trained"], r0["quantized"] = (load_file(f"{out}.{k}.safetensors") for k in ("trained", "quantized"))
    assert r0["losses"][-1] < r0["losses"][0]  # it did train
    assert res[1]["report"] == {} and r0["report"]["world_size"] == 2
    assert r0["report"]["source"] == "in-memory LlamaForCausalLM"
    # the dequantized weights differ from the trained ones (quantized in place)
    for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert not torch.equal(r0["trained"][k], r0["quantized"][k])

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert (out / "tokenizer.json").is_file()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"

    ref = _tiny_llama(0)
    ref.load_state_dict(r0["quantized"])
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert (got - want).norm() / want.norm() <= 1e-3


def _unsharded_refused(rank, world, out):
    import sq
    from sq.errors import SqError

    model = _tiny_llama(0)
    try:
        sq.quantize(model, out, algo="rtn", group_size=GS)
    except SqError as e:
        return str(e)
    return None


def test_unsharded_model_is_refused_on_every_rank(tmp_path):
    msgs = run_ranks(_unsharded_refused, 2, str(tmp_path / "q"), timeout=120)
    assert msgs[0] == msgs[1]
    assert "model.layers.0" in msgs[0] and "fully_shard each decoder layer" in msgs[0]
    assert not (tmp_path / "q").exists()


def _nccl_alone_refused(rank, world, out):
    import torch.distributed as dist

    import sq
    from sq.errors import SqError

    real = dist.get_backend
    dist.get_backend = lambda *a, **k: "nccl"  # a training framework's NCCL-only group, as sq sees it
    try:
        sq.quantize(_tiny_llama(0), out, algo="rtn", group_size=GS)
    except SqError as e:
        return str(e)
    finally:
        dist.get_backend = real
    return None


def test_nccl_only_process_group_is_refused_on_every_rank(tmp_path):
    """sq's collectives carry small CPU tensors: a group of NCCL alone (which refused them on the
    first GPU run) is refused up front with the fix, on every rank, before anything is written."""
    msgs = run_ranks(_nccl_alone_refused, 2, str(tmp_path / "q"), timeout=120)
    assert msgs[0] == msgs[1] and 'cpu:gloo,cuda:nccl' in msgs[0], msgs
    assert not (tmp_path / "q").exists()
