"""Calibrated activation scales: what a scheme's static activations and the FP8 KV cache need.

Two kinds of checkpoint tensor come from calibration data rather than from weights:

- per quantized Linear, the static activation tensors its scheme declares
  (``sq.formats.specs.activation_observers``): FP8's ``input_scale``, NVFP4's
  ``input_global_scale``; routed experts each have their own (gate and up read the same input
  and share it; down reads the expert's intermediate activations);
- per attention layer, with ``--kv-cache fp8``: ``k_scale`` and ``v_scale``, the fp8 scales
  of the keys and values the attention reads (after the rotary embedding: what the cache holds).

Each is the absmax of everything observed, over every rank's tokens, turned into the tensor
as compressed-tensors' ``static_minmax`` observer does (``ActivationObserver.finalize``).

When.  The pipeline runs one observed forward of the block on its current inputs with the
block's weights still in full precision -- before any algorithm solves it -- exactly when
llm-compressor's sequential pipeline calibrates a subgraph (quantization disabled, inputs
from the chain it propagates).  For RTN that chain is the full-precision one (its outputs
are the next block's inputs); a data-driven algorithm observes on the quantized chain it
carries anyway.  Dense Linears: each rank keeps a running max, then one all-reduce (MAX)
per block.  Experts: the holding rank sees every rank's tokens routed to its experts (the
gather of ``sq.quant.experts.ExpertCalibration``), so no reduction; an expert no token reached
(possible only without ``--calibrate-all-experts``) gets the finite fallbacks: ``input_scale``
the dtype's eps, ``input_global_scale`` from an absmax of 0 as the library computes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from sq.quant.attention import sdpa
from sq.quant.experts import ExpertCalibration
from sq.quant.work import ObservedScales
from sq.formats.specs import ActivationObserver, activation_observers

__all__ = ["KV_CACHE_SCHEMES", "KV_SCALES", "ActivationObservation", "kv_cache_args", "kv_cache_problems",
           "attention_modules", "observes_activations"]

# --kv-cache choices -> compressed-tensors' kv_cache_scheme (QuantizationArgs fields)
KV_CACHE_SCHEMES: dict[str, dict | None] = {
    "none": None,
    # static_minmax: the running max over every token (what sq computes, over all ranks); the
    # library's default for a KV cache (observer None -> "minmax") is a moving average of per-batch
    # ranges, which depends on the batch order and has no distributed equivalent
    "fp8": dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True,
                observer="static_minmax"),
}
KV_SCALES = (ActivationObserver("k_scale", "scale"), ActivationObserver("v_scale", "scale"))

_ATTN_IMPL = "sq_observed_sdpa"
_WATCHED: dict[int, Callable] = {}  # id(attention module) -> recorder of (key, value)


def _observed_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA (the job's, ``sq.quant.attention``), after handing the keys and values to the module's recorder
    (if watched)."""
    record = _WATCHED.get(id(module))
    if record is not None:
        record(key, value)
    return sdpa(module, query, key, value, attention_mask, **kwargs)


def _register_impl() -> None:
    from transformers import AttentionInterface

    if _ATTN_IMPL not in AttentionInterface._global_mapping:
        AttentionInterface.register(_ATTN_IMPL, _observed_sdpa)


def observes_activations(assigner) -> bool:
    """Whether any scheme the assigner can give writes calibrated activation tensors."""
    schemes = [assigner.default, *(r.scheme for r in assigner.rules)]
    return any(activation_observers(s) for s in schemes if s is not None)


def kv_cache_args(kind: str):
    """compressed-tensors' ``QuantizationArgs`` for ``--kv-cache kind`` (None for ``none``)."""
    from compressed_tensors.quantization import QuantizationArgs

    args = KV_CACHE_SCHEMES[kind]
    return None if args is None else QuantizationArgs(**args)


def attention_modules(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The block's attention modules (relative names): the modules whose forward calls the
    attention interface, recognised as modules with ``o_proj`` beside a config."""
    return [(n, m) for n, m in block.named_modules()
            if hasattr(m, "config") and isinstance(getattr(m, "o_proj", None), nn.Module)]


def kv_cache_problems(blocks: list[tuple[str, nn.Module]], kind: str) -> list[str]:
    """Why ``--kv-cache kind`` cannot be calibrated on these decoder blocks ([] if it can)."""
    if kind == "none":
        return []
    problems = []
    for prefix, block in blocks:
        attn = attention_modules(block)
        if not attn:
            problems.append(f"--kv-cache {kind}: {prefix} has no attention module sq recognises (a module with "
                            "o_proj and a config) to observe its keys and values")
        for n, m in attn:
            if hasattr(m, "kv_a_proj_with_mqa") or hasattr(m, "kv_b_proj"):
                problems.append(f"--kv-cache {kind}: {prefix}.{n} is multi-head latent attention, whose cache "
                                "engines keep as the compressed latent; sq calibrates per-head key/value caches only")
        if problems:
            break
    return problems


def _absmax(x: torch.Tensor) -> torch.Tensor:
    return ActivationObserver.local(x).float()


class ActivationObservation:
    """One block's observed forward: register, run (``block_forward(..., counters=[obs, *obs.experts])``),
    then :meth:`reduce` and :meth:`scales`.  ``on`` is switched off for dummy batches."""

    def __init__(self, model: nn.Module, work, kv_cache: str, device: torch.device):
        self.on = True
        self.model, self.device = model, device
        self.dense: dict[str, torch.Tensor] = {}
        self.linears = {l.name: l for l in work.linears if activation_observers(l.scheme)}
        self.handles = [l.module.register_forward_pre_hook(self._dense_hook(n)) for n, l in self.linears.items()]
        for n in self.linears:
            self.dense[n] = torch.zeros(1, dtype=torch.float32, device=device)
        self.experts = [(eprefix, scheme, ExpertCalibration(ex, work.calibrate_all_experts, device, hessians=False,
                                                            absmax=True))
                        for eprefix, ex, scheme in work.experts if activation_observers(scheme)]
        self.kv: dict[str, torch.Tensor] = {}  # attention module name -> float32 [2] (k, v absmax)
        self._impl = None
        if kv_cache != "none":
            _register_impl()
            for n, m in attention_modules(work.block):
                name = f"{work.prefix}.{n}" if n else work.prefix
                self.kv[name] = torch.zeros(2, dtype=torch.float32, device=device)
                _WATCHED[id(m)] = self._kv_recorder(name)
            self._watched = [m for _, m in attention_modules(work.block)]
            self._impl = model.config._attn_implementation
            model.set_attn_implementation(_ATTN_IMPL)

    @property
    def counters(self) -> list:
        return [self, *(c for _, _, c in self.experts)]

    def _dense_hook(self, name: str):
        def hook(module, args):
            if self.on:
                torch.maximum(self.dense[name], _absmax(args[0]), out=self.dense[name])
        return hook

    def _kv_recorder(self, name: str):
        def record(key, value):
            if self.on:
                both = torch.cat([_absmax(key), _absmax(value)])
                torch.maximum(self.kv[name], both, out=self.kv[name])
        return record

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for _, _, c in self.experts:
            c.remove()
        if self._impl is not None:
            for m in self._watched:
                _WATCHED.pop(id(m), None)
            self.model.set_attn_implementation(self._impl)

    def reduce(self) -> None:
        """Dense and KV statistics: the max over every rank's tokens (one all-reduce; collective)."""
        names, kv = list(self.dense), list(self.kv)
        if not names and not kv:
            return
        flat = torch.cat([self.dense[n] for n in names] + [self.kv[n] for n in kv])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        for i, n in enumerate(names):
            self.dense[n] = flat[i:i + 1]
        for j, n in enumerate(kv):
            self.kv[n] = flat[len(names) + 2 * j:len(names) + 2 * j + 2]

    def scales(self, dtype: torch.dtype) -> ObservedScales:
        """The checkpoint tensors, from the reduced statistics; ``dtype``: the activations' dtype.
        KV cache scales only with a KV cache scheme."""
        out = ObservedScales()
        for n, lin in self.linears.items():
            out.linears[n] = {o.name: o.finalize(self.dense[n], dtype) for o in activation_observers(lin.scheme)}
            out.absmax[n] = self.dense[n]
        for eprefix, scheme, c in self.experts:
            obs = activation_observers(scheme)
            for e in c.mine:
                out.experts[(eprefix, e, "in")] = {o.name: o.finalize(c.amax_in[e], dtype) for o in obs}
                out.experts[(eprefix, e, "mid")] = {o.name: o.finalize(c.amax_mid[e], dtype) for o in obs}
        for n, t in self.kv.items():
            out.kv[n] = {o.name: o.finalize(t[i:i + 1], dtype) for i, o in enumerate(KV_SCALES)}
        return out
