"""sq.eval: perplexity against transformers' own loss, and the CLI contract."""

from __future__ import annotations

import math

import pytest
import torch

from sq.errors import SqError
from sq.eval import main, perplexity


@pytest.fixture(scope="module")
def llama(llama_ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32).eval()


def test_matches_transformers_loss(llama):
    windows = torch.randint(0, 512, (5, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # equal-length windows: mean of per-window mean NLL == mean over all predicted tokens
        losses = [llama(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    expected = math.exp(sum(losses) / len(losses))
    assert perplexity(llama, windows, batch_size=2) == pytest.approx(expected, rel=1e-5)


def test_batch_size_does_not_change_the_result(llama):
    windows = torch.randint(0, 512, (6, 48), generator=torch.Generator().manual_seed(1))
    values = [perplexity(llama, windows, batch_size=b) for b in (1, 4, 6)]
    assert max(values) - min(values) < 1e-4 * values[0]


def test_bad_windows(llama):
    with pytest.raises(SqError, match="seqlen >= 2"):
        perplexity(llama, torch.zeros(3, dtype=torch.long))
    with pytest.raises(SqError, match="batch size"):
        perplexity(llama, torch.zeros(2, 8, dtype=torch.long), batch_size=0)


def test_cli_prints_perplexity(llama_ckpt, llama, capsys):
    from transformers import AutoTokenizer

    from sq.calib.data import eval_windows, load_text, tokenize_corpus

    assert main(["--model", str(llama_ckpt), "--seqlen", "64", "--nwindows", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    tokens = tokenize_corpus(AutoTokenizer.from_pretrained(llama_ckpt), load_text("builtin:pydoc"))
    expected = perplexity(llama, eval_windows(tokens, 3, 64))
    assert out[0] == f"perplexity: {expected:.2f}"
    assert out[1] == f"tokens: 192 in 3 windows of 64 (189 predicted), corpus {tokens.numel()}"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "/no/such/dir"], "sq: error: model directory /no/such/dir does not exist"),
        (["--model", "demo:nope"], "sq: error: unknown demo model 'demo:nope'"),
        (["--model", "X", "--dataset", "builtin:nope"], "sq: error: unknown dataset 'builtin:nope'"),
        (["--model", "X", "--seqlen", "abc"], "sq: error: argument --seqlen: invalid int value: 'abc'"),
        ([], "sq: error: the following arguments are required: --model"),
    ],
)
def test_cli_bad_input(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.out == ""


def test_cli_too_many_windows(llama_ckpt, capsys):
    assert main(["--model", str(llama_ckpt), "--seqlen", "512", "--nwindows", "100000"]) == 2
    assert "but the corpus has only" in capsys.readouterr().err
