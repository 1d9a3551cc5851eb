"""Malformed input files and bad arguments (issue 15, items 8 and 9): clean refusals at 1 and 2 ranks.

Every row is held to ``hostile.run_hostile``: exit 2 on every rank, an ``sq: error:`` line
naming the file and key (or flag) involved, no traceback, the source untouched, no hang.
Each case damages a copy of the Llama fixture (``ckpt_edit``) or passes a bad argument.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from ckpt_edit import copy_ckpt, edit_config, edit_header, edit_index, read_header
from harness import run_ranks
from hostile import Hostile, run_hostile
from sq.files import INDEX_NAME

BINARY = bytes(range(256)) * 8  # not UTF-8, not JSON, not YAML


def _copy(tmp: Path, ck) -> Path:
    return copy_ckpt(ck["llama"], tmp / "ckpt")


def _ptq(src: Path, tmp: Path, *extra: str, algo: str = "rtn") -> list[str]:
    return ["--model", str(src), "--output", str(tmp / "out"), "--algo", algo, *extra]


def _header_case(tmp: Path, ck, edit, what: str) -> Hostile:
    """Edit the header entry of the first tensor of the first shard; the refusal names file, key and field."""
    src = _copy(tmp, ck)
    weight_map = json.loads((src / INDEX_NAME).read_text())["weight_map"]
    key = sorted(weight_map)[0]
    file = src / weight_map[key]
    edit_header(file, lambda h: {**h, key: edit(h[key])})
    return Hostile(_ptq(src, tmp), rf"{re.escape(file.name)}.*'{re.escape(key)}'.*{what}",
                   protect=[src, ck["llama"]])


# ----------------------------------------------------------------------------- safetensors headers

def header_offsets_strings(tmp, ck) -> Hostile:
    return _header_case(tmp, ck, lambda e: {**e, "data_offsets": [str(x) for x in e["data_offsets"]]}, "data_offsets")


def header_dtype_list(tmp, ck) -> Hostile:
    return _header_case(tmp, ck, lambda e: {**e, "dtype": [e["dtype"]]}, "dtype")


def header_shape_int(tmp, ck) -> Hostile:
    return _header_case(tmp, ck, lambda e: {**e, "shape": e["shape"][0]}, "shape")


def header_shape_negative(tmp, ck) -> Hostile:
    return _header_case(tmp, ck, lambda e: {**e, "shape": [-x for x in e["shape"]]}, "shape")


def header_shape_float(tmp, ck) -> Hostile:
    return _header_case(tmp, ck, lambda e: {**e, "shape": [float(x) for x in e["shape"]]}, "shape")


def header_entry_not_object(tmp, ck) -> Hostile:
    return _header_case(tmp, ck, lambda e: [e["dtype"], e["shape"]], "object")


def header_overlapping_offsets(tmp, ck) -> Hostile:
    """Two tensors of one file claim the same bytes: each fits the data section, together they do not."""
    src = _copy(tmp, ck)
    for file in sorted(src.glob("*.safetensors")):  # the first file holding two tensors
        header, _ = read_header(file)
        entries = sorted((e["data_offsets"], k) for k, e in header.items() if k != "__metadata__")
        if len(entries) >= 2:
            break
    (b0, _), first = entries[0]
    (b1, e1), second = entries[1]

    def overlap(h):
        h[second] = {**h[second], "data_offsets": [b0, b0 + e1 - b1]}
        return h

    edit_header(file, overlap)
    return Hostile(_ptq(src, tmp), rf"{re.escape(file.name)}.*'{re.escape(second)}'.*overlap",
                   protect=[src, ck["llama"]])


# ----------------------------------------------------------------------------- index

def index_is_a_list(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    (src / INDEX_NAME).write_text(json.dumps(sorted(json.loads((src / INDEX_NAME).read_text())["weight_map"].items())))
    return Hostile(_ptq(src, tmp), rf"{re.escape(INDEX_NAME)}.*JSON object", protect=[src])


def index_weight_map_bad_values(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    key = sorted(json.loads((src / INDEX_NAME).read_text())["weight_map"])[0]
    edit_index(src, lambda m: {**m, key: [m[key]]})
    return Hostile(_ptq(src, tmp), rf"{re.escape(INDEX_NAME)}.*weight_map.*'{re.escape(key)}'", protect=[src])


def index_weight_map_not_a_dict(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    edit_index(src, lambda m: sorted(m.items()))
    return Hostile(_ptq(src, tmp), rf"{re.escape(INDEX_NAME)}.*weight_map", protect=[src])


def index_nul_in_file_name(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    key = sorted(json.loads((src / INDEX_NAME).read_text())["weight_map"])[0]
    edit_index(src, lambda m: {**m, key: "model\x00.safetensors"})
    return Hostile(_ptq(src, tmp), rf"{re.escape(INDEX_NAME)}.*NUL", protect=[src])


# ----------------------------------------------------------------------------- config.json

def config_binary(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    (src / "config.json").write_bytes(BINARY)
    return Hostile(_ptq(src, tmp), r"config\.json.*UTF-8", protect=[src])


def config_list(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    (src / "config.json").write_text(json.dumps([json.loads((src / "config.json").read_text())]))
    return Hostile(_ptq(src, tmp), r"config\.json.*JSON object", protect=[src])


def config_is_a_directory(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    (src / "config.json").unlink()
    (src / "config.json").mkdir()
    return Hostile(_ptq(src, tmp), r"config\.json.*not a file", protect=[src])


def config_unknown_model_type(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    edit_config(src, model_type="no-such-architecture")
    # a data-free job goes model-free (tests/test_modelfree.py); one that needs the model is refused
    return Hostile(_ptq(src, tmp, algo="gptq"), r"config\.json.*model_type 'no-such-architecture'", protect=[src])


def config_missing_model_type(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    edit_config(src, model_type=None)
    return Hostile(_ptq(src, tmp), r"config\.json.*no 'model_type'", protect=[src])


def config_model_type_not_a_string(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    edit_config(src, model_type=["llama"])
    return Hostile(_ptq(src, tmp), r"config\.json.*model_type", protect=[src])


# ----------------------------------------------------------------------------- arguments, recipe

def recipe_binary(tmp, ck) -> Hostile:
    recipe = tmp / "recipe.yaml"
    recipe.write_bytes(BINARY)
    return Hostile(_ptq(ck["llama"], tmp, "--recipe", str(recipe)), r"recipe .*recipe\.yaml.*UTF-8",
                   protect=[ck["llama"], recipe])


def recipe_is_a_directory(tmp, ck) -> Hostile:
    (tmp / "recipe.yaml").mkdir()
    return Hostile(_ptq(ck["llama"], tmp, "--recipe", str(tmp / "recipe.yaml")), r"recipe.*recipe\.yaml.*not a file",
                   protect=[ck["llama"]])


def timeout_zero(tmp, ck) -> Hostile:
    return Hostile(_ptq(ck["llama"], tmp, "--timeout", "0"), r"--timeout.*positive", protect=[ck["llama"]])


def timeout_negative(tmp, ck) -> Hostile:
    return Hostile(_ptq(ck["llama"], tmp, "--timeout", "-5"), r"--timeout.*positive", protect=[ck["llama"]])


def timeout_nan(tmp, ck) -> Hostile:
    return Hostile(_ptq(ck["llama"], tmp, "--timeout", "nan"), r"--timeout.*positive", protect=[ck["llama"]])


def inspect_timeout_zero(tmp, ck) -> Hostile:
    return Hostile(["--model", str(ck["llama"]), "--timeout", "0"], r"--timeout.*positive", module="sq.inspect",
                   protect=[ck["llama"]])


# ----------------------------------------------------------------------------- tokenizer

def no_tokenizer_for_gptq(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).unlink()
    return Hostile(_ptq(src, tmp, "--nsamples", "4", "--seqlen", "16", algo="gptq"),
                   rf"{re.escape(str(src))} has no tokenizer files.*--algo gptq", protect=[src])


def no_tokenizer_for_signround(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).unlink()
    return Hostile(_ptq(src, tmp, "--nsamples", "4", "--seqlen", "16", algo="signround"),
                   rf"{re.escape(str(src))} has no tokenizer files.*--algo signround", protect=[src])


def tokenizer_larger_than_embeddings(tmp, ck) -> Hostile:
    from sq.synthetic import build_tokenizer

    src = _copy(tmp, ck)
    build_tokenizer(src, 1024)  # the model's embedding has 512 rows
    return Hostile(_ptq(src, tmp, "--nsamples", "4", "--seqlen", "16", algo="gptq"),
                   r"tokenizer in .* has 1024 tokens .* embedding has only 512 rows", protect=[src])


def broken_tokenizer_json(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    (src / "tokenizer.json").write_bytes(BINARY)
    return Hostile(_ptq(src, tmp, "--nsamples", "4", "--seqlen", "16", algo="gptq"),
                   rf"cannot load the tokenizer in {re.escape(str(src))}", protect=[src])


# ----------------------------------------------------------------------------- sq.eval, sq.inspect

def eval_pickle_only(tmp, ck) -> Hostile:
    src = tmp / "pickled"
    src.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ck["llama"] / name, src / name)
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle, and never unpickled")
    return Hostile(["--model", str(src)], r"only pickle checkpoints \(pytorch_model\.bin\)", module="sq.eval",
                   protect=[src])


def eval_missing_folder(tmp, ck) -> Hostile:
    return Hostile(["--model", str(tmp / "nowhere")], r"nowhere does not exist", module="sq.eval")


def inspect_missing_model_type(tmp, ck) -> Hostile:
    src = _copy(tmp, ck)
    edit_config(src, model_type=None)
    return Hostile(["--model", str(src)], r"config\.json.*no 'model_type'", module="sq.inspect", protect=[src])


CASES = {f.__name__: f for f in (
    header_offsets_strings, header_dtype_list, header_shape_int, header_shape_negative, header_shape_float,
    header_entry_not_object, header_overlapping_offsets,
    index_is_a_list, index_weight_map_bad_values, index_weight_map_not_a_dict, index_nul_in_file_name,
    config_binary, config_list, config_is_a_directory, config_unknown_model_type, config_missing_model_type,
    config_model_type_not_a_string,
    recipe_binary, recipe_is_a_directory, timeout_zero, timeout_negative, timeout_nan, inspect_timeout_zero,
    no_tokenizer_for_gptq, no_tokenizer_for_signround, tokenizer_larger_than_embeddings, broken_tokenizer_json,
    eval_pickle_only, eval_missing_folder, inspect_missing_model_type,
)}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_input(case, world, tmp_path, checkpoints):
    run_hostile(CASES[case](tmp_path, checkpoints), world, tmp_path)


# ----------------------------------------------------------------------------- the Python loader

def _load_missing(rank, world, path):
    import sq

    try:
        sq.load_sharded(path)
    except sq.SqError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world", [1, 2])
def test_load_sharded_missing_folder(world, tmp_path):
    """``sq.load_sharded`` on a folder that is not there: an SqError naming it on every rank."""
    path = str(tmp_path / "nowhere")
    msgs = run_ranks(_load_missing, world, path, timeout=60)
    assert all(m and f"{path} does not exist" in m for m in msgs), msgs


def test_timeout_refused_by_ptq_config():
    """The Python side (``PTQConfig.problems``) refuses what the parser refuses."""
    from sq.config import PTQConfig

    for bad in (0, -5, float("nan"), float("inf")):
        assert any(p.startswith("--timeout must be a positive") for p in PTQConfig("m", "o", timeout_s=bad).problems())
    assert not any("--timeout" in p for p in PTQConfig("m", "o", timeout_s=0.5).problems())


def test_verify_source_refused_by_ptq_config():
    """An unknown ``verify_source`` from the Python side is one refusal, like the parser's choices."""
    from sq.config import PTQConfig

    assert "--verify-source must be stat or content, got 'sha'" in PTQConfig("m", "o", verify_source="sha").problems()
    assert not any("--verify-source" in p for p in PTQConfig("m", "o", verify_source="content").problems())
