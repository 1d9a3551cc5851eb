"""Corpus loading and the window packing rule of sq.calib.data."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from sq.calib.data import (
    builtin_pydoc_text,
    calibration_windows,
    eval_windows,
    load_text,
    tokenize_corpus,
)
from sq.errors import SqError


def test_calibration_windows_are_consecutive_from_the_start():
    tokens = torch.arange(1000)
    w = calibration_windows(tokens, 3, 128)
    assert w.shape == (3, 128) and w.dtype == torch.long
    assert torch.equal(w.reshape(-1), torch.arange(384))
    assert w[2, 0] == 256


def test_eval_windows_are_the_last_ones():
    tokens = torch.arange(1000)
    w = eval_windows(tokens, 3, 128)
    assert w.shape == (3, 128)
    assert torch.equal(w.reshape(-1), torch.arange(1000 - 384, 1000))


def test_standard_benchmark_offsets():
    # SmolLM2 on builtin:pydoc: 113,108 tokens; eval = tokens [92628, 113108)
    tokens = torch.arange(113_108)
    assert eval_windows(tokens, 40, 512)[0, 0] == 92_628
    assert calibration_windows(tokens, 128, 512)[-1, -1] == 65_535


def test_exact_fit_and_windows_are_copies():
    tokens = torch.arange(512)
    assert torch.equal(calibration_windows(tokens, 4, 128), eval_windows(tokens, 4, 128))
    w = calibration_windows(tokens, 4, 128)
    w.zero_()
    assert tokens[5] == 5  # callers may mutate windows without touching the token stream


@pytest.mark.parametrize("fn", [calibration_windows, eval_windows])
def test_too_few_tokens_is_a_clear_error(fn):
    with pytest.raises(SqError, match=r"4 windows x 128 tokens = 512 tokens, but the corpus has only 511"):
        fn(torch.arange(511), 4, 128)


@pytest.mark.parametrize("count,seqlen", [(0, 128), (4, 1), (-1, 8)])
def test_bad_sizes(count, seqlen):
    with pytest.raises(SqError):
        calibration_windows(torch.arange(1000), count, seqlen)


def test_windows_need_a_flat_stream():
    with pytest.raises(SqError, match="1-D"):
        eval_windows(torch.zeros(2, 500, dtype=torch.long), 1, 8)


def test_builtin_corpus_is_sorted_topics():
    from pydoc_data.topics import topics

    text = load_text("builtin:pydoc")
    assert text == "\n\n".join(topics[k] for k in sorted(topics))
    assert len(text) > 100_000


def test_builtin_corpus_is_deterministic_across_processes():
    code = "import hashlib, sys; from sq.calib.data import builtin_pydoc_text as t; " \
           "sys.stdout.write(hashlib.sha256(t().encode()).hexdigest())"  # fmt: skip
    digests = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        digests.add(out.stdout)
    assert digests == {hashlib.sha256(builtin_pydoc_text().encode()).hexdigest()}


def test_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello\nworld\n", encoding="utf-8")
    assert load_text(str(tmp_path / "a.txt")) == "hello\nworld\n"
    lines = [json.dumps({"text": "first", "id": 1}), "", json.dumps({"text": "second"})]
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert load_text(str(tmp_path / "b.jsonl")) == "first\n\nsecond"


@pytest.mark.parametrize(
    "content,match",
    [("{not json}\n", r"line 1: not JSON"), ('{"text": "a"}\n{"body": "b"}\n', r"line 2: no string field 'text'"),
     ("\n\n", "holds no records")],
)  # fmt: skip
def test_bad_jsonl_names_file_and_line(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SqError, match=match) as info:
        load_text(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "spec,match",
    [("builtin:wikitext", "unknown dataset 'builtin:wikitext'"), ("/no/such/file.txt", "does not exist"),
     ("data.parquet", "expected 'builtin:pydoc', a .txt file or a .jsonl file"),
     ("allenai/c4", "expected 'builtin:pydoc'")],
)  # fmt: skip
def test_unsupported_specs(spec, match):
    with pytest.raises(SqError, match=match):
        load_text(spec)


def test_tokenize_corpus_adds_no_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    from sq.testing.checkpoints import build_tokenizer

    tok = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path, 512))
    tokens = tokenize_corpus(tok, "def f(x):\n    return x\n")
    assert tokens.dtype == torch.long and tokens.dim() == 1
    assert tok.bos_token_id not in tokens.tolist() and tok.eos_token_id not in tokens.tolist()
    assert tok.decode(tokens.tolist()) == "def f(x):\n    return x\n"
