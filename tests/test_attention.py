"""Causal attention in query chunks (``sq.quant.attention``) and the probe that picks the chunk (``sq.probe``).

- Chunked, a model's causal attention is the unchunked one up to float rounding, and it really is
  chunked (one SDPA call per chunk and layer).
- Anything but the plain causal case goes to transformers' SDPA as it is, bit for bit: a padding mask,
  and a sliding window (whose mask transformers makes only if the implementation has a mask function).
- The probe picks a chunk only where one beats a single call by the margin, takes a resumed run's
  recorded chunk, never measures on a GPU or for windows too short for 4 chunks, and caches per shape.
- In a job: the chunk the probe gives is the one its forwards attend in, and it is in the run signature
  and the report; 1 and 2 ranks write the same bits with it.
- Where gradients flow (SignRound's steps), the chunks' hand-written backward (``_CausalChunks``) gives the
  attention's gradients (float32: to 1e-5 of float64's; bf16: as close as SDPA's own), its forward is the
  chunked SDPA's bit for bit, and under autocast it takes the inputs as autocast would give them to SDPA;
  its probe takes it only where it wins by the margin, and a SignRound job steps through it when chosen.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from harness import run_python, run_ranks
from quant_ref import quantize_jobs
from sq import probe
from sq.quant import attention
from sq.testing.checkpoints import build_llama
from test_ptq_moe import _same_bits


def _model(kind: str, **cfg):
    import transformers

    config = getattr(transformers, f"{kind}Config")(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                    **cfg)
    torch.manual_seed(0)
    return getattr(transformers, f"{kind}ForCausalLM")(config).eval()


@pytest.fixture
def counted_sdpa(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        calls.append(q.shape[2])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    yield calls
    attention._chunk, attention._backward = None, "sdpa"


def _logits(model, ids, chunk, **kw):
    attention.use_sdpa(model, chunk)
    with torch.no_grad():
        return model(ids, **kw).logits


def test_chunked_causal_attention_is_the_causal_attention(counted_sdpa):
    model = _model("Llama")
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    one = _logits(model, ids, None)
    assert model.config._attn_implementation == "sdpa" and counted_sdpa == [64, 64]
    counted_sdpa.clear()
    chunked = _logits(model, ids, 16)
    assert model.config._attn_implementation == attention.IMPL
    assert counted_sdpa == [16] * 8  # 4 chunks x 2 layers
    torch.testing.assert_close(chunked, one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,cfg,mask", [
    ("Llama", {}, "padding"),
    ("Mistral", {"sliding_window": 8}, None),  # a window shorter than the sequence: a mask every layer
])
def test_anything_but_the_plain_causal_case_is_sdpa_as_it_is(counted_sdpa, kind, cfg, mask):
    model = _model(kind, **cfg)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    kw = {}
    if mask == "padding":
        am = torch.ones(2, 32, dtype=torch.long)
        am[1, :5] = 0  # left padding
        kw["attention_mask"] = am
    one = _logits(model, ids, None, **kw)
    counted_sdpa.clear()
    chunked = _logits(model, ids, 8, **kw)
    assert counted_sdpa == [32, 32]  # one call per layer: not chunked
    assert torch.equal(chunked, one)


def test_probe_picks_a_chunk_only_where_it_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("SQ_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    fake = {None: 1.0, 32: 0.95, 64: 0.7, 128: 0.8, 256: 0.9}
    measured = []

    def timed(h, d, n, dtype, device, chunk, repeats=2):
        measured.append((h, n, chunk))
        return fake[chunk]

    monkeypatch.setattr(probe, "time_attention", timed)
    chunk, rec = probe.attention_chunk_choice(9, 64, 512, torch.bfloat16, cpu)
    assert chunk == 64 and rec["why"] == "probe" and rec["seconds"]["64"] == 0.7
    assert measured == [(4, 512, c) for c in (None, 32, 64, 128)]  # 4 heads; chunks that fit 4 times
    assert json.loads(probe.attention_probe_file(9, 64, 512, torch.bfloat16, cpu).read_text())["64"] == 0.7
    measured.clear()
    assert probe.attention_chunk_choice(9, 64, 512, torch.bfloat16, cpu)[0] == 64 and measured == []  # cached
    fake.update({32: 0.95, 64: 0.93, 128: 0.95})  # within the margin: one call
    assert probe.attention_chunk_choice(9, 64, 256, torch.bfloat16, cpu)[0] is None
    assert probe.attention_chunk_choice(9, 64, 100, torch.bfloat16, cpu) == (None, {})  # 4 x 32 > 100 tokens
    assert probe.attention_chunk_choice(9, 64, 512, torch.bfloat16, torch.device("cuda")) == (None, {})
    assert probe.attention_chunk_choice(9, 64, 512, torch.bfloat16, cpu, recorded=0) == (None, {"why": "recorded"})
    assert probe.attention_chunk_choice(9, 64, 512, torch.bfloat16, cpu, recorded=128)[0] == 128


def _seed_probe(seqlen: int, chunk: int | None) -> None:
    """The probe's cache (``$SQ_CACHE_DIR``) for the fixture's attention (4 heads of 16, float32): ``chunk``
    wins, or one call."""
    chunks = [c for c in probe.ATTN_CHUNKS if 4 * c <= seqlen]
    secs = {"none": 1.0, **{str(c): 0.5 if c == chunk else 2.0 for c in chunks}}
    path = probe.attention_probe_file(4, 16, seqlen, torch.float32, torch.device("cpu"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(secs))


def _report(d):
    return json.loads((d / "sq_report.json").read_text())


def _counted_jobs(rank, world, jobs):
    """``quantize_jobs``, and the query lengths SDPA was called with."""
    lengths = set()
    real = F.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        lengths.add(q.shape[2])
        return real(q, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counting
    return quantize_jobs(rank, world, jobs), sorted(lengths)


def test_a_job_attends_in_the_chunks_its_probe_chose(tmp_path, monkeypatch):
    src = build_llama(tmp_path / "llama")
    job = dict(model=str(src), scheme="W4A16", algo="gptq", group_size=16, nsamples=4, seqlen=128)
    monkeypatch.setenv("SQ_CACHE_DIR", str(tmp_path / "cache-chunked"))
    _seed_probe(128, 32)
    two = run_ranks(_counted_jobs, 2, [dict(output=str(tmp_path / "w2"), **job)], timeout=300)
    one = run_ranks(_counted_jobs, 1, [dict(output=str(tmp_path / "w1"), **job)], timeout=300)
    # (whole windows too: the time preflight measures attention at the job's length)
    assert all(res == [None] and 32 in lengths for res, lengths in two + one), (two, one)
    monkeypatch.setenv("SQ_CACHE_DIR", str(tmp_path / "cache-single"))
    _seed_probe(128, None)
    single = run_ranks(_counted_jobs, 1, [dict(output=str(tmp_path / "one"), **job)], timeout=300)
    assert single == [([None], [128])]
    rep = _report(tmp_path / "w2")
    assert rep["run_signature"]["args"]["attn_chunk"] == 32
    assert rep["speed"]["attention"]["chunk"] == 32 and rep["speed"]["attention"]["why"] == "probe"
    assert _report(tmp_path / "one")["run_signature"]["args"]["attn_chunk"] == 0
    assert _same_bits(tmp_path / "w1", tmp_path / "w2") == []


def _reference_grads(q, k, v, grad, scale):
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True, scale=scale).backward(grad.double())
    return [t.grad for t in ref]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv,tokens,chunk", [(4, 2, 70, 32), (3, 3, 64, 16), (6, 1, 100, 64)])
def test_hand_backward_is_the_attention_gradient(dtype, heads, kv, tokens, chunk):
    g = torch.Generator().manual_seed(tokens)
    q, k, v = (torch.randn(2, h, tokens, 16, generator=g).to(dtype).requires_grad_() for h in (heads, kv, kv))
    grad = torch.randn(2, heads, tokens, 16, generator=g).to(dtype)
    out = attention.causal_chunks(q, k, v, chunk, scale=0.3, backward="sq")
    assert type(out.grad_fn).__name__ == "_CausalChunksBackward"
    assert torch.equal(out.detach(), attention.causal_chunks(q.detach(), k.detach(), v.detach(), chunk, scale=0.3))
    out.backward(grad)
    mine = [t.grad for t in (q, k, v)]
    want = _reference_grads(q, k, v, grad, 0.3)
    if dtype == torch.float32:
        for a, b in zip(mine, want):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
        return
    for t in (q, k, v):
        t.grad = None
    attention.causal_chunks(q, k, v, chunk, scale=0.3).backward(grad)  # SDPA's own backward
    for a, s, b in zip(mine, [t.grad for t in (q, k, v)], want):
        err = lambda x: float((x.double() - b).norm() / b.norm())  # noqa: E731
        assert a.dtype == dtype and err(a) < 1.5 * err(s) + 1e-3, (err(a), err(s))


def test_hand_backward_only_within_its_memory_bound(monkeypatch):
    """A chunk's scores held four times past ``HAND_BACKWARD_BYTES``: SDPA's backward instead."""
    q = torch.randn(2, 4, 64, 8, requires_grad=True)
    assert type(attention.causal_chunks(q, q, q, 16, backward="sq").grad_fn).__name__ == "_CausalChunksBackward"
    assert attention.hand_backward_bytes(2, 4, 64, 16) == 2 * 4 * 16 * 64 * 12
    monkeypatch.setattr(attention, "HAND_BACKWARD_BYTES", 2 * 4 * 16 * 64 * 12 - 1)
    assert type(attention.causal_chunks(q, q, q, 16, backward="sq").grad_fn).__name__ == "CatBackward0"
    assert attention.hand_backward_bytes(2, 4, 64, 16) == 0  # nothing held: the memory preflight counts none


def test_hand_backward_under_autocast_takes_what_sdpa_would():
    """Rotary embeddings leave queries and keys float32 under autocast, values bf16: SDPA's autocast casts them
    all; the hand backward does the same, and the gradients flow back to each input in its own dtype."""
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 2, 48, 8, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(1, 2, 48, 8, generator=g).to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine = attention.causal_chunks(q, k, v, 16, backward="sq")
        theirs = attention.causal_chunks(q, k, v, 16)
    assert mine.dtype == theirs.dtype == torch.bfloat16 and torch.equal(mine, theirs)
    mine.float().sum().backward()
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, torch.bfloat16)


def test_backward_probe_rules(monkeypatch, tmp_path):
    monkeypatch.setenv("SQ_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    measured = []

    def timed(heads, head_dim, tokens, dtype, device, chunk, repeats=2, backward=None):
        measured.append(backward)
        return {"sdpa": 1.0, "sq": 0.7}[backward]

    monkeypatch.setattr(probe, "time_attention", timed)
    back, rec = probe.attention_backward_choice(9, 64, 512, torch.bfloat16, cpu, 64)
    assert back == "sq" and rec == {"why": "probe", "seconds": {"sdpa": 1.0, "sq": 0.7}} and measured == ["sdpa", "sq"]
    path = probe.attention_backward_probe_file(9, 64, 512, 64, torch.bfloat16, cpu)
    assert json.loads(path.read_text()) == {"sdpa": 1.0, "sq": 0.7}
    path.write_text(json.dumps({"sdpa": 1.0, "sq": 0.95}))  # within the margin: SDPA's
    assert probe.attention_backward_choice(9, 64, 512, torch.bfloat16, cpu, 64)[0] == "sdpa" and len(measured) == 2
    assert probe.attention_backward_choice(9, 64, 512, torch.bfloat16, cpu, None) == ("sdpa", {})  # not chunked
    assert probe.attention_backward_choice(9, 64, 512, torch.bfloat16, torch.device("cuda"), 64) == ("sdpa", {})
    assert probe.attention_backward_choice(9, 64, 512, torch.bfloat16, cpu, 64, recorded="sq") == (
        "sq", {"why": "recorded"})


def _hand_backward_jobs(rank, world, jobs):
    """``quantize_jobs``, and how many times the hand backward ran."""
    calls = []
    real = attention._CausalChunks.backward

    def counting(ctx, dout):
        calls.append(1)
        return real(ctx, dout)

    attention._CausalChunks.backward = staticmethod(counting)
    return quantize_jobs(rank, world, jobs), len(calls)


def test_signround_steps_through_the_backward_its_probe_chose(tmp_path, monkeypatch):
    src = build_llama(tmp_path / "llama", dtype=torch.bfloat16)
    job = dict(model=str(src), scheme="W4A16", algo="signround", iters=2, batch_size=4, group_size=16, nsamples=4,
               seqlen=128, calib_dtype="mixed")
    cpu = torch.device("cpu")
    for name, wins in (("sq", {"sdpa": 1.0, "sq": 0.5}), ("sdpa", {"sdpa": 0.5, "sq": 1.0})):
        monkeypatch.setenv("SQ_CACHE_DIR", str(tmp_path / f"cache-{name}"))
        chunks = {"none": 1.0, **{str(c): 0.5 if c == 32 else 2.0 for c in probe.ATTN_CHUNKS if 4 * c <= 128}}
        for path, secs in ((probe.attention_probe_file(4, 16, 128, torch.bfloat16, cpu), chunks),
                           (probe.attention_backward_probe_file(4, 16, 128, 32, torch.bfloat16, cpu), wins)):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(secs))
        [(res, calls)] = run_ranks(_hand_backward_jobs, 1, [dict(output=str(tmp_path / name), **job)], timeout=300)
        assert res == [None] and (calls > 0) == (name == "sq"), (name, calls)
        rep = _report(tmp_path / name)
        assert rep["speed"]["attention_backward"]["backward"] == name and rep["speed"]["attention"]["chunk"] == 32
        assert rep["run_signature"]["args"]["attn_backward"] == name
    # the memory preflight counts what sq's backward holds (one rank: all 4 windows a step, 4 heads, chunks of 32)
    sq_mem, sdpa_mem = (_report(tmp_path / name)["memory"] for name in ("sq", "sdpa"))
    assert sq_mem["phase"] == sdpa_mem["phase"] == "solve"
    assert sq_mem["algorithm"] - sdpa_mem["algorithm"] == attention.hand_backward_bytes(4, 4, 128, 32) == 4 * 4 * 32 * 128 * 12


def test_plan_counts_the_backward_at_any_chunk_its_probe_may_choose(tmp_path, monkeypatch):
    """``sq.plan`` cannot know the probe's chunk before the job: for SignRound on CPU it counts sq's backward at
    the chunk that holds the most (here 64 of 32, 64), where the job, told 32 and sq's backward, counts 32's."""
    src = build_llama(tmp_path / "llama", dtype=torch.bfloat16)
    cache, cpu = tmp_path / "cache", torch.device("cpu")
    monkeypatch.setenv("SQ_CACHE_DIR", str(cache))
    for path, secs in ((probe.attention_probe_file(4, 16, 256, torch.bfloat16, cpu), {"none": 1.0, "32": 0.5, "64": 2.0}),
                       (probe.attention_backward_probe_file(4, 16, 256, 32, torch.bfloat16, cpu), {"sdpa": 1.0, "sq": 0.5})):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(secs))
    args = ["--model", str(src), "--scheme", "W4A16", "--algo", "signround", "--iters", "1", "--batch-size", "4",
            "--group-size", "16", "--nsamples", "4", "--seqlen", "256", "--calib-dtype", "mixed"]
    env = {"SQ_CACHE_DIR": str(cache)}
    planned = run_python(["sq.plan", "--output", str(tmp_path / "o"), "--json", *args], timeout=300, env=env)
    assert planned.returncode == 0, planned.stderr[-3000:]
    plan = json.loads(planned.stdout.strip().splitlines()[-1])["memory"]
    res = run_python(["sq.ptq", "--output", str(tmp_path / "o"), *args], timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    job = _report(tmp_path / "o")
    assert job["speed"]["attention"]["chunk"] == 32 and job["speed"]["attention_backward"]["backward"] == "sq"
    assert plan["phase"] == job["memory"]["phase"] == "solve"
    held = [attention.hand_backward_bytes(4, 4, 256, c) for c in (32, 64)]
    assert plan["algorithm"] - job["memory"]["algorithm"] == held[1] - held[0] > 0
