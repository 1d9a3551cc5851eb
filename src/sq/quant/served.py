"""``--served-activations``: the quantized chain quantizes each Linear's input as the serving engine will.

A scheme with quantized activations (NVFP4 and MXFP4's fp4 groups, MXFP8, FP8 / INT8 per token, FP8
static) is served with every dense Linear's input rounded at run time.  By default sq calibrates as
llm-compressor does: the quantized chain carries quantized weights and float activations.  With
``--served-activations`` it carries what the served model computes: a forward pre-hook on each dense
quantized Linear rounds its input with the scheme's activation quantization (``activation_spec``; static
scales from the block's observed absmax, all-reduced, the same on every rank) on

- the pipeline's chain forward of the quantized block (the next block's calibration inputs), and
- GPTQ's (and GPTAQ's) quantized-chain Hessian forward: the weights are fitted to the inputs they will
  be served with (GPTAQ's full-precision pass stays unrounded: its target).

The hooks are added after every other pre-hook (an online rotation's runs first, as vLLM rotates then
quantizes).  Routed experts keep float activations in the chain (refused with the flag).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from sq.formats import primitives as P

__all__ = ["activation_spec", "served_activations_problems", "ServedActivations"]

# ``QuantScheme.activations`` -> (the input's QuantSpec over [tokens, in], the observed statistic it reads)
_SPECS: dict[str, tuple[P.QuantSpec, str | None]] = {
    "nvfp4_static_global": (P.QuantSpec(P.PerGroup(16), P.FP4_E2M1, torch.float8_e4m3fn, global_scale=True),
                            "global_absmax"),
    "mxfp4_dynamic": (P.QuantSpec(P.PerGroup(32), P.FP4_E2M1, P.E8M0), None),
    "mxfp8_dynamic": (P.QuantSpec(P.PerGroup(32), P.FP8_E4M3, P.E8M0), None),
    "fp8_dynamic_token": (P.QuantSpec(P.PerChannel(), P.FP8_E4M3), None),
    "fp8_dynamic_group128": (P.QuantSpec(P.PerGroup(128), P.FP8_E4M3), None),
    "int8_dynamic_token": (P.QuantSpec(P.PerChannel(), P.int_type(8)), None),
    "fp8_static_tensor": (P.QuantSpec(P.PerTensor(), P.FP8_E4M3), "absmax"),
}


def activation_spec(kind: str) -> tuple[P.QuantSpec, str | None] | None:
    """``(spec, statistic)`` of an activation kind (None: float activations)."""
    return _SPECS.get(kind)


def served_activations_problems(cfg, targets) -> list[str]:
    """Refusals of ``--served-activations`` (identical on every rank, before anything is mutated)."""
    if not cfg.served_activations:
        return []
    out = []
    if cfg.algo.name not in ("gptq", "gptaq"):
        out.append(f"--served-activations rounds the inputs of GPTQ's quantized chain; --algo {cfg.algo.name} "
                   "calibrates another way (use gptq or gptaq)")
    if any(targets.experts):
        out.append("--served-activations: routed experts keep float activations in the chain; not for models "
                   "with quantized experts")
    kinds = {l.scheme.activations for block in targets.linears for l in block}
    if not any(activation_spec(k) for k in kinds):
        out.append("--served-activations: no quantized Linear's scheme quantizes its activations (W4A4, W8A8, "
                   "FP8, ... do; weight-only schemes do not)")
    return out


class ServedActivations:
    """Pre-hooks rounding each dense quantized Linear's input as served; ``active()`` says when (GPTAQ's
    full-precision pass runs unrounded).  ``absmax``: the block's observed, all-reduced input absmax per
    Linear (static scales).  ``remove()`` when done."""

    def __init__(self, linears, absmax: dict[str, torch.Tensor], active: Callable[[], bool] = lambda: True):
        self.handles = []
        # the last rounding: Linears reading the very same input (q/k/v, gate/up) with the same rounding
        # reuse it instead of rounding it again (the rounding costs ~2/3 of a fused q/k/v matmul)
        self._last: tuple | None = None
        for lin in linears:
            found = activation_spec(lin.scheme.activations)
            if found is None:
                continue
            spec, stat = found
            stats = None if stat is None else {stat: absmax[lin.name]}
            key = (spec, None if stat is None else float(absmax[lin.name].reshape(-1)[0]))
            self.handles.append(lin.module.register_forward_pre_hook(self._hook(spec, stats, key, active)))

    def _hook(self, spec, stats, key, active):
        def hook(_m: nn.Module, args):
            if not active():
                return None
            x = args[0]
            last = self._last
            if last is not None and last[0] is x and last[1] == x._version and last[2] == key:
                return (last[3], *args[1:])
            y = P.fake_quantize(x.reshape(-1, x.shape[-1]), spec, stats=stats).reshape(x.shape)
            self._last = (x, x._version, key, y)
            return (y, *args[1:])
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self._last = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
