"""Fill this rank's shards of named model tensors through torch DCP's HuggingFaceStorageReader.

Each request reads one box of one checkpoint tensor (``safe_open(...).get_slice``) straight
into the box of this rank's local shard it belongs to, so a rank reads only what it holds.
The reader's metadata comes from the headers scanned once at planning (not re-parsed per
block), and the planner is a small custom ``LoadPlanner`` whose read items are those boxes.
"""

from __future__ import annotations

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

from sq.errors import LoadRefused
from sq.load.keymap import Piece
from sq.load.source import CheckpointSource


class SqStorageReader(HuggingFaceStorageReader):
    """HuggingFaceStorageReader whose metadata comes from sq's own header scan (index files only)."""

    def __init__(self, source: CheckpointSource, thread_count: int = 1):
        super().__init__(str(source.root), thread_count=thread_count)
        from torch.distributed.checkpoint._hf_utils import _HFStorageInfo

        sd_md, storage = {}, {}
        for key, t in source.tensors.items():
            zeros = torch.Size([0] * len(t.shape))
            sd_md[key] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), torch.Size(t.shape),
                                               [ChunkStorageMetadata(zeros, torch.Size(t.shape))])
            storage[MetadataIndex(key, zeros)] = _HFStorageInfo(str(source.path(t.file)), torch.Size(t.shape), t.dtype)
        self._metadata = Metadata(state_dict_metadata=sd_md, storage_data=storage)
        self.source = source
        self.bytes_read = 0  # checkpoint bytes this rank's boxes covered (what safetensors was asked for)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata

    def _process_read_request(self, f, req: ReadItem, planner: LoadPlanner) -> None:
        super()._process_read_request(f, req, planner)
        n = 1
        for s in req.lengths:
            n *= s
        self.bytes_read += n * self.source.tensors[req.storage_index.fqn].dtype.itemsize


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
    """One collective DCP load of the given boxes (every rank calls it, possibly with none)."""
    reader = reader or SqStorageReader(source)
    try:
        dcp.load({}, storage_reader=reader, planner=BoxLoadPlanner(requests),
                 process_group=None if dist.is_initialized() else None,
                 no_dist=not dist.is_initialized())
    except CheckpointException as e:  # BaseException in torch: wrap it into ours
        raise LoadRefused(f"reading {source.root} failed: {e}") from None


def module_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod_name, _, leaf = name.rpartition(".")
    return (model.get_submodule(mod_name) if mod_name else model), leaf


def _fsdp_reset(model: nn.Module, leaves: set[nn.Module]) -> None:
    """After swapping parameters under FSDP2, re-point its sharded-param records at them."""
    from torch.distributed.fsdp import FSDPModule

    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        state = mod._get_fsdp_state()
        for group in state._fsdp_param_groups:
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
    _fsdp_reset(model, leaves)
