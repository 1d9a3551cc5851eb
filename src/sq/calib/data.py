"""Text corpora -> token windows for calibration and perplexity.

Packing rule (the standard benchmark, shared with the peers' numbers in DESIGN.md): the
whole corpus is tokenized once, without special tokens, into one stream ``tokens[N]``.

- calibration: ``nsamples`` consecutive, non-overlapping windows from the start,
  ``tokens[i*seqlen:(i+1)*seqlen]`` for ``i < nsamples``;
- evaluation: the **last** ``nwindows`` windows, ``tokens[N - nwindows*seqlen:]``.

For SmolLM2 on ``builtin:pydoc`` (113,108 tokens): calibration 128 x 512 = tokens
[0, 65536); evaluation 40 x 512 = tokens [92628, 113108).  The two do not overlap as long
as ``(nsamples + nwindows) * seqlen <= N``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sq.errors import SqError

BUILTIN_PYDOC = "builtin:pydoc"


def builtin_pydoc_text() -> str:
    """The embedded corpus: CPython's ``pydoc_data.topics``, topics joined in sorted order.

    Always present offline; its exact content follows the running Python version.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def load_text(spec: str) -> str:
    """Corpus text of ``spec``: ``builtin:pydoc``, a ``.txt`` file, or a ``.jsonl`` file.

    A ``.jsonl`` file holds one JSON object per line with a string field ``text``; the
    records are joined with blank lines, like the pydoc topics.
    """
    if spec == BUILTIN_PYDOC:
        return builtin_pydoc_text()
    if spec.startswith("builtin:"):
        raise SqError(f"unknown dataset {spec!r}; the built-in dataset is {BUILTIN_PYDOC!r}")
    path = Path(spec)
    if path.suffix not in (".txt", ".jsonl"):
        raise SqError(
            f"dataset {spec!r}: expected {BUILTIN_PYDOC!r}, a .txt file or a .jsonl file with a 'text' field"
        )
    if not path.is_file():
        raise SqError(f"dataset file {path} does not exist")
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SqError(f"dataset file {path}: cannot read as UTF-8 text ({e})") from e
    if path.suffix == ".txt":
        return raw
    return "\n\n".join(_jsonl_texts(path, raw))


def _jsonl_texts(path: Path, raw: str) -> list[str]:
    texts = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SqError(f"dataset file {path}, line {lineno}: not JSON ({e.msg})") from e
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise SqError(f"dataset file {path}, line {lineno}: no string field 'text'")
        texts.append(record["text"])
    if not texts:
        raise SqError(f"dataset file {path} holds no records")
    return texts


def tokenize_corpus(tokenizer, text: str) -> torch.Tensor:
    """Tokenize the whole corpus once, without special tokens -> ``LongTensor[N]``."""
    # verbose=False: the corpus is far longer than model_max_length on purpose; it is cut
    # into windows afterwards, so the "sequence too long" warning would only mislead.
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def _check_sizes(tokens: torch.Tensor, count: int, seqlen: int, what: str) -> None:
    if tokens.dim() != 1:
        raise SqError(f"{what}: expected a 1-D token stream, got shape {tuple(tokens.shape)}")
    if count < 1 or seqlen < 2:
        raise SqError(f"{what}: need at least 1 window of at least 2 tokens, got {count} x {seqlen}")
    need = count * seqlen
    if need > tokens.numel():
        raise SqError(
            f"{what}: {count} windows x {seqlen} tokens = {need} tokens, "
            f"but the corpus has only {tokens.numel()}; lower the count or the sequence length"
        )


def calibration_windows(tokens: torch.Tensor, nsamples: int, seqlen: int) -> torch.Tensor:
    """``tokens[N]`` -> ``[nsamples, seqlen]``: consecutive windows from the start."""
    _check_sizes(tokens, nsamples, seqlen, "calibration data")
    return tokens[: nsamples * seqlen].reshape(nsamples, seqlen).clone()


def eval_windows(tokens: torch.Tensor, nwindows: int, seqlen: int) -> torch.Tensor:
    """``tokens[N]`` -> ``[nwindows, seqlen]``: the last ``nwindows * seqlen`` tokens."""
    _check_sizes(tokens, nwindows, seqlen, "evaluation data")
    start = tokens.numel() - nwindows * seqlen
    return tokens[start:].reshape(nwindows, seqlen).clone()
