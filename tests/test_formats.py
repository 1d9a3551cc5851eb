"""The format registry: declared tensors equal what is written, every registered scheme gives the
same tensors from 1, 2 or 3 row shards, and a cross-row scale without a declared reduction is refused."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from sq.errors import SqError
from sq.formats.compressed import compress_weight, compressed_names
from sq.formats import specs
from sq.formats import primitives as P
from sq.quant import rtn
from sq.formats.schemes import SCHEME_NAMES, QuantScheme, get_scheme

GROUP = 32


def _weight(rows: int, cols: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[3] = 0.0
    w[5, ::9] *= 30  # outliers: a per-tensor scale is set by one row
    return w.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _splits(rows: int, n: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 chunks (torch.chunk; a rank may hold no rows), as (start, stop)."""
    sizes = [len(c) for c in torch.arange(rows).chunk(n)]
    sizes += [0] * (n - len(sizes))
    starts = [sum(sizes[:i]) for i in range(n)]
    return [(a, a + s) for a, s in zip(starts, sizes)]


SPLITS = [_splits(72, 1), _splits(72, 2), _splits(72, 3), [(0, 0), (0, 25), (25, 72)]]


def _quantize_sharded(w: torch.Tensor, scheme, parts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the driver does: the declared reductions over every shard's rows (the all-reduce,
    in-process), then each shard quantized alone, then the rows gathered to one writer."""
    reductions = specs.required_reductions(scheme)
    stats = {
        r.stat: r.combine([r.local(w[a:b], row_offset=a, rows=w.shape[0]) for a, b in parts]) for r in reductions
    }
    spec = specs.spec_for(scheme)
    qs, qps = [], []
    for a, b in parts:
        qp = rtn.qparams(w[a:b], scheme, stats=stats or None)
        qs.append(P.quantize(w[a:b], qp, spec, row_offset=a))
        qps.append(qp)
    if P.scales_follow_rows(spec):
        scale = torch.cat([qp.scale for qp in qps])
        zp = None if qps[0].zero_point is None else torch.cat([qp.zero_point for qp in qps])
    else:  # identical on every rank: the writer takes its own
        scale, zp = qps[0].scale, qps[0].zero_point
        assert all(torch.equal(qp.scale, scale) for qp in qps)
    return torch.cat(qs), scale, zp


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_registered_schemes_are_row_shardable_without_reductions(name):
    s = get_scheme(name, GROUP)
    specs.check_row_shardable(s)
    assert specs.required_reductions(s) == []
    assert specs.row_independent(s)
    assert specs.format_for(s).name == s.format


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_one_two_three_row_shards_write_identical_tensors(name):
    s = get_scheme(name, GROUP)
    w = _weight(72, 128)
    scale, zp = rtn.compute_qparams(w, s)
    whole = compress_weight((rtn.quantize(w, scale, zp, s), scale, zp), s)
    for parts in SPLITS:
        got = compress_weight(_quantize_sharded(w, s, parts), s)
        assert sorted(got) == sorted(whole)
        for k in whole:
            assert got[k].dtype == whole[k].dtype and torch.equal(_bits(got[k]), _bits(whole[k])), (parts, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_declared_tensors_are_what_is_written(name, dtype):
    s = get_scheme(name, GROUP)
    fmt = specs.format_for(s)
    for shape in [(72, 128), (40, 96), (9, 32)]:
        w = _weight(*shape, dtype=dtype)
        scale, zp = rtn.compute_qparams(w, s)
        written = compress_weight((rtn.quantize(w, scale, zp, s), scale, zp), s)
        declared = {t.name: (t.dtype, t.shape) for t in fmt.tensors(s, shape, dtype)}
        assert {k: (v.dtype, tuple(v.shape)) for k, v in written.items()} == declared, shape
    assert compressed_names(s) == fmt.names(s) == tuple(declared)


def test_registry_lookups():
    assert set(specs.format_names()) >= {"pack-quantized", "float-quantized"}
    assert specs.get_format("pack-quantized").name == "pack-quantized"
    with pytest.raises(SqError, match="unknown format"):
        specs.get_format("nope-quantized")
    with pytest.raises(ValueError, match="already registered"):
        specs.register_format(specs.PackQuantized)


# ------------------------------------------------------------------ a per-tensor format


class _PerTensorInt8(specs.Format):
    """A test-only format: int8 with one scale per tensor (a cross-row statistic)."""

    name = "test-per-tensor"
    declare = True

    def accepts(self, scheme):
        ok = scheme.type == "int" and scheme.num_bits == 8 and scheme.strategy == "tensor"
        return None if ok else "int8 per-tensor only"

    def spec(self, scheme):
        return P.QuantSpec(P.PerTensor(), P.int_type(8, scheme.symmetric))

    def reductions(self, scheme):
        spec = self.spec(scheme)
        return tuple(specs.Reduction(stat, spec) for stat in P.cross_row_stats(spec)) if self.declare else ()

    def tensors(self, scheme, shape, dtype):
        return (specs.TensorSpec("weight", torch.int8, tuple(shape)), specs.TensorSpec("weight_scale", dtype, (1,)))

    def compress(self, q, qp, scheme):
        return {"weight": q, "weight_scale": qp.scale}


class _Undeclared(_PerTensorInt8):
    declare = False


@contextlib.contextmanager
def _registered(fmt):
    specs.register_format(fmt)
    try:
        yield
    finally:
        specs.unregister_format(fmt.name)


def _per_tensor(symmetric=True) -> QuantScheme:
    return QuantScheme("INT8_TENSOR", 8, "int", symmetric, "tensor", None)


def test_unregistered_per_tensor_scheme_is_refused():
    with pytest.raises(ValueError, match="no registered format writes it") as e:
        _per_tensor()
    assert "pack-quantized: writes per-group or per-channel scales, not tensor" in str(e.value)


def test_per_tensor_format_without_a_declared_reduction_is_refused():
    with _registered(_Undeclared()):
        s = _per_tensor()
        assert not specs.row_independent(s)
        with pytest.raises(SqError, match="absmax over all rows of a weight") as e:
            specs.check_row_shardable(s)
        assert "INT8_TENSOR" in str(e.value) and "test-per-tensor" in str(e.value)
        with pytest.raises(SqError, match="declares no reduction"):
            specs.required_reductions(s)


@pytest.mark.parametrize("symmetric", [True, False])
def test_per_tensor_format_with_declared_reductions_shards_exactly(symmetric):
    with _registered(_PerTensorInt8()):
        s = _per_tensor(symmetric)
        assert specs.row_independent(s)
        reductions = specs.required_reductions(s)
        assert {(r.stat, r.op) for r in reductions} == (
            {("absmax", "max")} if symmetric else {("min", "min"), ("max", "max")}
        )
        assert {r.reduce_op for r in reductions} <= {dist.ReduceOp.MAX, dist.ReduceOp.MIN}
        w = _weight(72, 128)
        scale, zp = rtn.compute_qparams(w, s)
        whole = (rtn.quantize(w, scale, zp, s), scale, zp)
        for parts in SPLITS:
            q, sc, z = _quantize_sharded(w, s, parts)
            assert torch.equal(q, whole[0]) and torch.equal(sc, whole[1])
            assert (z is None and zp is None) or torch.equal(z, zp)
        # what the reductions prevent: a shard's own per-tensor scale differs from the whole's
        assert not torch.equal(rtn.compute_qparams(w[36:], s)[0], scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp4_packing_equals_the_library_on_any_input(dtype):
    """sq's CPU packer is the library's ``pack_fp4_to_uint8`` (its own CPU function, called by name),
    byte for byte: every e2m1 value with both signs (-0.0 included), and values that are not e2m1
    (the library's rules for them too)."""
    from compressed_tensors.utils.impl_backend import ImplBackend

    from sq.formats.specs import pack_fp4_cpu

    vals = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6,
                         2.5, 5, 7, 12, 63.5, -64, 100, 1000, -1000])
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 2), (64, 32), (333, 128)]:
        x = vals[torch.randint(0, len(vals), shape, generator=g)].to(dtype)
        assert torch.equal(pack_fp4_cpu(x), ImplBackend.call("pack_fp4_to_uint8", x)), shape


def test_int_packing_is_the_librarys_bit_for_bit():
    """sq's lean int packer (``sq.formats.specs.pack_int32``: no int64 index copies, so no heap churn) against
    ``compressed_tensors``' ``pack_to_int32`` on every width it takes over, odd column counts (padding), both
    packed dimensions (weights along ``in``, asymmetric zero points along ``out``) and the extreme codes."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from sq.formats.specs import pack_int32

    g = torch.Generator().manual_seed(0)
    for bits in (2, 3, 4, 8):
        lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
        for shape in [(1, 1), (3, 33), (64, 128), (37, 1000)]:
            x = torch.randint(lo, hi, shape, generator=g, dtype=torch.int8)
            x.view(-1)[:2] = torch.tensor([lo, hi - 1], dtype=torch.int8)[: x.numel()]
            for dim in (0, 1):
                want = pack_to_int32(x, bits, packed_dim=dim)
                got = pack_int32(x, bits, packed_dim=dim)
                assert got.dtype == torch.int32 and torch.equal(got, want), (bits, shape, dim)
