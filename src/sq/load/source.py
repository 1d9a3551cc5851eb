"""What a checkpoint folder holds: config, index, safetensors headers.

Everything here is read from file headers only (a few KB per file), identically on every
rank, so refusals decided from it are the same everywhere.  No tensor data is touched and
nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sq.errors import LoadRefused, SqError
from sq.files import INDEX_NAME, SIDE_FILES

# huggingface_hub names a blob by its etag: the git blob sha1 (40 hex) or the LFS sha256 (64 hex)
_HUB_BLOB_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the checkpoint as its header describes it."""

    key: str
    file: str  # file name relative to the checkpoint folder
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # byte range inside the file's data section

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


@dataclass
class CheckpointSource:
    """A checkpoint folder scanned from headers; ``problems`` lists every file-level refusal."""

    root: Path
    config: dict
    tensors: dict[str, TensorInfo]
    files: list[str]
    problems: list[str] = field(default_factory=list)
    # a file that is an accepted link (hub-cache blob, or inside the folder) -> the target checked
    # at scan time: every later read opens that, not the link again
    targets: dict[str, Path] = field(default_factory=dict)
    # weight files the checkpoint names that could not be read (missing, a folder, a torn header):
    # named once in ``problems``; the model tensors they would fill are not listed one by one
    unreadable: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def path(self, file: str) -> Path:
        return self.targets.get(file, self.root / file)


def _short(value, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a hostile header's values can be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_count(value) -> bool:
    """A JSON non-negative integer (``true`` and ``4.0`` are not), as safetensors' ``usize``."""
    return type(value) is int and value >= 0


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise ValueError(f"key {_short(dup)} appears twice")
    return dict(pairs)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _entry_problem(info) -> str | None:
    """Why one tensor's header entry is malformed (field types), or None."""
    if not isinstance(info, dict):
        return f"is a JSON {type(info).__name__} ({_short(info)}), not an object with dtype, shape and data_offsets"
    missing = [f for f in ("dtype", "shape", "data_offsets") if f not in info]
    if missing:
        return f"has no {' and no '.join(missing)}"
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        return f"has dtype {_short(dtype)}, not a string"
    if dtype not in ST_DTYPES:
        return f"has unknown dtype {_short(dtype)} (sq reads {', '.join(ST_DTYPES)})"
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        return f"has shape {_short(shape)}, not a list of non-negative integers"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        return f"has data_offsets {_short(offsets)}, not a list of two non-negative integers [begin, end]"
    return None


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """Return (header dict, data start offset); raise ValueError on a torn or corrupt header.

    Everything safetensors itself requires is checked, so a header accepted here never fails
    later inside DCP's reader: UTF-8 JSON without duplicate keys or NaN, a ``__metadata__`` of
    strings, every entry's field types, known dtypes, sizes matching shapes, and data offsets
    that tile the data section exactly (no overlap, no gap, nothing after the last tensor).
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"file is {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ValueError(f"header length {n} does not fit in the file ({size} bytes): truncated or not safetensors")
        blob = f.read(n)
    try:
        header = json.loads(blob.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
        json.dumps(header, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape (\ud800) is no text
    except (UnicodeError, ValueError, RecursionError) as e:
        raise ValueError(f"header is not valid UTF-8 JSON ({e.__class__.__name__}: {_short(str(e), 120)}): "
                         "corrupt") from None
    if not isinstance(header, dict):
        raise ValueError(f"header is a JSON {type(header).__name__}, not an object: corrupt")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError(f"__metadata__ {_short(meta)} is not an object of strings: corrupt")
    data_len = size - 8 - n
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        problem = _entry_problem(info)
        if problem is not None:
            raise ValueError(f"tensor {_short(key, 200)} {problem}: corrupt")
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        if end > data_len:
            raise ValueError(f"tensor {_short(key, 200)} data [{begin}, {end}) lies past the end of the data "
                             f"({data_len} bytes): truncated")
        if begin > end:
            raise ValueError(f"tensor {_short(key, 200)} has data_offsets [{begin}, {end}) that end before they "
                             "begin: corrupt")
        numel = 1
        for s in shape:
            numel *= s
        if numel * ST_DTYPES[dtype].itemsize != end - begin:
            raise ValueError(f"tensor {_short(key, 200)} shape {_short(shape)} {dtype} does not match its "
                             f"{end - begin} bytes: corrupt")
        spans.append((begin, end, key))
    at, last = 0, None
    for begin, end, key in sorted(spans):
        if begin < at:
            raise ValueError(f"tensors {_short(last[2], 200)} [{last[0]}, {last[1]}) and {_short(key, 200)} "
                             f"[{begin}, {end}) overlap: corrupt")
        if begin > at:
            raise ValueError(f"bytes [{at}, {begin}) of the data, before tensor {_short(key, 200)}, belong to no "
                             "tensor: corrupt (safetensors refuses such a file)")
        at, last = end, (begin, end, key)
    if at != data_len:
        raise ValueError(f"{data_len - at} bytes after the last tensor's data belong to no tensor: corrupt or "
                         "not a safetensors file")
    return header, 8 + n


def _under(folder: Path, path: Path) -> bool:
    return path.parent == folder or folder in path.parents


def _hub_blob(real_root: Path, target: Path) -> bool:
    """Whether ``target`` (resolved) is a blob of the hub-cache repo whose snapshot ``real_root`` is.

    huggingface_hub lays a cached repo out as ``models--ORG--NAME/snapshots/REV/FILE`` ->
    ``../../blobs/HASH``: the folder ``blobs`` next to ``snapshots`` (a real folder, not a
    link), a regular file named by its sha1 / sha256.  Nothing else is accepted.
    """
    snapshots = real_root.parent
    repo = snapshots.parent
    blobs = repo / "blobs"
    return (snapshots.name == "snapshots" and repo.name.startswith("models--") and target.parent == blobs
            and not blobs.is_symlink() and _HUB_BLOB_NAME.fullmatch(target.name) is not None)


def _allowed_target(real_root: Path, target: Path) -> bool:
    return _under(real_root, target) or _hub_blob(real_root, target)


def link_problem(root: str | os.PathLike, name: str) -> str | None:
    """Why ``root/name`` must not be read, or None: sq reads no link that leaves the checkpoint folder.

    A plain file (or a missing one) is fine; so is a symbolic link whose target resolves inside
    ``root`` (its content is part of the folder the user handed over), and a Hugging Face hub-cache
    link ``snapshots/REV/FILE -> ../../blobs/HASH`` (:func:`_hub_blob`).  Any other link (to
    ``/etc/passwd``, a private key, another repo's blob, a dangling target outside) is refused, so
    its content never reaches the output the user publishes.
    """
    path = Path(root) / name
    if not path.is_symlink():
        return None
    real_root = Path(root).resolve()
    target = path.resolve()
    if _allowed_target(real_root, target):
        if target.exists() and not stat.S_ISREG(target.stat().st_mode):
            return f"{path} is a symbolic link to {target}, which is not a regular file: refused"
        return None
    hub = " (nor a Hugging Face cache blob of this snapshot)" if real_root.parent.name == "snapshots" else ""
    return (f"{path} is a symbolic link to {target}, outside the checkpoint folder {real_root}{hub}: refused, "
            f"so that file's content cannot leak into the output; copy the file into the folder instead of linking it")


def link_problems(root: str | os.PathLike, names) -> dict[str, str]:
    """``{name: problem}`` for each of ``names`` in ``root`` that :func:`link_problem` refuses."""
    out = {}
    for name in names:
        problem = link_problem(root, name)
        if problem is not None:
            out[name] = problem
    return out


def checkpoint_link_problems(root: str | os.PathLike) -> dict[str, str]:
    """:func:`link_problems` of every file sq (or transformers for it) reads from a checkpoint folder:
    config.json, the index, every ``*.safetensors`` in it (DCP's reader lists them all), SIDE_FILES."""
    root = Path(root)
    weights = sorted(p.name for p in root.iterdir() if p.name.endswith(".safetensors"))
    return link_problems(root, dict.fromkeys(["config.json", INDEX_NAME, *weights, *SIDE_FILES]))


def open_checked(root: str | os.PathLike, name: str):
    """``root/name`` opened for reading (binary) under :func:`link_problem`'s rule, checked at open time.

    The link is resolved and checked, then its target opened with ``O_NOFOLLOW``, and the file
    actually opened (``/proc/self/fd``) is checked again: a link swapped in between the check and
    the open is refused, never followed.

    Raises:
        SqError: naming the file and where it points.
    """
    root = Path(root)
    path = root / name
    problem = link_problem(root, name)
    if problem is not None:
        raise SqError(problem)
    target = path.resolve() if path.is_symlink() else path
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == 40:  # ELOOP: the final component became a link after the check
            raise SqError(f"{path} changed into a symbolic link while sq was reading it: refused") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SqError(f"{path} is not a regular file: refused")
        proc = Path(f"/proc/self/fd/{fd}")
        if proc.is_symlink():
            opened = Path(os.readlink(proc))
            if not _allowed_target(root.resolve(), opened):
                raise SqError(f"{path} was opened as {opened}, outside the checkpoint folder {root.resolve()} "
                              "(a link changed while sq was reading it): refused")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_checked(root: str | os.PathLike, name: str) -> bytes:
    """The bytes of ``root/name``, opened by :func:`open_checked`."""
    with open_checked(root, name) as f:
        return f.read()


def read_config(root: str | os.PathLike) -> dict:
    """``root/config.json`` as a JSON object, read under :func:`open_checked`'s link rule.

    Raises:
        LoadRefused: naming the file: the folder or the file is missing, the file is a folder or
            a link sq refuses, it is not UTF-8 JSON, not an object, or its ``auto_map`` is not one.
    """
    root = Path(root)
    path = root / "config.json"
    if not root.is_dir():
        raise LoadRefused(f"checkpoint folder {root} does not exist or is not a folder")
    if not os.path.lexists(path):
        raise LoadRefused(f"{path} is missing: every Hugging Face checkpoint needs a config.json")
    if path.is_dir():
        raise LoadRefused(f"{path} is a folder, not a file: every Hugging Face checkpoint needs a config.json file")
    try:
        text = read_checked(root, "config.json").decode("utf-8")
        config = json.loads(text)
    except SqError as e:
        raise LoadRefused(e.problems) from None
    except UnicodeDecodeError as e:
        raise LoadRefused(f"{path} is not UTF-8 text (byte {e.start}): not a config.json") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer of more than 4300 digits
        raise LoadRefused(f"{path} is not valid JSON ({_short(str(e), 160)})") from None
    except OSError as e:
        raise LoadRefused(f"{path} cannot be read ({e.strerror or e})") from None
    if not isinstance(config, dict):
        raise LoadRefused(f"{path} is a JSON {type(config).__name__}, not a JSON object: not a config.json")
    if "auto_map" in config and not isinstance(config["auto_map"], (dict, type(None))):
        raise LoadRefused(f"{path} has auto_map {_short(config['auto_map'])}, not an object of class names")
    return config


def read_index(root: str | os.PathLike) -> tuple[dict[str, str], list[str]]:
    """``(weight_map, problems)`` of ``root/model.safetensors.index.json``; ``({}, problems)`` if it is unusable.

    The index must be a JSON object whose ``weight_map`` maps tensor names to plain
    ``.safetensors`` file names (strings, no NUL byte, at most 255 bytes).  Where they lead
    (outside the folder, missing files, links) is checked by the caller.
    """
    root = Path(root)
    path = root / INDEX_NAME
    try:
        index = json.loads(read_checked(root, INDEX_NAME).decode("utf-8"))
    except SqError as e:
        return {}, e.problems
    except UnicodeDecodeError as e:
        return {}, [f"{path} is not UTF-8 text (byte {e.start}): not a safetensors index"]
    except (ValueError, RecursionError) as e:
        return {}, [f"{path} is not valid JSON ({_short(str(e), 160)}): not a safetensors index"]
    except OSError as e:
        return {}, [f"{path} cannot be read ({e.strerror or e})"]
    if not isinstance(index, dict):
        return {}, [f"{path} is a JSON {type(index).__name__}, not a JSON object with a 'weight_map': "
                    "not a safetensors index"]
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        what = "has no 'weight_map'" if weight_map is None else f"has a weight_map that is a JSON {type(weight_map).__name__}"
        return {}, [f"{path} {what}, not an object of tensor name -> file name: not a safetensors index"]
    bad = []
    for key, name in weight_map.items():
        if not isinstance(name, str):
            bad.append(f"{path}: weight_map[{_short(key, 200)}] is {_short(name)}, not a file name")
        elif "\x00" in name:
            bad.append(f"{path}: weight_map[{_short(key, 200)}] names {_short(name)}, a file name with a NUL byte: "
                       "refused")
        elif len(name.encode("utf-8", "surrogatepass")) > 255:
            bad.append(f"{path}: weight_map[{_short(key, 200)}] names {_short(name)}, a file name longer than 255 "
                       "bytes: refused")
        elif not name.endswith(".safetensors") and "/" not in name and "\\" not in name:
            bad.append(f"{path}: weight_map[{_short(key, 200)}] names {_short(name)}, not a .safetensors file")
        if len(bad) >= 5:
            break
    return ({}, bad) if bad else (weight_map, [])


def _not_a_file(path: Path) -> str:
    """What is at ``path`` instead of a readable regular file, for a message: 'is missing', 'is a folder'..."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a name no file can have (NUL, lone surrogate)
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISDIR(mode):
        return "is a folder, not a file: put the safetensors file itself there"
    return "is not a regular file (a device, pipe or socket): put the safetensors file itself there"


def scan_checkpoint(root: str | os.PathLike) -> CheckpointSource:
    """Read config, index and every listed header; collect file-level problems (never raise on them)."""
    root = Path(root)
    problems: list[str] = []
    config: dict = {}
    if not root.is_dir():
        return CheckpointSource(root, {}, {}, [], [f"checkpoint folder {root} does not exist or is not a folder"])
    refused = checkpoint_link_problems(root)  # first: a refused file is named and never opened
    problems += refused.values()
    if "config.json" in refused:
        pass  # named above
    else:
        try:
            config = read_config(root)  # missing, a folder, not UTF-8 JSON, not an object: named
        except SqError as e:
            problems += e.problems

    present = sorted(p.name for p in root.iterdir() if p.is_file() and p.name.endswith(".safetensors"))
    index_path = root / INDEX_NAME
    files: list[str] = []
    lost: set[str] = set()  # shard files named but not readable: their keys are not reported one by one
    weight_map: dict[str, str] = {}
    if INDEX_NAME in refused:
        pass  # named above; its shards are not read either
    elif index_path.is_file():
        weight_map, index_problems = read_index(root)  # a bad index is named; the files present are still read
        problems += index_problems
        listed = sorted(set(weight_map.values())) if not index_problems else present
        for name in listed:
            if os.path.isabs(name) or "/" in name or "\\" in name or name in ("", ".", ".."):
                problems.append(f"{INDEX_NAME} names {name!r}, a path outside the checkpoint folder {root}: refused")
            elif name in refused or (link := link_problem(root, name)) is not None:
                if name not in refused:
                    problems.append(link)
            elif not (root / name).is_file():
                keys = sorted(k for k, v in weight_map.items() if v == name)
                problems.append(f"{INDEX_NAME} names {name!r} (e.g. key {keys[0]!r}, {len(keys)} keys) but "
                                f"{root / name} {_not_a_file(root / name)}")
                lost.add(name)
            else:
                files.append(name)
        stray = sorted(set(present) - set(listed))
        odd = sorted(p.name for p in root.iterdir() if p.name.endswith(".safetensors") and p.name not in listed
                     and not p.is_symlink() and not p.is_file())
        for name in odd:
            problems.append(f"{root / name} is not listed in {INDEX_NAME} and is not a file; torch's "
                            "HuggingFaceStorageReader reads every *.safetensors in the folder, so move it out")
        if stray:
            problems.append(
                f"{', '.join(stray)} in {root} {'is' if len(stray) == 1 else 'are'} not listed in {INDEX_NAME}; "
                "torch's HuggingFaceStorageReader reads every *.safetensors in the folder, so move it out")
    elif present:
        files = [n for n in present if n not in refused]
        if len(present) > 1:
            problems.append(f"{root} has {len(present)} safetensors files but no {INDEX_NAME}")
    elif odd := sorted(p.name for p in root.iterdir() if p.name.endswith(".safetensors") and not p.is_symlink()):
        problems += [f"{root / name} {_not_a_file(root / name)} (the checkpoint has no {INDEX_NAME}, so this would "
                     "be its weights)" for name in odd]
        lost.update(odd)
    else:
        pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        if pickles:
            problems.append(
                f"{root} holds only pickle checkpoints ({', '.join(pickles[:3])}); sq reads safetensors only "
                "because unpickling can run arbitrary code. Convert them to safetensors first")
        else:
            problems.append(f"{root} has no *.safetensors files")

    tensors: dict[str, TensorInfo] = {}
    unread: set[str] = set()
    unlisted: list[str] = []  # tensors a listed file holds that the index does not name
    targets = {n: (root / n).resolve() for n in files if (root / n).is_symlink()}  # checked above
    for name in files:
        try:
            header, _ = read_safetensors_header(targets.get(name, root / name))
        except (ValueError, OSError) as e:
            problems.append(f"{root / name}: {e}")
            unread.add(name)  # named once: its keys are not listed again as missing from it
            continue
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if key in tensors:
                problems.append(f"tensor {_short(key, 200)} is stored twice: in {tensors[key].file} and {name}")
                continue
            if weight_map and key not in weight_map:
                # a listed file holds a tensor the index forgot: transformers loads it from there (it reads
                # the listed files whole), and so does sq: the file's header says where it is
                unlisted.append(f"{key} ({name})")
            elif weight_map and weight_map.get(key) != name:
                problems.append(f"tensor {_short(key, 200)} is in {name} but {INDEX_NAME} puts it in "
                                f"{_short(weight_map.get(key), 200)}")
            tensors[key] = TensorInfo(key, name, ST_DTYPES[info["dtype"]], tuple(info["shape"]),
                                      tuple(info["data_offsets"]))
    if unlisted:
        logging.getLogger(__name__).warning(
            "%s does not list %d tensor(s) its listed files hold (read from those files, as transformers does): %s",
            INDEX_NAME, len(unlisted), ", ".join(unlisted[:3]) + (" ..." if len(unlisted) > 3 else ""))
    for key, name in weight_map.items():
        if key not in tensors and name in files and name not in unread:
            problems.append(f"{INDEX_NAME} lists {_short(key, 200)} in {name} but that file does not hold it")
    return CheckpointSource(root, config, tensors, files, problems, targets, sorted(lost | unread))
