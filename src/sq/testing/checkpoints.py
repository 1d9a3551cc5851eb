"""Tiny random Hugging Face checkpoints: test fixtures and benchmark inputs.

Every builder ``build_<name>(out_dir, *, seed=0, dtype=torch.float32, shards=4, **config)``
writes a complete checkpoint folder the way the Hub ships one: ``config.json``,
``generation_config.json``, several ``model-XXXXX-of-YYYYY.safetensors`` shards plus
``model.safetensors.index.json``, and a real byte-level BPE tokenizer trained on the
embedded corpus.  Keyword arguments override the config (sizes); ``vocab_size`` also sets
the tokenizer's vocabulary.  Weights come from transformers' own init under
``torch.manual_seed(seed)``; constant tensors (norm weights all ones, zero biases, the
DeepSeek router bias) are then perturbed, so a loader that puts a tensor in the wrong slot
or leaves one at its default shows up as a value mismatch instead of passing by accident.  The
building itself (seeded init, perturbation, sharded save, tokenizer) is :mod:`sq.synthetic`'s.

On-disk key layouts (transformers 5.24, ``save_pretrained``):

- ``llama``: ``model.layers.{i}.mlp.gate_proj.weight``..., tied: no ``lm_head.weight``.
- ``qwen3_moe``: per-expert ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``
  (the default ``save_original_format=True`` reverts transformers' fusion).
- ``qwen3_moe_fused``: ``model.layers.{i}.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
  ``...experts.down_proj`` ``[E, H, I]`` (``save_original_format=False``).
- ``mixtral``: ``model.layers.{i}.block_sparse_moe.experts.{e}.w{1,2,3}.weight`` and
  ``...block_sparse_moe.gate.weight`` (in memory: ``mlp.experts.gate_up_proj``, ``mlp.gate``).
- ``mixtral_fused``: the ``mixtral`` model with fused ``mlp.experts.gate_up_proj`` / ``down_proj`` on disk.
- ``deepseek_v3``: per-expert layout plus a hand-made MTP layer ``model.layers.{L}.*``
  (``L = num_hidden_layers``) in its own last shard.
- ``deepseek_v3_fp8``: the ``deepseek_v3`` model in bf16, every ``*_proj.weight`` (MTP layer
  included) stored as ``float8_e4m3fn`` next to its ``*_proj.weight_scale_inv`` block scales, as
  the official DeepSeek-V3/R1 and Kimi-K2 checkpoints; ``config.json`` has their FP8
  ``quantization_config``.  transformers reads it through ``load_with_transformers``.
- ``vlm``: Qwen2-VL; disk ``model.layers.{i}...`` / ``visual...``, memory
  ``model.language_model.layers.{i}...`` / ``model.visual...``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sq.files import INDEX_NAME
from sq.synthetic import build_checkpoint

# Tiny shapes shared by the text models: fast on CPU, yet dimensions distinct enough that a
# transposed or swapped tensor fails the shape check (hidden 64, intermediate 128, expert
# intermediate 48: gate_up [E, 96, 64], down [E, 64, 48]).
_TEXT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=1024,
)
_MOE = dict(_TEXT, num_experts_per_tok=2, moe_intermediate_size=48)


def _text_kwargs(overrides: dict, defaults: dict) -> dict:
    # bos/eos follow the fixture tokenizer (ids 0 and 1), so generation and the config agree.
    return dict(defaults, bos_token_id=0, eos_token_id=1, pad_token_id=None) | overrides


# ----------------------------------------------------------------------------- builders


def build_llama(
    out_dir: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, shards: int = 4, **config
) -> Path:
    """Dense Llama with tied embeddings (no ``lm_head.weight`` on disk); ``LlamaForCausalLM``."""
    kwargs = _text_kwargs(config, dict(_TEXT, num_hidden_layers=3, tie_word_embeddings=True))
    return build_checkpoint(out_dir, "llama", kwargs, seed=seed, dtype=dtype, shards=shards)[0]


def build_qwen3_moe(
    out_dir: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, shards: int = 4, **config
) -> Path:
    """Qwen3-MoE, every layer sparse, 8 experts top-2, saved in the per-expert Hub layout."""
    defaults = dict(_MOE, num_experts=8, decoder_sparse_step=1, mlp_only_layers=[], head_dim=16)
    kwargs = _text_kwargs(config, defaults)
    return build_checkpoint(out_dir, "qwen3_moe", kwargs, seed=seed, dtype=dtype, shards=shards)[0]


def build_qwen3_moe_fused(
    out_dir: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, shards: int = 4, **config
) -> Path:
    """The ``qwen3_moe`` model saved in transformers' fused layout (``save_original_format=False``).

    Same seed -> same weights as :func:`build_qwen3_moe`, only the disk layout differs.
    """
    defaults = dict(_MOE, num_experts=8, decoder_sparse_step=1, mlp_only_layers=[], head_dim=16)
    kwargs = _text_kwargs(config, defaults)
    return build_checkpoint(
        out_dir, "qwen3_moe", kwargs, seed=seed, dtype=dtype, shards=shards, save_original_format=False
    )[0]


def build_mixtral(
    out_dir: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, shards: int = 4, **config
) -> Path:
    """Mixtral, 4 experts top-2; disk keys ``block_sparse_moe.experts.{e}.w1/w2/w3.weight``.

    transformers 5.24 ``save_pretrained`` reverts its own renaming and writes this original
    layout itself; the check below fails loudly should a future version stop doing so.
    """
    kwargs = _text_kwargs(config, dict(_MOE, num_local_experts=4, intermediate_size=48))
    path = build_checkpoint(out_dir, "mixtral", kwargs, seed=seed, dtype=dtype, shards=shards)[0]
    keys = read_index(path)
    if not any(re.search(r"\.block_sparse_moe\.experts\.\d+\.w1\.weight$", k) for k in keys):
        raise RuntimeError(f"{path}: save_pretrained no longer writes the Mixtral w1/w2/w3 layout")
    return path


def build_mixtral_fused(
    out_dir: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, shards: int = 4, **config
) -> Path:
    """The ``mixtral`` model saved in transformers' fused layout (``save_original_format=False``):
    ``mlp.experts.gate_up_proj`` / ``down_proj`` on disk, whose per-expert names transformers loads
    back are Mixtral's ``w1`` / ``w3`` / ``w2``, not ``gate_proj`` / ``up_proj`` / ``down_proj``."""
    kwargs = _text_kwargs(config, dict(_MOE, num_local_experts=4, intermediate_size=48))
    return build_checkpoint(out_dir, "mixtral", kwargs, seed=seed, dtype=dtype, shards=shards,
                            save_original_format=False)[0]


def build_deepseek_v3(
    out_dir: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, shards: int = 4, **config
) -> Path:
    """DeepSeek-V3: MLA (q/kv LoRA), 1 dense layer then MoE with a shared expert, + an MTP layer.

    3 decoder layers (``first_k_dense_replace=1``), 8 routed experts top-2 in 2 groups.  Like
    the real checkpoint (layer 61 of 61), the multi-token-prediction layer is stored as
    ``model.layers.{L}.*`` with ``L = num_hidden_layers``: a full MoE decoder layer plus
    ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.{norm,head}``, in
    its own last shard listed in the index.  ``DeepseekV3ForCausalLM`` has no slot for it.
    """
    defaults = dict(
        _MOE,
        num_hidden_layers=3,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        tie_word_embeddings=False,
    )
    kwargs = _text_kwargs(config, defaults)
    path, cfg = build_checkpoint(out_dir, "deepseek_v3", kwargs, seed=seed, dtype=dtype, shards=shards)
    _append_mtp_layer(path, cfg, dtype=dtype, seed=seed)
    return path


def build_deepseek_v3_fp8(
    out_dir: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    shards: int = 4,
    weight_block_size: tuple[int, int] = (32, 32),
    **config,
) -> Path:
    """The ``deepseek_v3`` fixture in the FP8 block-scaled layout of the official checkpoints.

    Built as bf16 (the real model's dtype), then every ``*_proj.weight`` (and ``kv_a_proj_with_mqa``) of the
    decoder and MTP layers is quantized block-wise to ``float8_e4m3fn`` (:func:`to_fp8_block_scaled`); norms,
    embeddings, heads and the router stay bf16.  The default ``[32, 32]`` blocks do not divide
    the fixture's widths 24 (``kv_a_proj_with_mqa`` rows), 48 (expert rows / ``down_proj``
    columns) and 16 (``kv_b_proj`` columns): partial last blocks, and at 2 or 3 ranks row
    splits inside a block (24 -> 12 | 12, 48 -> 24 | 24, 64 -> 22 | 22 | 20).
    """
    path = build_deepseek_v3(out_dir, seed=seed, dtype=dtype, shards=shards, **config)
    to_fp8_block_scaled(path, weight_block_size)
    return path


def build_vlm(
    out_dir: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, shards: int = 4, **config
) -> Path:
    """Qwen2-VL: a language model nested under another prefix in memory than on disk.

    Loaded by ``AutoModelForImageTextToText`` -> ``Qwen2VLForConditionalGeneration``
    (``AutoModelForCausalLM`` refuses this config in transformers 5.24).

    ====================  ========================================  ============================
    part                  on disk (Hub layout)                      in memory
    ====================  ========================================  ============================
    text decoder          ``model.layers.{i}.*``                    ``model.language_model.layers.{i}.*``
    embeddings / norm     ``model.embed_tokens.weight``,            ``model.language_model.embed_tokens.weight``,
                          ``model.norm.weight``                     ``model.language_model.norm.weight``
    vision tower          ``visual.*``                              ``model.visual.*``
    lm head               ``lm_head.weight``                        ``lm_head.weight``
    ====================  ========================================  ============================

    transformers maps these with its conversion mapping; a loader that does not know it must
    find each disk key by its longest unique trailing suffix (``layers.0.mlp.up_proj.weight``).
    ``config`` overrides go to ``text_config``.
    """
    text = _text_kwargs(config, dict(_TEXT))
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    # mrope splits head_dim/2 rotary frequencies over (time, height, width).
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    text.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})
    vision = dict(depth=1, embed_dim=32, hidden_size=text["hidden_size"], num_heads=2, mlp_ratio=2, patch_size=14)
    top = dict(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        bos_token_id=text["bos_token_id"],
        eos_token_id=text["eos_token_id"],
        # special ids must lie inside the tiny vocabulary (defaults are ~151k)
        image_token_id=text["vocab_size"] - 1,
        video_token_id=text["vocab_size"] - 2,
        vision_start_token_id=text["vocab_size"] - 3,
        vision_end_token_id=text["vocab_size"] - 4,
    )
    return build_checkpoint(out_dir, "qwen2_vl", top, seed=seed, dtype=dtype, shards=shards, image_text=True)[0]


FIXTURES: dict[str, Callable[..., Path]] = {
    "llama": build_llama,
    "qwen3_moe": build_qwen3_moe,
    "qwen3_moe_fused": build_qwen3_moe_fused,
    "mixtral": build_mixtral,
    "mixtral_fused": build_mixtral_fused,
    "deepseek_v3": build_deepseek_v3,
    "deepseek_v3_fp8": build_deepseek_v3_fp8,
    "vlm": build_vlm,
}


# ----------------------------------------------------------------------------- FP8 block-scaled

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# the Linears DeepSeek ships in FP8: attention and MLP / expert projections, the MTP eh_proj;
# not the router (mlp.gate), embeddings, lm_head or the MTP shared_head.head
FP8_WEIGHT = re.compile(r"_proj(_with_mqa)?\.weight$")


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> (``float8_e4m3fn [out, in]``, ``scale_inv`` float32 ``[ceil(out/bo), ceil(in/bi)]``).

    One absmax scale per block (partial last blocks included): ``w ~= q.float() * scale_inv``.
    """
    bo, bi = block
    out, inn = w.shape
    rows, cols = math.ceil(out / bo), math.ceil(inn / bi)
    padded = torch.zeros(rows * bo, cols * bi)
    padded[:out, :inn] = w.float()
    amax = padded.view(rows, bo, cols, bi).abs().amax(dim=(1, 3))  # [rows, cols]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / expand_blocks(scale_inv, block, (out, inn))).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale_inv


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Per-block values ``[R, C]`` -> per-element ``shape`` (cut at partial last blocks)."""
    full = scale.float().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[: shape[0], : shape[1]]


def dequantize_fp8_reference(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                             dtype: torch.dtype) -> torch.Tensor:
    """The reference dequantization: ``(q.float() * scale_inv per block).to(dtype)``, whole tensor."""
    return (q.float() * expand_blocks(scale_inv, block, tuple(q.shape))).to(dtype)


def fp8_block_size(path: Path) -> tuple[int, int] | None:
    """``weight_block_size`` of an FP8 block-scaled checkpoint's config.json, else None."""
    qc = json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
    bs = qc.get("weight_block_size") if qc.get("quant_method") == "fp8" else None
    return tuple(bs) if bs else None


def to_fp8_block_scaled(path: Path, block: tuple[int, int]) -> None:
    """Rewrite a checkpoint in place as FP8 block-scaled: each ``*_proj.weight`` -> FP8 + scale_inv.

    Each scale is written in its weight's shard (as the official checkpoints do); the index and
    config.json's ``quantization_config`` follow.
    """
    path = Path(path)
    index = json.loads((path / INDEX_NAME).read_text())
    weight_map: dict[str, str] = {}
    total = 0
    for fname in sorted(set(index["weight_map"].values())):
        tensors = load_file(path / fname)
        out = {}
        for key in sorted(tensors):
            t = tensors[key]
            if FP8_WEIGHT.search(key) and t.dim() == 2:
                out[key], out[key + "_scale_inv"] = quantize_fp8_blocks(t, block)
            else:
                out[key] = t
        save_file(out, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in out})
        total += sum(t.numel() * t.element_size() for t in out.values())
    index["weight_map"] = weight_map
    index.setdefault("metadata", {})["total_size"] = total
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def dequantized_tensors(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint with FP8 weights dequantized (reference) and scales dropped.

    ``dtype`` defaults to the config's; a checkpoint that is not FP8 comes back as stored.
    """
    tensors = read_tensors(path)
    block = fp8_block_size(path)
    if block is None:
        return tensors
    if dtype is None:
        cfg = json.loads((Path(path) / "config.json").read_text())
        dtype = getattr(torch, str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"))
    out = {}
    for key, t in tensors.items():
        if key.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(key + "_scale_inv")
        out[key] = t if scale is None else dequantize_fp8_reference(t, scale, block, dtype)
    return out


# ----------------------------------------------------------------------------- MTP layer


def _append_mtp_layer(path: Path, cfg, *, dtype: torch.dtype, seed: int) -> None:
    """Write ``model.layers.{L}.*`` into a new last shard and renumber the shards to N+1."""
    index = json.loads((path / INDEX_NAME).read_text())
    weight_map: dict[str, str] = index["weight_map"]
    n_layers = cfg.num_hidden_layers
    last = f"model.layers.{n_layers - 1}."
    shapes = {}
    for key, fname in weight_map.items():
        if key.startswith(last):
            with safe_open(path / fname, "pt") as f:
                shapes[f"model.layers.{n_layers}." + key[len(last) :]] = f.get_slice(key).get_shape()
    h, v = cfg.hidden_size, cfg.vocab_size
    mtp = f"model.layers.{n_layers}."
    shapes |= {
        mtp + "embed_tokens.weight": [v, h],
        mtp + "enorm.weight": [h],
        mtp + "hnorm.weight": [h],
        mtp + "eh_proj.weight": [h, 2 * h],  # [hidden, cat(embedding, hidden state)]
        mtp + "shared_head.norm.weight": [h],
        mtp + "shared_head.head.weight": [v, h],
    }
    gen = torch.Generator().manual_seed(seed + 2)
    tensors = {}
    for key in sorted(shapes):
        noise = torch.randn(shapes[key], generator=gen)
        is_norm = key.endswith("norm.weight") or key.endswith("layernorm.weight")
        tensors[key] = (1.0 + 0.1 * noise if is_norm else 0.02 * noise).to(dtype)

    old_files = sorted(set(weight_map.values()))
    total = len(old_files) + 1
    renamed = {old: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, old in enumerate(old_files)}
    for old, new in renamed.items():
        (path / old).rename(path / new)
    mtp_file = f"model-{total:05d}-of-{total:05d}.safetensors"
    save_file(tensors, str(path / mtp_file), metadata={"format": "pt"})

    index["weight_map"] = {k: renamed[f] for k, f in weight_map.items()} | {k: mtp_file for k in tensors}
    meta = index.setdefault("metadata", {})
    meta["total_size"] = meta.get("total_size", 0) + sum(t.numel() * t.element_size() for t in tensors.values())
    if "total_parameters" in meta:
        meta["total_parameters"] += sum(t.numel() for t in tensors.values())
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- verification


def read_index(path: Path) -> dict[str, str]:
    """``weight_map`` of a sharded checkpoint: tensor name -> shard file name."""
    return json.loads((Path(path) / INDEX_NAME).read_text())["weight_map"]


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard the index names (tiny fixtures only: all in memory)."""
    path = Path(path)
    out = {}
    for fname in sorted(set(read_index(path).values())):
        with safe_open(path / fname, "pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


_EXPERT_KEY = re.compile(r"^(?P<pre>.*)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
# disk expert projection -> (fused in-memory name, position inside gate_up)
_EXPERT_PROJ = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", 0), "w2": ("down_proj", 0)}  # fmt: skip


def _fuse_experts(disk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert disk tensors -> transformers' fused ones; other keys pass through renamed.

    ``gate_up_proj[e]`` = cat(gate_e ``[I, H]``, up_e ``[I, H]``) -> ``[E, 2I, H]``;
    ``down_proj[e]`` = down_e ``[H, I]`` -> ``[E, H, I]``.  Written independently of
    transformers' conversion code so that the check below is a real cross-check.
    """
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, list]] = {}
    for key, tensor in disk.items():
        key = key.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT_KEY.match(key)
        if m is None or m["proj"] not in _EXPERT_PROJ:
            out[key] = tensor
            continue
        fused, slot = _EXPERT_PROJ[m["proj"]]
        parts = groups.setdefault(f"{m['pre']}.experts.{fused}", {}).setdefault(int(m["e"]), [None, None])
        parts[slot] = tensor
    for name, experts in groups.items():
        order = sorted(experts)
        if order != list(range(len(order))):
            raise AssertionError(f"{name}: experts {order} are not 0..E-1")
        if name.endswith("gate_up_proj"):
            out[name] = torch.stack([torch.cat(experts[e], dim=0) for e in order])  # [E, 2I, H]
        else:
            out[name] = torch.stack([experts[e][0] for e in order])  # [E, H, I]
    return out


def _suffix_match(key: str, model_keys: list[str]) -> str | None:
    """The model key matched by the longest trailing-component suffix of ``key`` matching one key."""
    parts = key.split(".")
    for start in range(len(parts)):
        suffix = ".".join(parts[start:])
        hits = [m for m in model_keys if m == suffix or m.endswith("." + suffix)]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            return None  # shorter suffixes only match more keys
    return None


def mtp_keys(keys, num_hidden_layers: int) -> list[str]:
    """Checkpoint keys of layers past the model's last decoder layer (DeepSeek MTP)."""
    pattern = re.compile(r"^model\.layers\.(\d+)\.")
    return sorted(k for k in keys if (m := pattern.match(k)) and int(m[1]) >= num_hidden_layers)


def load_with_transformers(path: Path, dtype: torch.dtype | str = "auto"):
    """Load a checkpoint with the Auto class its config asks for (VLMs: image-text-to-text).

    An FP8 block-scaled checkpoint is dequantized by :func:`dequantize_fp8_reference` and handed
    to ``from_pretrained`` as a state dict (transformers' own key conversion still runs): on CPU
    transformers 5.24 dequantizes FP8 itself with a block size derived from the scale grid,
    which is wrong or refused where the block size does not divide a dimension.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
    archs = getattr(cfg, "architectures", None) or []
    image_text = any("ConditionalGeneration" in a for a in archs)
    auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    if fp8_block_size(path) is None:
        return auto.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    del cfg.quantization_config
    cls = auto._model_mapping[type(cfg)]  # the Auto class wants a path; the model class takes state_dict alone
    return cls.from_pretrained(None, config=cfg, state_dict=dequantized_tensors(path), dtype=dtype)


def verify_checkpoint(path: Path) -> None:
    """Load ``path`` with transformers and check every tensor equals the saved safetensors value.

    Disk keys are mapped to model keys by: exact name; per-expert -> fused stacking
    (``_fuse_experts``, Mixtral ``w1/w3/w2`` and ``block_sparse_moe`` included); then the
    longest unique suffix (VLM prefixes).  MTP layers (``model.layers.{>= L}``) are skipped.
    Every model tensor must be filled (a tied ``lm_head`` counts through its embedding), every
    remaining disk tensor must land somewhere, values must match bit for bit.

    Raises:
        AssertionError: naming every mismatched, missing or unmapped key.
    """
    path = Path(path)
    model = load_with_transformers(path)
    state = model.state_dict()
    text_cfg = model.config.get_text_config()
    disk = dequantized_tensors(path)  # FP8 weights by the reference dequantization, scales dropped
    skipped = set(mtp_keys(disk, text_cfg.num_hidden_layers))
    fused = _fuse_experts({k: v for k, v in disk.items() if k not in skipped})

    model_keys = list(state)
    problems: list[str] = []
    filled: dict[str, str] = {}
    for key, tensor in fused.items():
        target = key if key in state else _suffix_match(key, model_keys)
        if target is None:
            problems.append(f"{path}: disk tensor {key} has no unique model slot")
            continue
        if target in filled:
            problems.append(f"{path}: {key} and {filled[target]} both map to {target}")
            continue
        filled[target] = key
        have = state[target]
        if have.shape != tensor.shape or have.dtype != tensor.dtype:
            problems.append(
                f"{path}: {key} {tuple(tensor.shape)} {tensor.dtype} -> {target} {tuple(have.shape)} {have.dtype}"
            )
        elif not torch.equal(have, tensor):
            err = (have.float() - tensor.float()).abs().max().item()
            problems.append(f"{path}: {key} -> {target} differs (max abs {err:.3g})")
    filled_ptrs = {state[k].data_ptr() for k in filled}
    for key in model_keys:
        if key not in filled and state[key].data_ptr() not in filled_ptrs:
            problems.append(f"{path}: model tensor {key} is not in the checkpoint")
    if problems:
        raise AssertionError("\n".join(problems))


class CheckpointFactory(Mapping):
    """``factory["llama"]`` builds the fixture on first access (once per session) -> ``Path``."""

    def __init__(self, root: Path):
        self._root = root
        self._built: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in FIXTURES:
            raise KeyError(f"unknown checkpoint fixture {name!r}; known: {sorted(FIXTURES)}")
        if name not in self._built:
            self._built[name] = FIXTURES[name](self._root / name)
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(FIXTURES)

    def __len__(self) -> int:
        return len(FIXTURES)


def build_sparse(out_dir: Path, model_type: str, *, dtype: torch.dtype = torch.bfloat16, tokenizer: bool = True,
                 **config) -> Path:
    """A checkpoint of any size that takes no disk: one safetensors file whose header is real (every tensor of
    ``model_type``'s model built on meta from ``config``, under the model's own names: the fused-experts layout)
    and whose data is a hole (``truncate``: reads give zeros), with ``config.json`` and, with ``tokenizer``,
    the tiny tokenizer (its vocabulary is ``vocab_size``'s only up to a few thousand).  For what reads only
    headers (planning, preflights); a job that fills it reads zeros.  A tied lm_head is not stored."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sq.synthetic import build_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.for_model(model_type, **config)
    cfg.dtype = dtype
    cfg.save_pretrained(out_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    tied = getattr(cfg, "tie_word_embeddings", False)
    names = {str(k): v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    tag = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[dtype]
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for name, t in names.items():
        n = t.numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": tag, "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out_dir / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + at)
    if tokenizer:
        build_tokenizer(out_dir, cfg.vocab_size)
    return out_dir


def build_sparse_llama(out_dir: Path, *, dtype: torch.dtype = torch.bfloat16, **config) -> Path:
    """A dense Llama of any size that takes no disk (:func:`build_sparse`), tied embeddings, the tiny tokenizer."""
    return build_sparse(out_dir, "llama", dtype=dtype, **_text_kwargs(config, dict(_TEXT, tie_word_embeddings=True)))
