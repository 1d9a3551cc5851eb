"""Checkpoints at the real widths of the models sq exists for, without their weights.

``REAL_CONFIGS`` holds the fields of DeepSeek-V3's, Kimi-K2's and Qwen3-235B-A22B's Hub ``config.json`` that
their models read.  :func:`build_real_width` writes a checkpoint of a few of their decoder layers at those
widths, tensor by tensor, in the Hub's layout (per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``;
with ``fp8_block``, every projection ``float8_e4m3fn`` beside a float32 ``weight_scale_inv`` per block, as
DeepSeek-V3 and Kimi-K2 ship), from random values scaled ``1 / sqrt(fan_in)``.  Only the vocabulary is cut
to the tiny tokenizer's (the root's size is not what a block's width decides).  The builder holds one tensor
at a time, so a 16-expert DeepSeek-V3 layer (~1 GB of FP8) builds in a few hundred MiB.

    from sq.testing.realwidth import build_real_width
    build_real_width("ckpt", "DeepSeek-V3", layers=1, experts=16)          # the real-widths issue's layer
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from sq.files import INDEX_NAME

REAL_CONFIGS: dict[str, tuple[str, dict]] = {
    "DeepSeek-V3": ("deepseek_v3", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840, tie_word_embeddings=False)),
    "Qwen3-235B-A22B": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
        tie_word_embeddings=False)),
}
# Kimi-K2: DeepSeek-V3's architecture with these fields changed
REAL_CONFIGS["Kimi-K2"] = ("deepseek_v3", dict(
    REAL_CONFIGS["DeepSeek-V3"][1], vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
    n_routed_experts=384, routed_scaling_factor=2.827, n_group=1, topk_group=1, first_k_dense_replace=1,
    max_position_embeddings=131072))
# the real checkpoints' source formats: DeepSeek-V3 and Kimi-K2 in FP8 128 x 128 blocks, Qwen3 in bf16
FP8_SOURCES = {"DeepSeek-V3": (128, 128), "Kimi-K2": (128, 128)}
EXPERT_KEYS = {"n_routed_experts", "num_experts"}


def real_config(name: str, *, layers: int, experts: int | None = None, vocab: int = 4096, dense_layers: int = 0,
                **overrides) -> tuple[str, dict]:
    """``(model_type, config)`` of ``name`` at its real widths with ``layers`` decoder layers (the first
    ``dense_layers`` dense), ``experts`` routed experts (default: all), the vocabulary cut to ``vocab``."""
    if name not in REAL_CONFIGS:
        raise KeyError(f"unknown real config {name!r}; known: {sorted(REAL_CONFIGS)}")
    model_type, cfg = REAL_CONFIGS[name]
    cfg = dict(cfg, num_hidden_layers=layers, vocab_size=vocab, **overrides)
    if experts is not None:
        for k in EXPERT_KEYS & cfg.keys():
            cfg[k] = experts
        cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], experts)
        if "n_group" in cfg:  # DeepSeek's group-limited routing: groups must divide the experts
            g = math.gcd(cfg["n_group"], experts)
            cfg.update(n_group=g, topk_group=min(cfg["topk_group"], g))
    if model_type == "deepseek_v3":
        cfg["first_k_dense_replace"] = dense_layers
    elif model_type == "qwen3_moe":
        cfg["mlp_only_layers"] = list(range(dense_layers))
    return model_type, cfg


def _hub_tensors(model) -> list[tuple[str, tuple[int, ...], int]]:
    """``(checkpoint key, shape, fan_in)`` of every tensor a Hub checkpoint of ``model`` (on meta) stores:
    fused experts split back into per-expert projections, as ``save_pretrained`` writes them."""
    out = []
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H] -> gate_proj / up_proj [I, H] each
            base, (e_n, two_i, h) = name[: -len("gate_up_proj")], shape
            for e in range(e_n):
                out += [(f"{base}{e}.{p}.weight", (two_i // 2, h), h) for p in ("gate_proj", "up_proj")]
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            base, (e_n, h, i) = name[: -len("down_proj")], shape
            out += [(f"{base}{e}.down_proj.weight", (h, i), i) for e in range(e_n)]
        else:
            out.append((name, shape, shape[-1] if len(shape) == 2 else 0))
    return out


def build_real_width(out_dir: Path | str, name: str = "DeepSeek-V3", *, layers: int = 1, experts: int | None = 16,
                     fp8_block: tuple[int, int] | None | str = "source", seed: int = 0, shard_bytes: int = 1 << 30,
                     **overrides) -> Path:
    """Write ``name``'s first ``layers`` decoder layers at its real widths (:func:`real_config`) to ``out_dir``.

    ``fp8_block``: ``"source"`` stores what the real checkpoint stores (:data:`FP8_SOURCES`), None bf16.
    Norm weights are ones perturbed by 1 %, biases small; every matrix ``N(0, 1) / sqrt(fan_in)`` (the router
    too, so routing is not uniform).  Shards of about ``shard_bytes``; the index and ``config.json`` (with
    the FP8 ``quantization_config`` where FP8) last."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sq.synthetic import build_tokenizer
    from sq.testing.checkpoints import FP8_WEIGHT, quantize_fp8_blocks

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_type, cfg_fields = real_config(name, layers=layers, experts=experts, **overrides)
    block = FP8_SOURCES.get(name) if fp8_block == "source" else fp8_block
    cfg = AutoConfig.for_model(model_type, **cfg_fields)
    cfg.dtype = torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, shape, fan_in in _hub_tensors(model):
        if len(shape) == 2:
            w = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
        else:  # norms (ones, perturbed), biases (small)
            base = 1.0 if key.endswith("norm.weight") or "norm" in key.rsplit(".", 2)[-2] else 0.0
            w = base + 0.01 * torch.randn(shape, generator=gen)
        if block is not None and FP8_WEIGHT.search(key) and w.dim() == 2:
            q, s = quantize_fp8_blocks(w, block)
            new = {key: q, key + "_scale_inv": s}
        else:
            new = {key: w.to(torch.bfloat16)}
        nbytes = sum(t.numel() * t.element_size() for t in new.values())
        if shards[-1] and size + nbytes > shard_bytes:
            _write_shard(out_dir, len(shards), shards[-1])
            shards.append({})
            size = 0
        shards[-1].update(new)
        size += nbytes
    _write_shard(out_dir, len(shards), shards[-1])
    weight_map, total_size = {}, 0
    for k, (fname, nbytes) in _renamed(out_dir, len(shards)).items():
        weight_map[k] = fname
        total_size += nbytes
    (out_dir / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total_size},
                                                  "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    cfg.save_pretrained(out_dir)
    if block is not None:
        c = json.loads((out_dir / "config.json").read_text())
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": list(block)}
        (out_dir / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    build_tokenizer(out_dir, cfg.vocab_size)
    return out_dir


def _write_shard(out_dir: Path, i: int, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(out_dir / f"part-{i:05d}.safetensors"), metadata={"format": "pt"})
    tensors.clear()


def _renamed(out_dir: Path, total: int) -> dict[str, tuple[str, int]]:
    """The parts renamed ``model-XXXXX-of-YYYYY.safetensors`` once their count is known; key -> (file, bytes)."""
    from safetensors import safe_open

    out = {}
    for i in range(1, total + 1):
        src = out_dir / f"part-{i:05d}.safetensors"
        dst = out_dir / f"model-{i:05d}-of-{total:05d}.safetensors"
        src.rename(dst)
        with safe_open(str(dst), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (dst.name, math.prod(sl.get_shape()) * _itemsize(sl.get_dtype()))
    return out


def _itemsize(tag: str) -> int:
    return {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "I64": 8}[tag]
