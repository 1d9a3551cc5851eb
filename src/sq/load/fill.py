"""Fill this rank's shards of named model tensors through torch DCP's HuggingFaceStorageReader.

Each request reads one box of one checkpoint tensor straight into the box of this rank's local
shard it belongs to, so a rank reads only what it holds.  A box that is one contiguous byte range
of its file (a row slice of a row-major tensor: an FSDP row shard, a whole per-expert tensor, an
expert slice of a fused tensor) whose destination has the checkpoint's dtype is read with
``os.preadv`` into the shard (no mmap, no intermediate tensor), after ``POSIX_FADV_WILLNEED`` on
all of the call's ranges; any other box (a column slice, a dtype conversion, an FP8 weight) goes
through ``safe_open(...).get_slice``.  A tensor the key map sees in another form than its stored bytes
(an MXFP4 pair dequantized, a Hub tensor stored transposed) is a :class:`BoxTransform` the reader holds
by name: a box of it reads only the stored boxes it needs and writes the model's values.  The reader's
metadata comes from the headers scanned once at planning (not re-parsed per block), and the planner is
a small custom ``LoadPlanner`` whose read items are those boxes.  Every rank plans its own boxes, so
``dcp.load`` runs without collectives (``no_dist``); the caller agrees on errors (:func:`agree`).

``fill(..., map_files=True)`` (``load_sharded`` on CPU) reads nothing for a parameter whose whole
local shard is one such box: its shard becomes a view of a private, copy-on-write mapping of the
file (:meth:`SqStorageReader.file_view`), as transformers' loader hands back safetensors' mmapped
tensors.  The pages are read when first touched (after the same ``WILLNEED`` hint), never copied;
writing to the parameter copies only the written pages and never changes the file.
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct
import warnings
from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.futures import Future

from sq.errors import LoadRefused
from sq.load.keymap import Piece, swap_dims
from sq.load.source import CheckpointSource, TensorInfo, open_checked
from sq.parallel.fsdp import fsdp_param_groups

MAX_PREAD = 1 << 30  # bytes per preadv call (Linux moves at most ~2 GiB per call anyway)


def byte_range(info: TensorInfo, offsets, lengths) -> tuple[int, int] | None:
    """(offset in the file's data section, nbytes) of a box of a row-major tensor, or None if the
    box is not one contiguous range: every dimension after the last partial one is whole and every
    one before it has length 1 (``[r0:r1, :]``, ``[e, :, :]``, ``[e, i0:i1, :]``)."""
    shape, offsets, lengths = tuple(info.shape), tuple(offsets), tuple(lengths)
    if len(shape) != len(offsets) or len(shape) != len(lengths):
        return None
    if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)):
        return None
    last = max((i for i in range(len(shape)) if lengths[i] != shape[i]), default=-1)
    if any(lengths[i] != 1 for i in range(last)):
        return None
    first, stride, n = 0, 1, 1
    for i in range(len(shape) - 1, -1, -1):
        first += offsets[i] * stride
        stride *= shape[i]
        n *= lengths[i]
    size = info.dtype.itemsize
    return info.offsets[0] + first * size, n * size


def _coalesce(ranges) -> list[tuple[int, int]]:
    """Sorted (offset, nbytes) ranges, neighbours and overlaps merged."""
    out: list[list[int]] = []
    for off, n in sorted(ranges):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return [(o, n) for o, n in out]


def _will_need(fd: int, ranges) -> None:
    """Ask the kernel to read ``ranges`` (absolute offsets) ahead, asynchronously; a hint only."""
    if not hasattr(os, "posix_fadvise"):
        return
    for off, n in _coalesce(ranges):
        try:
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
        except OSError:
            return


def data_start(fd: int, path) -> int:
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise OSError(f"{path}: too short for a safetensors header (changed since it was scanned?)")
    return 8 + struct.unpack("<Q", raw)[0]


def pread_into(fd: int, buf: torch.Tensor, offset: int, path) -> None:
    """Fill the contiguous CPU tensor ``buf`` with the bytes at ``offset`` of ``fd``.  Raises
    ``EOFError`` where the file ends first (an I/O error stays an ``OSError``)."""
    mv = memoryview(buf.view(-1).view(torch.uint8).numpy())
    done, total = 0, len(mv)
    while done < total:
        got = os.preadv(fd, [mv[done:min(total, done + MAX_PREAD)]], offset + done)
        if got <= 0:
            raise EOFError(f"{path}: {total - done} bytes missing at offset {offset + done} (the file is shorter "
                          "than its header says: truncated since it was scanned?)")
        done += got


class ReadFiles:
    """The files one read call opens, each once, all closed by ``stack`` on every path: raw descriptors
    for ``preadv`` (under the link rule, :func:`open_checked`) and safetensors handles for ``get_slice``."""

    def __init__(self, source: CheckpointSource, stack: ExitStack, direct: bool = True):
        self.source, self.stack, self.direct = source, stack, direct
        self._fds: dict[str, tuple[int, int]] = {}
        self._safe: dict[str, object] = {}

    def fd(self, file: str) -> tuple[int, int]:
        """(fd, data start) of ``file``."""
        if file not in self._fds:
            path = self.source.path(file)  # the file (or link target) checked when the folder was scanned
            fd = self.stack.enter_context(open_checked(path.parent, path.name)).fileno()
            self._fds[file] = fd, data_start(fd, path)
        return self._fds[file]

    def slice(self, info: TensorInfo):
        """``safe_open(...).get_slice(key)`` of ``info``'s tensor."""
        if info.file not in self._safe:
            from safetensors import safe_open

            self._safe[info.file] = self.stack.enter_context(safe_open(str(self.source.path(info.file)),
                                                                       framework="pt"))
        return self._safe[info.file].get_slice(info.key)

    def read_box(self, info: TensorInfo, offsets, lengths) -> tuple[torch.Tensor, bool]:
        """The box ``offsets + lengths`` of ``info``'s tensor as stored (a new CPU tensor), and whether it
        was read with ``preadv`` (one contiguous byte range, ``direct``) rather than through safetensors."""
        rng = byte_range(info, offsets, lengths) if self.direct else None
        if rng is not None and rng[1]:
            fd, start = self.fd(info.file)
            buf = torch.empty(tuple(lengths), dtype=info.dtype)
            pread_into(fd, buf, start + rng[0], self.source.path(info.file))
            return buf, True
        return self.slice(info)[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))], False


class BoxTransform:
    """A tensor the key map sees (``shape``, in the model's layout) that the reader makes from stored
    tensors while it reads a box of it: an MXFP4 pair dequantized (``sq.load.mxfp4``), a tensor the Hub
    stores transposed (:class:`Transposed`).  ``file`` is where its (first) stored tensor lives."""

    shape: tuple[int, ...]
    file: str

    def sources(self, offsets, lengths) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """The stored boxes ``(key, offsets, lengths)`` a read of this box touches (the prefetch hint)."""
        raise NotImplementedError

    def read_into(self, files: ReadFiles, dest: torch.Tensor, offsets, lengths) -> int:
        """Write the box into ``dest`` (its shape, any dtype and device); return the stored bytes read."""
        raise NotImplementedError


TRANSPOSE_CHUNK_ELEMENTS = 1 << 24  # stored elements read per step of a transposed box (32 MiB of bf16)


def _sub_boxes(offsets, lengths, limit: int):
    """``(offsets, lengths)`` pieces of a box, each at most ``limit`` elements (one element at least):
    steps along the first dimension whose trailing part of the box fits, every earlier dimension one
    index at a time, so each piece of a row-major box whose trailing dimensions are whole stays one
    contiguous byte range (an expert slab ``[e0:e1, :, :]`` reads as whole experts)."""
    offsets, lengths = tuple(offsets), tuple(lengths)
    if 0 in lengths:
        return
    k, inner = len(lengths) - 1, 1
    while k > 0 and inner * lengths[k] <= limit:
        inner *= lengths[k]
        k -= 1
    if inner * lengths[k] <= limit:  # the whole box fits
        yield offsets, lengths
        return
    step = max(1, limit // inner)
    for head in itertools.product(*(range(o, o + n) for o, n in zip(offsets[:k], lengths[:k]))):
        for i in range(offsets[k], offsets[k] + lengths[k], step):
            n = min(step, offsets[k] + lengths[k] - i)
            yield (*head, i, *offsets[k + 1:]), (*(1,) * k, n, *lengths[k + 1:])


class Transposed(BoxTransform):
    """A checkpoint tensor stored with two dimensions swapped against the model parameter it fills
    (Qwen3-VL-MoE's experts on the Hub: ``gate_up_proj [E, H, 2I]`` for the model's ``[E, 2I, H]``;
    transformers' ``Transpose`` conversion).  A box of the model's tensor reads the stored box with those
    dimensions swapped, piece by piece (``TRANSPOSE_CHUNK_ELEMENTS`` at most; an expert slab is whole
    experts, one ``preadv`` each), and writes it transposed into the destination."""

    def __init__(self, info: TensorInfo, dims: tuple[int, int]):
        self.info, self.dims = info, tuple(dims)
        self.shape = swap_dims(info.shape, self.dims)
        self.file = info.file

    def sources(self, offsets, lengths):
        return [(self.info.key, swap_dims(offsets, self.dims), swap_dims(lengths, self.dims))]

    def read_into(self, files: ReadFiles, dest: torch.Tensor, offsets, lengths) -> int:
        if tuple(dest.shape) != tuple(lengths):
            raise ValueError(f"destination {list(dest.shape)} does not match the box {list(lengths)}")
        s_off, s_len = swap_dims(offsets, self.dims), swap_dims(lengths, self.dims)
        stored = dest.transpose(*self.dims)  # a view of dest in the stored orientation
        nbytes = 0
        for c_off, c_len in _sub_boxes(s_off, s_len, TRANSPOSE_CHUNK_ELEMENTS):
            buf, _ = files.read_box(self.info, c_off, c_len)
            stored[tuple(slice(c - o, c - o + n) for c, o, n in zip(c_off, s_off, c_len))].copy_(
                buf.to(dest.device, non_blocking=False))
            nbytes += buf.numel() * buf.element_size()
        return nbytes


class SqStorageReader(HuggingFaceStorageReader):
    """HuggingFaceStorageReader whose metadata comes from sq's own header scan (index files only),
    reading contiguous boxes with ``os.preadv`` (see the module docstring).

    ``transforms``: tensors (by the name the key map sees) the reader makes from stored tensors while
    reading a box of them (:class:`BoxTransform`: MXFP4 pairs dequantized, tensors stored transposed);
    their metadata has the model's shape.  Every other tensor is read as stored."""

    def __init__(self, source: CheckpointSource, thread_count: int = 1,
                 transforms: dict[str, BoxTransform] | None = None):
        super().__init__(str(source.root), thread_count=thread_count)
        from torch.distributed.checkpoint._hf_utils import _HFStorageInfo

        sd_md, storage = {}, {}
        for key, t in source.tensors.items():
            zeros = torch.Size([0] * len(t.shape))
            sd_md[key] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), torch.Size(t.shape),
                                               [ChunkStorageMetadata(zeros, torch.Size(t.shape))])
            storage[MetadataIndex(key, zeros)] = _HFStorageInfo(str(source.path(t.file)), torch.Size(t.shape), t.dtype)
        self.transforms: dict[str, BoxTransform] = dict(transforms or {})
        for key, tf in self.transforms.items():
            zeros = torch.Size([0] * len(tf.shape))
            sd_md[key] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size(tf.shape),
                                               [ChunkStorageMetadata(zeros, torch.Size(tf.shape))])
            storage[MetadataIndex(key, zeros)] = _HFStorageInfo(str(source.path(tf.file)), torch.Size(tf.shape),
                                                                torch.bfloat16)
        self._metadata = Metadata(state_dict_metadata=sd_md, storage_data=storage)
        self.source = source
        self.bytes_read = 0  # checkpoint bytes this rank's boxes covered (what it asked the files for)
        self.direct = True  # False: every box through safetensors (the reference path, for tests)
        self.direct_reads = 0  # boxes read with preadv straight into their shard
        self.mapped_reads = 0  # boxes read through safetensors (mmap + get_slice)
        self.file_views = 0  # whole local shards handed out as views of a private file mapping
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}  # file -> (private mapping, data start)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata

    def _process_read_request(self, f, req: ReadItem, planner: LoadPlanner) -> None:
        super()._process_read_request(f, req, planner)
        n = 1
        for s in req.lengths:
            n *= s
        self.bytes_read += n * self.source.tensors[req.storage_index.fqn].dtype.itemsize

    def _raw(self, key: str) -> bool:
        """Whether ``key``'s bytes are what the model holds (no for a transform, and for the FP8 weights a
        dequantizing reader dequantizes while reading them)."""
        return key not in self.transforms

    def file_view(self, key: str, offsets, lengths, dtype: torch.dtype) -> torch.Tensor | None:
        """The box of ``key`` as a tensor over a private (copy-on-write) mapping of its file, or None
        where it must be read instead: not one contiguous range, not the checkpoint's bytes (a dtype
        conversion, a dequantized FP8 / MXFP4 tensor), misaligned for its dtype, or past the file's end
        (the read then reports the truncation).  Nothing is read here: pages come in when touched."""
        if not self._raw(key):
            return None
        info = self.source.tensors[key]
        rng = byte_range(info, offsets, lengths)
        if rng is None or not rng[1] or dtype != info.dtype:
            return None
        if info.file not in self._maps:
            path = self.source.path(info.file)  # the link rule, as for every read
            with open_checked(path.parent, path.name) as f:
                start = data_start(f.fileno(), path)
                self._maps[info.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), start
        m, start = self._maps[info.file]
        off, n = start + rng[0], rng[1]
        if off % dtype.itemsize or off + n > len(m):
            return None
        self.file_views += 1
        self.bytes_read += n
        return torch.frombuffer(m, dtype=dtype, count=n // dtype.itemsize, offset=off).view(tuple(lengths))

    def drop_maps(self) -> None:
        """Forget the file mappings (tensors viewing them keep theirs alive until they are freed)."""
        self._maps.clear()

    def will_need(self, boxes) -> None:
        """``POSIX_FADV_WILLNEED`` on the byte ranges of ``boxes`` (``(key, offsets, lengths)``) that are
        contiguous: the kernel starts reading them now; a transform's box stands for the stored boxes it
        reads.  A hint: files are opened and closed here."""
        per_file: dict[str, list] = {}
        for key, offsets, lengths in self._stored(boxes):
            info = self.source.tensors[key]
            rng = byte_range(info, offsets, lengths)
            if rng is not None and rng[1]:
                per_file.setdefault(info.file, []).append(rng)
        with ExitStack() as stack:
            self._hint(ReadFiles(self.source, stack), per_file)

    def _stored(self, boxes):
        """``boxes`` with each box of a transform replaced by the stored boxes it reads."""
        for key, offsets, lengths in boxes:
            tf = self.transforms.get(key)
            if tf is None:
                yield key, offsets, lengths
            else:
                yield from tf.sources(offsets, lengths)

    def _hint(self, files: ReadFiles, per_file: dict[str, list]) -> None:
        """WILLNEED on ``per_file``'s ranges (file -> [(offset in its data section, nbytes)])."""
        for file, ranges in per_file.items():
            fd, start = files.fd(file)
            _will_need(fd, [(start + off, n) for off, n in ranges])

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        direct: dict[str, list] = {}  # file -> [(offset in its data section, nbytes, item, dest)]
        mapped: dict[str, list[ReadItem]] = {}  # path -> items read through safetensors
        hints: dict[str, list] = {}  # file -> every contiguous range of the call, whichever path reads it
        made = [it for it in plan.items if it.storage_index.fqn in self.transforms]
        for key, offsets, lengths in self._stored((it.storage_index.fqn, it.storage_offsets, it.lengths)
                                                  for it in made):
            rng = byte_range(self.source.tensors[key], offsets, lengths)
            if rng is not None and rng[1]:
                hints.setdefault(self.source.tensors[key].file, []).append(rng)
        for item in plan.items:
            key = item.storage_index.fqn
            if key in self.transforms:
                continue
            info = self.source.tensors[key]
            dest = planner.resolve_tensor(item).detach()
            rng = byte_range(info, item.storage_offsets, item.lengths)
            if rng is not None and rng[1]:
                hints.setdefault(info.file, []).append(rng)
            if (self.direct and rng is not None and self._raw(key) and dest.dtype == info.dtype
                    and tuple(dest.shape) == tuple(item.lengths)):
                direct.setdefault(info.file, []).append((*rng, item, dest))
            else:
                mapped.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        with ExitStack() as stack:  # every file opened here is closed on every path
            files = ReadFiles(self.source, stack, self.direct)
            self._hint(files, hints)  # queue every range first: the disk works while we copy
            for item in made:
                dest = planner.resolve_tensor(item).detach()
                self.bytes_read += self.transforms[item.storage_index.fqn].read_into(
                    files, dest, item.storage_offsets, item.lengths)
                planner.commit_tensor(item, dest)
                self.mapped_reads += 1
            for file, items in direct.items():
                fd, start = files.fd(file)
                path = self.source.path(file)
                for off, n, item, dest in sorted(items, key=lambda x: x[0]):
                    in_place = dest.device.type == "cpu" and dest.is_contiguous()
                    buf = dest if in_place else torch.empty(dest.shape, dtype=dest.dtype)
                    pread_into(fd, buf, start + off, path)
                    if buf is not dest:
                        dest.copy_(buf)
                    planner.commit_tensor(item, dest)
                    self.bytes_read += n
                    self.direct_reads += 1
        if mapped:
            from safetensors import safe_open

            for path, items in mapped.items():
                with safe_open(filename=path, framework="pt") as f:
                    for item in items:
                        self._process_read_request(f, item, planner)
                        self.mapped_reads += 1
        fut: Future = Future()
        fut.set_result(None)
        return fut


@dataclass(frozen=True)
class ReadRequest:
    ckpt_key: str
    storage_offsets: tuple[int, ...]
    lengths: tuple[int, ...]  # in checkpoint coordinates
    dest: torch.Tensor  # a view of the local shard, shaped like the read box


class BoxLoadPlanner(LoadPlanner):
    """Read items are exactly the given boxes; nothing is planned from a state dict."""

    def __init__(self, requests: list[ReadRequest]):
        self.requests = requests

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for i, r in enumerate(self.requests):
            nd = len(r.lengths)
            items.append(ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(f"sq-box-{i}", torch.Size([0] * nd)),
                dest_offsets=torch.Size([0] * nd),
                storage_index=MetadataIndex(r.ckpt_key, torch.Size([0] * nd)),
                storage_offsets=torch.Size(r.storage_offsets),
                lengths=torch.Size(r.lengths),
            ))
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value):
        raise LoadRefused(f"unexpected byte item {read_item.storage_index.fqn}")

    def resolve_tensor(self, read_item):
        return self.requests[int(read_item.dest_index.fqn.rsplit("-", 1)[1])].dest

    def commit_tensor(self, read_item, tensor) -> None:
        pass


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(local tensor, its global offset) of a plain tensor or DTensor."""
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        if tuple(local.shape) != tuple(shape):  # FSDP2 pads nothing on CPU; be strict anyway
            local = local[tuple(slice(0, s) for s in shape)]
        return local, tuple(offset)
    return t, (0,) * t.dim()


def requests_for(target: torch.Tensor, pieces: list[Piece]) -> tuple[list[ReadRequest], int]:
    """Intersect this rank's box of ``target`` with each piece; return requests and covered elements."""
    local, off = local_box(target)
    hi = [o + s for o, s in zip(off, local.shape)]
    reqs, covered = [], 0
    for p in pieces:
        lo_i = [max(a, b) for a, b in zip(off, p.offsets)]
        hi_i = [min(a, b + n) for a, b, n in zip(hi, p.offsets, p.lengths)]
        if any(h <= l for l, h in zip(lo_i, hi_i)):
            continue
        dest = local[tuple(slice(l - o, h - o) for l, h, o in zip(lo_i, hi_i, off))]
        s_off = [l - po for l, po in zip(lo_i, p.offsets)]
        s_len = [h - l for l, h in zip(lo_i, hi_i)]
        if p.stack_dim is not None:
            del s_off[p.stack_dim], s_len[p.stack_dim]
            dest = dest.squeeze(p.stack_dim)
        reqs.append(ReadRequest(p.ckpt_key, tuple(s_off), tuple(s_len), dest))
        covered += dest.numel()
    return reqs, covered


def dcp_read(source: CheckpointSource, requests: list[ReadRequest], *, reader: SqStorageReader | None = None) -> None:
    """A local DCP load of this rank's boxes (``no_dist``: no collective; a rank may have none).

    Every rank plans its own boxes, so DCP's central planning (gather the plans, scatter them,
    gather the results) would only add sync points.  An error is raised on this rank alone: the
    caller makes every rank agree (:func:`agree`) before its next collective.
    """
    reader = reader or SqStorageReader(source)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({}, storage_reader=reader, planner=BoxLoadPlanner(requests), no_dist=True)
    except CheckpointException as e:  # BaseException in torch: wrap it into ours
        raise LoadRefused(f"reading {source.root} failed: {e}") from None


MAX_AGREED_PROBLEMS = 20  # per rank: what one all_gather carries


def agree(problems: list[str]) -> None:
    """Every rank raises the same ``LoadRefused`` listing every rank's problems, or none raises.

    One ``all_gather_object`` (nothing without a process group or at world size 1): call it on
    every rank, with the local problems, before any collective a failing rank would skip.  A
    problem that several ranks share is listed once, with the ranks that had it.
    """
    problems = [str(p) for p in problems[:MAX_AGREED_PROBLEMS]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, problems)
        ranks: dict[str, list[int]] = {}
        for r, ps in enumerate(gathered):
            for p in ps:
                ranks.setdefault(p, []).append(r)
        problems = [f"{p} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" for p, rs in ranks.items()]
    if problems:
        raise LoadRefused(problems)


def module_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod_name, _, leaf = name.rpartition(".")
    return (model.get_submodule(mod_name) if mod_name else model), leaf


def fsdp_reset(model: nn.Module, leaves: set[nn.Module]) -> None:
    """After swapping parameters under FSDP2, re-point its sharded-param records at them."""
    from torch.distributed.fsdp import FSDPModule

    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        for group in fsdp_param_groups(mod):
            for fp in group.fsdp_params:
                if fp._module_info.module in leaves:
                    fp.reset_sharded_param()
                    # torch returns early for a meta parameter and would keep the freed shard's
                    # (padded) CPU buffer alive: memory would grow with every block streamed
                    if fp.sharded_param._local_tensor.is_meta and not fp._sharded_param_data.is_meta:
                        fp._sharded_param_data = fp._sharded_param_data.to("meta")


@torch.no_grad()
def set_device(model: nn.Module, names: list[str], device: torch.device | str) -> None:
    """Move the named tensors' local shards to ``device`` as uninitialized memory (or back to meta)."""
    leaves = {module_of(model, n)[0] for n in names}
    for leaf in leaves:
        leaf.to_empty(device=device, recurse=False)
    fsdp_reset(model, leaves)
