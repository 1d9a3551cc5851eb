"""Hostile inputs, round 3 (issue 32, items 3, 5, 6 and 8): patterns that never end, silently
accepted mistakes, quantizing twice, a shard that is a folder, a corpus tokenized whole.

Every row of ``CASES`` goes through the real command line at 2 ranks under the contract of
``hostile.run_hostile``: exit 2 on every rank, an ``sq: error:`` line naming the pattern, key or
file, no traceback, the source and the output folder untouched (the output never created), every
launch bounded by its timeout.  No assertion depends on how long anything took.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ckpt_edit import copy_ckpt
from harness import run_cli, run_ranks
from hostile import Hostile, run_hostile

GS = "32"
RTN = ["--algo", "rtn", "--group-size", GS]
GPTQ = ["--algo", "gptq", "--group-size", GS, "--nsamples", "4", "--seqlen", "16"]
CATASTROPHIC = r"^([a-z._0-9]+)+X$"  # the pattern: 2^n ways to split an n-character name


def _ptq(ck, tmp: Path, *extra: str, model: str = "llama") -> list[str]:
    return ["--model", str(ck[model]), "--output", str(tmp / "out"), *extra]


def _case(tmp: Path, ck, argv, pattern: str, *files: Path, model: str = "llama") -> Hostile:
    return Hostile(argv, pattern, protect=[ck[model], tmp / "out", *files])


def _recipe(tmp: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp / name
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- patterns that never end

def ignore_catastrophic(tmp, ck) -> Hostile:
    return _case(tmp, ck, _ptq(ck, tmp, *RTN, "--ignore", CATASTROPHIC),
                 rf"--ignore {re.escape(repr(CATASTROPHIC))} is refused: a quantified group can match the same "
                 r"text in more than one way.*\[a-z\._0-9\]\+X")


def ignore_catastrophic_gptq(tmp, ck) -> Hostile:
    """Refused among the argument checks: before the model, the tokenizer or the corpus is touched."""
    pattern = r"(\w+\.?)*proj$"
    return _case(tmp, ck, _ptq(ck, tmp, *GPTQ, "--ignore", "mlp", pattern),
                 rf"--ignore {re.escape(repr(pattern))} is refused: a quantified group")


def ignore_polynomial(tmp, ck) -> Hostile:
    return _case(tmp, ck, _ptq(ck, tmp, *RTN, "--ignore", ".*.*.*.*.*X"),
                 r"--ignore '\.\*\.\*\.\*\.\*\.\*X' is refused: 5 quantifiers in a row")


def ignore_backreference(tmp, ck) -> Hostile:
    return _case(tmp, ck, _ptq(ck, tmp, *RTN, "--ignore", r"(q|k)_proj.*\1"),
                 r"--ignore .* is refused: backreferences")


def recipe_rule_catastrophic(tmp, ck) -> Hostile:
    recipe = _recipe(tmp, "default: W4A16\nrules:\n  - {match: 'self_attn', scheme: W8A16}\n"
                          "  - {match: '(a|a)*b$', scheme: null}\n")
    return _case(tmp, ck, _ptq(ck, tmp, *RTN, "--recipe", str(recipe)),
                 r"recipe .*recipe\.yaml: rule 2: match '\(a\|a\)\*b\$' is refused: a quantified group", recipe)


def model_free_catastrophic(tmp, ck) -> Hostile:
    return _case(tmp, ck, _ptq(ck, tmp, *RTN, "--model-free", "--ignore", CATASTROPHIC),
                 rf"--ignore {re.escape(repr(CATASTROPHIC))} is refused")


# ----------------------------------------------------------------------------- silently accepted mistakes

def ignore_matches_nothing(tmp, ck) -> Hostile:
    """llm-compressor's spelling (``re:`` prefix): with re.search it matches no module at all."""
    return _case(tmp, ck, _ptq(ck, tmp, *RTN, "--ignore", "lm_head", "re:.*mlp.gate$"),
                 r"--ignore 're:\.\*mlp\.gate\$' matches no module of this model \(module names look like "
                 r"'model\.layers\.0\..*--allow-unmatched")


def ignore_matches_nothing_gptq(tmp, ck) -> Hostile:
    pattern = r"layers\.7\."
    return _case(tmp, ck, _ptq(ck, tmp, *GPTQ, "--ignore", pattern),
                 rf"--ignore {re.escape(repr(pattern))} matches no module.*--allow-unmatched")


def recipe_rule_typo(tmp, ck) -> Hostile:
    recipe = _recipe(tmp, "default: W4A16\nrules:\n  - {match: 'self_atn', scheme: W8A16}\n")
    return _case(tmp, ck, _ptq(ck, tmp, *RTN, "--recipe", str(recipe)),
                 r"recipe .*recipe\.yaml: rule 1 \(match 'self_atn'\) matches no module.*--allow-unmatched", recipe)


def recipe_rule_only_full_precision(tmp, ck) -> Hostile:
    """A rule that would quantize lm_head (sq keeps it in full precision): it would change nothing."""
    recipe = _recipe(tmp, json.dumps({"default": "W4A16", "rules": [{"match": "lm_head", "scheme": "W8A16"}]}),
                     "recipe.json")
    return _case(tmp, ck, _ptq(ck, tmp, *RTN, "--recipe", str(recipe)),
                 r"rule 1 \(match 'lm_head'\) matches only 'lm_head', which sq keeps in full precision", recipe)


def model_free_ignore_matches_nothing(tmp, ck) -> Hostile:
    return _case(tmp, ck, _ptq(ck, tmp, *RTN, "--model-free", "--ignore", "q_porj"),
                 r"--ignore 'q_porj' matches no module of this model")


def recipe_duplicate_default_yaml(tmp, ck) -> Hostile:
    recipe = _recipe(tmp, "default: W4A16\nrules:\n  - {match: 'self_attn', scheme: W8A16}\ndefault: W8A16\n")
    return _case(tmp, ck, _ptq(ck, tmp, *RTN, "--recipe", str(recipe)),
                 r"recipe .*recipe\.yaml: key 'default' is given twice in one mapping \(lines 1 and 4\)", recipe)


def recipe_duplicate_match_yaml(tmp, ck) -> Hostile:
    recipe = _recipe(tmp, "rules:\n  - match: 'self_attn'\n    scheme: W8A16\n    match: 'mlp'\n")
    return _case(tmp, ck, _ptq(ck, tmp, *RTN, "--recipe", str(recipe)),
                 r"key 'match' is given twice in one mapping \(lines 2 and 4\)", recipe)


def recipe_duplicate_json(tmp, ck) -> Hostile:
    recipe = _recipe(tmp, '{"default": "W4A16",\n "rules": [],\n "default": null}\n', "recipe.json")
    return _case(tmp, ck, _ptq(ck, tmp, *RTN, "--recipe", str(recipe)),
                 r"recipe .*recipe\.json: key 'default' is given twice in one object \(lines 1 and 3\)", recipe)


def corpus_whitespace(tmp, ck) -> Hostile:
    corpus = tmp / "blank.txt"
    corpus.write_text(" \n\t\n" * 5000)
    return _case(tmp, ck, _ptq(ck, tmp, *GPTQ, "--dataset", str(corpus)),
                 rf"dataset file {re.escape(str(corpus))} holds only whitespace \(20000 characters\)", corpus)


def corpus_empty(tmp, ck) -> Hostile:
    corpus = tmp / "empty.txt"
    corpus.write_text("")
    return _case(tmp, ck, _ptq(ck, tmp, *GPTQ, "--dataset", str(corpus)),
                 rf"dataset file {re.escape(str(corpus))} is empty", corpus)


def corpus_whitespace_records(tmp, ck) -> Hostile:
    corpus = tmp / "blank.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in ("", "  ", "\n\n", "\t")) + "\n")
    return _case(tmp, ck, _ptq(ck, tmp, *GPTQ, "--dataset", str(corpus)),
                 rf"dataset file {re.escape(str(corpus))}: the 'text' of every record \(4\) is empty or whitespace",
                 corpus)


# ----------------------------------------------------------------------------- files

def shard_is_a_folder(tmp, ck) -> Hostile:
    src = copy_ckpt(ck["llama"], tmp / "ckpt")
    shard = sorted(src.glob("model-*.safetensors"))[1]
    shard.unlink()
    shard.mkdir()

    def one_line(result):
        errors = [l for l in result.stderr.splitlines() if l.startswith("sq: error: ")]
        # the one problem, not "missing" and a cascade of keys the folder would have held
        assert errors and all("is a folder, not a file" in l for l in errors), errors

    case = Hostile(_ptq({"llama": src}, tmp, *RTN), rf"{re.escape(str(shard))} is a folder, not a file",
                   protect=[src, tmp / "out"])
    case.check_result = one_line
    return case


CASES = {f.__name__: f for f in (
    ignore_catastrophic, ignore_catastrophic_gptq, ignore_polynomial, ignore_backreference, recipe_rule_catastrophic,
    model_free_catastrophic,
    ignore_matches_nothing, ignore_matches_nothing_gptq, recipe_rule_typo, recipe_rule_only_full_precision,
    model_free_ignore_matches_nothing, recipe_duplicate_default_yaml, recipe_duplicate_match_yaml,
    recipe_duplicate_json, corpus_whitespace, corpus_empty, corpus_whitespace_records,
    shard_is_a_folder,
)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_round3(case, tmp_path, checkpoints):
    c = CASES[case](tmp_path, checkpoints)
    result = run_hostile(c, 2, tmp_path)
    check = getattr(c, "check_result", None)
    if check is not None:
        check(result)


# ----------------------------------------------------------------------------- what is still accepted

def test_allow_unmatched_accepts_and_warns(checkpoints, tmp_path):
    """``--allow-unmatched``: the same typo is a warning on the log, and the job runs; an --ignore of a
    Linear sq keeps in full precision anyway (lm_head) is no mistake and needs no flag."""
    recipe = _recipe(tmp_path, "default: W4A16\nrules:\n  - {match: 'self_atn', scheme: W8A16}\n")
    argv = _ptq(checkpoints, tmp_path, *RTN, "--recipe", str(recipe), "--ignore", "lm_head", "re:.*mlp.gate$",
                "--allow-unmatched")
    res = run_cli(["sq.ptq", *argv], 2, timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    assert "rule 1 (match 'self_atn') matches no module of this model" in res.output, res.output[-3000:]
    assert "(accepted: --allow-unmatched)" in res.output
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()


# ----------------------------------------------------------------------------- the pattern check itself

REFUSED = [CATASTROPHIC, r"(a+)+b", r"(a*)*b", r"(a|a)*b", r"(a|aa)*b", r"(\w+\s?)*$", r"(x+x+)+y", r"(\d+|\w+)*!",
           r"([a-z]+\.?)+\(", r"(a|b|ab)*c", r"(.*a){12}", r"(a|a){20}X", r"(?:(?:b{2,5}){3}){2,5}", r".*.*.*.*X",
           r"(?=(a+)+X)", r"(a+?)+b", r"(?i:(A+)+)b", r"((ab)*)*c", r"(a)(?(1)b|c)", r"(q)_proj\1", "(" * 300 + ")" * 300]
ACCEPTED = [r"self_attn\.(q|k|v|o)_proj$", r"mlp\.experts", r"layers\.61\.", r"mlp\.down_proj$",
            r"layers\.([2-9]|[12][0-9])\.", r"model\.layers\.0\.mlp\.lookup", "lm_head", "re:.*mlp.gate$", "",
            r"(\.\d+)+X", "layers.*mlp.*proj", ".*a.*b.*c", r"^model\.layers\.\d+\.mlp\.experts$", r"[0-9a-f]{64}",
            r"\d{1,3}(\.\d{1,3}){3}", r"(?i)Q_PROJ", r"(?!.*lora).*proj$", r"\bgate\b", r"(\w+\.)+proj",
            r"experts\.\d+\.(gate|up|down)_proj", "|".join(rf"model\.layers\.{i}\.mlp\.down_proj" for i in range(80))]


@pytest.mark.parametrize("pattern", REFUSED)
def test_pattern_refused(pattern):
    from sq.patterns import pattern_problem

    problem = pattern_problem(pattern, f"--ignore {pattern!r}")
    assert problem is not None and problem.startswith(f"--ignore {pattern!r}"), problem
    assert pattern_problem(pattern, f"--ignore {pattern!r}") == problem  # a pure function of the pattern


@pytest.mark.parametrize("pattern", ACCEPTED)
def test_pattern_accepted(pattern):
    from sq.patterns import pattern_problem

    assert pattern_problem(pattern, "p") is None


def test_every_documented_pattern_is_accepted():
    """The patterns the docs show users are not refused by the check that protects them."""
    from sq.patterns import pattern_problem

    docs = Path(__file__).parent.parent / "docs"
    found = []
    for name in ("recipes.md", "cli.md", "model-free.md", "python-api.md"):
        text = (docs / name).read_text()
        found += re.findall(r"match: '([^']+)'", text)
        found += re.findall(r"--ignore '([^']+)'", text)
    assert found
    assert [p for p in found if pattern_problem(p, "p") is not None] == []


# ----------------------------------------------------------------------------- quantizing twice (the API)

def _tiny_llama_sharded(seed: int = 0):
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _quantize_twice(rank, world, root):
    import sq
    from sq.errors import SqError

    def attempt(model, out, **kw):
        try:
            sq.quantize(model, f"{root}/{out}", algo="rtn", group_size=32, **kw)
        except SqError as e:
            return str(e)
        return None

    msgs = {}
    model = _tiny_llama_sharded()
    msgs["first"] = attempt(model, "first")
    msgs["again"] = attempt(model, "again")
    carried = _tiny_llama_sharded()
    carried.config.quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    msgs["config"] = attempt(carried, "config")
    held = _tiny_llama_sharded()
    held.model.layers[0].self_attn.q_proj.register_buffer("weight_scale", torch.ones(64, 2))
    msgs["modules"] = attempt(held, "modules")
    msgs["unmatched"] = attempt(_tiny_llama_sharded(), "unmatched", ignore=("self_atn",))
    msgs["allowed"] = attempt(_tiny_llama_sharded(), "allowed", ignore=("self_atn",), allow_unmatched=True)
    return msgs


def test_quantize_twice_is_refused_on_every_rank(tmp_path):
    msgs = run_ranks(_quantize_twice, 2, str(tmp_path), timeout=240)
    assert msgs[0] == msgs[1], msgs
    m = msgs[0]
    assert m["first"] is None and m["allowed"] is None, m
    assert "already quantized in place by sq.quantize (into " in m["again"] and "first" in m["again"], m["again"]
    assert "carries a quantization_config (quant_method 'compressed-tensors')" in m["config"], m["config"]
    assert "model.layers.0.self_attn.q_proj (weight_scale)" in m["modules"], m["modules"]
    assert "--ignore 'self_atn' matches no module" in m["unmatched"] and "allow_unmatched=True" in m["unmatched"]
    for refused in ("again", "config", "modules", "unmatched"):
        assert not (tmp_path / refused).exists(), refused
    assert (tmp_path / "first" / "config.json").is_file() and (tmp_path / "allowed" / "config.json").is_file()


# ----------------------------------------------------------------------------- the corpus, tokenized as needed

class _Recording:
    """A tokenizer that records how many characters each call tokenized."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def __call__(self, text, **kw):
        self.calls.append(len(text))
        return self.tok(text, **kw)


def test_only_the_needed_prefix_is_tokenized(checkpoints):
    """A 17 MB single-line corpus and 4 x 32 tokens: a few thousand characters are tokenized, not 17 MB;
    and the windows are the ones the whole text gives (bit-identical: resume depends on it)."""
    from transformers import AutoTokenizer

    from sq.calib.data import builtin_pydoc_text, calibration_windows, tokenize_corpus

    tok = AutoTokenizer.from_pretrained(checkpoints["llama"])
    text = builtin_pydoc_text()
    big = text.replace("\n", " ") * 36
    assert len(big) > 16_000_000
    rec = _Recording(tok)
    windows = calibration_windows(tokenize_corpus(rec, big, need=4 * 32), 4, 32)
    assert max(rec.calls) < 20_000, rec.calls
    whole_prefix = tokenize_corpus(tok, big[:200_000])
    assert torch.equal(windows, calibration_windows(whole_prefix, 4, 32))
    whole = tokenize_corpus(tok, text)  # the corpus the tests and the demo calibrate on
    for need in (2, 64, 500, 4096, 20000, 65536, whole.numel()):
        assert torch.equal(tokenize_corpus(tok, text, need=need)[:need], whole[:need]), need
    n = whole.numel() // 2 + 1  # windows of 2 tokens, one more token than the corpus has
    with pytest.raises(Exception, match=rf"corpus has only {whole.numel()}"):  # tokenized whole: its true length
        calibration_windows(tokenize_corpus(tok, text, need=2 * n), n, 2)
