"""Running calibration batches through a model's decoder blocks, one block at a time.

``capture_block0`` gives block 0's inputs (hidden states and the keyword arguments the decoder
layer gets: rotary embeddings, masks) for each local batch; ``block_forward`` runs a block on
them.  Every rank runs the same number of forwards (FSDP2 all-gathers a block's weights in
each), padding with a dummy batch that counts nothing.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from sq.anatomy import decoder_blocks
from sq.parallel.fsdp import unsharded

CALIB_BATCH = 8  # samples per calibration forward


class _StopForward(Exception):
    """Raised by the block-0 pre-hook once its inputs are captured."""


def capture_block0(model: nn.Module, windows: torch.Tensor, device,
                   dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, dict]]:
    """Block-0 inputs ``[(hidden [b, seq, d], kwargs), ...]`` for each batch of ``windows [n, seq]``.

    The root FSDP unit is bypassed: its lazy init would insist every block is materialized.
    The inner model's own root parameters are swapped for full copies for the duration
    (collective; cast to ``dtype``, the forwards' compute dtype, when given: the embeddings and
    the rotary tables then come out in it), and a pre-hook on block 0 (ahead of FSDP's) stops
    the forward.
    """
    inner = model.get_submodule(decoder_blocks(model)[0][0].rsplit(".", 2)[0])
    block0 = decoder_blocks(model)[0][1]
    swapped = []
    for mname, mod in inner.named_modules():
        if mname.startswith("layers"):
            continue
        for leaf, p in list(mod._parameters.items()):
            if isinstance(p, DTensor):
                swapped.append((mod, leaf, p))
                full = p.full_tensor()
                if dtype is not None and full.is_floating_point():
                    full = full.to(dtype)
                mod._parameters[leaf] = nn.Parameter(full, requires_grad=False)
    captured = []

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "hidden_states")}
        kw["use_cache"] = False
        captured.append((hidden.detach(), kw))
        raise _StopForward

    handle = block0.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    try:
        with torch.no_grad():
            for i in range(0, windows.shape[0], CALIB_BATCH):
                try:
                    inner(input_ids=windows[i:i + CALIB_BATCH].to(device), use_cache=False)
                except _StopForward:
                    pass
    finally:
        handle.remove()
        for mod, leaf, p in swapped:
            mod._parameters[leaf] = p
    return captured


def block_forward(block: nn.Module, inputs, steps: int, dummy, counters=()) -> list[torch.Tensor]:
    """Run every local batch through ``block``; pad with ``dummy`` so all ranks run ``steps`` forwards.
    ``counters`` (objects with an ``on`` flag) stop counting on dummy batches."""
    outs = []
    # the block's weights gathered once for every batch, not once per batch (FSDP2 reshards after
    # each forward: on SmolLM2 at 2 ranks, 15 ms per gather, 118 per job)
    with torch.no_grad(), unsharded(block):
        for i in range(steps):
            real = i < len(inputs)
            for c in counters:
                c.on = real
            hidden, kw = inputs[i] if real else dummy
            y = block(hidden, **kw)
            y = y[0] if isinstance(y, tuple) else y
            if real:
                outs.append(y.detach())
    return outs
