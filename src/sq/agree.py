"""Every rank acts on the same job, or none acts: the agreement steps before anything is written.

A distributed run can go wrong in ways one process cannot: a node-local copy of the checkpoint that
differs (another ``config.json``, another shard), a Python API call with other arguments on one rank,
another tokenizer, another sq or transformers version.  Unchecked, the ranks write shards that
disagree with each other and with ``config.json`` (exit 0, an output that matches neither copy), or
fall out of step in their collectives and hang until the process-group timeout.

:func:`agree` compares a nested dict of facts across the ranks in one small collective (a digest per
rank); only where the digests differ does a second one gather each field's digest and value, so
the ``SqError`` every rank raises names each differing field, the ranks that differ from rank 0 and
both values where they are short.  Two steps use it:

- ``arguments`` first, before any collective that depends on them (which data to read, which
  algorithm runs): the resolved job settings, the output path (absolute), the world layout;
- ``job`` before the output folder is claimed: the resume signature (the source's ``config.json``,
  index, shard sizes and every tensor header; the algorithm's settings; the module -> scheme
  assignment; the calibration text; the software versions) and the calibration token ids.  A
  shard's modification time is not compared (node-local copies are made at different times), a
  sampled digest of its content is (:func:`content_hashes`: a few small blocks of every tensor, at
  offsets every rank takes from the same header); ``--verify-source content`` hashes every shard
  whole (docs/resume.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import torch.distributed as dist

from sq.errors import SqError

# a differing value is printed when its JSON is at most this long, else named by its digest
_SHOW = 120


def _canon(value) -> str:
    return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))


def flatten(facts: dict, prefix: str = "") -> dict[str, str]:
    """Dotted field name -> canonical JSON of its value (nested dicts become fields)."""
    out = {}
    for k in sorted(facts, key=str):
        v = facts[k]
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = _canon(v)
    return out


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _show(value: str | None) -> str:
    if value is None:
        return "absent"
    return value if len(value) <= _SHOW else f"sha256 {_digest(value)[:12]}"


def agree(facts: dict, what: str, *, limit: int = 6) -> None:
    """Raise the same ``SqError`` on every rank unless every rank passed the same ``facts``.

    A collective: every rank must call it at the same point.  One ``all_gather_object`` of a
    64-character digest when the ranks agree; a second, of every field's value, only when not."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    flat = flatten(facts)
    mine = _digest(_canon(flat))
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, mine)
    if len(set(digests)) == 1:
        return
    # every rank saw the same digests, so every rank takes this branch: the second collective is safe
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, flat)
    ref = views[0]
    fields = sorted(set().union(*views), key=lambda f: (f not in ref, f))
    problems = []
    for field in fields:
        differ = [r for r, v in enumerate(views) if v.get(field) != ref.get(field)]
        if not differ:
            continue
        r = differ[0]
        others = f"rank(s) {differ}" if len(differ) <= 8 else f"{len(differ)} ranks (first {differ[:8]})"
        problems.append(f"the ranks disagree on {what} field {field!r}: rank 0 has {_show(ref.get(field))}, "
                        f"{others} {'have' if len(differ) > 1 else 'has'} {_show(views[r].get(field))}")
    if len(problems) > limit:
        problems = problems[:limit] + [f"... and {len(problems) - limit} more {what} fields differ"]
    problems.append("every rank must run the same job on the same inputs (the same command, checkpoint copy, "
                    "tokenizer and software versions); nothing was written")
    raise SqError(problems)


def argument_facts(cfg, *, skip: tuple[str, ...] = ("model", "fault")) -> dict:
    """A job's resolved arguments as agreement facts: the dataclass fields but ``skip`` (the model's
    path may differ between nodes holding the same copy: its content is compared later), the
    output path made absolute, and the world size."""
    facts = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}
    facts["output"] = os.path.abspath(str(cfg.output))
    facts["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
    return facts


def job_facts(sig: dict, **extra) -> dict:
    """The resume signature as agreement facts: shard modification times left out (node-local
    copies are made at different times; sizes, headers and config still count)."""
    facts = json.loads(_canon(sig))
    for entry in (facts.get("source", {}).get("files") or {}).values():
        if isinstance(entry, dict):
            entry.pop("mtime_ns", None)
    return {**facts, **extra}


def _node_share() -> tuple[int, int]:
    """(this rank's index among the ranks of its node, how many there are): torchrun's LOCAL_RANK /
    LOCAL_WORLD_SIZE; one rank per node without them."""
    try:
        return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return 0, 1


# the sampled digest (the default, ``--verify-source stat``): per tensor, SAMPLES blocks of SAMPLE_BYTES (its
# start, middle and end; a smaller tensor whole), so a tensor rewritten at the same shape is seen for ~1 KiB of
# reads per tensor (~90 MiB for DeepSeek-V3's 91k tensors, split over each node's ranks)
SAMPLES, SAMPLE_BYTES = 3, 256


def _sample_ranges(tensors, data_start: int) -> list[tuple[int, int]]:
    """The (offset, length) ranges the sampled digest reads of the file holding ``tensors``: the same on every
    rank (from the header), in file order."""
    out = []
    for t in sorted(tensors, key=lambda t: t.offsets):
        begin, end = data_start + t.offsets[0], data_start + t.offsets[1]
        if end - begin <= SAMPLES * SAMPLE_BYTES:
            out.append((begin, end - begin))
            continue
        for at in (begin, (begin + end - SAMPLE_BYTES) // 2, end - SAMPLE_BYTES):
            out.append((at, SAMPLE_BYTES))
    return out


def _hash_file(fh, tensors, chunk: int) -> str:
    """``fh``'s SHA-256, or with ``tensors`` (its header's entries) that of :func:`_sample_ranges`' blocks."""
    h = hashlib.sha256()
    if tensors is None:
        while block := fh.read(chunk):
            h.update(block)
        return h.hexdigest()
    head = fh.read(8)
    if len(head) < 8:
        return h.hexdigest()
    data_start = 8 + int.from_bytes(head, "little")
    fd = fh.fileno()
    for at, n in _sample_ranges(tensors, data_start):
        h.update(os.pread(fd, n, at))
    return h.hexdigest()


def content_hashes(source, chunk: int = 1 << 24, *, sampled: bool = False) -> dict[str, str]:
    """Every shard's SHA-256 (``--verify-source content``), or with ``sampled`` the SHA-256 of a few blocks of
    each of its tensors (the default: ``SAMPLES`` x ``SAMPLE_BYTES`` per tensor, at offsets from the header):
    the same dict on every rank (a collective).

    Each node reads its copy once (its ranks split the shards), so node-local copies are each hashed
    and compared: a shard whose bytes differ between nodes is refused, naming it and the ranks."""
    from sq.load.source import open_checked

    local, local_world = _node_share()
    mine, failed = {}, []
    by_file: dict[str, list] = {}
    if sampled:  # each file's tensors, grouped once
        for t in source.tensors.values():
            by_file.setdefault(t.file, []).append(t)
    for i, f in enumerate(sorted(source.files)):
        if i % local_world == local:
            try:
                with open_checked(source.root, f) as fh:
                    digest = _hash_file(fh, by_file.get(f, []) if sampled else None, chunk)
            except SqError as e:
                failed += e.problems
                continue
            except OSError as e:
                failed.append(f"{source.root / f}: cannot read it to hash it ({e.strerror or e})")
                continue
            mine[f] = digest
    views = [(mine, failed)]
    if dist.is_initialized() and dist.get_world_size() > 1:  # a read error is gathered, then raised everywhere
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, (mine, failed))
    hashes: dict[str, str] = {}
    seen: dict[str, dict[str, list[int]]] = {}
    problems = []
    for r, (view, errors) in enumerate(views):
        problems += [f"rank {r}: {e}" for e in errors]
        for f, h in view.items():
            seen.setdefault(f, {}).setdefault(h, []).append(r)
            hashes.setdefault(f, h)
    what = "sampled bytes (a few blocks of every tensor)" if sampled else "bytes"
    problems += [f"{source.root / f}: its {what} differ between ranks ("
                + "; ".join(f"rank(s) {ranks}: sha256 {h[:12]}" for h, ranks in by_hash.items())
                + "): every node must hold the same checkpoint copy"
                for f, by_hash in sorted(seen.items()) if len(by_hash) > 1]
    if problems:
        raise SqError(problems)
    return hashes


def verified_identity(source, verify_source: str) -> dict:
    """The source's identity for the resume signature and the ranks' agreement (a collective): sizes, headers
    and a sampled content digest per shard (``stat``, the default), or every shard's SHA-256 (``content``)."""
    from sq.resume import source_identity

    if verify_source == "content":
        return source_identity(source, content_hashes(source))
    return source_identity(source, samples=content_hashes(source, sampled=True))
