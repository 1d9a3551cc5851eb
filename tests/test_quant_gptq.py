"""GPTQ: beats RTN on correlated inputs, deterministic, row-shardable, refuses clearly."""

from __future__ import annotations

import pytest
import torch

from sq.errors import SqError
from sq.formats.compressed import compress_weight, decompress_weight
from sq.quant import rtn
from sq.quant.gptq import GPTQ, GPTQConfig, Problem, quantize_together
from sq.formats.schemes import SCHEME_NAMES, get_scheme

ROWS, COLS, TOKENS = 96, 256, 2048


def _data(seed: int = 0, dtype=torch.bfloat16):
    """Correlated inputs (a random mixing matrix + noise, a few loud channels) and a weight."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(COLS, COLS, generator=g) / COLS**0.5
    x = torch.randn(TOKENS, COLS, generator=g) @ mix + 0.05 * torch.randn(TOKENS, COLS, generator=g)
    x[:, :8] *= 5.0
    w = (torch.randn(ROWS, COLS, generator=g) * 0.05).to(dtype)
    return x, w


def _out_err(x, w, wq):
    ref = x @ w.float().T
    return float((ref - x @ wq.float().T).norm() / ref.norm())


def _gptq(x) -> GPTQ:
    g = GPTQ(x.shape[-1])
    for chunk in x.split(512):
        g.add_batch(chunk.unsqueeze(0))  # [batch, seq, in] is accepted
    return g


@pytest.fixture(scope="module")
def data():
    return _data()


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_gptq_beats_rtn(data, name):
    x, w = data
    s = get_scheme(name, group_size=64)
    r = _gptq(x).quantize(w, s, name="layer")
    e_gptq, e_rtn = _out_err(x, w, r.weight), _out_err(x, w, rtn.fake_quantize(w, s))
    assert e_gptq < 0.85 * e_rtn, (e_gptq, e_rtn)
    # the reported error is the same quantity, computed through H
    assert r.rel_err == pytest.approx(e_gptq, rel=2e-3)
    assert r.retries == 0 and r.dead_columns == 0 and r.nsamples == TOKENS
    assert r.q.dtype == s.storage_dtype and r.q.shape == w.shape
    assert r.weight.dtype == w.dtype and r.scale.dtype == w.dtype
    if s.type == "int":
        assert s.qmin <= int(r.q.min()) and int(r.q.max()) <= s.qmax
    # the stored tensors reconstruct exactly the weight GPTQ optimized
    assert torch.equal(r.weight, rtn.dequantize(r.q, r.scale, r.zero_point, s))
    assert torch.equal(decompress_weight(compress_weight(r, s, w.shape), s), r.weight)


def test_rerun_is_bit_identical(data):
    x, w = data
    s = get_scheme("W4A16_ASYM", 64)
    a = _gptq(x).quantize(w, s)
    b = _gptq(x).quantize(w, s)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)
    assert torch.equal(a.zero_point, b.zero_point) and torch.equal(a.weight, b.weight)


@pytest.mark.parametrize("name", ["W4A16", "W4A16_ASYM", "FP8_DYNAMIC"])
@pytest.mark.parametrize("actorder", [False, True])
def test_row_shards_match_full_solve(data, name, actorder):
    """Each rank solves only its rows; the result must be those rows of the full solve.

    Measured on this CPU (float32 sweep, MKL/OpenBLAS): the shards are bit-identical to
    the full solve.  The assertion allows a stray rounding flip (BLAS may pick a different
    kernel for a different row count) but no more than 0.5% of the values.
    """
    x, w = data
    s = get_scheme(name, 64)
    g = _gptq(x)
    full = g.quantize(w, s, actorder=actorder)
    flips = 0
    for a, b in [(0, 40), (40, 41), (41, 96)]:
        part = g.quantize(w[a:b], s, actorder=actorder)
        assert torch.equal(part.scale, full.scale[a:b]) or name == "FP8_DYNAMIC" or not actorder
        flips += int((part.q.view(torch.uint8) != full.q[a:b].view(torch.uint8)).sum())
        torch.testing.assert_close(part.weight.float(), full.weight[a:b].float(), rtol=0, atol=0.02)
    assert flips <= 0.005 * w.numel()


def test_row_shards_bit_identical(data):
    """The measured fact, stated exactly: shards reproduce the full solve bit for bit."""
    x, w = data
    s = get_scheme("W4A16", 64)
    g = _gptq(x)
    full = g.quantize(w, s)
    parts = [g.quantize(w[a:b], s) for a, b in [(0, 17), (17, 64), (64, 96)]]
    assert torch.equal(torch.cat([p.q for p in parts]), full.q)
    assert torch.equal(torch.cat([p.scale for p in parts]), full.scale)


def test_hessian_sum_over_ranks_equals_single_accumulator(data):
    x, w = data
    x = x.reshape(4, x.shape[0] // 4, -1)  # ranks split by samples: two samples each

    def acc(*batches):
        g = GPTQ(x.shape[-1])
        for b in batches:
            g.add_batch(b)
        return g

    whole = acc(x[:1], x[1:])  # one rank: batches of 1 and 3 samples
    halves = [acc(x[:2]), acc(x[2:])]
    summed = GPTQ.from_hessian(halves[0].H + halves[1].H, halves[0].nsamples + halves[1].nsamples)
    torch.testing.assert_close(summed.hessian(), whole.hessian(), rtol=1e-12, atol=1e-12)
    assert summed.hessian().dtype == torch.float64
    s = get_scheme("W4A16", 64)
    assert torch.equal(summed.quantize(w, s).q, whole.quantize(w, s).q)


def test_actorder_static_groups(data):
    x, w = data
    s = get_scheme("W4A16", 64)
    g = _gptq(x)
    r = g.quantize(w, s, actorder=True)
    scale, _ = rtn.compute_qparams(w, s)
    # static: the scales are the up-front (RTN) scales of the unpermuted weight, and the
    # output stays plain group-wise (no g_idx): reconstructing needs only q and scale
    assert torch.equal(r.scale, scale)
    assert _out_err(x, w, r.weight) < 0.85 * _out_err(x, w, rtn.fake_quantize(w, s))
    st = g.quantize(w, s, static_groups=True)
    assert torch.equal(st.scale, scale)
    assert not torch.equal(st.q, r.q)  # a different column order gives a different solution


def test_config_dataclass_round_trip(data):
    x, w = data
    cfg = GPTQConfig(blocksize=64, actorder=True)
    assert GPTQConfig.from_dict(cfg.to_dict()) == cfg
    s = get_scheme("W4A16", 64)
    a = _gptq(x).quantize(w, s, **cfg.to_dict())
    assert a.retries == 0
    with pytest.raises(ValueError):
        GPTQConfig(percdamp=0)
    with pytest.raises(ValueError):
        GPTQConfig.from_dict({"blocksize": 128, "bogus": 1})


def test_blocksize_not_multiple_of_group(data):
    """Groups never straddle blocks: the result with blocksize 96 and group 64 is a valid
    quantization whose scales match RTN on the updated weights (sanity: beats RTN)."""
    x, w = data
    s = get_scheme("W4A16", 64)
    r = _gptq(x).quantize(w, s, blocksize=96)
    assert _out_err(x, w, r.weight) < 0.85 * _out_err(x, w, rtn.fake_quantize(w, s))


def test_dead_columns(data):
    x, w = data
    x = x.clone()
    x[:, [3, 100]] = 0.0
    s = get_scheme("W4A16", 64)
    r = _gptq(x).quantize(w, s)
    assert r.dead_columns == 2
    assert bool((r.weight[:, [3, 100]] == 0).all())


def test_cholesky_retry_is_reported():
    # symmetric, indefinite: eigenvalues 3 and -2 in each 2x2 block, mean(diag) 0.5, so
    # dampening 0.01, 0.1 and 1 x mean(diag) fail and 10 x succeeds
    block = torch.tensor([[0.5, 2.5], [2.5, 0.5]], dtype=torch.float64)
    H = torch.kron(torch.eye(32, dtype=torch.float64), block)
    g = GPTQ.from_hessian(H, nsamples=2)  # hessian() = 2 / 2 * H = H
    w = torch.randn(8, 64)
    s = get_scheme("W4A16", 32)
    r = g.quantize(w, s, name="model.layers.7.mlp.down_proj")
    assert r.retries == 3
    assert r.percdamp == pytest.approx(10.0)
    assert r.damp == pytest.approx(10.0 * float(torch.diag(g.hessian()).mean()))
    assert r.stats()["retries"] == 3
    with pytest.raises(SqError, match=r"model\.layers\.7\.mlp\.down_proj: Cholesky"):
        g.quantize(w, s, max_retries=2, name="model.layers.7.mlp.down_proj")


def test_refusals():
    g = GPTQ(96)
    w = torch.randn(8, 96)
    with pytest.raises(SqError, match="no calibration tokens"):
        g.quantize(w, get_scheme("W4A16", 32), name="model.layers.0.mlp.experts.5.up_proj")
    g.add_batch(torch.randn(10, 96))
    with pytest.raises(SqError) as e:
        g.quantize(w, get_scheme("W4A16", 64), name="model.layers.0.self_attn.q_proj")
    assert "model.layers.0.self_attn.q_proj" in str(e.value) and "64" in str(e.value) and "96" in str(e.value)
    with pytest.raises(SqError, match="does not match"):
        g.quantize(torch.randn(8, 64), get_scheme("W4A16", 32), name="l")
    with pytest.raises(SqError, match="width"):
        g.add_batch(torch.randn(4, 95))
    bad = GPTQ(32)
    bad.add_batch(torch.full((2, 32), float("inf")))
    with pytest.raises(SqError, match="non-finite"):
        bad.quantize(torch.randn(4, 32), get_scheme("W4A16", 32), name="l")
    for preset in ("FP8_BLOCK", "FP8"):  # per-tensor / 2-D block scales: not GPTQ's per-row sweep
        with pytest.raises(SqError, match=f"scheme {preset} has Per(Block|Tensor) scales"):
            g.quantize(torch.randn(8, 96), get_scheme(preset), name="l")
    g.free()
    assert g.H is None


def test_input_weight_untouched(data):
    x, w = data
    w32 = w.float()
    before = w32.clone()
    xd = x.clone()
    xd[:, 5] = 0
    _gptq(xd).quantize(w32, get_scheme("W4A16", 64))
    assert torch.equal(w32, before)


@pytest.mark.parametrize("actorder", [False, True])
def test_weights_sharing_an_accumulator_factor_it_once_with_the_same_bits(data, actorder, monkeypatch):
    """q/k/v, or every expert's gate/up under calibrate-all, share one Hessian: it is prepared
    (dead columns, act-order, damped inverse factor) once, and each weight's result equals a
    solve against its own fresh accumulator."""
    import sq.quant.gptq as gptq_mod

    x, _ = data
    x = x.clone()
    x[:, 5] = 0.0  # a dead column travels with the shared preparation
    s = get_scheme("W4A16_ASYM", 64)
    weights = [_data(seed)[1] for seed in (1, 2, 3)]
    fresh = [_gptq(x).quantize(w, s, actorder=actorder) for w in weights]

    calls = []
    real = gptq_mod._inverse_cholesky
    monkeypatch.setattr(gptq_mod, "_inverse_cholesky", lambda *a: calls.append(1) or real(*a))
    shared = _gptq(x)
    got = [shared.quantize(w, s, actorder=actorder) for w in weights]
    assert len(calls) == 1
    for a, b in zip(fresh, got):
        assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)
        assert torch.equal(a.weight, b.weight) and a.rel_err == b.rel_err and a.loss == b.loss
        assert b.dead_columns == 1
    # other settings, or more calibration data, prepare again
    shared.quantize(weights[0], s, actorder=not actorder)
    assert len(calls) == 2
    shared.add_batch(x[:64])
    shared.quantize(weights[0], s, actorder=not actorder)
    assert len(calls) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hessian_upper_triangle_is_each_samples_full_product(dtype):
    """add_batch computes only the upper block triangle of each sample's x^T x (in bands) and
    mirrors it: H is exactly symmetric and equals the per-sample float32 products summed in float64."""
    g = torch.Generator().manual_seed(3)
    n = 300  # not a multiple of any band
    x = (torch.randn(3, 64, n, generator=g) * torch.rand(n, generator=g) * 4).to(dtype)
    acc = GPTQ(n)
    acc.add_batch(x[:2])
    acc.add_batch(x[2:])
    H = acc.H
    assert torch.equal(H, H.T)
    if dtype == torch.float32:
        ref = sum((s.float().T @ s.float()).double() for s in x)
        torch.testing.assert_close(H, ref, rtol=0, atol=0)
    else:
        # bf16 inputs multiply as bf16 operands with float32 sums where the CPU has them
        # (_bf16_operands): exact operands, so within float32 summation of the exact products (bf16
        # results would be ~1e-3 off); the process-wide setting is back as it was
        ref = sum(s.double().T @ s.double() for s in x)
        torch.testing.assert_close(H, ref, rtol=2e-6, atol=2e-6 * float(ref.abs().max()))
        if hasattr(torch.backends.mkldnn, "matmul"):
            assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"
    assert acc.nsamples == 3 * 64
    # a 2-D token set (float64) after sample batches sees the mirrored matrix, not half of it
    before = H.clone()
    acc.add_batch(x[0].float())
    torch.testing.assert_close(acc.H, before + (x[0].double().T @ x[0].double()), rtol=1e-12, atol=1e-9)


def test_inverse_factor_float32_then_float64():
    """The damped inverse factor is computed in float32 when every pivot is sound and again in
    float64 (same dampening, no retry) when not; both satisfy U^T U = (H + damp I)^-1."""
    import sq.quant.gptq as gptq_mod

    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 128, generator=g, dtype=torch.float64) @ torch.randn(128, 128, generator=g, dtype=torch.float64)
    x[:, :4] *= 30.0  # 64 tokens in 128 dims: H is singular, H + damp I as ill-conditioned as damp makes it
    for percdamp, want_dtype_path in ((0.01, "float32"), (1e-5, "float64")):
        H = x.T @ x
        Hd = H + percdamp * float(H.diagonal().mean()) * torch.eye(128, dtype=torch.float64)
        n = H.shape[0]
        J = torch.arange(n - 1, -1, -1)
        paths = []
        real = torch.linalg.cholesky_ex
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.linalg, "cholesky_ex", lambda A: paths.append(str(A.dtype)) or real(A))
            U, damp, retries = gptq_mod._inverse_cholesky(H[J][:, J].clone(), float(H.diagonal().mean()),
                                                          GPTQConfig(percdamp=percdamp), "t")
        assert retries == 0 and U.dtype == torch.float32
        assert paths[-1] == f"torch.{want_dtype_path}", paths
        inv = torch.linalg.inv(Hd)
        assert float((U.double().T @ U.double() - inv).norm() / inv.norm()) < 1e-4
        assert torch.equal(U, torch.triu(U))


def test_lower_inverse_by_halves():
    import sq.quant.gptq as gptq_mod

    g = torch.Generator().manual_seed(5)
    a = torch.randn(700, 700, generator=g, dtype=torch.float64)
    L = torch.linalg.cholesky(a @ a.T + 700 * torch.eye(700, dtype=torch.float64))
    inv = gptq_mod._lower_inverse(L, leaf=64)
    torch.testing.assert_close(inv @ L, torch.eye(700, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(inv, torch.tril(inv))


@pytest.mark.parametrize("name", ["W4A16", "W4A16_ASYM", "NVFP4A16"])
def test_stacked_weights_solve_as_each_alone(data, name):
    """The pipeline solves the Linears sharing a Hessian (q/k/v, gate/up) as one stack of rows
    (GPTQAlgorithm.solve_linears): each one's rows equal its own solve, bit for bit."""
    x, _ = data
    s = get_scheme(name, 64 if name.startswith("W") else 16)
    ws = [_data(seed)[1][:rows] for seed, rows in ((1, 96), (2, 32), (3, 40))]
    g = _gptq(x)
    alone = [g.quantize(w, s, actorder=True) for w in ws]
    stats = None
    if name == "NVFP4A16":  # fused partners share one global scale: the stack's
        stats = {"global_absmax": torch.stack([w.abs().max() for w in ws]).max().float().reshape(1)}
        alone = [g.quantize(w, s, actorder=True, stats=stats) for w in ws]
    stacked = g.quantize(torch.cat(ws), s, actorder=True, stats=stats)
    heights = [w.shape[0] for w in ws]
    for a, q, sc, wt in zip(alone, stacked.q.split(heights), stacked.scale.split(heights), stacked.weight.split(heights)):
        assert torch.equal(a.q, q) and torch.equal(a.scale, sc) and torch.equal(a.weight, wt)


@pytest.mark.parametrize("n", [37, 300, 1000])
def test_cholesky_lower_inverse_by_halves(n):
    """L^-1 of A = L L^T by halves (products, leaves of <= 256 factorized) equals the float64 one
    to float32 accuracy, is lower triangular, and is None when A is not positive definite -- also
    when only a Schur complement (a later half) fails."""
    from sq.quant.gptq import _cholesky_lower_inverse

    g = torch.Generator().manual_seed(n)
    x = torch.randn(4 * n, n, generator=g, dtype=torch.float64) * torch.rand(n, generator=g, dtype=torch.float64)
    A = x.T @ x / (4 * n)
    A.diagonal().add_(0.01 * A.diagonal().mean())
    ref = torch.linalg.inv(torch.linalg.cholesky(A))
    got = _cholesky_lower_inverse(A.float())
    assert got is not None and got.dtype == torch.float32
    assert torch.equal(got, torch.tril(got))
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-4
    bad = A.clone()
    bad[n - 1, n - 1] = -1.0  # the last pivot: in the last leaf, after every Schur complement
    assert _cholesky_lower_inverse(bad.float()) is None


@pytest.mark.parametrize("name", ["W4A16", "W4A16_ASYM", "W8A16", "FP8_DYNAMIC", "NVFP4A16", "MXFP4"])
@pytest.mark.parametrize("actorder", [False, True])
@pytest.mark.parametrize("heights", [(40, 96, 17, 64), (64, 64, 64, 64)], ids=["heights", "one-height"])
def test_weights_solved_together_are_each_solved_alone(name, actorder, heights):
    """quantize_together: the weights of one width and scheme, each under its own Hessian (q/k/v, o and
    gate/up of a block; experts' down projections), swept as one stack of rows with each weight's own
    error pushes (for weights of one height, batched products): each result is its own solve's, bit for
    bit (codes, scales, dequantized rows, loss), through a dead input column, a weight stacking two under
    one Hessian, and a sweep split by max_elems."""
    s = get_scheme(name, 32)
    probs = []
    for seed, rows in zip((1, 2, 3, 4), heights):
        x, w = _data(seed)
        if seed == 3:
            x[:, 5] = 0  # a dead input column in one weight only
        probs.append(Problem(_gptq(x), w[:rows].contiguous(), s, f"w{seed}"))
    stats = None
    if name == "NVFP4A16":  # the stacked weight's halves under their own global scales
        w = probs[3].w
        stats = [{"global_absmax": w[:32].abs().amax().float().reshape(1)},
                 {"global_absmax": w[32:].abs().amax().float().reshape(1)}]
    probs[3] = Problem(probs[3].gptq, probs[3].w, s, "stacked", stats)
    alone = [quantize_together([p], actorder=actorder) for p in probs]
    for together in (quantize_together(probs, actorder=actorder),
                     quantize_together(probs, actorder=actorder, max_elems=96 * COLS)):
        for (a,), b in zip(alone, together):
            assert torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8))
            assert torch.equal(a.scale, b.scale) and torch.equal(a.weight, b.weight) and a.loss == b.loss
            assert (a.zero_point is None) == (b.zero_point is None)
            assert a.zero_point is None or torch.equal(a.zero_point, b.zero_point)
            assert (a.global_scale is None) == (b.global_scale is None)
            assert a.global_scale is None or torch.equal(a.global_scale, b.global_scale)
    # and quantize is quantize_together of one
    r = probs[1].gptq.quantize(probs[1].w, s, actorder=actorder, name="w2")
    assert torch.equal(r.weight, alone[1][0].weight)


def test_calibration_forward_skips_the_last_linears_product():
    """GPTQ's calibration forward is run for its Hessians alone (block_forward(..., outputs=False)): after the
    first batch the block's last Linear (down_proj) computes zeros instead of its product, and for a later block
    of the same kind from the first batch; every Hessian equals the one of full forwards, and the Linear is
    itself again afterwards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sq.quant.algorithms.gptq import Counting, GPTQAlgorithm
    from sq.quant.forward import block_forward
    from sq.quant.work import Linear

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=32)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 2, 16, 64, generator=g)
    pe = model.model.rotary_emb(hidden[0], torch.arange(16)[None].expand(2, -1))
    inputs = [(h, {"position_embeddings": pe}) for h in hidden]
    s = get_scheme("W4A16", 32)
    algo = GPTQAlgorithm(GPTQConfig())
    for b, block in enumerate(model.model.layers):
        prefix = f"model.layers.{b}"
        lins = [Linear(f"{prefix}.{n}", m, f"{prefix}.{n}.", 0, s) for n, m in block.named_modules()
                if isinstance(m, torch.nn.Linear)]
        down = block.mlp.down_proj
        products = []
        down.register_forward_hook(lambda m, a, out: products.append(bool(out.abs().sum())))
        full = Counting(lins, torch.device("cpu"))
        block_forward(block, inputs, 3, inputs[0], counters=[full])
        full.remove()
        products.clear()
        kind = (type(block), tuple(l.name[len(prefix):] for l in lins))
        last = algo._last_linear.get(kind)
        lean = Counting(lins, torch.device("cpu"), skip_last=True, last=None if last is None else prefix + last)
        assert block_forward(block, inputs, 3, inputs[0], counters=[lean], outputs=False) == []
        if lean.learned is not None:
            algo._last_linear[kind] = lean.learned[len(prefix):]
        lean.remove()
        # block 0 learns it from its first batch (a product, then zeros); block 1 knows it from the start
        assert products == ([True, False, False] if b == 0 else [False, False, False]), products
        assert algo._last_linear == {kind: ".mlp.down_proj"}
        for name in full.gptq:
            assert torch.equal(full.gptq[name].H, lean.gptq[name].H), name
        assert set(full.gptq) == set(lean.gptq) and "forward" not in down.__dict__
        x = torch.randn(2, 96, generator=g)
        assert torch.equal(down(x), x @ down.weight.T)
