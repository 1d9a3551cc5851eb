"""Fuzz: random type and field mutations of safetensors headers and index files (issue 15).

Each mutant damages one file of a copy of the Llama fixture (a shard's header, raw header
bytes, or the index), then runs the parsers in process: ``scan_checkpoint``, then
``plan_load`` on a skeleton built once.  The contract:

- the outcome is a refusal (``source.problems`` or an ``SqError``) or an accepted plan;
  any other exception fails the test, naming the mutant;
- an accepted plan only describes what safetensors itself reads back: every file the plan
  reads opens with ``safe_open``, every tensor with the dtype and shape sq recorded (so a
  header sq accepts cannot fail later inside DCP's reader);
- a mutant that safetensors reads back exactly like the original (same keys, dtypes, shapes;
  the same weight map) is accepted: sq refuses no valid checkpoint.

Mutant ``i`` is drawn from ``random.Random(f"{SEED}:{i}")`` alone, so any failure is reproduced
with ``SQ_FUZZ_SEED=<seed> SQ_FUZZ_ONLY=<i>``.  The run stops after ``SQ_FUZZ_SECONDS`` (10 s)
or ``SQ_FUZZ_MUTANTS`` (2000) mutants, whichever comes first.  A few mutants also go through
the real command line at 2 ranks (``hostile.run_hostile``).
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch

from ckpt_edit import read_header, write_header
from hostile import Hostile, run_hostile
from sq.errors import SqError
from sq.files import INDEX_NAME
from sq.load.loader import plan_load
from sq.load.meta import build_skeleton
from sq.load.source import scan_checkpoint

SEED = int(os.environ.get("SQ_FUZZ_SEED", "1515"))
SECONDS = float(os.environ.get("SQ_FUZZ_SECONDS", "10"))
MUTANTS = int(os.environ.get("SQ_FUZZ_MUTANTS", "2000"))
ONLY = os.environ.get("SQ_FUZZ_ONLY")

DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2",
          "F8_E8M0", "U16", "U32", "U64", "F4", "C64", "f32", "", "F32 "]
ODD_VALUES = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, 10**30, -(10**30), 0.5, 1e308, "", "0", "F32",
              "ünïcødé", [], {}, [None], [[1, 2]], {"a": 1}, [0, 1, 2], ["0", "16"], [-16, 0], [1.0, 2.0],
              [True, False], "x" * 5000]
ODD_KEYS = ["", " ", "ünïcødé.weight", "模型.权重", "emoji😀", "a\nb", "a\x00b", "__metadata__x", "../x",
            "x" * 3000, "model.embed_tokens.weight\u200b", "\udc80x", "__metadata__"]
ODD_NAMES = ["", ".", "..", "../x.safetensors", "/etc/passwd", "model\x00.safetensors", "x" * 300 + ".safetensors",
             "ünïcødé.safetensors", "config.json", "tokenizer.json", "sub/model.safetensors", "C:\\x.safetensors",
             "model-00001-of-00005.safetensors ", "nope.safetensors", "model.safetensors.index.json",
             "\ud800.safetensors", "model-00001-of-00005.safetensors/.", "~/x.safetensors"]


# ----------------------------------------------------------------------------- mutations

def _entries(h: dict) -> list[str]:
    return sorted(k for k in h if k != "__metadata__")


def _m_field_type(rng, h):
    key = rng.choice(_entries(h))
    field = rng.choice(["dtype", "shape", "data_offsets"])
    h[key][field] = copy.deepcopy(rng.choice(ODD_VALUES))
    return f"{key}.{field} = odd value"


def _m_drop_field(rng, h):
    key = rng.choice(_entries(h))
    field = rng.choice(["dtype", "shape", "data_offsets"])
    del h[key][field]
    return f"{key}: drop {field}"


def _m_entry_type(rng, h):
    key = rng.choice(_entries(h))
    h[key] = copy.deepcopy(rng.choice(ODD_VALUES))
    return f"{key} = odd value"


def _m_drop_entry(rng, h):
    key = rng.choice(_entries(h))
    del h[key]
    return f"drop {key}"


def _m_offsets(rng, h):
    key = rng.choice(_entries(h))
    b, e = h[key]["data_offsets"]
    other = h[rng.choice(_entries(h))]["data_offsets"]
    h[key]["data_offsets"] = rng.choice([
        [e, b], [b + 1, e + 1], [b - 1, e - 1], [b, e + 1], [b, e - 1], [b + 2**64, e + 2**64],
        [0, e - b], list(other), [other[0], other[0] + e - b], [b, b], [e, e + (e - b)],
    ])
    return f"{key}.data_offsets moved"


def _m_swap_offsets(rng, h):
    """Two entries of the same byte size trade places: valid if they also share dtype and shape."""
    keys = _entries(h)
    size = {k: h[k]["data_offsets"][1] - h[k]["data_offsets"][0] for k in keys}
    pairs = [(a, b) for a in keys for b in keys if a < b and size[a] == size[b]]
    if not pairs:
        return "no pair to swap"
    a, b = rng.choice(pairs)
    h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    return f"swap offsets of {a} and {b}"


def _m_shape(rng, h):
    key = rng.choice(_entries(h))
    shape = list(h[key]["shape"])
    choice = rng.randrange(7)
    if choice == 0 and shape:
        shape[rng.randrange(len(shape))] *= -1
    elif choice == 1:
        shape = shape + [1]
    elif choice == 2:
        shape = list(reversed(shape))
    elif choice == 3 and shape:
        shape[0] = 10**30
    elif choice == 4:
        shape = [float(s) for s in shape]
    elif choice == 5:
        shape = [int(torch.tensor(shape).prod())] if shape else [1]
    else:
        shape = [True] * len(shape)
    h[key]["shape"] = shape
    return f"{key}.shape = {shape!r}"[:120]


def _m_dtype(rng, h):
    key = rng.choice(_entries(h))
    h[key]["dtype"] = rng.choice(DTYPES)
    return f"{key}.dtype = {h[key]['dtype']!r}"


def _m_rename(rng, h):
    key = rng.choice(_entries(h))
    new = rng.choice(ODD_KEYS)
    if new in h:
        return "rename onto an existing key"
    h[new] = h.pop(key)
    return f"rename {key} -> {new!r}"[:120]


def _m_metadata(rng, h):
    h["__metadata__"] = copy.deepcopy(rng.choice([None, {"format": "pt"}, {"x": "y"}, {}, [1], "pt",
                                                  {"format": 1}, {"format": None}, {"a": {"b": "c"}}]))
    return f"__metadata__ = {h['__metadata__']!r}"


def _m_extra_field(rng, h):
    key = rng.choice(_entries(h))
    h[key][rng.choice(["extra", "dtype2", "offsets", "ünï"])] = copy.deepcopy(rng.choice(ODD_VALUES[:20]))
    return f"{key}: extra field"


HEADER_MUTATIONS = [_m_field_type, _m_drop_field, _m_entry_type, _m_drop_entry, _m_offsets, _m_swap_offsets,
                    _m_shape, _m_dtype, _m_rename, _m_metadata, _m_extra_field]


def _raw_mutation(rng, header: dict, data: bytes) -> tuple[bytes, str]:
    """The whole file, damaged below the JSON level: length field, bytes, encoding, JSON grammar."""
    blob = json.dumps(header).encode()
    n = len(blob)
    choice = rng.randrange(12)
    if choice == 0:
        length = rng.choice([0, 1, n - 1, n + 1, n + 8, n + len(data), n + len(data) + 1, 2**63, 2**64 - 1,
                             100 * 1024 * 1024 + 1])
        return struct.pack("<Q", length) + blob + data, f"header length field {length} (real {n})"
    if choice == 1:
        cut = rng.randrange(0, 8 + n + len(data))
        return (struct.pack("<Q", n) + blob + data)[:cut], f"truncated to {cut} bytes"
    if choice == 2:
        extra = bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 64])))
        return struct.pack("<Q", n) + blob + data + extra, f"{len(extra)} bytes appended"
    if choice == 3:
        pos = rng.randrange(n)
        bad = blob[:pos] + bytes([rng.randrange(128, 256)]) + blob[pos + 1:]
        return struct.pack("<Q", n) + bad + data, f"non-UTF-8 byte at {pos} of the header"
    if choice == 4:
        pos = rng.randrange(n)
        bad = blob[:pos] + bytes([rng.choice(b'{}[]",:0 -')]) + blob[pos + 1:]
        return struct.pack("<Q", n) + bad + data, f"JSON byte flipped at {pos}"
    if choice == 5:
        bad = blob.replace(b"[0, ", b"[NaN, ", 1)
        return struct.pack("<Q", len(bad)) + bad + data, "NaN in data_offsets"
    if choice == 6:
        bad = blob[:-1] + b', "\\ud800x": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}'
        return struct.pack("<Q", len(bad)) + bad + data, "a key with a lone surrogate"
    if choice == 7:
        bad = blob[:-1] + b', "deep": ' + b"[" * 100000 + b"]" * 100000 + b"}"
        return struct.pack("<Q", len(bad)) + bad + data, "deeply nested value"
    if choice == 8:
        pad = b" " * rng.choice([1, 3, 8])
        return struct.pack("<Q", n + len(pad)) + blob + pad + data, "header padded with spaces (valid)"
    if choice == 9:
        bad = blob[:-1] + b', "__metadata__": {"format": "pt"}}'
        return struct.pack("<Q", len(bad)) + bad + data, "a duplicate key"
    if choice == 10:
        bad = json.dumps(rng.choice([[], "x", 1, None, [header]])).encode()
        return struct.pack("<Q", len(bad)) + bad + data, "header not an object"
    big = b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}'
    return struct.pack("<Q", len(big)) + big + data, "an integer of 5000 digits"


def _index_mutation(rng, index: dict, files: list[str]) -> tuple[object, str]:
    index = copy.deepcopy(index)
    wm = index["weight_map"]
    keys = sorted(wm)
    choice = rng.randrange(10)
    if choice == 0:
        return copy.deepcopy(rng.choice([[], [wm], "x", 0, None, sorted(wm.items())])), "index not an object"
    if choice == 1:
        index["weight_map"] = copy.deepcopy(rng.choice([None, [], sorted(wm.items()), "x", 1, {}]))
        return index, "weight_map replaced"
    if choice == 2:
        del index["weight_map"]
        return index, "no weight_map"
    if choice == 3:
        key = rng.choice(keys)
        wm[key] = copy.deepcopy(rng.choice(ODD_VALUES))
        return index, f"weight_map[{key}] = odd value"
    if choice == 4:
        key = rng.choice(keys)
        wm[key] = rng.choice(ODD_NAMES + files)
        return index, f"weight_map[{key}] = {wm[key]!r}"[:120]
    if choice == 5:
        key = rng.choice(keys)
        del wm[key]
        return index, f"weight_map drops {key}"
    if choice == 6:
        wm[rng.choice(ODD_KEYS)] = rng.choice(files)
        return index, "weight_map gains a key no file holds"
    if choice == 7:
        index["metadata"] = copy.deepcopy(rng.choice(ODD_VALUES))
        return index, "metadata = odd value (ignored: valid)"
    if choice == 8:
        index[rng.choice(["extra", "ünï", ""])] = copy.deepcopy(rng.choice(ODD_VALUES))
        return index, "extra top-level key (ignored: valid)"
    index["weight_map"] = dict(reversed(list(wm.items())))
    return index, "weight_map reordered (valid)"


# ----------------------------------------------------------------------------- oracle

def safetensors_view(folder: Path) -> dict[str, dict[str, tuple[str, tuple]]] | None:
    """``{file: {key: (dtype, shape)}}`` as safetensors itself reads every ``*.safetensors``; None if it refuses one."""
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                out[f.name] = {k: (str(st.get_slice(k).get_dtype()), tuple(st.get_slice(k).get_shape()))
                               for k in st.keys()}
        except Exception:  # noqa: BLE001 - any refusal by safetensors means "not a valid file"
            return None
    return out


def _index_map(folder: Path):
    try:
        return json.loads((folder / INDEX_NAME).read_text())["weight_map"]
    except Exception:  # noqa: BLE001
        return None


_ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def judge(folder: Path, model, original_view, original_map) -> str:
    """Run the parsers on ``folder`` and check the contract; returns 'refused' or 'accepted'."""
    source = scan_checkpoint(folder)
    outcome = "refused"
    if not source.problems:
        try:
            plan_load(model, source)
            outcome = "accepted"
        except SqError:
            pass
    view = safetensors_view(folder)
    if outcome == "accepted":
        assert view is not None, "sq accepted a file safetensors refuses"
        for key, t in source.tensors.items():
            assert view[t.file].get(key) == (_ST_NAMES[t.dtype], t.shape), \
                f"sq read {key} as {t.dtype} {t.shape}, safetensors as {view[t.file].get(key)}"
    elif view == original_view and _index_map(folder) == original_map:
        problems = source.problems or ["(plan_load refused)"]
        raise AssertionError(f"a valid checkpoint was refused: {problems[:3]}")
    return outcome


# ----------------------------------------------------------------------------- the test

@pytest.fixture(scope="module")
def fuzz_base(checkpoints, tmp_path_factory):
    folder = shutil.copytree(checkpoints["llama"], tmp_path_factory.mktemp("fuzz") / "ckpt")
    model = build_skeleton(folder, dtype=torch.float32)
    return Path(folder), model


def make_mutant(folder: Path, i: int, originals: dict[str, bytes]) -> tuple[str, str]:
    """Damage one file of ``folder`` as mutant ``i``; returns (file name, what was done)."""
    rng = random.Random(f"{SEED}:{i}")
    shards = sorted(n for n in originals if n.endswith(".safetensors"))
    kind = rng.choices(["header", "raw", "index"], weights=[6, 2, 3])[0]
    if kind == "index":
        index = json.loads(originals[INDEX_NAME])
        mutated, what = _index_mutation(rng, index, shards)
        if rng.random() < 0.3 and isinstance(mutated, dict) and isinstance(mutated.get("weight_map"), dict) \
                and mutated["weight_map"]:
            mutated, more = _index_mutation(rng, mutated, shards)
            what += f"; {more}"
        (folder / INDEX_NAME).write_text(json.dumps(mutated))
        return INDEX_NAME, what
    name = rng.choice(shards)
    path = folder / name
    header, data = read_header(path)
    if kind == "raw":
        raw, what = _raw_mutation(rng, header, data)
        path.write_bytes(raw)
        return name, what
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if not _entries(header) or any(not isinstance(header[k], dict) for k in _entries(header)):
            break
        try:
            done.append(rng.choice(HEADER_MUTATIONS)(rng, header))
        except (KeyError, TypeError, ValueError, IndexError):
            break  # a field an earlier mutation removed or retyped: one mutation is enough
    write_header(path, header, data)
    return name, "; ".join(done)


def test_fuzz_headers_and_index(fuzz_base):
    folder, model = fuzz_base
    names = [p.name for p in folder.iterdir() if p.name.endswith(".safetensors") or p.name == INDEX_NAME]
    originals = {n: (folder / n).read_bytes() for n in names}
    original_view, original_map = safetensors_view(folder), _index_map(folder)
    assert judge(folder, model, original_view, original_map) == "accepted"

    counts = {"accepted": 0, "refused": 0}
    indices = [int(ONLY)] if ONLY is not None else range(MUTANTS)
    deadline = time.monotonic() + SECONDS
    for i in indices:
        if time.monotonic() > deadline:
            break
        file, what = make_mutant(folder, i, originals)
        try:
            counts[judge(folder, model, original_view, original_map)] += 1
        except Exception as e:
            raise AssertionError(f"mutant {i} (SQ_FUZZ_SEED={SEED} SQ_FUZZ_ONLY={i}) of {file}: {what}: "
                                 f"{type(e).__name__}: {e}") from e
        finally:
            for n, raw in originals.items():
                (folder / n).write_bytes(raw)
    total = sum(counts.values())
    print(f"fuzz: {total} mutants (seed {SEED}): {counts}")
    assert total >= min(50, len(indices)), f"only {total} mutants ran in {SECONDS} s"
    assert counts["refused"] > 0


# ----------------------------------------------------------------------------- end to end

@pytest.mark.parametrize("seed_offset", [0, 1, 2, 3])
def test_fuzz_mutants_through_the_cli(seed_offset, checkpoints, tmp_path):
    """A refused mutant, seeded, through ``python -m sq.ptq`` at 2 ranks: the same refusal, cleanly, from every rank."""
    src = shutil.copytree(checkpoints["llama"], tmp_path / "ckpt")
    names = [p.name for p in src.iterdir() if p.name.endswith(".safetensors") or p.name == INDEX_NAME]
    originals = {n: (src / n).read_bytes() for n in names}
    for i in range(1000 * seed_offset, 1000 * seed_offset + 1000):  # the first mutant whose scan names its file
        file, what = make_mutant(src, i, originals)
        problems = scan_checkpoint(src).problems
        if problems and any(file in p for p in problems):
            break
        for n, raw in originals.items():
            (src / n).write_bytes(raw)
    else:
        pytest.fail("no refused mutant found")
    argv = ["--model", str(src), "--output", str(tmp_path / "out"), "--algo", "rtn"]
    run_hostile(Hostile(argv, re.escape(file), protect=[src, checkpoints["llama"]]), 2, tmp_path)
