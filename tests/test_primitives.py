"""Quantization primitives: every block shape, target type and scale type equals compressed-tensors'
own functions bit for bit, and row shards with reduced statistics equal the whole weight."""

from __future__ import annotations

import pytest
import torch

from quant_ref import exact_bits
from compressed_tensors.compressors.mx_utils import compress_mx_scale, decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4
from compressed_tensors.quantization.utils.mxfp_utils import round_to_power_2

from sq.errors import SqError
from sq.formats import primitives as P

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _weight(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0] = 0.0  # all-zero row: zero scales
    w[1] = w[1].abs()  # all-positive row
    w[2] = -w[2].abs()  # all-negative row
    w[4, ::7] *= 40  # outliers
    return w.to(dtype)




def _args(preset: str, **overrides) -> QuantizationArgs:
    args = preset_name_to_scheme(preset, ["Linear"]).weights
    return args.model_copy(update=overrides) if overrides else args


def _block_minmax(w: torch.Tensor, r: int, c: int):
    """Per-block min/max the library's observer sees (edge blocks padded with zeros)."""
    wp = torch.nn.functional.pad(w, (0, -w.shape[1] % c, 0, -w.shape[0] % r))
    b = wp.unflatten(1, (-1, c)).unflatten(0, (-1, r))  # [nbr, r, nbc, c]
    return b.amin(dim=(1, 3)), b.amax(dim=(1, 3))


# ------------------------------------------------------------------ element and scale types


@pytest.mark.parametrize("dtype", DTYPES)
def test_e2m1_rounding_equals_library(dtype):
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([torch.arange(-7, 7, 1 / 64), ties, -ties, torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-3, -1e-3])])
    x = x.to(dtype)
    ours, ref = P.round_to_e2m1(x), cast_to_fp4(x.clone())
    assert ours.dtype == ref.dtype == dtype
    assert torch.equal(exact_bits(ours), exact_bits(ref))
    values = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    assert set(ours.abs().float().tolist()) <= values
    # ties go to the even code, as round-to-nearest-even in e2m1
    assert P.round_to_e2m1(ties.to(dtype)).float().tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    # the library's packer reads our values (sign of a negative zero included)
    q = ours[: (ours.numel() // 2) * 2].reshape(1, -1)
    assert torch.equal(unpack_fp4_from_uint8(pack_fp4_to_uint8(q), 1, q.shape[1], dtype), q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_e2m1_rounding_equals_library_on_every_value(dtype):
    """Every finite bf16 / fp16 value (fp32: both neighbours of every midpoint and value, and a
    million random values), bit for bit with the library's ``cast_to_fp4``."""
    if dtype == torch.float32:
        edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0])
        x = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1),
                       torch.randn(1_000_000) * 3])
        x = torch.cat([x, -x])
    else:
        x = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(dtype)
        x = x[torch.isfinite(x)]
    assert torch.equal(exact_bits(P.round_to_e2m1(x)), exact_bits(cast_to_fp4(x.clone())))


@pytest.mark.parametrize("dtype", DTYPES)
def test_power_of_two_rounding_equals_library(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.rand(4000, generator=g) * 10.0 ** torch.randint(-6, 4, (4000,), generator=g),
                   torch.tensor([0.0, 1.0, 1.5, 1.4999, 3.0, 6.0])]).to(dtype)
    assert torch.equal(exact_bits(P.round_to_power_of_two(x)), exact_bits(round_to_power_2(x)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_e8m0_scales_equal_library_mxfp4(dtype):
    w = _weight(24, 256, dtype)
    args = _args("MXFP4A16")
    spec = P.QuantSpec(P.PerGroup(32), P.FP4_E2M1, scale_dtype=P.E8M0)
    qp = P.choose_qparams(w, spec)
    wg = w.unflatten(-1, (-1, 32))
    ref_scale, _ = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
    assert qp.scale.dtype == ref_scale.dtype == dtype and qp.zero_point is None
    assert torch.equal(exact_bits(qp.scale), exact_bits(ref_scale))
    # powers of two the MX compressor stores exactly as biased exponents
    assert torch.equal(decompress_mx_scale(compress_mx_scale(qp.scale, torch.uint8)).to(dtype), qp.scale)
    q = P.quantize(w, qp, spec)
    ref_q = ct_quantize(w, ref_scale, None, args)
    assert q.dtype == torch.bfloat16 and torch.equal(exact_bits(q), exact_bits(ref_q.to(torch.bfloat16)))
    deq = P.dequantize(q, qp, spec)
    assert torch.equal(exact_bits(deq), exact_bits(ct_dequantize(ref_q, ref_scale, None, args)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_global_and_fp8_scales_equal_library(dtype):
    w = _weight(24, 128, dtype)
    args = _args("NVFP4A16")
    spec = P.QuantSpec(P.PerGroup(16), P.FP4_E2M1, scale_dtype=torch.float8_e4m3fn, global_scale=True)
    qp = P.choose_qparams(w, spec)
    ref_g = generate_gparam(w.amin(), w.amax())
    wg = w.unflatten(-1, (-1, 16))
    ref_scale, _ = calculate_qparams(wg.amin(-1), wg.amax(-1), args, global_scale=ref_g)
    assert torch.equal(qp.global_scale, ref_g) and qp.global_scale.dtype == torch.float32
    assert qp.scale.dtype == ref_scale.dtype and torch.equal(exact_bits(qp.scale), exact_bits(ref_scale))
    # the scales are fp8 values (what the NVFP4 compressor casts them to)
    assert torch.equal(qp.scale.to(torch.float8_e4m3fn).to(qp.scale.dtype), qp.scale)
    q = P.quantize(w, qp, spec)
    ref_q = ct_quantize(w, ref_scale, None, args, global_scale=ref_g)
    assert torch.equal(exact_bits(q), exact_bits(ref_q.to(torch.bfloat16)))
    deq = P.dequantize(q, qp, spec)
    ref_deq = ct_dequantize(ref_q, ref_scale, None, args, global_scale=ref_g)
    assert torch.equal(exact_bits(deq), exact_bits(ref_deq))


# ------------------------------------------------------------------ block shapes


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_tensor_fp8_and_int_equal_library(dtype):
    w = _weight(24, 96, dtype)
    for spec, args in [
        (P.QuantSpec(P.PerTensor(), P.FP8_E4M3), _args("FP8")),
        (P.QuantSpec(P.PerTensor(), P.int_type(8, symmetric=False)),
         QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="tensor")),
    ]:
        qp = P.choose_qparams(w, spec)
        ref_scale, ref_zp = calculate_qparams(w.amin(), w.amax(), args)
        assert qp.scale.shape == (1,) == ref_scale.shape
        assert torch.equal(exact_bits(qp.scale), exact_bits(ref_scale))
        if qp.zero_point is not None:
            assert torch.equal(qp.zero_point, ref_zp)
        q = P.quantize(w, qp, spec)
        ref_q = ct_quantize(w, ref_scale, ref_zp if qp.zero_point is not None else None, args,
                            dtype=spec.qtype.storage_dtype)
        assert torch.equal(exact_bits(q), exact_bits(ref_q))
        deq = P.dequantize(q, qp, spec)
        assert torch.equal(deq, ct_dequantize(ref_q, ref_scale, qp.zero_point, args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_2d_blocks_with_partial_edges_equal_library(dtype):
    w = _weight(40, 72, dtype)  # 16 x 32 blocks: partial in both dimensions
    args = _args("FP8_BLOCK", block_structure=[16, 32])
    spec = P.QuantSpec(P.PerBlock(16, 32), P.FP8_E4M3)
    qp = P.choose_qparams(w, spec)
    ref_scale, _ = calculate_qparams(*_block_minmax(w, 16, 32), args)
    assert qp.scale.shape == (3, 3) == P.scale_shape(spec.granularity, tuple(w.shape))
    assert torch.equal(exact_bits(qp.scale), exact_bits(ref_scale))
    q = P.quantize(w, qp, spec)
    ref_q = ct_quantize(w, ref_scale, None, args, dtype=torch.float8_e4m3fn)
    assert torch.equal(exact_bits(q), exact_bits(ref_q))
    assert torch.equal(P.dequantize(q, qp, spec), ct_dequantize(ref_q, ref_scale, None, args))


def test_block_size_and_scale_shape():
    shape = (40, 72)
    assert P.block_size(P.PerTensor(), shape) == (40, 72) and P.scale_shape(P.PerTensor(), shape) == (1,)
    assert P.block_size(P.PerChannel(), shape) == (1, 72) and P.scale_shape(P.PerChannel(), shape) == (40, 1)
    assert P.block_size(P.PerGroup(8), shape) == (1, 8) and P.scale_shape(P.PerGroup(8), shape) == (40, 9)
    assert P.block_size(P.PerBlock(16, 32), shape) == (16, 32)
    with pytest.raises(SqError, match="group size 16 does not divide the weight width 72"):
        P.scale_shape(P.PerGroup(16), shape)


# ------------------------------------------------------------------ row shards


SHARDED_SPECS = {
    "tensor-fp8": P.QuantSpec(P.PerTensor(), P.FP8_E4M3),
    "tensor-int8-asym": P.QuantSpec(P.PerTensor(), P.int_type(8, symmetric=False)),
    "block-fp8": P.QuantSpec(P.PerBlock(16, 32), P.FP8_E4M3),
    "block-int4-asym": P.QuantSpec(P.PerBlock(16, 32), P.int_type(4, symmetric=False)),
    "nvfp4": P.QuantSpec(P.PerGroup(16), P.FP4_E2M1, scale_dtype=torch.float8_e4m3fn, global_scale=True),
    "mxfp4": P.QuantSpec(P.PerGroup(32), P.FP4_E2M1, scale_dtype=P.E8M0),
    "channel-int4": P.QuantSpec(P.PerChannel(), P.int_type(4)),
}


def _splits(rows: int, n: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 chunks (torch.chunk: empty tail chunks), as (start, stop)."""
    sizes = [len(c) for c in torch.arange(rows).chunk(n)] + [0] * n
    bounds = [0]
    for s in sizes[:n]:
        bounds.append(bounds[-1] + s)
    return list(zip(bounds[:-1], bounds[1:]))


def _sharded(w: torch.Tensor, spec: P.QuantSpec, parts: list[tuple[int, int]]):
    """Quantize each shard on its own with the all-reduced statistics; reassemble."""
    stats = {}
    for stat, op in P.cross_row_stats(spec).items():
        local = [P.local_stat(w[a:b], spec, stat, row_offset=a, rows=w.shape[0]) for a, b in parts]
        stats[stat] = torch.stack(local).amax(0) if op == "max" else torch.stack(local).amin(0)
    qs, qps = [], []
    for a, b in parts:
        qp = P.choose_qparams(w[a:b], spec, stats=stats)
        qs.append(P.quantize(w[a:b], qp, spec, row_offset=a))
        qps.append(qp)
    return torch.cat(qs), qps


@pytest.mark.parametrize("name", SHARDED_SPECS)
def test_row_shards_with_reduced_stats_equal_the_whole(name):
    spec = SHARDED_SPECS[name]
    w = _weight(40, 96, torch.bfloat16, seed=5)
    whole_qp = P.choose_qparams(w, spec)
    whole_q = P.quantize(w, whole_qp, spec)
    for parts in (_splits(40, 1), _splits(40, 2), _splits(40, 3), [(0, 17), (17, 17), (17, 40)]):
        q, qps = _sharded(w, spec, parts)
        assert torch.equal(exact_bits(q), exact_bits(whole_q)), parts
        for field in ("scale", "zero_point", "global_scale"):
            whole = getattr(whole_qp, field)
            got = [getattr(qp, field) for qp in qps]
            if whole is None:
                assert all(g is None for g in got)
            elif field != "global_scale" and P.scales_follow_rows(spec):
                assert torch.equal(exact_bits(torch.cat(got)), exact_bits(whole))
            else:  # the whole tensor's, identical on every rank
                assert all(torch.equal(exact_bits(g), exact_bits(whole)) for g in got)
        a, b = parts[-1]
        deq = P.dequantize(q[a:b], qps[-1], spec, row_offset=a)
        assert torch.equal(deq, P.dequantize(whole_q, whole_qp, spec)[a:b])


def test_row_local_specs_need_no_stats():
    assert P.cross_row_stats(SHARDED_SPECS["channel-int4"]) == {}
    assert P.cross_row_stats(SHARDED_SPECS["mxfp4"]) == {}
    assert P.cross_row_stats(P.QuantSpec(P.PerBlock(1, 32), P.FP8_E4M3)) == {}
    assert P.cross_row_stats(SHARDED_SPECS["tensor-int8-asym"]) == {"min": "min", "max": "max"}
    assert P.cross_row_stats(SHARDED_SPECS["nvfp4"]) == {"global_absmax": "max"}


def test_missing_stats_and_bad_specs_refused():
    w = _weight(8, 64, torch.bfloat16)
    with pytest.raises(SqError, match="absmax"):
        P.choose_qparams(w, SHARDED_SPECS["block-fp8"], stats={})
    with pytest.raises(SqError, match="2-D"):
        P.choose_qparams(w[0], SHARDED_SPECS["tensor-fp8"])
    with pytest.raises(ValueError):
        P.QType("float", 4, symmetric=False)
    with pytest.raises(ValueError):
        P.QType("int", 9)
    with pytest.raises(ValueError):
        P.QuantSpec(P.PerTensor(), P.FP4_E2M1, global_scale=True)
    with pytest.raises(ValueError):
        P.QuantSpec(P.PerGroup(32), P.int_type(4), scale_dtype=P.E8M0)
    with pytest.raises(ValueError):
        P.PerGroup(0)


@pytest.mark.parametrize("rows,cols", [(384, 1024), (576, 576), (300, 200), (1000, 130), (129, 1)])
def test_block_absmax_of_any_row_shard_is_the_tiles_absmax(rows, cols):
    """FP8_BLOCK's block absmax (reduced down each block row, then across each tile's columns) of any
    row range equals the brute-force max of |x| over each tile's rows in that range."""
    from sq.formats.specs import spec_for
    from sq.formats.schemes import get_scheme

    spec = spec_for(get_scheme("FP8_BLOCK"))
    br, bc = spec.granularity.rows, spec.granularity.cols
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).bfloat16()
    w[5, min(3, cols - 1)] = 100
    for lo, hi in [(0, rows), (0, rows // 3), (rows // 3, rows), (7, rows - 5), (130, 260)]:
        hi = min(hi, rows)
        if hi <= lo:
            continue
        got = P.local_stat(w[lo:hi], spec, "absmax", row_offset=lo, rows=rows)
        want = torch.zeros_like(got)
        for i in range(got.shape[0]):
            for j in range(got.shape[1]):
                tile = w[max(lo, i * br):min(hi, (i + 1) * br), j * bc:(j + 1) * bc]
                if tile.numel():
                    want[i, j] = tile.abs().max().float()
        assert torch.equal(got, want), (lo, hi)
