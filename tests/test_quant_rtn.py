"""RTN maths: bit-identical to compressed-tensors' torch path, and row-independent."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import (
    dequantize as ct_dequantize,
)
from compressed_tensors.quantization.lifecycle.forward import (
    fake_quantize as ct_fake_quantize,
)
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from sq.errors import SqError
from sq.quant import rtn
from sq.formats.schemes import SCHEME_NAMES, get_scheme

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _weight(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0] = 0.0  # all-zero row: zero scales, asymmetric 0/0 zero points
    w[1] = w[1].abs()  # all-positive row: min widened to 0
    w[2] = -w[2].abs()  # all-negative row
    w[3, :] = 0.0123  # constant row
    w[4, ::7] *= 40  # outliers
    return w.to(dtype)


def _library_qparams(w: torch.Tensor, name: str, group_size: int):
    """compressed-tensors' scales for ``w``: a min-max observation + ``calculate_qparams``."""
    scheme = preset_name_to_scheme(name, ["Linear"])
    args = scheme.weights
    if args.strategy == "group":
        args.group_size = group_size
        wg = w.unflatten(-1, (-1, group_size))
        mn, mx = torch.amin(wg, dim=-1), torch.amax(wg, dim=-1)
    else:
        mn, mx = torch.amin(w, dim=-1, keepdim=True), torch.amax(w, dim=-1, keepdim=True)
    scale, zp = calculate_qparams(mn, mx, args)
    return scale, zp, args


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_bit_identical_to_compressed_tensors(name, dtype):
    w = _weight(48, 256, dtype)
    scheme = get_scheme(name, group_size=64)
    scale, zp = rtn.compute_qparams(w, scheme)
    ref_scale, ref_zp, args = _library_qparams(w, name, 64)

    assert scale.dtype == ref_scale.dtype == dtype
    assert torch.equal(scale, ref_scale)
    if scheme.symmetric:
        assert zp is None
    else:
        assert zp.dtype == torch.int8 and torch.equal(zp, ref_zp)

    q = rtn.quantize(w, scale, zp, scheme)
    ref_q = ct_quantize(w, ref_scale, ref_zp, args, dtype=args.pytorch_dtype())
    assert q.dtype == ref_q.dtype == scheme.storage_dtype
    assert torch.equal(q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q,
                       ref_q.view(torch.uint8) if ref_q.dtype == torch.float8_e4m3fn else ref_q)

    deq = rtn.dequantize(q, scale, zp, scheme)
    assert deq.dtype == dtype
    assert torch.equal(deq, ct_dequantize(ref_q, ref_scale, ref_zp, args))
    assert torch.equal(rtn.fake_quantize(w, scheme), ct_fake_quantize(w, ref_scale, ref_zp, args))


def test_int_values_in_range():
    w = _weight(32, 128, torch.bfloat16)
    for name in ("W4A16", "W4A16_ASYM", "W8A16"):
        s = get_scheme(name, 32)
        q = rtn.quantize(w, *rtn.compute_qparams(w, s), s)
        assert q.dtype == torch.int8
        assert int(q.min()) >= s.qmin and int(q.max()) <= s.qmax
    s = get_scheme("W4A16", 32)
    q = rtn.quantize(w, *rtn.compute_qparams(w, s), s)
    assert int(q.min()) == -8 or int(q.max()) == 7  # the range is used


def test_zero_rows_are_exact():
    w = _weight(8, 64, torch.bfloat16)
    for name in SCHEME_NAMES:
        s = get_scheme(name, 32)
        fq = rtn.fake_quantize(w, s)
        assert torch.equal(fq[0], torch.zeros_like(fq[0]))
        scale, zp = rtn.compute_qparams(w, s)
        assert bool((scale > 0).all())
        if zp is not None:
            assert torch.equal(zp[0], torch.zeros_like(zp[0]))


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_row_independent(name):
    """Quantizing rows [a, b) alone gives exactly those rows of the full result."""
    w = _weight(97, 256, torch.bfloat16, seed=3)
    s = get_scheme(name, 64)
    scale, zp = rtn.compute_qparams(w, s)
    q = rtn.quantize(w, scale, zp, s)
    for a, b in [(0, 1), (5, 37), (37, 97), (96, 97)]:
        ss, zz = rtn.compute_qparams(w[a:b], s)
        qq = rtn.quantize(w[a:b], ss, zz, s)
        assert torch.equal(ss, scale[a:b])
        if zp is not None:
            assert torch.equal(zz, zp[a:b])
        assert torch.equal(qq.view(torch.uint8), q[a:b].view(torch.uint8))
        assert torch.equal(rtn.fake_quantize(w[a:b], s), rtn.fake_quantize(w, s)[a:b])


def test_bad_input_raises_sqerror():
    s = get_scheme("W4A16", 64)
    with pytest.raises(SqError, match="group size 64 does not divide the weight width 96"):
        rtn.compute_qparams(torch.randn(4, 96), s)
    with pytest.raises(SqError, match="2-D"):
        rtn.compute_qparams(torch.randn(4), s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_all_finite_sees_nan_and_inf_in_every_weight_dtype(dtype):
    from sq.quant.rtn import all_finite
    w = torch.randn(8, 16).to(dtype)
    assert all_finite(w) and all_finite(w[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        if dtype == torch.float8_e4m3fn and bad != bad:
            w2 = w.clone(); w2.view(torch.uint8)[3, 5] = 0x7F  # e4m3fn's NaN bit pattern
        elif dtype == torch.float8_e4m3fn:
            continue  # e4m3fn has no infinity
        else:
            w2 = w.clone(); w2[3, 5] = bad
        assert not all_finite(w2), (dtype, bad)
