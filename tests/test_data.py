"""Corpus loading and the window packing rule of sq.calib.data."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from sq.calib.data import (
    builtin_pydoc_text,
    calibration_windows,
    eval_windows,
    load_text,
    read_corpus,
    read_corpus_dist,
    tokenize_corpus,
)
from sq.errors import SqError

from harness import run_ranks


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
    [("{not json}\n", r"line 1: not JSON"),
     ('{"text": "a"}\n{"body": "b"}\n', r"line 2: no string field 'text' and no field 'messages'"),
     ('{"text": null, "messages": "hi"}\n', r"line 1: field 'messages' must be a non-empty list"),
     ('{"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}\n',
      r"line 1: field 'messages', item 1: expected an object with a string 'role' and a 'content'"),
     ('["text"]\n', r"line 1: expected an object with a field 'text' or 'messages', got list"),
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
     ("no/such.parquet", "dataset file no/such.parquet does not exist"),
     ("a/b/c", r"expected 'builtin:pydoc', a .txt, .jsonl or .parquet file, or a hub dataset org/name\[:split\]"),
     ("org/name:", "expected 'builtin:pydoc'")],
)  # fmt: skip
def test_unsupported_specs(spec, match):
    with pytest.raises(SqError, match=match):
        load_text(spec)


def test_unsupported_file_type(tmp_path):
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(SqError, match=r"data.csv': unsupported file type; expected 'builtin:pydoc'"):
        read_corpus(str(tmp_path / "data.csv"))


def test_tokenize_corpus_adds_no_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    from sq.synthetic import build_tokenizer

    tok = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path, 512))
    tokens = tokenize_corpus(tok, "def f(x):\n    return x\n")
    assert tokens.dtype == torch.long and tokens.dim() == 1
    assert tok.bos_token_id not in tokens.tolist() and tok.eos_token_id not in tokens.tolist()
    assert tok.decode(tokens.tolist()) == "def f(x):\n    return x\n"


# ----------------------------------------------------------------------------- formats and chat records

# A tiny chat template: every message as "<s>role: content</s>\n"; conversations must open with the user.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'user' %}{{ raise_exception('conversations open with the user') }}{% endif %}"
    "<s>{{ m['role'] }}: {{ m['content'] }}</s>\n"
    "{% endfor %}"
)
CHATS = [
    [{"role": "user", "content": "What is a tuple?"}, {"role": "assistant", "content": "An immutable sequence."}],
    [{"role": "user", "content": "And a list?"}, {"role": "assistant", "content": "A mutable one."},
     {"role": "user", "content": "Thanks."}],
]  # fmt: skip


def rendered(messages: list[dict]) -> str:
    """CHAT_TEMPLATE by hand."""
    return "".join(f"<s>{m['role']}: {m['content']}</s>\n" for m in messages)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The fixtures' byte-level BPE; it has no chat template."""
    from transformers import AutoTokenizer

    from sq.synthetic import build_tokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok"), 512))


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """The same tokenizer with CHAT_TEMPLATE, saved and loaded back as a model folder would hold it."""
    from transformers import AutoTokenizer

    from sq.synthetic import build_tokenizer

    folder = build_tokenizer(tmp_path_factory.mktemp("chat-tok"), 512)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def write_parquet(path, columns: dict) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return str(path)


class FakeHubDataset:
    """What sq reads of a ``datasets.Dataset``: ``column_names`` and ``ds[column]``."""

    def __init__(self, rows: list[dict]):
        self.rows, self.column_names = rows, list(rows[0])

    def __getitem__(self, column: str) -> list:
        return [r[column] for r in self.rows]


def fake_datasets(monkeypatch, rows=None, error=None) -> list:
    """Install a stand-in ``datasets`` package (no hub here); returns the load_dataset calls."""
    calls = []

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        if error is not None:
            raise error
        return FakeHubDataset(rows)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_every_format_gives_the_windows_of_the_txt(tmp_path, tokenizer, monkeypatch):
    pytest.importorskip("pyarrow")
    pydoc = builtin_pydoc_text()
    texts = [pydoc[i * 2500:(i + 1) * 2500] for i in range(4)]  # multi-line records
    texts[1] += " caf\u00e9 \u2014 \u00fcnic\u00f6de"
    (tmp_path / "c.txt").write_text("\n\n".join(texts), encoding="utf-8")
    specs = {
        "jsonl": write_jsonl(tmp_path / "c.jsonl", [{"text": t, "id": i} for i, t in enumerate(texts)]),
        "parquet": write_parquet(tmp_path / "c.parquet", {"id": list(range(4)), "text": texts}),
        "hub": "org/calib:train",
    }
    fake_datasets(monkeypatch, rows=[{"id": i, "text": t} for i, t in enumerate(texts)])
    ref = tokenize_corpus(tokenizer, load_text(str(tmp_path / "c.txt")))
    assert ref.numel() > 8 * 64
    for kind, spec in specs.items():
        tokens = tokenize_corpus(tokenizer, load_text(spec))
        assert torch.equal(tokens, ref), kind
        assert torch.equal(calibration_windows(tokens, 4, 64), calibration_windows(ref, 4, 64)), kind
        assert torch.equal(eval_windows(tokens, 4, 64), eval_windows(ref, 4, 64)), kind


def test_messages_are_rendered_with_the_chat_template(tmp_path, chat_tokenizer, monkeypatch):
    records = [{"messages": CHATS[0]}, {"text": "Plain text between chats."}, {"text": None, "messages": CHATS[1]},
               {"text": "A string text wins over messages.", "messages": CHATS[0]}]  # fmt: skip
    expected = "\n\n".join([rendered(CHATS[0]), "Plain text between chats.", rendered(CHATS[1]),
                            "A string text wins over messages."])  # fmt: skip
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    corpus = read_corpus(path)  # reading needs no tokenizer: bad files fail before the model loads
    assert corpus.needs_tokenizer and [r.where for r in corpus.records][0] == f"dataset file {path}, line 1"
    assert corpus.text(chat_tokenizer) == expected
    assert load_text(path, chat_tokenizer) == expected
    # the "<s>" strings the template wrote become the BOS token, though no special tokens are added
    tokens = tokenize_corpus(chat_tokenizer, expected).tolist()
    assert tokens.count(chat_tokenizer.bos_token_id) == 5  # 2 + 3 messages

    fake_datasets(monkeypatch, rows=[{"text": r.get("text"), "messages": r.get("messages")} for r in records])
    assert load_text("org/chats", chat_tokenizer) == expected
    pytest.importorskip("pyarrow")
    parquet = write_parquet(tmp_path / "chats.parquet", {"messages": CHATS})
    assert load_text(parquet, chat_tokenizer) == "\n\n".join(rendered(c) for c in CHATS)


def test_messages_need_a_tokenizer_with_a_chat_template(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chats.jsonl", [{"text": "plain"}, {"messages": CHATS[0]}])
    where = re.escape(f"dataset file {path}, line 2: field 'messages'")
    with pytest.raises(SqError, match=where + " needs a chat template, but the tokenizer .* has none; give the "
                       "records a string field 'text' instead"):  # fmt: skip
        load_text(path, tokenizer)
    with pytest.raises(SqError, match=where + " is rendered with the model's chat template, so dataset .* needs "
                       "the tokenizer"):  # fmt: skip
        load_text(path)
    assert load_text(write_jsonl(tmp_path / "plain.jsonl", [{"text": "a"}])) == "a"  # text alone needs none


def test_a_failing_chat_template_names_the_record(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[0]}, {"messages": CHATS[0][1:]}])
    with pytest.raises(SqError, match=re.escape(f"dataset file {path}, line 2: field 'messages': the chat template "
                                                "failed (") + ".*conversations open with the user"):  # fmt: skip
        load_text(path, chat_tokenizer)


def test_bad_records_are_listed_together(tmp_path):
    records = [{"text": "ok"}] + [{"body": i} for i in range(12)]
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(SqError) as info:
        read_corpus(path)
    problems = info.value.problems
    assert problems[0] == f"dataset file {path}, line 2: no string field 'text' and no field 'messages'"
    assert len(problems) == 11 and problems[-1] == f"dataset file {path}: 2 more bad records"


def test_parquet_errors_name_file_row_and_field(tmp_path):
    pytest.importorskip("pyarrow")
    path = write_parquet(tmp_path / "rows.parquet", {"text": ["a", None, "c"]})
    with pytest.raises(SqError, match=re.escape(f"dataset file {path}, row 1: no string field 'text' and no field "
                                                "'messages'")):  # fmt: skip
        read_corpus(path)
    path = write_parquet(tmp_path / "cols.parquet", {"body": ["a"], "id": [1]})
    with pytest.raises(SqError, match=re.escape(f"dataset file {path}: no column 'text' or 'messages' (columns: "
                                                "body, id)")):  # fmt: skip
        read_corpus(path)
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(SqError, match="junk.parquet: not a readable parquet file"):
        read_corpus(str(tmp_path / "junk.parquet"))


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # an import of it now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(SqError, match=r"d.parquet: reading .parquet needs pyarrow \(pip install 'sq\[data\]'"):
        read_corpus(str(tmp_path / "d.parquet"))


@pytest.mark.parametrize(
    "spec,call",
    [("org/calib", ("org/calib", None, "train")), ("org/calib:validation", ("org/calib", None, "validation")),
     ("org/calib:en:train[:10]", ("org/calib", "en", "train[:10]")), ("org/calib:train[:50%]", ("org/calib", None, "train[:50%]"))],
)  # fmt: skip
def test_hub_dataset_specs(monkeypatch, spec, call):
    calls = fake_datasets(monkeypatch, rows=[{"text": "a"}, {"text": "b"}])
    assert load_text(spec) == "a\n\nb"
    assert calls == [call]


def test_hub_dataset_without_the_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(SqError, match=r"dataset 'org/calib': no such file here, and reading it as a Hugging Face hub "
                       r"dataset needs the datasets package \(pip install datasets\); or save it as a local .jsonl"):  # fmt: skip
        read_corpus("org/calib")


@pytest.mark.parametrize("offline", [False, True])
def test_unreachable_hub_dataset(monkeypatch, offline):
    import sq.hub

    monkeypatch.setattr(sq.hub, "hub_offline", lambda: offline)
    fake_datasets(monkeypatch, error=ConnectionError("Couldn't reach 'org/calib' on the Hub"))
    off = " while downloads are off (HF_HUB_OFFLINE=1)" if offline else ""
    with pytest.raises(SqError) as info:
        read_corpus("org/calib:test")
    assert str(info.value) == (
        f"hub dataset 'org/calib' (split 'test'): cannot load it{off} (ConnectionError: Couldn't reach 'org/calib' "
        "on the Hub); save it as a local .jsonl or .parquet file with a 'text' or 'messages' field and pass that "
        "path instead")


def test_hub_dataset_needs_a_text_or_messages_column(monkeypatch):
    fake_datasets(monkeypatch, rows=[{"prompt": "x", "id": 1}])
    with pytest.raises(SqError, match=r"hub dataset 'org/calib' \(en, split 'train'\): no column 'text' or "
                       r"'messages' \(columns: prompt, id\)"):  # fmt: skip
        read_corpus("org/calib:en:train")


def test_packing_rule_on_a_multi_record_corpus(tmp_path, tokenizer):
    """Records joined by a blank line; calibration windows consecutive from the start, eval from the end."""
    pydoc = builtin_pydoc_text()
    texts = [pydoc[i * 700:(i + 1) * 700] for i in range(8)]
    text = load_text(write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts]))
    assert text == "\n\n".join(texts)
    tokens = tokenize_corpus(tokenizer, text)
    n, seqlen, nsamples, nwindows = tokens.numel(), 48, 5, 3
    assert (nsamples + nwindows) * seqlen <= n
    calib = calibration_windows(tokens, nsamples, seqlen)
    evals = eval_windows(tokens, nwindows, seqlen)
    for i in range(nsamples):
        assert torch.equal(calib[i], tokens[i * seqlen:(i + 1) * seqlen])
    assert torch.equal(evals.reshape(-1), tokens[n - nwindows * seqlen:])
    assert nsamples * seqlen <= n - nwindows * seqlen  # disjoint token ranges: calibration never scores itself


def _read_on_rank0_only(rank, world, good, bad):
    import sq.calib.data

    if rank != 0:  # only rank 0 may read: any read elsewhere fails this rank
        sq.calib.data.read_corpus = lambda spec: (_ for _ in ()).throw(AssertionError(f"rank {rank} read {spec}"))
    text = read_corpus_dist(good, poll_s=0.05).text()
    try:
        read_corpus_dist(bad, poll_s=0.05)
    except SqError as e:
        return text, type(e).__name__, e.problems
    return text, None, None


def test_read_corpus_dist_reads_on_rank0_and_shares(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "one"}, {"text": "two"}])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "one"}, {"body": "two"}])
    results = run_ranks(_read_on_rank0_only, 2, good, bad, timeout=120)
    expected = ("one\n\ntwo", "SqError", [f"dataset file {bad}, line 2: no string field 'text' and no field 'messages'"])
    assert results == [expected, expected]


def test_eval_cli_scores_chat_and_parquet_datasets(tmp_path, llama_ckpt, capsys):
    """``python -m sq.eval --dataset`` takes the new formats; chat records use the model's own template."""
    pytest.importorskip("pyarrow")
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sq.eval import main, perplexity

    model_dir = tmp_path / "model"
    shutil.copytree(llama_ckpt, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(model_dir)
    pydoc = builtin_pydoc_text()
    chats = [[{"role": "user", "content": pydoc[i * 400:(i + 1) * 400]},
              {"role": "assistant", "content": pydoc[(i + 1) * 400:(i + 2) * 400]}] for i in range(0, 16, 2)]  # fmt: skip
    expected_text = "\n\n".join(rendered(c) for c in chats)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = perplexity(model, eval_windows(tokenize_corpus(tok, expected_text), 3, 32))
    for spec in (write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in chats]),
                 write_parquet(tmp_path / "chats.parquet", {"messages": chats})):  # fmt: skip
        assert main(["--model", str(model_dir), "--dataset", spec, "--seqlen", "32", "--nwindows", "3"]) == 0
        assert capsys.readouterr().out.splitlines()[0] == f"perplexity: {expected:.2f}"
    # the fixture's own tokenizer has no template: refused before the model loads, naming the record
    assert main(["--model", str(llama_ckpt), "--dataset", str(tmp_path / "chats.jsonl")]) == 2
    assert capsys.readouterr().err.startswith(f"sq: error: dataset file {tmp_path / 'chats.jsonl'}, line 1: "
                                              "field 'messages' needs a chat template")
