"""``--rotate r1[,r2][,r4]``: rotations fused into the weights before any algorithm sees a block.

R1 rotates the residual stream by one orthogonal ``Q`` (``sq.quant.rotate``): the embedding's rows,
every reader of the stream (its norm's scale folded in, the norm's own scale set to one), every writer
into it, and ``lm_head`` with the final norm folded in (tied embeddings are untied: the embedding and
``lm_head`` differ by that norm).  R2 rotates each attention head's values (``v_proj`` rows,
``o_proj`` columns).  The rotated model computes the same function; nothing is needed at serving time.
R4 is online: every dense ``down_proj`` Linear's columns take ``I ⊗ Q_b`` and a forward pre-hook (first
of all its hooks) turns its input into ``x (I ⊗ Q_b)`` for every later forward here (calibration,
observers, the chain); the checkpoint says so in ``quantization_config.transform_config`` (group ``R4``,
compressed-tensors' ``random-hadamard`` type with ``head_dim = b``, an ``input`` and an inverse
``weight_input`` entry as llm-compressor writes them) and stores ``sqrt(b) Q_b`` as
``<down_proj>.R4_input.weight`` (exact ±1), which vLLM multiplies the input by before the quantized
matmul.  Routed experts (fused in vLLM, which applies transforms to Linear layers only) and AWQ (whose
up -> down smoothing would scale the rotated columns) are refused.

Nothing is keyed on a model's name or class.  Each block's roles are read off one traced forward of a
short probe: a reader is a module whose input is the very tensor a norm-like module (one 1-D scale
over the hidden size) returned, or the block's own input; a writer is a Linear (or an experts module's
``down_proj``) whose output has the hidden size and that is not a reader.  Each norm's scale and its
"one" are measured from the module itself (``w * x`` and Gemma's ``(1 + w) * x`` alike).  Then the
proof, on every block, before it is quantized: the block's own contribution to the stream on the probe,
before and after, must agree up to ``Q`` (``|f'(x Q) - f(x) Q| <= TOLERANCE |f(x)|``); the root's too
(``lm_head(norm(h))`` against the rotated ``lm_head`` on ``h Q``).  A layout the rules misread (a
LayerNorm, a sandwich norm, a per-channel residual scale, a module reading the stream some other way)
fails its proof, and the run stops with the block and the error, every rank together.

Distributed: a reader's rows are rotated where they are held (columns only); a writer's and ``v_proj``'s
rows are gathered, rotated and each rank keeps its own; experts are rotated where they live (an expert's
rows gathered within its dp group).  ``Q`` comes from ``--seed``: the same on every rank and on resume.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.distributed as dist

from sq.anatomy import decoder_blocks, expert_params, is_experts_module
from sq.errors import SqError
from sq.load.fill import local_box
from sq.parallel.collectives import full_tensor
from sq.quant.experts import full_expert_rows
from sq.parallel.fsdp import unsharded
from sq.quant.forward import block_kwargs, capture_block0
from sq.formats.transforms import blockwise
from sq.quant.rotate import (hadamard, online_hadamard, orthogonal, rotate_head_columns, rotate_head_rows,
                             rotate_input, rotate_output)

logger = logging.getLogger(__name__)

__all__ = ["rotation_problems", "r4_modules", "Rotation", "TOLERANCE", "R4_GROUP"]

R4_GROUP = "R4"  # the transform_config group, and the stored matrix's name: <down_proj>.R4_input.weight

PROBE_TOKENS = 16
# a block's contribution after rotation against before, relative: rounding the rotated weights to bf16
# moves it by ~1e-2 at most on the models tried; a misread layout by ~1 (docs/rotations.md)
TOLERANCE = 0.05


def rotation_problems(cfg, in_memory: bool, model: nn.Module) -> list[str]:
    """Refusals of ``--rotate`` before anything is mutated (identical on every rank)."""
    if not cfg.rotate:
        return []
    out = []
    hidden = model.get_input_embeddings().weight.shape[1]
    if cfg.rotate_block is not None and "r1" in cfg.rotate and hidden % cfg.rotate_block:
        out.append(f"--rotate-block {cfg.rotate_block} does not divide the hidden size {hidden}")
    if cfg.rotate_block is not None and "r2" in cfg.rotate:
        bad = sorted({d for d in _head_dims(model) if d % cfg.rotate_block})
        if bad:
            out.append(f"--rotate-block {cfg.rotate_block} does not divide the attention head size "
                       f"{', '.join(map(str, bad))} (r2)")
    if in_memory:
        out.append("--rotate rewrites every weight of the model, embeddings and lm_head included: quantize "
                   "from a checkpoint (sq.ptq, or sq.pipeline.job.quantize_model), not a model in memory")
    if cfg.target_bits is not None:
        out.append("--rotate with --target-bits: the search scores the unrotated blocks; run one or the other")
    if "r4" in cfg.rotate:
        out += _r4_problems(cfg, model)
    return out


def r4_linears(block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """R4's Linears in a decoder block: every ``nn.Linear`` named ``down_proj`` (names relative to the block)."""
    return [(n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] == "down_proj"]


def r4_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """:func:`r4_linears` of every decoder block, in block order (full names)."""
    return [(f"{prefix}.{n}", m) for prefix, block in decoder_blocks(model) for n, m in r4_linears(block)]


def _r4_problems(cfg, model: nn.Module) -> list[str]:
    out = []
    if cfg.algo.name == "awq":
        out.append("--rotate r4 with --algo awq: AWQ's up_proj -> down_proj smoothing would scale down_proj's "
                   "rotated columns, not the channels it measured; use gptq, gptaq, rtn or signround")
    blocks = decoder_blocks(model)
    experts = sorted({p for p, block in blocks for n, m in block.named_modules()
                      if is_experts_module(m) or "experts" in n.split(".")})
    if experts:
        out.append(f"--rotate r4: {experts[0]} holds routed experts; vLLM applies online transforms to Linear "
                   "layers only, not to its fused MoE experts, so their rotated weights would be served unrotated")
    mods = r4_modules(model)
    have = {n.rsplit(".", 1)[0] for n, _ in mods}
    missing = [p for p, block in blocks if not any(n.startswith(p + ".") for n in have) and p not in have]
    if not mods or missing:
        out.append(f"--rotate r4: {(missing or [blocks[0][0]])[0]} has no nn.Linear named down_proj (R4 rotates "
                   "the MLP's down_proj input)")
    for size in sorted({m.in_features for _, m in mods}):
        b = cfg.rotate_block or size
        if size % b:
            out.append(f"--rotate-block {b} does not divide down_proj's input size {size} (r4)")
        elif hadamard(b) is None:
            out.append(f"--rotate r4: no Hadamard matrix of order {b} is built here (down_proj's input size "
                       f"{size}); give --rotate-block with a power of two dividing it")
    return out


def _attention(module: nn.Module):
    """``(name, module, v_proj, o_proj, head_dim or None)`` of every submodule with ``v_proj`` and ``o_proj`` Linears."""
    for name, mod in module.named_modules():
        v, o = getattr(mod, "v_proj", None), getattr(mod, "o_proj", None)
        if isinstance(v, nn.Linear) and isinstance(o, nn.Linear):
            d = getattr(mod, "head_dim", None)
            yield name, mod, v, o, d if isinstance(d, int) else None


def _head_dims(model: nn.Module) -> list[int]:
    return [d for *_, d in _attention(model) if d is not None]


def _ptr(t) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


def _first_tensor(args, kwargs):
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return kwargs.get("hidden_states")


def _out_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _norm_like(mod: nn.Module, hidden: int) -> bool:
    p = dict(mod.named_parameters(recurse=False))
    return set(p) == {"weight"} and p["weight"].dim() == 1 and p["weight"].shape[0] == hidden


def _norm_with(norm: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` (float32) with its weight swapped for the plain float32 ``weight`` during the call; the
    module's own weight (a sharded one too) put back after."""
    p = norm._parameters["weight"]
    try:
        norm._parameters["weight"] = nn.Parameter(weight.float().to(p.device), requires_grad=False)
        return norm(x.float().to(p.device)).float()
    finally:
        norm._parameters["weight"] = p


def _norm_affine(norm: nn.Module, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)``: the norm's output on a constant input is ``a * w + b`` per channel (``w`` its scale):
    ``(1, 0)`` for ``w * x``, ``(1, 1)`` for Gemma's ``(1 + w) * x``.  Measured with the weight at zeros,
    then ones, on a constant input (which normalizes to 1: eps / 1e6 off)."""
    x = torch.full((1, hidden), 1e3)
    zero, one = (_norm_with(norm, torch.full((hidden,), v), x).reshape(-1) for v in (0.0, 1.0))
    return one - zero, zero


def _norm_scale(norm: nn.Module, affine: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The norm's effective per-channel scale ``a * w + b`` (float32, whole; a collective when sharded)."""
    a, b = affine
    return a * full_tensor(norm.weight).float().to(a.device) + b


def _set_local(p: torch.Tensor, whole: torch.Tensor) -> None:
    """This rank's part of ``p`` from ``whole`` (the new value of all of ``p``)."""
    local, off = local_box(p)
    local.copy_(whole[tuple(slice(o, o + s) for o, s in zip(off, local.shape))].to(local.dtype))


def _map_local(p: torch.Tensor, fn) -> None:
    """``p``'s local part through ``fn`` (a column operation: rows stay where they are)."""
    local, _ = local_box(p)
    if local.numel():
        local.copy_(fn(local))


def _map_whole(p: torch.Tensor, fn) -> None:
    """``p`` whole (gathered: a collective) through ``fn``; each rank keeps its part."""
    _set_local(p, fn(full_tensor(p)))


class Rotation:
    """One job's rotations: ``start`` (probe, root), then ``block`` per block, ``root_tensors`` at the end."""

    def __init__(self, model: nn.Module, kinds, seed: int, device: torch.device, block: int | None = None):
        self.model, self.kinds, self.seed, self.device, self.size = model, tuple(kinds), seed, device, block
        emb = model.get_input_embeddings()
        self.hidden = int(emb.weight.shape[1])
        self.r1 = "r1" in self.kinds
        self.q = None  # R1, built by start()
        self.report: dict = {"rotations": list(self.kinds), "hidden_size": self.hidden, "block": block,
                             "r1": None, "r2": {}, "blocks": {}, "tolerance": TOLERANCE}
        self.r4: dict[int, torch.Tensor] = {}  # down_proj's input size -> the online block Q_b (float64)
        if "r4" in self.kinds:
            self.report["r4"] = {"type": "random-hadamard", "head_dim": block, "group": R4_GROUP}
        self.heads: dict[int, torch.Tensor] = {}
        self.probe = None
        self.tied = False
        self.lm_head_name = None
        self.g_final = None

    # ---- the root
    def start(self, dtype: torch.dtype | None) -> None:
        """The probe's block kwargs (from the unrotated embeddings), then R1 on the root, proven."""
        g = torch.Generator().manual_seed(self.seed + 1)
        ids = torch.randint(0, self.model.get_input_embeddings().weight.shape[0], (1, PROBE_TOKENS), generator=g)
        h0, kw = capture_block0(self.model, ids, self.device, dtype=dtype)[0]
        self.probe = (h0.detach(), kw)
        if self.r1:
            q, self.report["r1"] = orthogonal(self.hidden, self.seed, self.size)
            self.q = q.float().to(self.device)
            self._root()

    def _final_norm(self) -> tuple[str, nn.Module]:
        """The one norm-like module of the decoder's root (beside the layers), which ``lm_head`` reads."""
        layers = decoder_blocks(self.model)[0][0].rsplit(".", 1)[0]
        inner_name = layers.rsplit(".", 1)[0] if "." in layers else ""
        inner = self.model.get_submodule(inner_name)
        found = [(f"{inner_name}.{n}" if inner_name else n, m) for n, m in inner.named_children()
                 if _norm_like(m, self.hidden)]
        if len(found) != 1:
            raise SqError(f"--rotate r1: {type(self.model).__name__} has {len(found)} norm-like modules beside its "
                          f"decoder layers ({', '.join(n for n, _ in found) or 'none'}); the final norm that "
                          "lm_head reads cannot be told, so the rotation cannot be proven")
        return found[0]

    def _root(self) -> None:
        model, q = self.model, self.q
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        if head is None or getattr(head, "weight", None) is None or head.weight.shape[-1] != self.hidden:
            raise SqError("--rotate r1: the model has no lm_head reading the hidden size")
        norm_name, norm = self._final_norm()
        self.lm_head_name = next(n for n, m in model.named_modules() if m is head) + ".weight"
        self.tied = head.weight is emb.weight
        a, b = _norm_affine(norm, self.hidden)
        w = full_tensor(norm.weight).float()
        g = _norm_scale(norm, (a, b))
        # the probe: this rank's logits before, through the final norm module itself, on hidden states h
        h = torch.randn(PROBE_TOKENS, self.hidden, generator=torch.Generator().manual_seed(self.seed + 2)).to(self.device)
        ref = _norm_with(norm, w, h) @ local_box(head.weight)[0].float().T
        _map_local(emb.weight, lambda t: rotate_input(t, q))
        if not self.tied:
            _map_local(head.weight, lambda t: rotate_input(t, q, g))
        self._set_one(norm, a, b)
        self.g_final = g
        w_new = local_box(head.weight)[0]
        w_new = (_untied(w_new, q, g) if self.tied else w_new).float()
        got = _norm_with(norm, full_tensor(norm.weight), h @ q) @ w_new.T
        err = _rel(got - ref, ref)
        self._check(err, f"the root ({norm_name} -> {self.lm_head_name})")
        self.report["root"] = {"final_norm": norm_name, "lm_head": self.lm_head_name, "untied": self.tied,
                               "error": err}

    def _set_one(self, norm: nn.Module, a: torch.Tensor, b: torch.Tensor) -> None:
        """The norm's scale set to its "one": ``a * w + b = 1``."""
        if torch.any(a.abs() < 1e-6):
            raise SqError(f"--rotate r1: {type(norm).__name__} maps a constant input to zero (it centres its input: "
                          "a LayerNorm, which a rotation does not commute with)")
        one = (1 - b) / a
        _set_local(norm.weight, one.to(norm.weight.device))

    def root_tensors(self) -> dict[str, torch.Tensor]:
        """Whole tensors rank 0 writes beside the root's own: a tied ``lm_head`` untied, as the rotated
        embedding with the final norm folded back in (``E Q (Q^T diag(g) Q)``).  A collective."""
        if not (self.r1 and self.tied):
            return {}
        emb = full_tensor(self.model.get_input_embeddings().weight)
        return {self.lm_head_name: _untied(emb, self.q, self.g_final)}

    def config(self, config: dict) -> dict:
        """The written config: untied where a tied lm_head was written as a tensor of its own."""
        if self.r1 and self.tied:
            config = dict(config)
            config["tie_word_embeddings"] = False
            for k, v in list(config.items()):  # a VLM's text config carries the flag too
                if isinstance(v, dict) and "tie_word_embeddings" in v:
                    config[k] = {**v, "tie_word_embeddings": False}
        return config

    # ---- one block
    def block(self, b: int, prefix: str, block: nn.Module, nonfinite=()) -> None:
        """Roles traced, weights rotated, the block's proof; every rank together (collectives).
        ``nonfinite``: the block's Linears holding NaN/Inf (the same list on every rank): refused."""
        if nonfinite:
            raise SqError(f"--rotate: {', '.join(nonfinite)} hold NaN/Inf values, which a rotation would spread "
                          "over every weight it touches; fix the checkpoint or run without --rotate")
        h0, kw = self.probe
        gen = torch.Generator().manual_seed(self.seed + 1000 + b)
        x = (torch.randn(h0.shape, generator=gen) * h0.float().std()).to(device=h0.device, dtype=h0.dtype)
        kwb = block_kwargs(kw, block)
        records, ref = self._trace(block, x, kwb)
        readers, writers, norms = self._roles(prefix, block, records, x) if self.r1 else ({}, {}, {})
        want = ref.float() - x.float()
        errors = {}
        if self.r1:
            self._rotate_r1(prefix, readers, writers, norms)
            want = want @ self.q
            x = (x.float() @ self.q).to(x.dtype)
            errors["r1"] = self._prove(block, x, kwb, want, f"block {b} ({prefix})", "r1")
        heads = 0
        if "r2" in self.kinds:
            heads = self._rotate_r2(prefix, block)
            if heads:
                errors["r2"] = self._prove(block, x, kwb, want, f"block {b} ({prefix})", "r2")
        online = 0
        if "r4" in self.kinds:
            online = self._rotate_r4(block)
            errors["r4"] = self._prove(block, x, kwb, want, f"block {b} ({prefix})", "r4")
        err = max(errors.values(), default=0.0)
        self.report["blocks"][prefix] = {"readers": len(readers), "writers": len(writers), "norms": len(norms),
                                         "heads": heads, "online": online, "error": round(err, 6)}
        logger.debug("block %d rotated: readers %s, writers %s, norms %s, %d heads; error %.2e", b,
                     {k: v[1] for k, v in readers.items()}, list(writers), list(norms), heads, err)

    def _prove(self, block, x, kw, want, what: str, kind: str) -> float:
        """The block's contribution on the rotated probe against the rotated contribution before: the
        relative error, the same on every rank (a refusal naming ``kind`` above the tolerance)."""
        got = _out(self._forward(block, x, kw)).float() - x.float()
        return self._check(_rel(got - want, want), what, kind)

    def _forward(self, block, x, kw):
        with torch.no_grad(), unsharded(block):
            return block(x, **kw)

    def _trace(self, block: nn.Module, x, kw):
        """One forward with every parameter-holding module recorded: (module, input, output) tensors."""
        records: list[tuple[str, nn.Module, torch.Tensor | None, torch.Tensor | None]] = []
        hooks = []
        for name, mod in block.named_modules():
            if mod is block or not (any(True for _ in mod.parameters(recurse=False)) or is_experts_module(mod)):
                continue

            def hook(m, args, kwargs, out, name=name):
                records.append((name, m, _first_tensor(args, kwargs), _out_tensor(out)))

            hooks.append(mod.register_forward_hook(hook, with_kwargs=True))
        try:
            out = _out(self._forward(block, x, kw))
        finally:
            for h in hooks:
                h.remove()
        return records, out

    def _roles(self, prefix, block, records, x):
        """Readers ``{name: (module, norm name or None)}``, writers ``{name: module}``, norms ``{name: module}``
        from the traced tensors (identity of storage: a view of the norm's output is its output)."""
        H = self.hidden
        norm_out = {}
        for name, m, _, out in records:
            if _norm_like(m, H) and out is not None and out.shape[-1] == H:
                norm_out.setdefault(_ptr(out), name)
        x_ptr = _ptr(x)
        readers, writers, norms = {}, {}, {}
        for name, m, inp, out in records:
            src = _ptr(inp)
            if src in norm_out and norm_out[src] != name:
                norm = norm_out[src]
            elif src == x_ptr and not _norm_like(m, H):
                norm = None
            else:
                norm = False
            if norm is not False:
                if not (is_experts_module(m) or _reads_hidden(m, H)):
                    if any(any(True for _ in c.parameters()) for c in m.children()):
                        continue  # a container (attention with sinks, a router with its bias): children traced
                    raise SqError(f"--rotate r1: {prefix}.{name} ({type(m).__name__}) reads the residual stream "
                                  "but is neither a Linear-like weight [*, hidden] nor fused experts; its rotation "
                                  "cannot be proven")
                readers[name] = (m, norm)
                if norm is not None:
                    norms[norm] = block.get_submodule(norm)
            elif isinstance(m, nn.Linear) and m.out_features == H:
                writers[name] = m
        written = {_ptr(out) for name, m, _, out in records if name in writers or is_experts_module(m)}
        for name, m, inp, _ in records:  # a norm of what a writer wrote, before the residual add (a sandwich norm)
            if _norm_like(m, H) and _ptr(inp) in written:
                raise SqError(f"--rotate r1: {prefix}.{name} ({type(m).__name__}) normalizes a branch's output before "
                              "the residual add (a sandwich norm): a rotation does not commute with its per-channel "
                              "scale")
        for name, m, _, _ in records:  # an experts module writes through its down_proj whatever it reads
            if is_experts_module(m) and name not in readers:
                raise SqError(f"--rotate r1: {prefix}.{name}'s input is not a norm's output; cannot be proven")
        return readers, writers, norms

    def _rotate_r1(self, prefix, readers, writers, norms) -> None:
        q = self.q
        affine = {n: _norm_affine(m, self.hidden) for n, m in norms.items()}
        scales = {n: _norm_scale(m, affine[n]) for n, m in norms.items()}
        for name, (m, norm) in readers.items():
            g = scales[norm] if norm is not None else None
            if is_experts_module(m):
                _map_local(m._parameters[expert_params(m)[0]], lambda w: rotate_input(w, q, g))
                down = m._parameters["down_proj"]
                local, off = local_box(down)
                whole_rows = full_expert_rows(local, down)  # [n_local, H, I]: rows gathered in the dp group
                new = rotate_output(whole_rows, q)
                local.copy_(new[:, off[1]:off[1] + local.shape[1]])
            else:
                _map_local(m.weight, lambda w: rotate_input(w, q, g))
        for name, m in writers.items():
            _map_whole(m.weight, lambda w: rotate_output(w, q))
            if m.bias is not None:
                _map_whole(m.bias, lambda v: rotate_output(v, q))
        for n, m in norms.items():
            self._set_one(m, *affine[n])

    def _rotate_r2(self, prefix: str, block: nn.Module) -> int:
        """Per-head rotations of each attention module with ``v_proj`` and ``o_proj`` Linears; the heads rotated."""
        n = 0
        for name, _, v, o, d in _attention(block):
            if d is None or v.out_features % d or o.in_features % d:
                raise SqError(f"--rotate r2: {prefix}.{name} has no head_dim dividing v_proj's "
                              f"{v.out_features} rows and o_proj's {o.in_features} columns")
            if d not in self.heads:
                hq, kind = orthogonal(d, self.seed + 7, self.size)
                self.heads[d] = hq.float().to(self.device)
                self.report["r2"][str(d)] = kind
            h = self.heads[d]
            _map_whole(v.weight, lambda w: rotate_head_rows(w, h))
            if v.bias is not None:
                _map_whole(v.bias, lambda t: rotate_head_rows(t[:, None], h)[:, 0])
            _map_local(o.weight, lambda w: rotate_head_columns(w, h))
            n += v.out_features // d
        return n

    def _r4_block(self, size: int) -> torch.Tensor:
        if size not in self.r4:
            qb = online_hadamard(size, self.seed + 11, self.size)
            if qb is None:  # rotation_problems refused it before anything was mutated
                raise AssertionError(f"no Hadamard block for down_proj's input size {size}")
            self.r4[size] = qb
        return self.r4[size]

    def _rotate_r4(self, block: nn.Module) -> int:
        """Each dense ``down_proj``'s columns times ``I ⊗ Q_b`` (a column operation: rows stay where they
        are) and its input rotated the same way by a pre-hook run before any other; the Linears rotated."""
        n = 0
        for _, m in r4_linears(block):
            qb = self._r4_block(m.in_features)
            _map_local(m.weight, lambda w: blockwise(w, qb))
            qd = qb.float().to(self.device)
            m.register_forward_pre_hook(lambda _m, args, qd=qd: (blockwise(args[0], qd), *args[1:]), prepend=True)
            n += 1
        return n

    def online_tensors(self, block: nn.Module, dtype: torch.dtype) -> list[tuple[str, str, torch.Tensor]]:
        """``(module name in block, "R4_input.weight", sqrt(b) Q_b)`` (exact ±1, ``dtype``) per R4-rotated Linear."""
        if "r4" not in self.kinds:
            return []
        out = []
        for n, m in r4_linears(block):
            qb = self.r4.get(m.in_features)
            if qb is not None:
                out.append((n, f"{R4_GROUP}_input.weight", (qb * qb.shape[0] ** 0.5).round().to(dtype)))
        return out

    def transform_config(self, ckpt_module) -> dict | None:
        """compressed-tensors' ``TransformConfig`` fields for R4 over :func:`r4_modules` (named in the checkpoint
        by ``ckpt_module(name)``, ``"...down_proj."``), or None without R4.  ``head_dim`` is the block (None:
        the whole input)."""
        if "r4" not in self.kinds:
            return None
        targets = [ckpt_module(n).removesuffix(".") for n, _ in r4_modules(self.model)]
        apply = [{"targets": list(targets), "location": "input"},
                 {"targets": list(targets), "location": "weight_input", "inverse": True}]
        return {"config_groups": {R4_GROUP: {"type": "random-hadamard", "apply": apply, "randomize": False,
                                              "requires_grad": False, "head_dim": self.size}}}

    def _check(self, err: float, what: str, kind: str = "r1") -> float:
        t = torch.tensor([err], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the same verdict on every rank
        err = float(t)
        if not err <= TOLERANCE:
            why = ("an elementwise gate or norm on the attention heads' values" if kind == "r2" else
                   "a down_proj whose input is used by another module too" if kind == "r4" else
                   "a norm that is not a root-mean-square one, a per-channel residual scale, or a module reading "
                   "the stream another way")
            raise SqError(f"--rotate {kind}: {what} does not compute the same function after the rotation "
                          f"(relative error {err:.3g} on a probe, tolerance {TOLERANCE}): its layout is not one sq "
                          f"can rotate ({why}); run without --rotate {kind}")
        logger.debug("--rotate %s proven on %s: relative error %.2e", kind, what, err)
        return err


def _reads_hidden(m: nn.Module, hidden: int) -> bool:
    w = m._parameters.get("weight")
    return w is not None and w.dim() == 2 and w.shape[1] == hidden


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    den = float(ref.float().norm())
    return float(diff.float().norm()) / den if den > 0 else float(diff.float().norm())


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def _untied(emb_rot: torch.Tensor, q: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    m = q.T @ (g.to(q.device)[:, None] * q)
    return (emb_rot.float() @ m).to(emb_rot.dtype)
