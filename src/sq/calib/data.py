"""Text corpora -> token windows for calibration and perplexity.

A ``--dataset`` is read as a list of records (:func:`read_corpus`), then turned into one
text (:meth:`Corpus.text`), then tokenized once (:func:`tokenize_corpus`).  Accepted specs:

- ``builtin:pydoc``: CPython's ``pydoc_data.topics``, always present offline;
- a ``.txt`` file: the whole file is one record;
- a ``.jsonl`` file (one JSON object per line) or a ``.parquet`` file (needs ``pyarrow``):
  each record has a string ``text`` or a chat ``messages`` list of ``{role, content}``;
- a Hugging Face hub dataset ``org/name``, ``org/name:split`` or ``org/name:config:split``
  (needs the ``datasets`` package and a connection, or its cache), with a ``text`` or a
  ``messages`` column.

A record uses ``text`` when it has a string ``text``, else its ``messages``, rendered with the
model tokenizer's chat template (``apply_chat_template(messages, tokenize=False)``), so the
text carries the template's role markers and special-token strings as the model sees them in
use.  Records are joined with a blank line (``"\\n\\n"``), whatever their kind, in file order.

Packing rule (the standard benchmark, shared with the peers' numbers in DESIGN.md): the
whole corpus is tokenized once, without special tokens, into one stream ``tokens[N]``
(special-token strings a chat template wrote into the text still become their tokens).
Calibration needs only the stream's first ``nsamples * seqlen`` tokens, and tokenizes only a
prefix of the text that yields them (``tokenize_corpus(..., need=)``: the same tokens).

- calibration: ``nsamples`` consecutive, non-overlapping windows from the start,
  ``tokens[i*seqlen:(i+1)*seqlen]`` for ``i < nsamples``;
- evaluation: the **last** ``nwindows`` windows, ``tokens[N - nwindows*seqlen:]``.

Windows ignore record boundaries: a window may end inside one record and the next window
start in it.  For SmolLM2 on ``builtin:pydoc`` (113,108 tokens): calibration 128 x 512 =
tokens [0, 65536); evaluation 40 x 512 = tokens [92628, 113108).  The two do not overlap as
long as ``(nsamples + nwindows) * seqlen <= N``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from sq import hub
from sq.dist import run_on_rank0
from sq.errors import SqError

BUILTIN_PYDOC = "builtin:pydoc"
FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
RECORD_SEP = "\n\n"
_MAX_LISTED = 10  # bad records named in one error; the rest are counted
# org/name[:split] or org/name:config:split; a split may carry a slice, e.g. train[:1000]
_HUB_DATASET = re.compile(r"(?P<name>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?:(?P<config>[^:\[\]]+):)?(?P<split>.+))?")
_ACCEPTED = (f"expected {BUILTIN_PYDOC!r}, a .txt, .jsonl or .parquet file, "
             "or a hub dataset org/name[:split] (see docs/data.md)")


@dataclass(frozen=True)
class Record:
    """One record of a corpus: its text, or the chat ``messages`` to render into text.

    ``where`` names it in errors: ``dataset file F, line L`` (.jsonl, lines from 1) or
    ``..., row R`` (.parquet and hub datasets, rows from 0 as in pyarrow and datasets).
    """

    where: str
    text: str | None = None
    messages: list | None = None


@dataclass(frozen=True)
class Corpus:
    """A dataset's records, checked, before any tokenizer is known.

    Reading first and rendering later lets an entry point reject a bad file before the slow
    model load, while chat records still use that model's own template.
    """

    spec: str
    records: tuple[Record, ...]

    @property
    def needs_tokenizer(self) -> bool:
        return any(r.text is None for r in self.records)

    def text(self, tokenizer=None) -> str:
        """The records joined with blank lines; ``messages`` rendered with ``tokenizer``'s chat template."""
        chats = [r for r in self.records if r.text is None]
        if chats:
            first = chats[0].where
            if tokenizer is None:
                raise SqError(f"{first}: field 'messages' is rendered with the model's chat template, "
                              f"so dataset {self.spec!r} needs the tokenizer (load_text(spec, tokenizer))")
            if not getattr(tokenizer, "chat_template", None):
                name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
                raise SqError(f"{first}: field 'messages' needs a chat template, but the tokenizer {name} "
                              "has none; give the records a string field 'text' instead")
        return RECORD_SEP.join(r.text if r.text is not None else _render(r, tokenizer) for r in self.records)


def builtin_pydoc_text() -> str:
    """The embedded corpus: CPython's ``pydoc_data.topics``, topics joined in sorted order.

    Always present offline; its exact content follows the running Python version.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def load_text(spec: str, tokenizer=None) -> str:
    """Corpus text of ``spec`` (see the module docstring); ``tokenizer`` renders chat records."""
    return read_corpus(spec).text(tokenizer)


def read_corpus(spec: str) -> Corpus:
    """Read and check every record of ``spec``; no tokenizer needed yet.

    Raises:
        SqError: an unknown spec, a missing or unreadable file, a missing optional package
            (pyarrow, datasets), an unreachable hub dataset, or bad records (up to 10 named
            by file, line or row, and field).
    """
    if spec == BUILTIN_PYDOC:
        return Corpus(spec, (Record(BUILTIN_PYDOC, text=builtin_pydoc_text()),))
    if spec.startswith("builtin:"):
        raise SqError(f"unknown dataset {spec!r}; the built-in dataset is {BUILTIN_PYDOC!r}")
    path = Path(spec).expanduser()
    if path.suffix in FILE_SUFFIXES:
        if not path.is_file():
            raise SqError(f"dataset file {path} does not exist")
        if path.suffix == ".txt":
            text = _read_utf8(path)
            if not text.strip():
                raise SqError(f"dataset file {path} is empty: nothing to calibrate on; pass a file with text in it (or "
                              "the default, builtin:pydoc)" if not text else
                              f"dataset file {path} holds only whitespace ({len(text)} characters): nothing to "
                              "calibrate on; pass a file with text in it (or the default, builtin:pydoc)")
            return Corpus(spec, (Record(f"dataset file {path}", text=text),))
        rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
        return Corpus(spec, _check_records(rows, f"dataset file {path}"))
    if path.exists():
        raise SqError(f"dataset {spec!r}: unsupported file type; {_ACCEPTED}")
    dataset = _HUB_DATASET.fullmatch(spec)
    if dataset is None:
        raise SqError(f"dataset {spec!r}: {_ACCEPTED}")
    return _hub_corpus(spec, dataset["name"], dataset["config"], dataset["split"] or "train")


def read_corpus_dist(spec: str, *, poll_s: float = 1.0) -> Corpus:
    """:func:`read_corpus` on rank 0 only; every rank gets the same records, or the same error.

    One download of a hub dataset instead of one per rank, and identical text on every rank
    even where ranks do not share a filesystem.  Call it at the same point on every rank.
    """
    return run_on_rank0(lambda: read_corpus(spec), what=f"reading dataset {spec!r}", poll_s=poll_s)


# ----------------------------------------------------------------------------- readers


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SqError(f"dataset file {path}: cannot read as UTF-8 text ({e})") from e


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    for lineno, line in enumerate(_read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"dataset file {path}, line {lineno}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise SqError(f"{where}: not JSON ({e.msg})") from e


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError as e:
        raise SqError(f"dataset file {path}: reading .parquet needs pyarrow (pip install 'sq[data]' "
                      "or pip install pyarrow), or convert the file to .jsonl") from e
    try:
        names = pq.read_schema(path).names
        columns = [c for c in ("text", "messages") if c in names]
        if not columns:
            raise SqError(f"dataset file {path}: no column 'text' or 'messages' (columns: {', '.join(names)})")
        table = pq.read_table(path, columns=columns)
    except (OSError, ValueError, pyarrow.ArrowException) as e:
        raise SqError(f"dataset file {path}: not a readable parquet file ({_one_line(e)})") from e
    for i, row in enumerate(table.to_pylist()):
        yield f"dataset file {path}, row {i}", row


def _hub_corpus(spec: str, name: str, config: str | None, split: str) -> Corpus:
    label = f"hub dataset {name!r} ({config + ', ' if config else ''}split {split!r})"
    try:
        import datasets
    except ImportError as e:
        raise SqError(f"dataset {spec!r}: no such file here, and reading it as a Hugging Face hub dataset "
                      "needs the datasets package (pip install datasets); or save it as a local .jsonl or "
                      ".parquet file with a 'text' or 'messages' field and pass that path") from e
    try:
        ds = datasets.load_dataset(name, name=config, split=split)
    except Exception as e:  # noqa: BLE001 - network, auth, missing config/split: all mean "cannot use it"
        off = " while downloads are off (HF_HUB_OFFLINE=1)" if hub.hub_offline() else ""
        raise SqError(f"{label}: cannot load it{off} ({type(e).__name__}: {_one_line(e)}); save it as a "
                      "local .jsonl or .parquet file with a 'text' or 'messages' field and pass that path "
                      "instead") from e
    columns = [c for c in ("text", "messages") if c in ds.column_names]
    if not columns:
        raise SqError(f"{label}: no column 'text' or 'messages' (columns: {', '.join(ds.column_names)})")
    values = [ds[c] for c in columns]
    rows = ((f"{label}, row {i}", dict(zip(columns, v))) for i, v in enumerate(zip(*values)))
    return Corpus(spec, _check_records(rows, label))


# ----------------------------------------------------------------------------- records


def _check_records(rows: Iterable[tuple[str, object]], source: str) -> tuple[Record, ...]:
    """Every row -> a Record; the problems of all bad rows in one SqError (the first few named)."""
    records, problems, bad = [], [], 0
    for where, row in rows:
        problem = _row_problem(row)
        if problem is None:
            text = row.get("text")
            records.append(Record(where, text=text) if isinstance(text, str) else
                           Record(where, messages=row["messages"]))
            continue
        bad += 1
        if bad <= _MAX_LISTED:
            problems.append(f"{where}: {problem}")
    if bad > _MAX_LISTED:
        problems.append(f"{source}: {bad - _MAX_LISTED} more bad records")
    if problems:
        raise SqError(problems)
    if not records:
        raise SqError(f"{source} holds no records")
    if all(r.text is not None and not r.text.strip() for r in records):
        raise SqError(f"{source}: the 'text' of every record ({len(records)}) is empty or whitespace: nothing to "
                      "calibrate on; pass a dataset with text in it (or the default, builtin:pydoc)")
    return tuple(records)


def _row_problem(row) -> str | None:
    """Why ``row`` is no record (a string ``text``, else a ``messages`` list), or None."""
    if not isinstance(row, dict):
        return f"expected an object with a field 'text' or 'messages', got {type(row).__name__}"
    if isinstance(row.get("text"), str):
        return None
    messages = row.get("messages")
    if messages is None:
        return "no string field 'text' and no field 'messages'"
    if not isinstance(messages, list) or not messages:
        return "field 'messages' must be a non-empty list of {role, content} objects"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            return f"field 'messages', item {i}: expected an object with a string 'role' and a 'content'"
    return None


def _render(record: Record, tokenizer) -> str:
    try:
        out = tokenizer.apply_chat_template(record.messages, tokenize=False)
    except Exception as e:  # noqa: BLE001 - the model's template over user data: any failure is this record's
        raise SqError(f"{record.where}: field 'messages': the chat template failed "
                      f"({type(e).__name__}: {_one_line(e)})") from e
    if not isinstance(out, str):
        raise SqError(f"{record.where}: field 'messages': the chat template gave {type(out).__name__}, not text")
    return out


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- tokenizer

# the files a Hugging Face tokenizer is read from (at least one of them must be there)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "special_tokens_map.json")


def load_tokenizer(root, model=None, *, purpose: str = "the calibration data is tokenized with it", **kwargs):
    """The tokenizer of the checkpoint folder ``root``, checked against ``model``'s input embedding.

    Decided from the folder's files and the model's config alone, so every rank that calls it
    gets the same tokenizer or the same error.  ``kwargs`` go to ``AutoTokenizer.from_pretrained``.

    Raises:
        SqError: ``root`` has no tokenizer files; transformers cannot load them; or the tokenizer
            has token ids the embedding has no row for (they would index past it in the forward).
    """
    from transformers import AutoTokenizer

    root = Path(root)
    if root.is_dir() and not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise SqError(f"{root} has no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...) but {purpose}; copy "
                      "the tokenizer files of these weights into the folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(root, **kwargs)
    except Exception as e:  # noqa: BLE001 - untrusted files: whatever transformers trips on is their problem
        raise SqError(f"cannot load the tokenizer in {root} ({type(e).__name__}: {_one_line(e)}); {purpose}, so "
                      "it must be the tokenizer these weights were trained with") from None
    rows = _embedding_rows(model)
    if rows is not None:
        try:
            top = max(tokenizer.get_vocab().values(), default=-1)
        except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: its length is the best guess
            top = len(tokenizer) - 1
        if top >= rows:
            raise SqError(f"the tokenizer in {root} has {top + 1} tokens (ids up to {top}) but the model's input "
                          f"embedding has only {rows} rows (config.json vocab_size): token ids >= {rows} would index "
                          "past it; use the tokenizer that came with these weights")
    return tokenizer


def _embedding_rows(model) -> int | None:
    """Rows of ``model``'s input embedding (a meta model is fine), or None if it has no such method."""
    if model is None:
        return None
    try:
        emb = model.get_input_embeddings()
        return int(emb.weight.shape[0])
    except (AttributeError, NotImplementedError, TypeError):
        return None


# ----------------------------------------------------------------------------- windows

def _ids(tokenizer, text: str) -> list[int]:
    # verbose=False: the corpus is far longer than model_max_length on purpose; it is cut
    # into windows afterwards, so the "sequence too long" warning would only mislead.
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def tokenize_corpus(tokenizer, text: str, need: int | None = None) -> torch.Tensor:
    """Tokenize the corpus once, without special tokens -> ``LongTensor[N]``.

    With ``need`` (calibration: ``nsamples * seqlen``), only as much of the text as those tokens
    take is tokenized, and the stream's first ``need`` tokens are returned (the whole stream where
    the whole text was tokenized): a 17 MB corpus is not tokenized whole for 128 tokens.  A prefix of the text tokenizes like the whole except
    near its cut (a word cut in two), so the prefix is taken with a margin of tokens beyond
    ``need`` and the first ``need`` tokens are accepted only when a half-longer prefix gives the
    same ones; otherwise the prefix doubles, up to the whole text.  Where the prefix would be
    more than half the text, the whole text is tokenized (as for the standard benchmark's
    128 x 512 tokens of ``builtin:pydoc``).  A corpus shorter than ``need`` tokens is always
    tokenized whole, so its refusal names its true length.
    """
    if need is not None and need > 0:
        margin = max(256, need // 8)
        chars = 8 * (need + margin)  # about twice the characters those tokens take in English
        while 2 * chars < len(text):
            ids = _ids(tokenizer, text[:chars])
            if len(ids) >= need + margin and _ids(tokenizer, text[: chars + chars // 2])[:need] == ids[:need]:
                return torch.tensor(ids[:need], dtype=torch.long)
            chars *= 2
    return torch.tensor(_ids(tokenizer, text), dtype=torch.long)


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
