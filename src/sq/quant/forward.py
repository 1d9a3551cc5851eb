"""Running calibration batches through a model's decoder blocks, one block at a time.

``capture_block0`` gives block 0's inputs (hidden states and the keyword arguments the decoder
layer gets: rotary embeddings, masks) for each local batch, with what differs for later blocks
(:class:`BlockKwargs`); ``block_forward`` runs a block on them.  Every rank runs the same number
of forwards (FSDP2 all-gathers a block's weights in each), padding with a dummy batch that
counts nothing.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from sq.anatomy import decoder_blocks
from sq.errors import SqError
from sq.parallel.fsdp import unsharded

CALIB_BATCH = 8  # samples per calibration forward
# what a calibration forward holds at once per token, for the memory preflight (sq.pipeline.footprint): tensors
# of the hidden width (norms, residuals, q/o, outputs) and of the block's widest (gate, up, their product, the
# activation)
ACT_HIDDEN = 6
ACT_WIDE = 4
# never replayed: a cache would carry one batch's (or one block's) state into the next forward
_DROPPED = ("past_key_values", "past_key_value", "cache", "cache_params", "hidden_states")


class _StopForward(Exception):
    """Raised by the block-0 pre-hook (or the last block's recorder) once the inputs are captured."""


class BlockKwargs(dict):
    """Block 0's keyword arguments, and per later block the ones the model's loop gives it otherwise.

    Hybrid and interleaved models hand their layers different arguments by layer type: Gemma-3's
    global layers another rotary table and mask than its sliding ones, Qwen3-Next's linear-attention
    layers another mask than its full-attention ones, Gemma-4 each layer its own per-layer input.
    ``per_block`` maps a block module to its differences (by identity: one object per layer type).
    """

    def __init__(self, common: dict, per_block: dict | None = None):
        super().__init__(common)
        self.per_block: dict[nn.Module, dict] = per_block or {}


def block_kwargs(kw: dict, block: nn.Module) -> dict:
    """The keyword arguments ``block`` is called with: ``kw``, with ``block``'s own differences."""
    extra = getattr(kw, "per_block", {}).get(block)
    return {**kw, **extra} if extra else kw


class _Recorder(nn.Module):
    """Stands in for a decoder block during capture: records the arguments the model's loop gives it
    and hands the hidden states on untouched (alone, or as the first of ``width`` outputs: layers that
    return a tuple, e.g. ``hidden, attn_weights = layer(...)``).
    Attributes the loop reads (``attention_type``, ``layer_type``, ...) come from the real block."""

    def __init__(self, block: nn.Module, sink: list, last: bool, width: int):
        super().__init__()
        object.__setattr__(self, "_sq_state", (block, sink, last, width))

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_sq_state")[0], name)

    def forward(self, *args, **kwargs):
        block, sink, last, width = self._sq_state
        sig = inspect.signature(block.forward)
        try:
            bound = sig.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = {"hidden_states": args[0], **kwargs} if args else dict(kwargs)
        bound = dict(bound)
        for var in [k for k, p in sig.parameters.items()
                    if p.kind is inspect.Parameter.VAR_KEYWORD and k in bound]:
            bound.update(bound.pop(var))  # **kwargs, flattened back into keywords
        hidden = args[0] if args else kwargs["hidden_states"]
        sink.append((hidden, bound))
        if last:
            raise _StopForward
        return (hidden, *[None] * (width - 1)) if width else hidden


def _replay_kwargs(bound: dict, first_name: str) -> dict:
    kw = {k: v for k, v in bound.items() if k not in _DROPPED and k != first_name}
    kw["use_cache"] = False
    return kw


def _capture_all(model: nn.Module, inner: nn.Module, blocks, batch: torch.Tensor) -> tuple[torch.Tensor, BlockKwargs] | None:
    """One batch's block-0 inputs and every block's differences, by running the model's own loop
    over recorders (no block computes); None where the loop does not pass the hidden states along
    unchanged either way (a layer output it reshapes), so the caller falls back to block 0's."""
    names = [prefix.rsplit(".", 1) for prefix, _ in blocks]
    parents = [model.get_submodule(p) for p, _ in names]
    for width in (0, 1, 2, 3):  # what the loop does with a layer's output: a tensor, or a tuple it indexes or unpacks
        sink: list = []
        saved = [(parent, leaf, parent._modules[leaf]) for parent, (_, leaf) in zip(parents, names)]
        try:
            for i, (parent, leaf, real) in enumerate(saved):
                parent._modules[leaf] = _Recorder(real, sink, i == len(saved) - 1, width)
            try:
                inner(input_ids=batch, use_cache=False)
            except _StopForward:
                pass
            except Exception:  # noqa: BLE001 - e.g. a tuple where the loop wanted a tensor: try the other way
                continue
        finally:
            for parent, leaf, real in saved:
                parent._modules[leaf] = real
        h0 = sink[0][0] if sink else None
        if len(sink) != len(blocks) or any(not isinstance(h, torch.Tensor) or h is not h0 for h, _ in sink):
            continue
        first = next(iter(inspect.signature(blocks[0][1].forward).parameters), "hidden_states")
        kws = [_replay_kwargs(b, first) for _, b in sink]
        per_block = {}
        for (_, block), kw in zip(blocks[1:], kws[1:]):
            diff = {k: v for k, v in kw.items() if k not in kws[0] or kws[0][k] is not v}
            gone = [k for k in kws[0] if k not in kw]
            if gone:  # a keyword block 0 gets and this one does not: its own default
                params = inspect.signature(block.forward).parameters
                diff.update({k: params[k].default for k in gone if k in params})
            if diff:
                per_block[block] = diff
        return h0.detach(), BlockKwargs(kws[0], per_block)
    return None


def capture_block0(model: nn.Module, windows: torch.Tensor, device,
                   dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, dict]]:
    """Block-0 inputs ``[(hidden [b, seq, d], kwargs), ...]`` for each batch of ``windows [n, seq]``;
    each ``kwargs`` a :class:`BlockKwargs` that also holds what later blocks get otherwise.

    The root FSDP unit is bypassed: its lazy init would insist every block is materialized.
    The inner model's own root parameters are swapped for full copies for the duration
    (collective; cast to ``dtype``, the forwards' compute dtype, when given: the embeddings and
    the rotary tables then come out in it).  The model's own forward then runs with every block
    replaced by a recorder (:class:`_Recorder`; the masks, rotary tables and per-layer inputs each
    layer type gets); where that fails, a pre-hook on block 0 (ahead of FSDP's) stops the forward
    and every block gets block 0's arguments.
    """
    blocks = decoder_blocks(model)
    inner = model.get_submodule(blocks[0][0].rsplit(".", 2)[0])
    block0 = blocks[0][1]
    swapped = _full_root(inner, blocks, dtype)
    captured = []

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kw = {k: v for k, v in kwargs.items() if k not in _DROPPED}
        kw["use_cache"] = False
        captured.append((hidden.detach(), BlockKwargs(kw)))
        raise _StopForward

    try:
        with torch.no_grad():
            for i in range(0, windows.shape[0], CALIB_BATCH):
                batch = windows[i:i + CALIB_BATCH].to(device)
                got = _capture_all(model, inner, blocks, batch)
                if got is not None:
                    captured.append(got)
                    continue
                handle = block0.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
                try:
                    inner(input_ids=batch, use_cache=False)
                except _StopForward:
                    pass
                finally:
                    handle.remove()
    finally:
        _put_back(swapped)
    return captured


def _full_root(model: nn.Module, blocks, dtype: torch.dtype | None) -> list:
    """Swap every sharded parameter of ``model`` outside its decoder blocks for a full copy (collective;
    cast to ``dtype`` when given), a tied one once; returns what ``_put_back`` restores."""
    inside = {id(m) for _, b in blocks for m in b.modules()}
    swapped, full_of = [], {}
    for mod in model.modules():
        if id(mod) in inside:
            continue
        for leaf, p in list(mod._parameters.items()):
            if isinstance(p, DTensor):
                if id(p) not in full_of:
                    full = p.full_tensor()
                    if dtype is not None and full.is_floating_point():
                        full = full.to(dtype)
                    full_of[id(p)] = nn.Parameter(full, requires_grad=False)
                swapped.append((mod, leaf, p))
                mod._parameters[leaf] = full_of[id(p)]
    return swapped


def _put_back(swapped: list) -> None:
    for mod, leaf, p in swapped:
        mod._parameters[leaf] = p


class _Inject(nn.Module):
    """Stands in for a decoder block in the head's forward: hands its input on (``hidden`` is None), or
    returns ``hidden`` instead (the last block), as a tensor or the first of ``width`` outputs."""

    def __init__(self, hidden: torch.Tensor | None, width: int):
        super().__init__()
        object.__setattr__(self, "_sq_state", (hidden, width))

    def forward(self, *args, **kwargs):
        hidden, width = self._sq_state
        h = hidden if hidden is not None else (args[0] if args else kwargs["hidden_states"])
        return (h, *[None] * (width - 1)) if width else h


def head_grads(model: nn.Module, finals: list[torch.Tensor], windows: torch.Tensor, total_tokens: int,
               dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The gradient of the next-token cross entropy, summed over this rank's tokens over
    ``total_tokens`` (every rank's), at the last decoder block's outputs ``finals`` (one per batch of
    ``CALIB_BATCH`` rows of ``windows``).  The model's own forward after its layers computes the logits
    (its final norm, ``lm_head``, any soft-capping or scaling) with every block standing aside
    (``_Inject``) and the root's parameters full copies (collective), a sample at a time.  The root
    FSDP unit's hooks are bypassed (``type(model).forward``).  Raises SqError where the model's loop
    does not carry the injected states to its logits."""
    blocks = decoder_blocks(model)
    names = [prefix.rsplit(".", 1) for prefix, _ in blocks]
    parents = [model.get_submodule(p) for p, _ in names]
    swapped = _full_root(model, blocks, dtype)
    saved = [(parent, leaf, parent._modules[leaf]) for parent, (_, leaf) in zip(parents, names)]
    width, why = None, "no logits that depend on them"
    grads = []
    try:
        for b, final in enumerate(finals):
            g = torch.zeros_like(final, dtype=torch.float32)
            for j in range(final.shape[0]):
                ids = windows[b * CALIB_BATCH + j : b * CALIB_BATCH + j + 1].to(final.device)
                h = final[j : j + 1].detach().clone().requires_grad_(True)
                for w in ((width,) if width is not None else (0, 1, 2, 3)):
                    for i, (parent, leaf, _) in enumerate(saved):
                        parent._modules[leaf] = _Inject(h if i == len(saved) - 1 else None, w)
                    try:
                        with torch.enable_grad():
                            logits = type(model).forward(model, input_ids=ids, use_cache=False).logits
                    except Exception as e:  # noqa: BLE001 - the loop wanted another output form: try the next
                        if width is not None:
                            raise
                        why = f"{type(e).__name__}: {e}"
                        continue
                    if logits.requires_grad and logits.shape[:2] == ids.shape:
                        width = w
                        break
                else:
                    raise SqError(f"{type(model).__name__}: the logits could not be computed from the last "
                                  "block's outputs (its forward after the layers is not a norm and a head "
                                  f"over them; {why}); score with --search-score mse")
                with torch.enable_grad():
                    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
                    (loss / total_tokens).backward()
                g[j] = h.grad[0]
            grads.append(g)
    finally:
        for parent, leaf, real in saved:
            parent._modules[leaf] = real
        _put_back(swapped)
    return grads


def block_grads(block: nn.Module, inputs, grads: list[torch.Tensor], steps: int, dummy,
                autocast: torch.dtype | None = None) -> list[torch.Tensor]:
    """Back through ``block``: the gradient at each batch's input given ``grads`` at its output (float32),
    the block's own weights constant.  Ranks pad with ``dummy`` (a forward only) as ``block_forward``;
    the block's FSDP hooks are bypassed (``block.forward``) while ``unsharded`` holds its weights."""
    out = []
    with frozen(block), unsharded(block), autocast_to(autocast, dummy[0].device):
        for i in range(steps):
            real = i < len(inputs)
            hidden, kw = inputs[i] if real else dummy
            x = hidden.detach().clone().requires_grad_(real)
            with torch.set_grad_enabled(real):
                y = block.forward(x, **block_kwargs(kw, block))
                y = y[0] if isinstance(y, tuple) else y
                if real:
                    y.backward(grads[i].to(y.dtype))
                    out.append(x.grad.float())
    return out


@contextlib.contextmanager
def frozen(block: nn.Module):
    """The block's own weights as constants for the duration (no gradient, no FSDP2 grad sync): those that
    required a gradient stop, and start again after."""
    params = [p for p in block.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def autocast_to(dtype: torch.dtype | None, device: torch.device):
    """``torch.autocast`` to ``dtype`` on ``device`` (``--calib-dtype mixed``); a no-op for None."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def block_forward(block: nn.Module, inputs, steps: int, dummy, counters=(), autocast: torch.dtype | None = None,
                  outputs: bool = True) -> list[torch.Tensor]:
    """Run every local batch through ``block``; pad with ``dummy`` so all ranks run ``steps`` forwards.
    ``counters`` (objects with an ``on`` flag) stop counting on dummy batches, and hear of the first real
    batch's end where they ask to (``first_pass_done``); ``autocast``: the half dtype the block's matmuls
    run in (``--calib-dtype mixed``); ``outputs=False``: the block's outputs are not kept (a forward run for
    its counters only, which may then skip work the outputs alone need)."""
    outs = []
    # the block's weights gathered once for every batch, not once per batch (FSDP2 reshards after
    # each forward: on SmolLM2 at 2 ranks, 15 ms per gather, 118 per job)
    with torch.no_grad(), unsharded(block), autocast_to(autocast, dummy[0].device):
        for i in range(steps):
            real = i < len(inputs)
            for c in counters:
                c.on = real
            hidden, kw = inputs[i] if real else dummy
            y = block(hidden, **block_kwargs(kw, block))
            y = y[0] if isinstance(y, tuple) else y
            if real and outputs:
                outs.append(y.detach())
            if i == 0 and real and not outputs:
                for c in counters:
                    if hasattr(c, "first_pass_done"):
                        c.first_pass_done()
    return outs


class InputLeaders:
    """Which Linears read the very same input tensor (q/k/v, gate/up): each one's leader is the first
    to read it.  The first batch decides, its inputs kept alive meanwhile so that no address can be
    reused by another tensor."""

    def __init__(self):
        self.lead: dict[str, str] = {}
        self._first: dict[tuple, tuple[str, torch.Tensor]] = {}

    def of(self, name: str, x: torch.Tensor) -> str:
        if name not in self.lead:
            key = (x.data_ptr(), tuple(x.shape), x.dtype)
            self.lead[name] = self._first.setdefault(key, (name, x))[0]
        return self.lead[name]

    def release(self) -> None:
        """Let the first batch's inputs go (the leaders stay)."""
        self._first.clear()


def paired_forward(block: nn.Module, fp_inputs, inputs, steps: int, dummy, counters=(),
                   autocast: torch.dtype | None = None) -> list[torch.Tensor]:
    """Each batch through ``block`` twice, the full-precision chain's then the quantized chain's: the
    first with every counter's ``capturing`` set (it keeps what it needs of that pass), the second
    without (it reads what it kept: the same tokens on both chains, one batch held at a time; then
    ``release()``).  ``on`` is False for dummy batches in both.  Returns the full-precision outputs;
    ranks pad with ``dummy`` as ``block_forward``."""
    outs = []
    with torch.no_grad(), unsharded(block), autocast_to(autocast, dummy[0].device):
        for i in range(steps):
            real = i < len(inputs)
            for c in counters:
                c.on, c.capturing = real, True
            hidden, kw = fp_inputs[i] if real else dummy
            y = block(hidden, **block_kwargs(kw, block))
            for c in counters:
                c.capturing = False
            hidden, kw = inputs[i] if real else dummy
            block(hidden, **block_kwargs(kw, block))
            for c in counters:
                c.release()
            if real:
                outs.append((y[0] if isinstance(y, tuple) else y).detach())
    return outs
