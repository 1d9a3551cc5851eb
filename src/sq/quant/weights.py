"""Where the PTQ driver's weights come from, and what their checkpoint names are.

The driver (``sq.quant.blockwise``) walks decoder blocks; for each it asks its weight source to
``fill`` the block's tensors before quantizing and to ``free`` them after.  Two sources:

- ``CheckpointWeights``: a checkpoint folder, read one block at a time into FSDP2 / EP shards
  (``sq.load``); output names are the checkpoint's own keys (the key map run backwards).
- ``ModelWeights``: a model already in memory and already FSDP2-sharded (a training job's
  model, through ``sq.api.quantize``); nothing is read or freed, output names are the model's
  own parameter names (what ``save_pretrained`` writes for a dense causal LM).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from sq.errors import SqError
from sq.export import writer
from sq.files import CARRIED_NAME
from sq.load.loader import LoadPlan, fill, free
from sq.anatomy import decoder_blocks, experts_modules
from sq.resume import source_identity



class CheckpointWeights:
    """Block tensors streamed from a checkpoint through the load plan."""

    def __init__(self, model: nn.Module, plan: LoadPlan, src: Path, device: torch.device):
        self.model, self.plan, self.src, self.device = model, plan, Path(src), device

    @property
    def root_names(self) -> list[str]:
        return self.plan.root_names

    def block_names(self, b: int) -> list[str]:
        return self.plan.block_names[b]

    def fill(self, names) -> None:
        fill(self.model, self.plan, names, device=self.device)

    def free(self, names) -> None:
        free(self.model, self.plan, names)

    def ckpt_name(self, target: str) -> str:
        """The checkpoint key that fills ``target`` whole (dense: exact or suffix rule)."""
        pieces = self.plan.keymap.pieces.get(target, [])
        shape = tuple(self.plan.targets[target])
        if (len(pieces) != 1 or pieces[0].stack_dim is not None or tuple(pieces[0].lengths) != shape
                or any(pieces[0].offsets)):
            raise SqError(f"{target} is filled from {len(pieces)} checkpoint piece(s) (fused/stacked layout); "
                          "only one-to-one dense tensors can be exported yet")
        return pieces[0].ckpt_key

    @property
    def expert_pieces(self) -> dict:
        return self.plan.keymap.pieces

    @property
    def config(self) -> dict:
        return dict(self.plan.source.config)

    @property
    def carried(self) -> list[str]:
        return list(self.plan.carried)

    def identity(self) -> dict:
        return source_identity(self.plan.source)

    def write_extras(self, out: Path) -> dict[str, str]:
        """Checkpoint tensors the model has no slot for (rank 0): byte for byte, except FP8 block-scaled
        weights, which are dequantized (their scales have no place in a compressed-tensors config)."""
        return writer.write_tensors(out, CARRIED_NAME, self.plan.read_carried())

    def write_side_files(self, out: Path) -> list[str]:
        return writer.copy_side_files(self.src, out)

    def describe(self) -> str:
        return str(self.src)


class ModelWeights:
    """An in-memory model whose decoder blocks are FSDP2-sharded on dim 0 over the whole world."""

    def __init__(self, model: nn.Module, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer
        blocks = decoder_blocks(model)
        if not blocks:
            raise SqError(f"{type(model).__name__}: no decoder blocks found (expected a *.layers ModuleList)")
        moe = [f"{p}.{n}" for p, b in blocks for n, _ in experts_modules(b)]
        if moe:
            raise SqError(f"{moe[0]} (and {len(moe) - 1} more): the Python API quantizes dense models; "
                          "for MoE models save the checkpoint and run sq.ptq on it")
        persistent = _persistent_names(model)
        self._blocks = [[n for n in persistent if n.startswith(p + ".")] for p, _ in blocks]
        in_blocks = {n for names in self._blocks for n in names}
        self._root = [n for n in persistent if n not in in_blocks]
        world = dist.get_world_size()
        problems = []
        for (prefix, block), names in zip(blocks, self._blocks):
            for n, p in block.named_parameters():
                if world > 1 and not (isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),)
                                      and p.device_mesh.size() == world):
                    problems.append(f"{prefix}.{n}: expected an FSDP2 parameter sharded on dim 0 over all "
                                    f"{world} ranks (fully_shard each decoder layer), got "
                                    f"{type(p).__name__} {getattr(p, 'placements', '')}")
                    break
        if problems:
            raise SqError(problems[:3] + ([f"... and {len(problems) - 3} more blocks"] if len(problems) > 3 else []))

    @property
    def root_names(self) -> list[str]:
        return self._root

    def block_names(self, b: int) -> list[str]:
        return self._blocks[b]

    def fill(self, names) -> None:  # already in memory
        pass

    def free(self, names) -> None:  # the caller's model keeps its (now fake-quantized) weights
        pass

    def ckpt_name(self, target: str) -> str:
        return target

    expert_pieces = None

    @property
    def config(self) -> dict:
        config = self.model.config.to_dict()
        config["architectures"] = [self.model_class]  # as save_pretrained writes it
        return config

    @property
    def model_class(self) -> str:
        """The model's own class name (FSDP2 wraps it in a generated ``FSDP<Name>`` subclass)."""
        from torch.distributed.fsdp import FSDPModule

        return next(c.__name__ for c in type(self.model).__mro__ if not issubclass(c, FSDPModule))

    carried: list[str] = []

    def identity(self) -> dict:
        """Class, names, shapes and dtypes: an in-memory model cannot prove its values unchanged."""
        h = hashlib.sha256()
        for n, p in self.model.state_dict().items():
            h.update(f"{n}:{tuple(p.shape)}:{p.dtype};".encode())
        return {"in_memory": self.model_class, "tensors_sha256": h.hexdigest(),
                "config_sha256": hashlib.sha256(json.dumps(self.config, sort_keys=True, default=str)
                                                .encode()).hexdigest()}

    def write_extras(self, out: Path) -> dict[str, str]:
        return {}

    def write_side_files(self, out: Path) -> list[str]:
        """Tokenizer (if given) and generation config, through their own ``save_pretrained``."""
        before = {p.name for p in Path(out).iterdir()}
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(out)
        gen = getattr(self.model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(out)
        return sorted({p.name for p in Path(out).iterdir()} - before - {"config.json"})

    def describe(self) -> str:
        return f"in-memory {self.model_class}"


def _persistent_names(model: nn.Module) -> list[str]:
    """Parameters (tied ones once) and persistent buffers, in module order."""
    names = [n for n, _ in model.named_parameters()]
    for mod_name, mod in model.named_modules():
        for b in mod._buffers:
            if b not in mod._non_persistent_buffers_set and mod._buffers[b] is not None:
                names.append(f"{mod_name}.{b}" if mod_name else b)
    return names
