"""The conformance zoo: a tiny seeded checkpoint of every architecture family users bring.

``ZOO`` lists transformers ``model_type``s by family (dense, MoE, hybrid, VLM) with the config
overrides that make each tiny (hidden 64, 2-4 layers, 4 experts) yet keep its layout features
(shared experts, dense-first layers, sliding windows, linear-attention / SSM layers, biases).
:func:`build_zoo` writes one the way the Hub ships it (``save_pretrained``'s original-format keys);
:func:`check_output` proves a quantized output of it loads in transformers with no missing or
unexpected keys and gives the logits of the source model with each quantized weight replaced by its
dequantized value from the output.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sq.synthetic import build_checkpoint
from sq.formats.transforms import apply_online_transforms, transform_groups

# sizes every family shares: distinct widths, so a transposed tensor fails a shape check
_BASE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=528, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    tie_word_embeddings=False,
)
# every key a MoE config might spell its sizes with; only those the config class has are set
_MOE = dict(
    moe_intermediate_size=48, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    shared_expert_intermediate_size=48, n_shared_experts=1, decoder_sparse_step=1, mlp_only_layers=[],
    first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, num_shared_experts=1, moe_num_experts=4, moe_k=2,
    moe_layer_start_index=1, expert_intermediate_size=48,
)


@dataclass(frozen=True)
class ZooEntry:
    model_type: str
    family: str  # dense | moe | hybrid | vlm
    overrides: dict = field(default_factory=dict)
    moe: bool = False  # routed experts (run with --ep 2)
    # why sq's model path leaves this type's routed experts unquantized (its runs pass
    # --allow-unquantized-experts, and check_output accepts full-precision experts); None: every routed expert
    # weight of the output must be quantized
    carried_experts: str | None = None
    model_free_experts: bool = False  # model-free quantizes the experts the model path carries

    def allow_carried(self, model_free: bool) -> bool:
        """Whether a run (model-free or not) of this type writes full-precision routed experts."""
        return self.carried_experts is not None and not (model_free and self.model_free_experts)


def _e(model_type: str, family: str, *, moe: bool | None = None, carried_experts: str | None = None,
       model_free_experts: bool = False, **overrides) -> ZooEntry:
    return ZooEntry(model_type, family, overrides, family == "moe" if moe is None else moe, carried_experts,
                    model_free_experts)


# why the model path carries a type's routed experts (ZooEntry.carried_experts)
_TRANSPOSED = "stored [E, in, out] (gpt-oss, Llama 4): no layout transformers loads back quantized from the model path"
_NO_MAPPING = "transformers has no per-expert conversion mapping for them"
_ZERO = "zero-compute slots beside the experts: the model path's EP split needs equal slots (model-free quantizes them)"


_MLA = dict(num_key_value_heads=4, head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=32)
# multimodal rope: head_dim 16 / 2 frequencies over (time, height, width)
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16,
              mamba_d_conv=4, mamba_expand=2)
_LINEAR = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               layer_types=["linear_attention", "full_attention"])

ZOO: dict[str, ZooEntry] = {e.model_type: e for e in [
    # dense
    _e("llama", "dense"), _e("mistral", "dense"), _e("qwen2", "dense"), _e("qwen3", "dense"),
    _e("gemma", "dense"), _e("gemma2", "dense"), _e("gemma3_text", "dense"),
    _e("gemma4_text", "dense", vocab_size_per_layer_input=528, hidden_size_per_layer_input=16, global_head_dim=16,
       layer_types=["sliding_attention", "full_attention"]),
    _e("phi3", "dense"), _e("phi", "dense"), _e("cohere", "dense"), _e("cohere2", "dense"),
    _e("olmo2", "dense"), _e("olmo3", "dense"), _e("granite", "dense"), _e("stablelm", "dense"),
    _e("starcoder2", "dense"), _e("glm4", "dense"), _e("smollm3", "dense"), _e("exaone4", "dense"),
    _e("seed_oss", "dense"), _e("ernie4_5", "dense"), _e("apertus", "dense"), _e("nemotron", "dense"),
    _e("helium", "dense"), _e("ministral", "dense"),
    # MoE
    _e("mixtral", "moe"), _e("qwen2_moe", "moe"), _e("qwen3_moe", "moe"), _e("deepseek_v2", "moe", **_MLA),
    _e("deepseek_v3", "moe", **_MLA),
    _e("deepseek_v32", "moe", **_MLA, index_head_dim=16, index_n_heads=2, index_topk=8,
       mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention"] * 2),
    _e("deepseek_v4", "moe", o_lora_rank=16), _e("gpt_oss", "moe", carried_experts=_TRANSPOSED),
    _e("llama4_text", "moe", carried_experts=_TRANSPOSED), _e("phimoe", "moe"),
    _e("granitemoe", "moe", carried_experts=_NO_MAPPING), _e("granitemoeshared", "moe", carried_experts=_NO_MAPPING),
    _e("olmoe", "moe"), _e("ernie4_5_moe", "moe"), _e("glm4_moe", "moe"), _e("dots1", "moe"),
    _e("hunyuan_v1_moe", "moe"),
    _e("longcat_flash", "moe", **_MLA, carried_experts=_ZERO, model_free_experts=True, num_layers=2,
       expert_ffn_hidden_size=48, zero_expert_num=2, moe_topk=2),
    _e("minimax", "moe", layer_types=["linear_attention", "full_attention"]), _e("flex_olmo", "moe"),
    _e("lfm2_moe", "moe", num_dense_layers=1, layer_types=["conv", "full_attention"]),
    _e("exaone_moe", "moe"), _e("qwen3_5_moe_text", "moe", **_LINEAR),
    _e("afmoe", "moe", num_dense_layers=1, global_attn_every_n_layers=2),
    # hybrids: linear attention / SSM layers beside attention
    _e("qwen3_next", "hybrid", **_LINEAR), _e("qwen3_5_text", "hybrid", **_LINEAR),
    _e("kimi_linear", "hybrid", **_MLA, linear_head_dim=16, linear_num_heads=4, num_experts_per_token=2,
       layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"]),
    _e("falcon_h1", "hybrid", **_MAMBA, mamba_d_ssm=128),
    _e("nemotron_h", "hybrid", layers_block_type=["mamba", "moe", "attention", "mlp"], mamba_num_heads=8,
       mamba_head_dim=16, ssm_state_size=16, n_groups=1, moe_shared_expert_intermediate_size=48, chunk_size=16),
    _e("jamba", "hybrid", attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
       mamba_dt_rank=16, mamba_d_state=16),
    _e("lfm2", "hybrid", layer_types=["conv", "full_attention"]),
    _e("bamba", "hybrid", **_MAMBA, attn_layer_indices=[1]),
    _e("granitemoehybrid", "hybrid", carried_experts=_NO_MAPPING, **_MAMBA, layer_types=["mamba", "attention"]),
    # Zamba2: one shared attention block, stored once per hybrid layer and tied by transformers while loading
    _e("zamba2", "hybrid", num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
       hybrid_layer_ids=[1, 3], attention_head_dim=32, mamba_headdim=16, n_mamba_heads=8, mamba_ngroups=1,
       mamba_d_state=16, chunk_size=16, num_mem_blocks=1, adapter_rank=16, use_mem_rope=False),
    # vision-language: overrides go to text_config; the vision tower is tiny (_VISION)
    _e("gemma3", "vlm"), _e("qwen2_5_vl", "vlm", rope_parameters=_MROPE), _e("qwen3_vl", "vlm"),
    _e("qwen3_vl_moe", "vlm", moe=True, carried_experts=_NO_MAPPING),
    _e("qwen3_5", "vlm", **_LINEAR), _e("llama4", "vlm", moe=True, carried_experts=_TRANSPOSED), _e("mistral3", "vlm"),
    _e("llava", "vlm"),
    _e("idefics3", "vlm"),
    # Kimi-K2.5: a DeepSeek-V3 text MoE beside a vision tower whose fused wqkv transformers splits and permutes
    # while loading (carried as stored: sq.load.loader.carry_side_towers)
    _e("kimi_k25", "vlm", moe=True, **_MLA),
]}

# a vision tower's sizes under every name the vision config classes use; its output width is the text
# model's hidden size (the projector's input where a config names it)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, depth=1, num_attention_heads=2,
               num_heads=2, head_dim=16, out_hidden_size=64, projection_dim=64, vision_output_dim=64,
               projector_input_dim=64, projector_output_dim=64)
# special-token ids (image, video, begin/end of image ...) go past the tokenizer's 512 ids, inside the
# model's 528 rows: text calibration never produces one
_SPECIAL_IDS = range(512, 528)


def tiny_config(model_type: str, variant: "Variant | None" = None) -> dict:
    """The config keyword arguments for a tiny ``model_type``: every size key its class has (``variant``:
    its overrides on top, :func:`variant`)."""
    from transformers import AutoConfig

    entry = ZOO[model_type]
    config = AutoConfig.for_model(model_type)
    # a copy: some config classes edit a per-layer list in place (Gemma 4 makes the last layer full attention)
    more = copy.deepcopy(variant.overrides) if variant is not None else {}
    top = {k: more.pop(k) for k in _TOP_LEVEL if k in more}
    if entry.family == "vlm":
        return _vlm_config(config, entry.overrides | more) | top
    wanted = dict(_BASE, **_MOE) if entry.family in ("moe", "hybrid") else dict(_BASE)
    defaults = config.to_dict()
    # a size the class derives (Falcon's ``head_dim`` property) cannot be set
    kwargs = {k: v for k, v in wanted.items() if (k in defaults or k in _BASE)
              and not (isinstance(getattr(type(config), k, None), property) and getattr(type(config), k).fset is None)}
    return kwargs | entry.overrides | more | top


def _vlm_config(config, text_overrides: dict) -> dict:
    """A tiny text model (MoE sizes where its class has them) beside a one-layer vision tower."""
    text_defaults = config.text_config.to_dict()
    text = {k: v for k, v in dict(_BASE, **_MOE).items() if k in text_defaults or k in _BASE} | text_overrides
    vision_defaults = config.vision_config.to_dict()
    vision = {k: v for k, v in _VISION.items() if k in vision_defaults}
    top = dict(text_config=text, vision_config=vision, tie_word_embeddings=False)
    ids = iter(_SPECIAL_IDS)
    for key, value in sorted(config.to_dict().items()):
        if (key.endswith("_token_id") or key.endswith("_token_index")) and isinstance(value, int) and value >= 512:
            top[key] = next(ids)
    return top


def build_zoo(out_dir: Path, model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
              shards: int = 2, variant: "Variant | None" = None) -> Path:
    """``model_type``'s tiny checkpoint in ``out_dir`` (``variant``: that configuration, in its dtype)."""
    entry = ZOO[model_type]
    if variant is not None:
        dtype = torch.bfloat16 if variant.dtype in ("bfloat16", "mixed") else torch.float32
    # the embedding has spare rows past the tokenizer (as real checkpoints do): some tokenizer classes
    # add a special token of their own
    path = build_checkpoint(out_dir, model_type, tiny_config(model_type, variant), seed=seed, dtype=dtype,
                            shards=shards, image_text=entry.family == "vlm", tokenizer_vocab_size=512)[0]
    hub_transposed_layout(path, model_type)
    if variant is not None and variant.dtype == "mixed":
        float32_state(path)
    return path


# ----------------------------------------------------------------------------- variants

# config keys set on the top-level config of a VLM (the rest go to its text_config)
_TOP_LEVEL = ("tie_word_embeddings",)
# what a variant may change, each only where the config class has the key: (key, choices)
_LAYER_AXES = (
    ("first_k_dense_replace", (0, 1)), ("decoder_sparse_step", (1, 2)), ("moe_layer_start_index", (0, 1)),
    ("num_dense_layers", (0, 1)), ("mlp_only_layers", ([], [0])), ("interleave_moe_layer_step", (1, 2)),
)
_SHARED_AXES = (
    ("n_shared_experts", (0, 1, 2)), ("num_shared_experts", (0, 1)), ("shared_expert_intermediate_size", (0, 48, 96)),
    ("moe_shared_expert_intermediate_size", (48, 96)),
)
# the 1-D state parameters of linear-attention / SSM layers that real hybrids store in float32 beside bf16 weights
_STATE = re.compile(r"\.(A_log|D|dt_bias|dt_proj\.bias|conv1d\.bias)$")


@dataclass(frozen=True)
class Variant:
    """One generated configuration of a zoo type: a function of ``(model_type, seed)`` alone (seed 0: the
    entry as listed).  ``overrides`` go on top of :func:`tiny_config`; ``dtype`` is the checkpoint's
    (``mixed``: bf16 weights, float32 SSM / linear-attention state parameters); ``dropped`` names the drawn
    overrides the config class refused (the model did not build with them)."""

    model_type: str
    seed: int
    overrides: dict
    dtype: str  # float32 | bfloat16 | mixed
    dropped: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.model_type}-s{self.seed}"

    def describe(self) -> str:
        keys = ", ".join(f"{k}={v}" for k, v in sorted(self.overrides.items()))
        return f"{self.id} [{self.dtype}{'; ' + keys if keys else ''}]"


def variant(model_type: str, seed: int) -> Variant:
    """The ``seed``-th generated configuration of ``model_type`` (reproducible: ``random.Random`` seeded with the
    pair): layer count and pattern (dense-first layers, sparse step), shared experts on / off, head size
    (``head_dim`` != hidden / heads), tied / untied embeddings, dtype (float32, bf16, bf16 with float32 state
    parameters for hybrids).  Only keys the config class has are drawn, and the drawn set is proven by building
    the model on the meta device: an override it refuses, or turns into a 0-wide parameter, is dropped (named in
    ``dropped``)."""
    import random

    from transformers import AutoConfig

    entry = ZOO[model_type]
    if seed == 0:
        return Variant(model_type, 0, {}, "float32")
    rng = random.Random(f"{model_type}/{seed}")
    config = AutoConfig.for_model(model_type)
    text = config.get_text_config() if entry.family == "vlm" else config
    has = set(text.to_dict())
    base = tiny_config(model_type)
    base_text = base.get("text_config", base)
    drawn: dict = {}
    layers_key = "num_hidden_layers" if "num_hidden_layers" in base_text else None
    per_layer = {k: v for k, v in base_text.items() if isinstance(v, list) and len(v) == base_text.get(layers_key)}
    if layers_key and "num_layers" not in base_text and not any(
            isinstance(v, list) and k not in per_layer and k != "mlp_only_layers" for k, v in base_text.items()):
        n = rng.choice((2, 3, 4))
        if n != base_text[layers_key]:
            drawn[layers_key] = n
            for k, v in per_layer.items():  # per-layer lists cycled to the new depth
                drawn[k] = [v[i % len(v)] for i in range(n)]
    if entry.family in ("moe", "hybrid") or entry.moe:
        for key, choices in _LAYER_AXES + _SHARED_AXES:
            if key in has and key not in entry.overrides:
                drawn[key] = rng.choice(choices)
    if "head_dim" in has and "head_dim" not in entry.overrides and "kv_lora_rank" not in base_text:
        drawn["head_dim"] = rng.choice((16, 32))  # 32: head_dim != hidden / heads (64 / 4)
    drawn["tie_word_embeddings"] = rng.choice((False, True))
    dtypes = ("float32", "bfloat16", "mixed") if entry.family == "hybrid" else ("float32", "bfloat16")
    dtype = rng.choice(dtypes)
    kept, dropped = _buildable(model_type, seed, drawn)
    return Variant(model_type, seed, kept, dtype, tuple(dropped))


def _buildable(model_type: str, seed: int, drawn: dict) -> tuple[dict, list[str]]:
    """``drawn`` less the overrides the model does not build with: the one whose removal makes it build, else the
    first in key order, until it builds (a layer count goes with its cycled per-layer lists)."""
    def builds(overrides: dict) -> bool:
        try:
            model = _meta_model(model_type, Variant(model_type, seed, overrides, "float32"))
        except Exception:  # noqa: BLE001 - a value the config class or the model refuses: not this variant's
            return False
        # a size drawn 0 that the model builds as a 0-wide Linear instead of leaving the part out
        # (DeepSeek-V3's shared experts at n_shared_experts 0): no checkpoint ships that
        return all(p.numel() for p in model.parameters())

    def without(overrides: dict, key: str) -> dict:
        lists = [k for k, v in overrides.items() if isinstance(v, list) and k != "mlp_only_layers"]
        gone = {key, *(lists if key == "num_hidden_layers" else ())}
        return {k: v for k, v in overrides.items() if k not in gone}

    kept = dict(drawn)
    while kept and not builds(kept):
        key = next((k for k in sorted(kept) if builds(without(kept, k))), sorted(kept)[0])
        kept = without(kept, key)
    return kept, sorted(set(drawn) - set(kept))


def _meta_model(model_type: str, v: "Variant"):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.for_model(model_type, **tiny_config(model_type, v))
    auto = AutoModelForImageTextToText if ZOO[model_type].family == "vlm" else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(cfg)


def variants(model_type: str, n: int, start: int = 1) -> list[Variant]:
    """Seeds ``start .. start + n - 1`` of ``model_type`` (:func:`variant`)."""
    return [variant(model_type, s) for s in range(start, start + n)]


def float32_state(path: Path, leaves: tuple[str, ...] | None = None) -> list[str]:
    """Rewrite checkpoint ``path``'s SSM / linear-attention state parameters (``A_log``, ``D``, ``dt_bias``...;
    ``leaves``: the tensors whose last name component is one of these) as float32 beside its bf16 weights, as
    real hybrids ship them; returns their keys."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    done = []
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            metadata = h.metadata()
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        hit = [k for k in tensors if tensors[k].dtype == torch.bfloat16
               and (_STATE.search(k) if leaves is None else k.rsplit(".", 1)[-1] in leaves)]
        if hit:
            for k in hit:
                tensors[k] = tensors[k].float()
            save_file(tensors, str(f), metadata=metadata)
            done += hit
    return sorted(done)


def hub_transposed_layout(path: Path, model_type: str) -> list[str]:
    """Rewrite the tensors of checkpoint ``path`` that ``model_type``'s conversion mapping reads through a
    ``Transpose(d0, d1, check_dims=True)`` converter with ``d0`` / ``d1`` swapped, as the Hub stores them;
    returns their keys (sorted).

    ``save_pretrained`` writes the model's own layout there (the reverse ``Transpose`` checks the shapes too
    and finds nothing to do), but the real checkpoints are stored transposed: Qwen3-VL-MoE's
    ``mlp.experts.gate_up_proj`` is ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]`` on the Hub, for the model's
    ``[E, 2I, H]`` / ``[E, H, I]``.  Keys, files and the index are unchanged; transformers loads the result
    (its ``Transpose`` swaps them back)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Transpose, WeightConverter, WeightRenaming, apply_renamings

    try:
        mapping = get_checkpoint_conversion_mapping(model_type) or []
    except Exception:  # noqa: BLE001 - no mapping for this type: nothing is stored otherwise
        return []
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [(c, c.operations[0]) for c in mapping if isinstance(c, WeightConverter)
                  and len(c.operations) == 1 and type(c.operations[0]) is Transpose and c.operations[0].check_dims]
    if not converters:
        return []
    done = []
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            metadata = h.metadata()
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        changed = False
        for key, t in tensors.items():
            name = apply_renamings(key, renamings) if renamings else key
            op = next((op for conv, op in converters if conv.rename_source_key(name)[1] is not None), None)
            if op is not None:
                tensors[key] = t.transpose(op.dim0, op.dim1).contiguous()
                done.append(key)
                changed = True
        if changed:
            save_file(tensors, str(f), metadata=metadata)
    return sorted(done)


# ----------------------------------------------------------------------------- output check

_ROUTER_LEAVES = ("gate", "router", "classifier", "shared_expert_gate", "wg")
# module names of the vision side of the zoo's VLMs
_VISION_PARTS = {"visual", "vision_tower", "vision_model", "multi_modal_projector", "connector"}


def _unpack_int4(packed: torch.Tensor, scale: torch.Tensor, shape: list[int],
                 zero: torch.Tensor | None = None) -> torch.Tensor:
    """compressed-tensors' ``pack-quantized`` int4 -> float32, written from the format's definition
    (eight 4-bit codes per int32, lowest bits first, offset by 8; one scale per group along ``in``),
    not from sq's or the library's unpacker, so the check below is a real cross-check."""
    out, inp = shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    codes = ((packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF).reshape(out, -1)[:, :inp] - 8
    group = inp // scale.shape[1]
    q = codes.to(torch.float32).reshape(out, scale.shape[1], group)
    if zero is not None:
        q = q - zero.to(torch.float32).unsqueeze(-1)
    return (q * scale.to(torch.float32).unsqueeze(-1)).reshape(out, inp)


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def dequantized_output(out_dir: Path) -> dict[str, torch.Tensor]:
    """``name.weight`` -> float32 for every W4A16 (pack-quantized int4) weight of an output folder."""
    tensors = read_safetensors_dir(out_dir)
    deq = {}
    for key in tensors:
        if key.endswith(".weight_packed"):
            base = key[: -len("_packed")]
            shape = [int(s) for s in tensors[base + "_shape"].tolist()]
            deq[base] = _unpack_int4(tensors[key], tensors[base + "_scale"], shape,
                                     tensors.get(base + "_zero_point"))
    return deq


def _load(path: Path, *, state_dict=None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(path)
    archs = getattr(cfg, "architectures", None) or []
    auto = AutoModelForImageTextToText if any("ConditionalGeneration" in a for a in archs) else AutoModelForCausalLM
    model, info = auto.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    # computed in float32 throughout: transformers leaves a compressed checkpoint's routed experts in their
    # scales' dtype (bf16 for a bf16 source) while the reference's are float32; the values are the same
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
    # online transforms (--rotate r4): transformers leaves their stored matrices unused; sq hooks them on
    groups = transform_groups(json.loads((Path(path) / "config.json").read_text()))
    if apply_online_transforms(model, path):
        info["unexpected_keys"] = {k for k in info.get("unexpected_keys") or ()
                                   if not any(k.endswith(f".{g}_input.weight") for g in groups)}
    return model, info


def _logits(model, vocab: int) -> torch.Tensor:
    ids = torch.arange(3, 3 + 24).remainder(vocab).reshape(2, 12)
    with torch.no_grad():
        if type(model).__name__ == "Llama4ForConditionalGeneration":
            # its text-only forward fails building its output object: transformers 5.24 reads
            # ``image_outputs`` from its language model's output, which has none
            model.language_model.register_forward_hook(lambda _m, _a, out: setattr(out, "image_outputs", None))
        return model(input_ids=ids).logits.float()


def _both_logits(ref_dir: Path, out: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits transformers gives for the reference checkpoint and for ``out``, on the same ids; raises
    ``AssertionError`` when either loads with missing, unexpected or mismatched keys."""
    ref_model, ref_info = _load(ref_dir)
    model, info = _load(out)
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if ref_info.get(kind):
            raise AssertionError(f"the reference ({ref_dir}) has {kind}: {sorted(ref_info[kind])[:8]}")
        if info.get(kind):
            problems.append(f"transformers loading {out} reports {kind}: {sorted(info[kind])[:8]}")
    if problems:
        raise AssertionError("\n".join(problems))
    vocab = model.config.get_text_config().vocab_size
    return _logits(ref_model, vocab), _logits(model, vocab)


_PER_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.[^.]+\.weight$")


def routed_expert_weights(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names among ``tensors`` (a checkpoint's, or an output's) that hold a routed expert's weight in full
    precision: per-expert ``*.experts.{e}.{leaf}.weight`` (2-D), or a fused ``[E, rows, cols]`` tensor (every
    dimension above 1: not a convolution's ``[C, 1, K]`` kernel nor a ``[1, 1, H]`` probe) outside the vision
    tower.  A quantized expert is ``weight_packed`` / ``weight_scale`` ..., never a plain ``weight``."""
    found = []
    for name, t in tensors.items():
        if any(part in _VISION_PARTS for part in name.split(".")):
            continue
        if (t.dim() == 2 and _PER_EXPERT_WEIGHT.search(name)) or (t.dim() == 3 and min(t.shape) > 1):
            found.append(name)
    return sorted(found)


def check_output(src: Path, out: Path, *, atol: float = 1e-4, max_rel_err: float = 0.35,
                 carried_experts: bool | None = None) -> dict:
    """Prove ``out`` (a W4A16 output of checkpoint ``src``) is ``src`` with some weights quantized.

    1. every quantized weight's name is a weight of the source checkpoint with the same shape, and its
       dequantized value is near the source's (a transposed or swapped tensor is not);
    2. no router / gate is quantized, and every routed expert weight is (:func:`routed_expert_weights` finds
       none in ``out``), unless ``carried_experts`` (default: the zoo entry of ``src``'s ``model_type`` names
       why its experts are carried);
    3. transformers loads ``out`` with no missing or unexpected keys;
    4. its logits equal those of the source checkpoint with each quantized weight replaced by its
       dequantized value (loaded by transformers from the source's own layout): float tolerance only.

    Returns a summary (quantized / carried counts, the largest logit difference); raises
    ``AssertionError`` naming what is wrong.
    """
    import shutil
    import tempfile

    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    source = read_safetensors_dir(src)
    deq = dequantized_output(out)
    problems = []
    for name, w in deq.items():
        if name not in source:
            problems.append(f"quantized {name!r} is not a source checkpoint tensor")
            continue
        if tuple(source[name].shape) != tuple(w.shape):
            problems.append(f"quantized {name!r} is {list(w.shape)}, source {list(source[name].shape)}")
            continue
        ref = source[name].float()
        rel = float((w - ref).norm() / ref.norm().clamp_min(1e-12))
        if rel > max_rel_err:
            problems.append(f"quantized {name!r} is {rel:.2f} away from the source (relative): wrong layout")
        leaf = name.rsplit(".", 2)[-2]
        if leaf in _ROUTER_LEAVES:
            problems.append(f"router {name!r} was quantized")
        if any(part in _VISION_PARTS for part in name.split(".")):
            problems.append(f"{name!r} of the vision tower / projector was quantized (carried by default)")
    if not deq:
        problems.append("no weight was quantized")
    written = read_safetensors_dir(out)
    for name, t in source.items():  # a vision tower / projector carried: in the output as stored, bit for bit
        if any(part in _VISION_PARTS or part == "mm_projector" for part in name.split(".")) and name not in deq:
            if name not in written or written[name].dtype != t.dtype or not torch.equal(written[name], t):
                problems.append(f"{name!r} of the vision tower / projector is not in the output as stored")
    if carried_experts is None:
        entry = ZOO.get(json.loads((src / "config.json").read_text()).get("model_type"))
        report = out / "sq_report.json"
        model_free = report.exists() and json.loads(report.read_text()).get("mode") == "model-free"
        carried_experts = entry is not None and entry.allow_carried(model_free)
    if not carried_experts:
        full = routed_expert_weights(read_safetensors_dir(out))
        if full:
            problems.append(f"{len(full)} routed expert weight(s) left in full precision, e.g. {full[:3]}")
    if problems:
        raise AssertionError(f"{out}:\n" + "\n".join(problems))
    with tempfile.TemporaryDirectory(prefix="sq-zoo-ref-") as tmp:
        ref_dir = Path(tmp)
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy(f, ref_dir / f.name)
        # the dequantized weights as transformers computes them from the output: a Linear's in float32 whatever
        # the source's dtype, a routed expert's in its scales' dtype (compressed-tensors' per-expert
        # decompression, before the experts are stacked)
        scales = {k: t.dtype for k, t in read_safetensors_dir(out).items() if k.endswith(".weight_scale")}
        patched = {k: (_as_loaded(k, deq[k], scales.get(k + "_scale")) if k in deq else v).contiguous()
                   for k, v in source.items()}
        save_file(patched, ref_dir / "model.safetensors", metadata={"format": "pt"})
        a, b = _both_logits(ref_dir, out)
    diff = float((a - b).abs().max())
    scale = float(a.abs().max())
    if not torch.isfinite(b).all() or diff > atol * max(1.0, scale):
        raise AssertionError(f"{out}: logits differ from the dequantized source by {diff:.3g} (max |logit| {scale:.3g})")
    n_carried = len(json.loads((out / "config.json").read_text())["quantization_config"].get("ignore", []))
    return {"quantized": len(deq), "ignored": n_carried, "logit_diff": diff}


def _as_loaded(name: str, w: torch.Tensor, scale_dtype: torch.dtype | None) -> torch.Tensor:
    if scale_dtype is not None and _PER_EXPERT_WEIGHT.search(name):
        return w.to(scale_dtype).float()
    return w


def check_rotated(src: Path, out: Path, *, max_rel: float = 0.05, max_proof: float = 1e-4) -> dict:
    """Prove ``out`` (a ``--rotate`` W8A16 output of ``src``) computes the source's function: every proof the
    run recorded (root and blocks, float32 weights) within ``max_proof``, transformers loads it with no
    missing or unexpected keys, and its logits are the source's within ``max_rel`` (relative, Frobenius:
    W8A16's own error on these models is ~1e-2; a misread layout's ~1)."""
    rot = json.loads((Path(out) / "sq_report.json").read_text())["rotation"]
    proofs = {**({"root": rot["root"]["error"]} if "root" in rot else {}), **{k: v["error"] for k, v in rot["blocks"].items()}}
    worst = max(proofs, key=proofs.get)
    if proofs[worst] > max_proof:
        raise AssertionError(f"{out}: the rotation's proof on {worst} is {proofs[worst]:.3g} off")
    a, b = _both_logits(Path(src), Path(out))
    rel = float((a - b).norm() / a.norm().clamp_min(1e-12))
    if not torch.isfinite(b).all() or rel > max_rel:
        raise AssertionError(f"{out}: logits {rel:.3g} away from the source's (relative): the rotation changed "
                             "the model's function")
    return {"logit_rel_err": rel}
