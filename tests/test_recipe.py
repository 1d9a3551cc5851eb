"""Mixed-precision recipes: precedence, refusals, the exported config groups, and resume safety."""

from __future__ import annotations

import json

import pytest
import torch

from harness import run_cli
from quant_ref import load_any
from sq.errors import SqError
from sq.quant import rtn
from sq.quant.recipe import make_assigner, scheme_tag
from sq.formats.schemes import get_scheme

GS = 16
RECIPE = """\
# q/k at 8 bits, down_proj left in bf16, the rest 4 bits
default: W4A16
group_size: 16
rules:
  - match: 'self_attn\\.(q|k)_proj$'
    scheme: W8A16
  - match: 'mlp\\.down_proj$'
    scheme: null
"""


def _write(tmp_path, text, name="recipe.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_precedence_ignore_then_first_rule_then_default(tmp_path):
    p = _write(tmp_path, """\
default: {preset: W4A16, group_size: 32}
rules:
  - {match: 'layers\\.0\\.self_attn', scheme: null}
  - {match: 'self_attn', scheme: W8A16}
  - {match: 'q_proj', scheme: {name: custom3, num_bits: 3, symmetric: false, group_size: 16}}
""")
    a = make_assigner("W4A16", 128, ignore=["layers\\.1\\.mlp"], recipe=p)
    assert a.assign("model.layers.0.self_attn.q_proj") is None  # first rule wins over the later ones
    assert a.assign("model.layers.2.self_attn.q_proj") == get_scheme("W8A16", 128)  # file group_size absent
    assert a.assign("model.layers.1.mlp.up_proj") is None  # --ignore beats every rule
    assert scheme_tag(a.assign("model.layers.2.mlp.up_proj")) == "int4-sym-group32"  # the recipe's default
    # no default key: the command line's scheme
    p2 = _write(tmp_path, "rules:\n  - {match: 'x', scheme: null}\n", "r2.json".replace(".json", ".yaml"))
    assert make_assigner("W8A16", 64, recipe=p2).assign("model.layers.0.mlp.up_proj") == get_scheme("W8A16", 64)
    # JSON works the same
    p3 = _write(tmp_path, json.dumps({"default": None, "rules": [{"match": "mlp", "scheme": "W8A16"}]}), "r.json")
    a3 = make_assigner("W4A16", 16, recipe=p3)
    assert a3.assign("model.layers.0.self_attn.q_proj") is None and a3.assign("model.layers.0.mlp.up_proj")


def test_bad_recipes_list_every_problem(tmp_path):
    p = _write(tmp_path, """\
default: W5A16
colour: blue
rules:
  - {match: '(', scheme: W8A16}
  - {match: 'mlp'}
  - {match: 'o_proj', scheme: {preset: W8A16, bits: 3}}
""")
    with pytest.raises(SqError) as e:
        make_assigner("W4A16", 16, recipe=p)
    text = "\n".join(e.value.problems)
    for needle in ("unknown key(s) ['colour']", "unknown scheme 'W5A16'", "rule 1: match '(' is not a valid",
                   "rule 2: expected exactly the keys 'match' and 'scheme'", "rule 3: with 'preset' only"):
        assert needle in text, text
    with pytest.raises(SqError, match="does not exist"):
        make_assigner("W4A16", 16, recipe=tmp_path / "nope.yaml")
    with pytest.raises(SqError, match="expected a .yaml, .yml or .json"):
        make_assigner("W4A16", 16, recipe=_write(tmp_path, "{}", "r.toml"))


def _args(model, out, recipe, *extra):
    return ["sq.ptq", "--model", str(model), "--output", str(out), "--algo", "rtn", "--group-size", str(GS),
            "--recipe", str(recipe), "--timeout", "60", *extra]


def test_mixed_recipe_exports_one_group_per_scheme_and_loads(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "o"
    res = run_cli(_args(checkpoints["llama"], out, _write(tmp_path, RECIPE)), 2, timeout=240)
    assert res.returncode == 0, res.output[-3000:]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = {g["weights"]["num_bits"]: g["targets"] for g in qc["config_groups"].values()}
    assert set(groups) == {4, 8}
    assert groups[4] == ["Linear"]  # the biggest group by class, the other by exact names
    assert sorted(groups[8]) == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(3) for p in "qk")
    assert {f"model.layers.{i}.mlp.down_proj" for i in range(3)} <= set(qc["ignore"])
    report = json.loads((out / "sq_report.json").read_text())
    assert report["assignment"]["model.layers.0.self_attn.q_proj"] == "int8-sym-group16"
    assert report["assignment"]["model.layers.0.mlp.up_proj"] == "int4-sym-group16"
    assert "model.layers.0.mlp.down_proj" not in report["assignment"]

    # transformers' default path applies each config group to its modules (its run_compressed=False /
    # dequantize paths use one scheme for every dense layer in 5.24, so they cannot read mixed recipes)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = load_any(checkpoints["llama"], dtype=torch.float32)
    with torch.no_grad():
        for name, m in ref.named_modules():
            if ".layers." in name and name.endswith("proj") and "down_proj" not in name:
                eight = name.endswith(("q_proj", "k_proj"))
                m.weight.copy_(rtn.fake_quantize(m.weight, get_scheme("W8A16" if eight else "W4A16", GS)))
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
        want, got = ref(input_ids=ids).logits, model(input_ids=ids).logits
        # all at 4 bits would be a different model: the 8-bit q/k must be what was loaded
        four = load_any(checkpoints["llama"], dtype=torch.float32)
        for name, m in four.named_modules():
            if ".layers." in name and name.endswith("proj") and "down_proj" not in name:
                m.weight.copy_(rtn.fake_quantize(m.weight, get_scheme("W4A16", GS)))
        other = four(input_ids=ids).logits
    assert (got - want).norm() / want.norm() <= 1e-3
    assert (other - want).norm() / want.norm() > 10 * (got - want).norm() / want.norm()


def test_runs_differing_only_in_bit_allocation_never_resume_each_other(checkpoints, tmp_path):
    out = tmp_path / "o"
    a = _write(tmp_path, RECIPE, "a.yaml")
    killed = run_cli(_args(checkpoints["llama"], out, a), 2, timeout=240, env={"SQ_FAULT": "after-shard-write:1:1"})
    assert killed.returncode != 0 and (out / ".sq-run").is_dir()
    # same scheme names, same flags; only q_proj moves from 8 to 4 bits
    b = _write(tmp_path, RECIPE.replace("(q|k)", "(k)"), "b.yaml")
    res = run_cli(_args(checkpoints["llama"], out, b), 2, timeout=240)
    assert res.returncode != 0
    assert "holds an unfinished run with different settings" in res.stderr
    assert "assignment.model.layers.0.self_attn.q_proj" in res.stderr
    # the original recipe resumes and finishes
    res = run_cli(_args(checkpoints["llama"], out, a), 2, timeout=240)
    assert res.returncode == 0, res.output[-3000:]
    assert json.loads((out / "sq_report.json").read_text())["resumed_from_block"] == 1
