"""The serving presets (issue 17): FP8_BLOCK, FP8, NVFP4A16, NVFP4, MXFP4A16, MXFP4, MXFP8A16, MXFP8,
W8A8, W4A8, W4AFP8.

For every preset, sq's data-free round-to-nearest output equals compressed-tensors' own path tensor
for tensor (names, dtypes, shapes, bits): the preset applied to the module with the library
(``apply_quantization_config``), its qparams from the library's functions in llm-compressor's order
(min-max observation, ``generate_gparam`` then ``calculate_qparams``), compressed by the library's
``ModelCompressor``, its ``quantization_config`` from ``update_config``.  Partial 128 x 128 blocks
(576 = 4.5 x 128) included; the same refusals where the library cannot write a weight.  1, 2 and 3
row shards with the declared reductions give the same tensors, and transformers 5.24 loads each.
"""

from __future__ import annotations

import json

import pytest
import torch

from quant_ref import exact_bits
import torch.nn.functional as F
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from sq.errors import SqError
from sq.formats.compressed import compress_weight, compressed_names, decompress_weight, quantization_config
from sq.formats import specs
from sq.quant import rtn
from sq.quant.recipe import make_assigner, scheme_tag
from sq.formats.schemes import (
    PRESET_NAMES,
    SCHEME_NAMES,
    SERVING_SCHEME_NAMES,
    QuantScheme,
    check_group_size,
    get_scheme,
    to_compressed_tensors,
)

NAMES = SERVING_SCHEME_NAMES
CALIBRATED = ("FP8", "NVFP4")
CROSS_ROW = {"FP8_BLOCK": {"absmax"}, "FP8": {"absmax"}, "NVFP4A16": {"global_absmax"}, "NVFP4": {"global_absmax"}}


def _weight(rows: int, cols: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0] = 0.0  # all-zero row (and groups, and part of a block)
    w[1] = w[1].abs()
    w[2] = -w[2].abs()
    w[min(5, rows - 1), ::9] *= 30  # outliers: they set a per-tensor / global scale
    return w.to(dtype)


def _acts(cols: int, dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, cols, generator=g)
    x[7, 3] = -9.0  # the absmax is a negative value
    return x.to(dtype)




def _assert_same(ours: dict, ref: dict, where=""):
    assert sorted(ours) == sorted(ref), where
    for k in ref:
        assert ours[k].dtype == ref[k].dtype, (where, k, ours[k].dtype, ref[k].dtype)
        assert ours[k].shape == ref[k].shape, (where, k, ours[k].shape, ref[k].shape)
        assert torch.equal(exact_bits(ours[k]), exact_bits(ref[k])), (where, k)


# ------------------------------------------------------------------ the library's own path


def _minmax(w: torch.Tensor, args):
    """What llm-compressor's min-max observer sees of a weight (edge blocks zero-padded)."""
    if args.strategy == "tensor":
        return w.amin(), w.amax()
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    if args.strategy in ("group", "tensor_group"):
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    r, c = args.block_structure
    b = F.pad(w, (0, -w.shape[1] % c, 0, -w.shape[0] % r)).unflatten(1, (-1, c)).unflatten(0, (-1, r))
    return b.amin(dim=(1, 3)), b.amax(dim=(1, 3))


@torch.no_grad()
def _library_calibrate(module: torch.nn.Module, x: torch.Tensor | None, global_scale=None) -> None:
    """compressed-tensors' qparams for one module with an applied preset, in llm-compressor's order:
    the weight's global scale (``generate_gparam``; vLLM's fused partners then share their minimum),
    the weight scales (``calculate_qparams``), the static activation scales from the inputs' running
    min / max (``static_minmax``), then FROZEN."""
    scheme = module.quantization_scheme
    args, w = scheme.weights, module.weight.data
    gs = None
    if args.strategy == "tensor_group":
        gs = generate_gparam(w.amin(), w.amax()) if global_scale is None else global_scale
        module.weight_global_scale.data.copy_(gs)
    scale, zp = calculate_qparams(*_minmax(w, args), args, global_scale=gs)
    module.weight_scale.data.copy_(scale)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zp)
    act = scheme.input_activations
    if act is not None and act.dynamic is not True:
        if act.strategy == "tensor_group":  # NVFP4: only the global scale is static
            module.input_global_scale.data.copy_(generate_gparam(x.amin(), x.amax()))
        else:
            module.input_scale.data.copy_(calculate_qparams(x.amin(), x.amax(), act)[0])
    module.quantization_status = QuantizationStatus.FROZEN


def _library(weights: dict[str, torch.Tensor], preset: str, x=None, tmp_path=None, global_scale=None):
    """The library's whole path for Linears holding ``weights``: its tensors by ``name.key`` and,
    with ``tmp_path``, the ``quantization_config`` its ``update_config`` writes."""
    model = torch.nn.Module()
    for name, w in weights.items():
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        lin.weight.data.copy_(w)
        model.add_module(name, lin)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}))
    for name in weights:
        _library_calibrate(getattr(model, name), None if x is None else x[name], global_scale)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    config = None
    if tmp_path is not None:
        (tmp_path / "config.json").write_text("{}")
        compressor.update_config(str(tmp_path))
        config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    return model.state_dict(), config


# ------------------------------------------------------------------ sq's path


def _observe(s: QuantScheme, x: torch.Tensor | None, dtype, batches: int = 3) -> dict[str, torch.Tensor]:
    """The calibrated activation tensors from ``x`` seen in ``batches`` pieces (forwards or ranks):
    each piece's ``local``, the running / all-reduced max, ``finalize``."""
    out = {}
    for o in specs.activation_observers(s):
        absmax = torch.stack([o.local(c) for c in x.chunk(batches)] + [o.local(x[:0])]).amax(0)
        out[o.name] = o.finalize(absmax, dtype)
    return out


def _sq(w: torch.Tensor, s: QuantScheme, x=None, stats=None) -> dict[str, torch.Tensor]:
    qp = rtn.qparams(w, s, stats=stats)
    q = rtn.quantize(w, qp.scale, qp.zero_point, s, global_scale=qp.global_scale)
    return compress_weight((q, qp), s, w.shape, activation_scales=_observe(s, x, w.dtype))


def _refused_by_library(w: torch.Tensor, preset: str) -> bool:
    try:
        _library({"m": w}, preset, {"m": _acts(w.shape[1], w.dtype)})
    except (ValueError, RuntimeError):
        return True
    return False


# ------------------------------------------------------------------ presets and config


@pytest.mark.parametrize("name", NAMES)
def test_preset_args_and_format_are_the_library_s(name):
    s = get_scheme(name)
    ours, lib = to_compressed_tensors(s, ["Linear"]), preset_name_to_scheme(name, ["Linear"])
    assert ours.weights == lib.weights and ours.input_activations == lib.input_activations
    assert ours.output_activations is None and lib.output_activations is None
    assert ours.model_dump(exclude={"format"}) == lib.model_dump(exclude={"format"})
    assert ours.format == s.format == infer_module_format(torch.nn.Linear, lib).value
    # the declarations: cross-row statistics, calibrated activations, the tensors' names
    assert {r.stat for r in specs.required_reductions(s)} == CROSS_ROW.get(name, set())
    assert specs.row_independent(s)
    observed = [o.name for o in specs.activation_observers(s)]
    assert observed == {"FP8": ["input_scale"], "NVFP4": ["input_global_scale"]}.get(name, [])
    assert (lib.input_activations is not None and lib.input_activations.dynamic is not True) == bool(observed)


def test_preset_names_and_group_size():
    assert PRESET_NAMES == SCHEME_NAMES + SERVING_SCHEME_NAMES and len(set(PRESET_NAMES)) == len(PRESET_NAMES)
    assert get_scheme("w4afp8", 64).group_size == 64 and get_scheme("W4A8", 32).group_size == 32
    assert get_scheme("NVFP4", 64).group_size == 16 and get_scheme("MXFP4", 64).group_size == 32  # fixed
    assert get_scheme("FP8_BLOCK", 64).block_structure == (128, 128)
    with pytest.raises(SqError, match="group size"):
        get_scheme("W4A8", 0)
    assert len({scheme_tag(get_scheme(n)) for n in PRESET_NAMES}) == len(PRESET_NAMES)
    assert scheme_tag(get_scheme("NVFP4")) == "float4-sym-tensor_group16-s:float8_e4m3fn-a:nvfp4_static_global"
    assert scheme_tag(get_scheme("FP8_BLOCK")) == "float8-sym-block128x128-a:fp8_dynamic_group128"


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_dict_round_trip_keeps_old_schemes_dicts(name):
    s = get_scheme(name, 64)
    d = json.loads(json.dumps(s.to_dict()))  # through JSON, as the resume signature
    assert QuantScheme.from_dict(d) == s and hash(QuantScheme.from_dict(d)) == hash(s)
    old = ["name", "num_bits", "type", "symmetric", "strategy", "group_size", "activations"]
    if name in SCHEME_NAMES:  # unchanged: the first presets' signatures stay what they were
        assert list(d) == old
    else:
        assert list(d)[: len(old)] == old


def test_recipe_takes_the_new_presets(tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("default: NVFP4\nrules:\n  - match: 'mlp\\.down_proj$'\n    scheme: FP8_BLOCK\n"
                 "  - match: 'self_attn'\n    scheme: {preset: W4AFP8, group_size: 64}\n")
    a = make_assigner("W4A16", 128, (), r)
    assert a.assign("model.layers.0.mlp.down_proj") == get_scheme("FP8_BLOCK")
    assert a.assign("model.layers.0.self_attn.q_proj") == get_scheme("W4AFP8", 64)
    assert a.assign("model.layers.0.mlp.up_proj") == get_scheme("NVFP4")
    assert make_assigner("mxfp8", 128).default == get_scheme("MXFP8")
    from sq.ptq import build_parser

    assert build_parser().parse_args(["--model", "m", "--output", "o", "--scheme", "nvfp4a16"]).scheme == "NVFP4A16"


# ------------------------------------------------------------------ equal to the library


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", NAMES)
def test_one_linear_equals_library(name, dtype, tmp_path):
    """[72, 256] and SmolLM2's width, [200, 576]: 576 = 4.5 x 128, so FP8_BLOCK's last block column
    (and with 200 rows its last block row) is partial; int4 groups of 128 do not tile 576 and both
    the library and sq refuse them."""
    s = get_scheme(name)
    for shape in [(72, 256), (200, 576)]:
        w = _weight(*shape, dtype=dtype)
        x = _acts(shape[1], dtype)
        if s.group_size is not None and shape[1] % s.group_size:
            assert _refused_by_library(w, name)
            with pytest.raises(SqError, match="does not divide"):
                check_group_size("m", shape[1], s)
            with pytest.raises(SqError, match="does not divide"):
                _sq(w, s, x)
            continue
        ref, config = _library({"m": w}, name, {"m": x}, tmp_path)
        ours = {f"m.{k}": v for k, v in _sq(w, s, x).items()}
        _assert_same(ours, ref, (name, shape))
        assert tuple(k.split(".", 1)[1] for k in ours) == compressed_names(s)
        declared = {t.name: (t.dtype, t.shape) for t in specs.format_for(s).tensors(s, shape, dtype)}
        assert {k.split(".", 1)[1]: (v.dtype, tuple(v.shape)) for k, v in ours.items()} == declared
        # the config: the library's own update_config (sq lists the ignore list explicitly)
        assert quantization_config({s: ["Linear"]}, ignore=[]) == config
        # what a loader reconstructs: the library's decompression of our tensors
        deq = decompress_weight({k.split(".", 1)[1]: v for k, v in ours.items()}, s)
        qp = rtn.qparams(w, s)
        ref_deq = rtn.dequantize(rtn.quantize(w, qp.scale, qp.zero_point, s, global_scale=qp.global_scale),
                                 qp.scale, qp.zero_point, s, global_scale=qp.global_scale)
        assert torch.equal(deq.float(), ref_deq.to(deq.dtype).float()), (name, shape)


@pytest.mark.parametrize("fixture", ["llama_ckpt", "qwen3_moe_ckpt"])
def test_fixture_weights_equal_library(fixture, request):
    """Every decoder Linear of the llama and qwen3_moe fixtures (experts one by one), each weight
    whole, every preset: the same tensors as the library, or refused by both."""
    from sq.testing.checkpoints import read_tensors

    sd = read_tensors(request.getfixturevalue(fixture))
    weights = {k[: -len(".weight")].replace(".", "_"): v for k, v in sd.items()
               if k.startswith("model.layers.") and k.endswith("_proj.weight")}
    assert len(weights) > 20
    for name in NAMES:
        s = get_scheme(name)
        ok = {k: w for k, w in weights.items() if s.group_size is None or w.shape[1] % s.group_size == 0}
        for w in {tuple(w.shape): w for k, w in weights.items() if k not in ok}.values():
            assert _refused_by_library(w, name), (name, tuple(w.shape))
            with pytest.raises(SqError, match="does not divide"):
                _sq(w, s, _acts(w.shape[1], w.dtype))
        if not ok:
            continue
        x = {k: _acts(w.shape[1], w.dtype, seed=i) for i, (k, w) in enumerate(ok.items())}
        ref, _ = _library(ok, name, x)
        ours = {f"{k}.{n}": t for k, w in ok.items() for n, t in _sq(w, s, x[k]).items()}
        _assert_same(ours, ref, (fixture, name))


# ------------------------------------------------------------------ row shards


def _splits(rows: int, n: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 chunks (torch.chunk; a rank may hold no rows), as (start, stop)."""
    sizes = [len(c) for c in torch.arange(rows).chunk(n)]
    sizes += [0] * (n - len(sizes))
    starts = [sum(sizes[:i]) for i in range(n)]
    return [(a, a + z) for a, z in zip(starts, sizes)]


def _sharded(w: torch.Tensor, s: QuantScheme, parts, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the pipeline does: each rank's contribution to the declared reductions, the all-reduce
    (in-process), each rank quantizing its rows alone, the rows (and row-following scales)
    gathered to one writer; the activation statistics from each rank's own tokens."""
    rows = w.shape[0]
    stats = rtn.combine_stats([rtn.local_stats(w[a:b], s, row_offset=a, rows=rows) for a, b in parts], s)
    qs, qps = [], []
    for a, b in parts:
        qp = rtn.qparams(w[a:b], s, stats=stats or None)
        qs.append(rtn.quantize(w[a:b], qp.scale, qp.zero_point, s, global_scale=qp.global_scale, row_offset=a))
        qps.append(qp)
    if rtn.scales_follow_rows(s):
        scale = torch.cat([qp.scale for qp in qps])
    else:  # the whole scale on every rank
        scale = qps[0].scale
        assert all(torch.equal(qp.scale, scale) for qp in qps)
    gs = qps[0].global_scale
    assert all((qp.global_scale is None) == (gs is None) for qp in qps)
    assert gs is None or all(torch.equal(qp.global_scale, gs) for qp in qps)
    acts = _observe(s, x, w.dtype, batches=len(parts))  # each rank its tokens, all-reduced
    return compress_weight((torch.cat(qs), scale, None), s, w.shape, global_scale=gs, activation_scales=acts)


@pytest.mark.parametrize("name", NAMES)
def test_one_two_three_row_shards_write_identical_tensors(name):
    s = get_scheme(name)
    cols = 256 if s.group_size == 128 else 576
    w = _weight(300, cols)  # 300 rows: 2 full 128-row blocks and a partial one
    x = _acts(cols, w.dtype)
    whole = _sq(w, s, x)
    for parts in [_splits(300, 1), _splits(300, 2), _splits(300, 3), [(0, 0), (0, 97), (97, 300)]]:
        _assert_same(_sharded(w, s, parts, x), whole, (name, parts))
    if name in CROSS_ROW:  # what the reductions prevent: a shard's own statistics differ
        own = rtn.qparams(w[150:], s)
        assert not torch.equal(own.scale if own.global_scale is None else own.global_scale,
                               rtn.qparams(w, s).scale[-1:] if own.global_scale is None
                               else rtn.qparams(w, s).global_scale)


@pytest.mark.parametrize("name", ["NVFP4A16", "NVFP4"])
def test_fused_partners_share_the_global_scale_as_llm_compressor(name):
    """vLLM fuses q/k/v (and gate/up) and needs one global scale for them: llm-compressor sets
    each partner's to the minimum of theirs, then computes the group scales.  sq reduces
    ``global_absmax`` over the partners (and their ranks): the same tensors."""
    s = get_scheme(name)
    parts = {n: _weight(r, 128, seed=i) * (i + 1) for i, (n, r) in enumerate([("q", 64), ("k", 32), ("v", 32)])}
    lib_gs = torch.min(torch.cat([generate_gparam(w.amin(), w.amax()) for w in parts.values()])).reshape([1])
    x = {n: _acts(128, torch.bfloat16) for n in parts}
    ref, _ = _library(parts, name, x, global_scale=lib_gs)
    stats = rtn.combine_stats([rtn.local_stats(w, s) for w in parts.values()], s)
    ours = {f"{n}.{k}": t for n, w in parts.items() for k, t in _sq(w, s, x[n], stats=stats).items()}
    _assert_same(ours, ref, name)
    assert len({float(ours[f"{n}.weight_global_scale"]) for n in parts}) == 1


# ------------------------------------------------------------------ calibration and refusals


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_expert_without_tokens_gets_finite_library_scales(dtype):
    """No token reached it (no calibrate-all-experts): absmax 0 -> the library's own fallbacks, the
    fp8 scale the dtype's eps, the global scale 1 -- finite and valid, but uncalibrated."""
    zero = torch.zeros(1, 8, dtype=dtype)
    for name, key in [("FP8", "input_scale"), ("NVFP4", "input_global_scale")]:
        (o,) = specs.activation_observers(get_scheme(name))
        got = o.finalize(o.local(torch.zeros(0, 8, dtype=dtype)), dtype)
        act = preset_name_to_scheme(name, ["Linear"]).input_activations
        ref = generate_gparam(zero.amin(), zero.amax()) if key == "input_global_scale" else \
            calculate_qparams(zero.amin(), zero.amax(), act)[0]
        assert o.name == key and got.dtype == ref.dtype and torch.equal(got, ref) and bool(torch.isfinite(got).all())
    assert float(o.finalize(torch.zeros(1), dtype)) == 1.0


def test_refusals():
    w = _weight(32, 128)
    nv, fp8 = get_scheme("NVFP4"), get_scheme("FP8")
    qp = rtn.qparams(w, nv)
    q = rtn.quantize(w, qp.scale, None, nv, global_scale=qp.global_scale)
    acts = {"input_global_scale": torch.tensor([2.0])}
    with pytest.raises(SqError, match="needs its weight_global_scale"):
        compress_weight((q, qp.scale, None), nv, activation_scales=acts)
    with pytest.raises(SqError, match=r"missing \['input_global_scale'\]"):
        compress_weight((q, qp), nv)
    with pytest.raises(SqError, match="finite and positive"):
        compress_weight((q, qp), nv, activation_scales={"input_global_scale": torch.tensor([float("inf")])})
    with pytest.raises(SqError, match="global scale"):
        rtn.compute_qparams(w, nv)  # would drop it
    with pytest.raises(SqError, match="has no global scale"):
        f = get_scheme("FP8_BLOCK")
        p = rtn.qparams(w, f)
        compress_weight((rtn.quantize(w, p.scale, None, f), p.scale, None), f, global_scale=torch.ones(1))
    p = rtn.qparams(w, fp8)
    with pytest.raises(SqError, match="input_scale must be"):
        compress_weight((rtn.quantize(w, p.scale, None, fp8), p), fp8,
                        activation_scales={"input_scale": torch.ones(1, dtype=torch.float32)})
    with pytest.raises(SqError, match="statistics"):
        rtn.qparams(w[:8], fp8, stats={})
    with pytest.raises(SqError, match="its format fixes the group size"):
        check_group_size("model.layers.0.mlp.down_proj", 72, nv)
    with pytest.raises(ValueError, match="block_structure"):
        QuantScheme("x", 8, "float", True, "block", None)
    with pytest.raises(ValueError, match="no registered format writes it"):
        QuantScheme("x", 4, "float", True, "tensor_group", 32, scale_dtype="float8_e4m3fn")


# ------------------------------------------------------------------ transformers loads them


def _tiny_llama(path, hidden: int, inter: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def _write(src, dst, s: QuantScheme) -> dict[str, torch.Tensor]:
    """Every decoder Linear replaced by sq's tensors (RTN, activation scales from a made-up absmax)."""
    from safetensors.torch import load_file, save_file

    out, deq = {}, {}
    for key, t in load_file(src / "model.safetensors").items():
        if key.startswith("model.layers.") and key.endswith("_proj.weight"):
            tensors = _sq(t, s, _acts(t.shape[1], t.dtype))
            out.update({key[: -len("weight")] + n: v for n, v in tensors.items()})
            deq[key] = decompress_weight(tensors, s)
        else:
            out[key] = t
    dst.mkdir()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config({s: ["Linear"]}, ignore=["lm_head"])
    (dst / "config.json").write_text(json.dumps(config))
    return deq


def test_transformers_loads_every_preset(tmp_path):
    """transformers 5.24 + compressed-tensors 0.20.1 load each preset's checkpoint (default,
    compressed path: no missing or unexpected keys) and, on the first forward, decompress every
    Linear to exactly the weight sq's tensors hold."""
    from transformers import AutoModelForCausalLM

    _tiny_llama(tmp_path / "src", 128, 256)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    for name in NAMES:
        deq = _write(tmp_path / "src", tmp_path / name, get_scheme(name))
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path / name, output_loading_info=True)
        assert not any(info.values()), (name, info)
        with torch.no_grad():
            assert bool(torch.isfinite(model(ids).logits).all()), name
        sd = model.state_dict()
        for k, v in deq.items():
            assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), (name, k)


def test_transformers_fp8_block_with_a_partial_block(tmp_path):
    """A hidden size that is not a multiple of 128 (SmolLM2: 576): the checkpoint is what the library
    writes, but transformers' compressed forward quantizes activations in per-token groups of 128 and
    fails with the library's error; ``CompressedTensorsConfig(dequantize=True)`` loads it."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    _tiny_llama(tmp_path / "src", 64, 192)
    s = get_scheme("FP8_BLOCK")
    deq = _write(tmp_path / "src", tmp_path / "dst", s)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst")
    with pytest.raises(RuntimeError, match="unflatten"), torch.no_grad():
        model(ids)
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "dst", output_loading_info=True, quantization_config=CompressedTensorsConfig(dequantize=True))
    assert not any(info.values()), info
    with torch.no_grad():
        assert bool(torch.isfinite(model(ids).logits).all())
    sd = model.state_dict()
    for k, v in deq.items():
        assert torch.equal(sd[k], v.to(sd[k].dtype)), k
