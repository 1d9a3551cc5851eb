"""AWQ (``--algo awq``): the fold, the search on real multi-rank runs, resume, refusals.

- folding random scales in [0.5, 2] into every mapping of every block (norm -> q/k/v, v -> o,
  MLA's norms, norm -> gate/up or every expert's gate_up + shared expert + the router, up -> down,
  each expert's up -> down) leaves the float32 model's logits unchanged (relative error <= 1e-5)
  on Llama (no GQA), Qwen3-MoE, Mixtral and DeepSeek-V3;
- on the tiny Llama (W4A16 group 16, 2 ranks) AWQ's logits are closer to the source's than RTN's,
  and every mapping's searched loss is no worse than RTN's (the identity is in the grid);
- the next block is calibrated on the full-precision chain after RTN (a block's inputs do not depend
  on what earlier blocks chose), on the quantized chain with ``--awq-chain quantized``;
- the clip search is the brute-force minimum of each group's output error; on after RTN, off with
  GPTQ or ``--awq-clip off``, never on q/k;
- 1 and 2 ranks pick the same exponents, their folded norms agree within 1e-5 and logits within 1e-3;
- killed mid-block and between blocks, the resumed run is bit-identical to an uninterrupted one;
- the outputs load in transformers with no missing or unexpected keys; Qwen3-MoE and DeepSeek-V3
  (MLA, shared expert) run at 2 ranks; GPTQ after AWQ; NVFP4A16;
- refusals: static FP8 (per-tensor) weights, an architecture without mappings (Qwen2-VL),
  --ep 2, tied weights a fold would touch.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from harness import run_cli, run_ranks
from quant_ref import checkpoint_bit_diff, load_any, quantize_jobs, read_tensors
from test_ptq_moe import _same_bits

GS = 16
JOB = dict(group_size=GS, nsamples=8, seqlen=32)
ARGS = ["--group-size", str(GS), "--nsamples", "8", "--seqlen", "32", "--timeout", "60"]


def _ids():
    return torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _logits(model, ids):
    return model(input_ids=ids).logits.double()


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def _fold_random(model, seed=0):
    from sq.anatomy import decoder_blocks
    from sq.quant.algorithms.awq import balance_param, fold
    from sq.quant.awq import block_mappings

    g = torch.Generator().manual_seed(seed)
    kinds = []
    for _, block in decoder_blocks(model):
        maps, refused = block_mappings(block)
        assert not refused, refused
        for m in maps:
            shape = balance_param(block, m.balance[0]).shape  # per expert: one vector each
            fold(block, m, 0.5 + 1.5 * torch.rand(*(shape[::2] if m.per_expert else shape[-1:]), generator=g))
            kinds.append(m.smooth)
    return kinds


@pytest.mark.parametrize("arch", ["llama_mha", "qwen3_moe", "mixtral", "deepseek_v3"])
def test_fold_preserves_fp_outputs(checkpoints, arch):
    if arch == "llama_mha":  # no grouped-query attention: v -> o is a mapping too
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        cfg = AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=128, vocab_size=512)
        model = AutoModelForCausalLM.from_config(cfg).float().eval()
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.data.uniform_(0.5, 1.5)
    else:
        model = load_any(checkpoints[arch], dtype=torch.float32)
    ids = _ids()
    before = _logits(model, ids)
    kinds = _fold_random(model)
    assert "post_attention_layernorm" in kinds and "input_layernorm" in kinds
    if arch != "llama_mha":
        assert "mlp.experts:up" in kinds
    if arch == "deepseek_v3":  # MLA, the dense first layer, the shared expert
        assert {"self_attn.q_a_layernorm", "self_attn.kv_a_layernorm", "mlp.up_proj",
                "mlp.shared_experts.up_proj"} <= set(kinds), kinds
    if arch == "llama_mha":
        assert {"self_attn.v_proj", "mlp.up_proj"} <= set(kinds)
    after = _logits(model, ids)
    assert _rel(after, before) <= 1e-5


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("awq")
    ll = str(checkpoints["llama"])
    recipe = root / "recipe.json"  # the MLPs at 8 bits, layer 1's attention left unquantized
    recipe.write_text(json.dumps({"default": {"preset": "W4A16", "group_size": GS}, "rules": [
        {"match": r"mlp\.", "scheme": {"preset": "W8A16", "group_size": GS}},
        {"match": r"layers\.1\.self_attn", "scheme": None}]}))
    two = {"llama-w2": dict(model=ll, algo="awq", **JOB),
           "llama-rtn": dict(model=ll, algo="rtn", group_size=GS),
           "moe-w2": dict(model=str(checkpoints["qwen3_moe"]), algo="awq", **JOB),
           "llama-gptq": dict(model=ll, algo="awq", awq_gptq=True, **JOB),
           # the chain the next block is calibrated on: fp (the default after RTN) or quantized
           "llama-fp-g2": dict(model=ll, algo="awq", n_grid=2, **JOB),
           "llama-q": dict(model=ll, algo="awq", awq_chain="quantized", **JOB),
           "llama-q-g2": dict(model=ll, algo="awq", awq_chain="quantized", n_grid=2, **JOB),
           "llama-noclip": dict(model=ll, algo="awq", awq_clip="off", **JOB),
           "llama-recipe": dict(model=ll, algo="awq", recipe=str(recipe), **JOB),
           "llama-nvfp4": dict(model=ll, algo="awq", scheme="NVFP4A16", **JOB),
           "llama-mxfp4": dict(model=ll, algo="awq", scheme="MXFP4A16", **dict(JOB, group_size=32)),
           "moe-nvfp4": dict(model=str(checkpoints["qwen3_moe"]), algo="awq", scheme="NVFP4A16", **JOB),
           # refusals, before anything is written
           "no-fp8": dict(model=ll, algo="awq", scheme="FP8", **JOB),
           "no-ep": dict(model=str(checkpoints["qwen3_moe"]), algo="awq", ep=2, **JOB),
           "deepseek-w2": dict(model=str(checkpoints["deepseek_v3"]), algo="awq", **JOB),
           "no-vlm": dict(model=str(checkpoints["vlm"]), algo="awq", **JOB)}
    errors = run_ranks(quantize_jobs, 2, [dict(j, output=str(root / k)) for k, j in two.items()], timeout=600)[0]
    one = run_ranks(quantize_jobs, 1, [dict(model=ll, output=str(root / "llama-w1"), algo="awq", **JOB)],
                    timeout=600)[0]
    return root, dict(zip(two, errors)), one[0]


def _report(path):
    """sq_report.json, each block's clip summary moved from ``awq`` (mappings only) to ``clip``."""
    r = json.loads((path / "sq_report.json").read_text())
    r["clip"] = {b: maps.pop("clip") for b, maps in r.get("awq", {}).items() if "clip" in maps}
    return r


def test_awq_beats_rtn_on_llama(checkpoints, runs):
    root, errors, _ = runs
    assert errors["llama-w2"] is None and errors["llama-rtn"] is None and errors["llama-noclip"] is None, errors
    report = _report(root / "llama-w2")
    assert report["args"]["algo"] == "awq"
    assert set(report["clip"]) == set(report["awq"])  # the clip search after the fold, on by default after RTN
    assert any(c["groups_clipped"] > 0 for c in report["clip"].values()), report["clip"]
    for block, maps in report["awq"].items():
        assert set(maps) == {"input_layernorm", "post_attention_layernorm", "mlp.up_proj"}, block  # GQA: no v -> o
        for name, m in maps.items():
            assert m["loss_best"] <= m["loss_rtn"], (block, name, m)
    assert any(m["loss_best"] < 0.95 * m["loss_rtn"] for maps in report["awq"].values() for m in maps.values())
    ids = _ids()
    src = _logits(load_any(checkpoints["llama"], dtype=torch.float32), ids)
    model, info = load_any(root / "llama-w2", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # the scales alone (no clip): random token ids here, while the clip search fits each group's
    # range to the 256 calibration tokens of this tiny model (on the standard benchmark it is worth
    # 14.23 -> 13.44; docs/awq.md)
    awq = _rel(_logits(load_any(root / "llama-noclip", dtype=torch.float32), ids), src)
    rtn = _rel(_logits(load_any(root / "llama-rtn", dtype=torch.float32), ids), src)
    print(f"logits rel err vs source: awq {awq:.5f} (with clip {_rel(_logits(model, ids), src):.5f}) rtn {rtn:.5f}")
    assert awq < rtn, (awq, rtn)


def test_the_full_precision_chain_makes_each_blocks_search_independent_of_earlier_choices(runs):
    """``--awq-chain fp`` (the default after round-to-nearest, as AutoAWQ and llm-compressor): every
    block is calibrated on the source model's outputs of the block before, so what earlier blocks
    chose (20 grid points or 2) does not change a later block's inputs -- its round-to-nearest loss
    is the same to the bit.  On the quantized chain it does (block 0 alike in every run)."""
    root, errors, _ = runs
    for k in ("llama-w2", "llama-fp-g2", "llama-q", "llama-q-g2"):
        assert errors[k] is None, (k, errors[k])

    def rtn_losses(k):
        awq = _report(root / k)["awq"]
        return [awq[b]["input_layernorm"]["loss_rtn"] for b in sorted(awq, key=lambda b: int(b.rsplit(".", 1)[1]))]

    fp20, fp2, q20, q2 = (rtn_losses(k) for k in ("llama-w2", "llama-fp-g2", "llama-q", "llama-q-g2"))
    assert len(fp20) > 1 and fp20 == fp2, (fp20, fp2)
    assert q20[0] == q2[0] == fp20[0], (q20, q2, fp20)
    assert q20[1:] != q2[1:] and q20[1:] != fp20[1:], (q20, q2, fp20)
    assert _report(root / "llama-q")["args"]["algo_settings"]["awq_chain"] == "quantized"


def test_one_and_two_ranks_choose_the_same_scales(runs):
    root, errors, one = runs
    assert one is None and errors["llama-w2"] is None
    r1, r2 = _report(root / "llama-w1")["awq"], _report(root / "llama-w2")["awq"]
    for block in r2:
        for name in r2[block]:
            a, b = r1[block][name], r2[block][name]
            assert (a["ratio"], a["duo"]) == (b["ratio"], b["duo"]), (block, name, a, b)
            assert a["loss_best"] == pytest.approx(b["loss_best"], rel=0.2)  # other samples per rank's batches
    t1, t2 = read_tensors(root / "llama-w1"), read_tensors(root / "llama-w2")
    norms = [k for k in t2 if k.endswith("layernorm.weight")]
    assert norms
    for k in norms:
        torch.testing.assert_close(t1[k], t2[k], rtol=1e-5, atol=1e-6)
    ids = _ids()
    assert _rel(_logits(load_any(root / "llama-w1", dtype=torch.float32), ids),
                _logits(load_any(root / "llama-w2", dtype=torch.float32), ids)) <= 1e-3


@pytest.mark.parametrize("out,arch", [("moe-w2", "qwen3_moe"), ("deepseek-w2", "deepseek_v3")])
def test_moe_two_ranks(checkpoints, runs, out, arch):
    root, errors, _ = runs
    assert errors[out] is None, errors[out]
    report = _report(root / out)
    moe = [b for b, maps in report["awq"].items() if "mlp.experts:up" in maps]
    assert moe
    for block in moe:
        maps = report["awq"][block]
        assert "post_attention_layernorm" in maps, block  # every expert's gate_up (+ shared) + the router
        assert maps["mlp.experts:up"]["experts_searched"] > 0, maps  # each expert's up -> down
    assert all(m["loss_best"] <= m["loss_rtn"] for maps in report["awq"].values() for m in maps.values())
    model, info = load_any(root / out, dtype=torch.float32, output_loading_info=True)
    mtp = tuple({".".join(k.split(".")[:3]) + "." for k in report["carried_over"]})  # DeepSeek's MTP layer
    assert not info["missing_keys"], info["missing_keys"]
    assert not [k for k in info["unexpected_keys"] if not k.startswith(mtp or ("-",))], info["unexpected_keys"]
    ids = _ids()
    src = _logits(load_any(checkpoints[arch], dtype=torch.float32), ids)
    err = _rel(_logits(model, ids), src)
    print(f"{out}: logits rel err vs source {err:.5f}")
    assert err < 0.2


@pytest.mark.parametrize("out,arch", [("llama-gptq", "llama"), ("llama-nvfp4", "llama"), ("moe-nvfp4", "qwen3_moe"),
                                      ("llama-mxfp4", "llama")])
def test_gptq_after_awq_and_nvfp4(checkpoints, runs, out, arch):
    """GPTQ on the folded weights; NVFP4A16 with its global scales recomputed after the fold; MXFP4A16."""
    root, errors, _ = runs
    assert errors[out] is None, errors[out]
    report = _report(root / out)
    assert all(m["loss_best"] <= m["loss_rtn"] for maps in report["awq"].values() for m in maps.values())
    if out == "llama-gptq":
        assert all(e["metric"] == "output (through H)" for e in report["layers"].values())
    nvfp4 = out.endswith("nvfp4")
    if out == "llama-nvfp4":  # q/k/v and gate/up share one global scale (vLLM fuses them)
        t = read_tensors(root / out)
        for p in {k.rsplit(".mlp.", 1)[0] for k in t if ".mlp.gate_proj.weight_global_scale" in k}:
            assert len({t[f"{p}.self_attn.{n}_proj.weight_global_scale"].item() for n in "qkv"}) == 1
            assert len({t[f"{p}.mlp.{n}_proj.weight_global_scale"].item() for n in ("gate", "up")}) == 1
    # compressed-tensors decompresses NVFP4 and MXFP4 in bfloat16 only
    model, info = load_any(root / out, dtype=torch.bfloat16 if nvfp4 or out.endswith("mxfp4") else torch.float32,
                           output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if out == "moe-nvfp4":  # transformers' NVFP4 MoE load is off for RTN as much (rel err 1.39 measured)
        return
    ids = _ids()
    src = _logits(load_any(checkpoints[arch], dtype=torch.float32), ids)
    err = _rel(_logits(model, ids), src)
    print(f"{out}: logits rel err vs source {err:.5f}")
    assert err < 0.3


def test_refusals(runs):
    root, errors, _ = runs
    assert "scheme FP8" in errors["no-fp8"] and "--algo awq" in errors["no-fp8"], errors["no-fp8"]
    assert "--ep 1" in errors["no-ep"], errors["no-ep"]
    assert "Qwen2VLDecoderLayer" in errors["no-vlm"] and "no smoothing mappings" in errors["no-vlm"], errors["no-vlm"]
    for k in ("no-fp8", "no-ep", "no-vlm"):
        assert not (root / k / "config.json").exists()


def test_tied_parameter_refused():
    """A fold target tied to another module (as a tied embedding would be) is refused by name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sq.quant.algorithms.awq import AWQAlgorithm
    from sq.quant.awq import AWQConfig
    from sq.quant.recipe import make_assigner

    cfg = AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, vocab_size=512)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    model.model.layers[0].post_attention_layernorm.weight = model.model.layers[0].input_layernorm.weight
    assigner = make_assigner("W4A16", GS)
    problems = AWQAlgorithm(AWQConfig()).refusals(model, assigner, 1, 1)
    assert any("input_layernorm" in p and "tied" in p for p in problems), problems


def test_killed_mid_block_and_between_blocks_resumes_bit_identical(checkpoints, runs, tmp_path):
    root, errors, _ = runs
    assert errors["llama-w2"] is None
    out = tmp_path / "o"
    args = ["sq.ptq", "--model", str(checkpoints["llama"]), "--output", str(out), "--algo", "awq", *ARGS]
    restarts = []
    for fault in ["calib:0:1", "after-shard-write:1", None]:
        res = run_cli(args, 2, timeout=300, env={"SQ_FAULT": fault} if fault else {})
        restarts += [int(b) for b in re.findall(r"resuming at block (\d+) of", res.output)]
        if fault is None:
            assert res.returncode == 0, res.output[-3000:]
        else:
            assert res.returncode != 0 and f"SIGKILL at {fault.split(':')[0]}" in res.output, res.output[-3000:]
    assert restarts and restarts[0] >= 1, restarts
    assert _same_bits(root / "llama-w2", out) == []


def test_clip_search_is_the_brute_force_minimum_of_each_groups_output_error():
    """``clip_search`` picks, per row and group, the shrink whose quantized weights give the least
    ``|X_g (Q(clip(w_g)) - w_g)|^2`` over the tokens (computed here directly from X, not through the
    Gram matrix), never worse than no clipping, and clips where an outlier costs the group its grid."""
    from sq.quant.rtn import rtn_rows
    from sq.quant.awq import CLIP_GRID, clip_search
    from sq.formats.schemes import get_scheme

    g = torch.Generator().manual_seed(0)
    scheme = get_scheme("W4A16", group_size=8)
    rows, cols, gs, tokens = 6, 32, 8, 64
    w = torch.randn(rows, cols, generator=g)
    w[0, 3] = 12.0  # an outlier
    x = torch.randn(tokens, cols, generator=g) * torch.linspace(0.1, 3, cols)
    xg = x.view(tokens, cols // gs, gs)
    gram = torch.einsum("tgi,tgj->gij", xg, xg).double()
    qdq = lambda t: rtn_rows(t, scheme).deq
    got, shrink = clip_search(w, gram, qdq)
    for r in range(rows):
        for k in range(cols // gs):
            wg = w[r, k * gs:(k + 1) * gs]
            errs = []
            for i in range(CLIP_GRID // 2):
                m = wg.abs().max() * (1 - i / CLIP_GRID)
                row = w[r].clone()
                row[k * gs:(k + 1) * gs] = wg.clamp(-m, m)
                d = qdq(row[None])[0, k * gs:(k + 1) * gs] - wg
                errs.append(float((xg[:, k] @ d).pow(2).sum()))
            best = min(range(len(errs)), key=lambda i: (errs[i], i))
            assert errs[best] <= errs[0]
            assert abs(errs[round(shrink[r, k].item() * CLIP_GRID)] - errs[best]) <= 1e-4 * max(errs[best], 1e-6)
            m = wg.abs().max() * (1 - shrink[r, k].item())
            torch.testing.assert_close(got[r, k * gs:(k + 1) * gs], wg.clamp(-m, m))
    assert (shrink > 0).any() and (shrink == 0).any()


def test_clip_is_on_after_rtn_and_off_when_asked(runs):
    root, errors, _ = runs
    assert errors["llama-noclip"] is None, errors["llama-noclip"]
    assert _report(root / "llama-noclip")["clip"] == {}
    assert _report(root / "llama-gptq")["clip"] == {}  # auto: GPTQ after AWQ does not clip
    diff = checkpoint_bit_diff(root / "llama-w2", root / "llama-noclip")
    assert any(k.endswith("mlp.down_proj.weight_packed") for k in diff), diff  # clipping changed codes
    assert not any("q_proj" in k or "k_proj" in k for k in diff), diff  # query / key never clipped


def test_recipe(checkpoints, runs):
    """A recipe: a mapping whose Linears are all unquantized is not searched (layer 1's q/k/v), the
    others search and clip with their own scheme (the MLPs at 8 bits); transformers loads the output."""
    root, errors, _ = runs
    assert errors["llama-recipe"] is None, errors["llama-recipe"]
    report = _report(root / "llama-recipe")
    blocks = sorted(report["awq"], key=lambda b: int(b.rsplit(".", 1)[1]))
    assert "input_layernorm" in report["awq"][blocks[0]] and "input_layernorm" not in report["awq"][blocks[1]]
    assert all("post_attention_layernorm" in report["awq"][b] for b in blocks)
    qc = json.loads((root / "llama-recipe" / "config.json").read_text())["quantization_config"]
    bits = sorted(g["weights"]["num_bits"] for g in qc["config_groups"].values())
    assert bits == [4, 8], qc["config_groups"]
    assert any("layers.1.self_attn" in i for i in qc["ignore"]), qc["ignore"]
    model, info = load_any(root / "llama-recipe", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = _ids()
    src = _logits(load_any(checkpoints["llama"], dtype=torch.float32), ids)
    assert _rel(_logits(model, ids), src) < 0.2
