"""GPTQ (Frantar et al., 2022) on any subset of a Linear's output rows.

One small class with three verbs, as IST-DASLab's ``gptq.py``: ``add_batch`` accumulates
``H = sum x^T x`` over calibration inputs, ``quantize`` runs the whole algorithm on the
rows this rank holds, ``free`` drops the Hessian.

Why rows can be split across ranks: GPTQ quantizes column by column and pushes each
column's error onto the later columns *of the same row* (``W[r, j:] -= err[r] *
Hinv[i, j:] / Hinv[i, i]``).  Rows never mix, so given the full ``in x in`` Hessian
(summed over every rank's tokens) a rank can solve its own rows alone.  Scales are
per row too (groups run along ``in``).  (The pipeline uses this to stack Linears that share a
Hessian and experts that share one, and to solve a stack on any one rank; a solve's cost is
mostly per column, not per row, so it does not split one weight's rows over ranks.)

Numerics: the Hessian is accumulated in float32, as the reference and the peers keep it -- per
calibration sample ``x^T x`` (its upper block triangle, mirrored; bf16 inputs as bf16 operands with
float32 sums), summed in float32.  Its memory is what bounds a rank at real widths (DeepSeek-V3's
o_proj reads 16384 channels: 1 GiB in float32, 2 in float64), so float64 is kept only where it is
cheap (vectors, the rare fallback below).  What float64 sums bought was a sum over ranks (which split
by samples) equal to the single process's up to float64 rounding; in float32 the rank count changes
the summation order, so 1 and 2 ranks agree to float32 rounding of ``H`` (the conformance bound),
while a resumed run, which keeps its world size, stays bit-identical.  The damped inverse factor is
computed in float32 when a residual check passes, else in float64 (``_inverse_cholesky``), and the
column sweep runs in float32.  The solve's working set is the raw sum, the permuted copy and the
factor, each ``in x in`` float32 (``_permuted``, ``_lower_inverse_into``, ``_flipped_into``).  Scales are computed by the scheme's own format maths
(:func:`sq.formats.primitives.choose_qparams` with the ``QuantSpec`` of ``formats.spec_for``) on the
weights rounded to their storage dtype, so a GPTQ scale is exactly the one compressed-tensors
would compute for those (error-updated) weights; the error that is propagated is the
difference to the value a loader will reconstruct, ``(q - zp) * scale`` in that dtype.

Formats: every scheme whose scales are per row -- per channel or per group along ``in`` --
int (W4A16 ... W8A8, W4A8), FP8 per channel, the fp4 formats (NVFP4: e2m1 groups of 16,
float8_e4m3fn group scales under one float32 global scale; MXFP4: groups of 32, e8m0
power-of-two scales) and MXFP8.  The quantizer inside the sweep is the format's: its element
rounding (fp4 e2m1, fp8), its scale type (fp8 / e8m0 rounding of each group scale) and
NVFP4's global scale, which is a statistic of the whole weight -- the all-reduced
``global_absmax`` (shared by fused partners) passed as ``stats``, fixed before the sweep --
while the group scales under it are like any group scale: fixed up front from the weights with
act-order / static groups (llm-compressor 0.14 takes every qparam, global scale included, from
its observer before the sweep), else computed per group mid-sweep from the error-updated
columns.  Per-tensor and 2-D block scales (FP8, FP8_BLOCK) are refused.

To combine Hessians across ranks: all-reduce (SUM) ``gptq.H`` and ``gptq.nsamples``
(or build the object with :meth:`GPTQ.from_hessian`) before calling ``quantize``.

Weights that share one accumulator (q/k/v read the same input; with calibrate-all every
expert's gate/up reads every token) share its prepared Hessian: the normalized, dead-column
fixed, act-order permuted matrix and its damped inverse Cholesky factor are computed by the
first ``quantize`` call and reused by the later ones with the same settings (on DeepSeek-V3 a
7168 x 7168 factorization once per block instead of once per local expert).  Each call
would compute exactly that matrix from exactly the same inputs, so the bits do not change.  The
pipeline goes further and solves such weights as one stack of rows when their schemes match
(``sq.quant.algorithms.gptq``): one column loop for q/k/v instead of three.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sq.errors import SqError
from sq.formats import primitives
from sq.quant import rtn
from sq.formats.specs import spec_for
from sq.quant.settings import AlgoConfig, option
from sq.formats.schemes import QuantScheme, check_group_size

__all__ = ["GPTQ", "GPTQConfig", "GPTAQConfig", "GPTQResult", "Problem", "bf16_operand_products", "bf16_products",
           "bf16_products_available", "quantize_together", "hessian_dtype", "sym_products", "use_bf16_products"]

logger = logging.getLogger(__name__)

_BF32: bool | None = None  # _cpu_bf32's answer, once asked
_CHOSEN: bool | None = None  # use_bf16_products' setting (None: wherever the CPU has them)


def _cpu_bf32() -> bool:
    """Whether this torch and CPU can run float32 matmuls in oneDNN's bf16 mode at all (whether that is
    faster is measured: ``sq.probe.hessian_products_choice``)."""
    global _BF32
    if _BF32 is None:
        mm = getattr(torch.backends.mkldnn, "matmul", None)
        try:
            _BF32 = bool(mm is not None and hasattr(mm, "fp32_precision") and torch.backends.mkldnn.is_available()
                         and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            _BF32 = False
    return _BF32


def bf16_products_available() -> bool:
    """Whether bf16-operand products (``use_bf16_products``) can run here."""
    return _cpu_bf32()


def use_bf16_products(on: bool | None) -> None:
    """Process-wide: whether the Hessians' (and GPTAQ's cross terms') products of bf16 inputs on CPU run as
    bf16 operands with float32 sums (``_bf16_operands``) or in float32.  A job sets what its probe chose
    (or its run recorded): the two differ in summation order, so a run keeps one.  None: wherever the CPU
    has them (the default for callers outside a job)."""
    global _CHOSEN
    _CHOSEN = None if on is None else bool(on) and _cpu_bf32()


def bf16_products() -> bool:
    """The process's current setting (``use_bf16_products``)."""
    return _CHOSEN if _CHOSEN is not None else _cpu_bf32()


def _bf16_operands(on: bool):
    """``bf16_operand_products`` where the setting (``use_bf16_products``) has them."""
    return bf16_operand_products(on and bf16_products())


@contextmanager
def bf16_operand_products(on: bool):
    """Float32 CPU matmuls computed by oneDNN from bf16 operands with float32 accumulation and a float32
    result ("bf32"), for operands whose values are bf16 already: rounding them to bf16 is exact, so the
    product is the float32 one up to summation order (one thread, 16 x 512 tokens, band products: with AMX
    0.079 s against 0.186 s at 1536 wide; on an AMD EPYC with AVX512-BF16 0.233 against 0.264 s, and equal
    at 576).  A process-wide torch setting, restored on exit; a no-op for ``on=False`` or where the CPU has
    no such mode."""
    if not (on and _cpu_bf32()):
        yield
        return
    mm = torch.backends.mkldnn.matmul
    before = mm.fp32_precision
    mm.fp32_precision = "bf16"
    try:
        yield
    finally:
        mm.fp32_precision = before


def sym_products(H: Tensor, xs: Tensor, band: int | None = None) -> None:
    """``H += xs^T xs`` over its upper block triangle only, in row bands of ``band`` (``_SYM_BAND``): an
    entry is the same float32 dot product over the tokens either way; the lower triangle is left as it
    is (``GPTQ`` mirrors it when ``H`` is next read).  ``xs``: ``[tokens, n]`` float32."""
    n, band = xs.shape[1], band or _SYM_BAND
    for a in range(0, n, band):
        H[a : a + band, a:].add_(xs[:, a : a + band].T @ xs[:, a:])


# add_batch's row band for the upper block triangle of x^T x, measured on one CPU thread for
# 16 samples x 512 tokens: 0.17 s vs 0.31 s the full products at 1536 wide, 0.024 vs 0.037 s at 576
# (bands of 64-256 within 5% of each other)
_SYM_BAND = 128
# the column sweep's inner block: each column's error is pushed onto the later columns of its
# sub-block one by one, onto the rest of the lazy-update block once per sub-block
_SUB_BLOCK = 32


@dataclass(frozen=True)
class GPTQConfig(AlgoConfig):
    """Algorithm settings; ``GPTQ.quantize(w, scheme, **cfg.to_dict())``.

    ``actorder``: quantize columns by descending ``diag(H)`` ("static" act-order as in
    llm-compressor / vLLM: scales are fixed up front from the unpermuted weights, so the
    checkpoint stays plain group-wise, no ``g_idx``).  ``static_groups``: fixed up-front
    scales without reordering.  Otherwise a group's scales are computed when the sweep
    reaches its first column, from the error-updated weights (IST-DASLab default).
    ``max_retries``: failed Cholesky factorizations are retried with dampening
    ``percdamp * damp_growth**k``.
    """

    name = "gptq"

    blocksize: int = 128
    percdamp: float = 0.01
    actorder: bool = option(True, "column order: static act-order (descending Hessian diagonal, scales fixed "
                                  "up front, as llm-compressor) or off (natural order)",
                            choices={"static": True, "off": False})
    static_groups: bool = False
    max_retries: int = 4
    damp_growth: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.blocksize, bool) or not isinstance(self.blocksize, int) or self.blocksize <= 0:
            raise ValueError(f"blocksize must be a positive int, got {self.blocksize!r}")
        if not (isinstance(self.percdamp, (int, float)) and 0 < self.percdamp and math.isfinite(self.percdamp)):
            raise ValueError(f"percdamp must be a positive finite number, got {self.percdamp!r}")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        if not (isinstance(self.damp_growth, (int, float)) and self.damp_growth > 1):
            raise ValueError(f"damp_growth must be > 1, got {self.damp_growth!r}")



GPTAQ_FITS = ("all", "later")


@dataclass(frozen=True)
class GPTAQConfig(GPTQConfig):
    """GPTQ's settings plus GPTAQ's: each Linear is fitted to the full-precision model's outputs
    (its inputs on the full-precision chain) instead of to its own outputs on the quantized chain
    (``_asymmetric_map``).  ``gptaq_alpha`` weighs the correction (the GPTAQ paper's 0.25)."""

    name = "gptaq"
    # auto-round's full-range grid under --int-grid auto: GPTAQ has no peer whose bits it must match, and
    # on the standard benchmark it scores 11.93 there against 12.08 on the standard grid (docs/gptaq.md)
    default_int_grid = "full"

    gptaq_alpha: float = option(0.25, "weight of the correction toward the full-precision model's outputs "
                                      "(0 = plain GPTQ)")
    gptaq_fit: str = option("all", "what fits the full-precision outputs' drift: all (the least-squares "
                                   "correction over every input) or later (the GPTAQ paper's: each input's "
                                   "drift by the inputs after it)", choices={f: f for f in GPTAQ_FITS})

    def __post_init__(self) -> None:
        super().__post_init__()
        a = self.gptaq_alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a < 0:
            raise ValueError(f"gptaq_alpha must be a finite number >= 0, got {a!r}")
        if self.gptaq_fit not in GPTAQ_FITS:
            raise ValueError(f"gptaq_fit must be one of {', '.join(GPTAQ_FITS)}, got {self.gptaq_fit!r}")


@dataclass
class GPTQResult:
    """Quantized rows of one weight, as data (nothing is applied to a module)."""

    q: Tensor  # [rows, in] int8 (int schemes), float8_e4m3fn, or bf16 holding fp4 e2m1 values
    scale: Tensor  # [rows, n_groups] or [rows, 1]: weight dtype (float32 under a global scale)
    zero_point: Tensor | None  # like scale, int8; None when symmetric
    weight: Tensor  # [rows, in] dequantized, weight dtype: what a loader reconstructs
    loss: float  # GPTQ's own objective, sum_j (w - q)^2 / Hinv_jj^2 / 2 (reference)
    damp: float  # absolute dampening added to diag(H) that succeeded
    percdamp: float  # the same, relative to mean(diag(H))
    retries: int  # failed factorizations before success (0 = first try)
    dead_columns: int  # input channels never active in calibration (zeroed)
    nsamples: int
    seconds: float
    # NVFP4's float32 global scale: [1] for one weight; [n] when ``stats`` was a list of n row
    # segments (stacked experts), one per segment; None for schemes without one
    global_scale: Tensor | None = None
    _rel_err: Any = dataclasses.field(default=None, repr=False)  # a float, or the thunk computing it

    @property
    def rel_err(self) -> float:
        """``||(W - Q) X^T|| / ||W X^T||`` through the (undamped) Hessian, computed on first use
        (a ``rows x in x in`` matmul the pipeline, which measures its own, never needs)."""
        if callable(self._rel_err):
            self._rel_err = self._rel_err()
        return self._rel_err

    def stats(self) -> dict[str, Any]:
        """The scalar part, for the report."""
        return {
            k: getattr(self, k)
            for k in ("loss", "rel_err", "damp", "percdamp", "retries", "dead_columns", "nsamples", "seconds")
        }


class GPTQ:
    """Hessian accumulator and solver for one Linear of width ``in_features``."""

    def __init__(self, in_features: int, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        self.in_features = in_features
        dtype = dtype or hessian_dtype(in_features)
        self._H: Tensor | None = torch.zeros(in_features, in_features, dtype=dtype, device=device)
        self._upper = False  # only the upper block triangle of _H is current (see add_batch)
        # GPTAQ's cross term where the full-precision chain's inputs were given (add_batch's x_fp), as
        # accumulated (a sum over tokens: all-reduce it like H); ``D`` reads it.  None: GPTQ's objective
        self.cross: Tensor | None = None
        self._cross_is_c = False  # cross holds sum x_fp^T x (D = cross - H), else D itself
        self.nsamples = 0  # tokens seen (rows of the flattened inputs)
        self._prepared: _Prepared | None = None
        self.owner: int | None = None  # the rank its sum was reduced to, which alone solves against it
        # the dtype the report's errors read a float32 sum in (bf16 where the forwards are): kept in it once the
        # solve's permuted copy is made, half of the float32 beside the factorization (0.5 GiB at 16384 wide)
        self.report_dtype: torch.dtype | None = None

    @property
    def H(self) -> Tensor | None:
        """``sum x^T x`` (float32, symmetric): its lower triangle is filled in on first read after
        per-sample accumulation, which computes the upper block triangle only."""
        if self._upper and self._H is not None:
            H, n = self._H, self._H.shape[0]
            for a in range(0, n, _SYM_BAND):  # band by band: ~10x one whole-matrix triu pass
                b = min(a + _SYM_BAND, n)
                d = H[a:b, a:b]
                d.copy_(torch.triu(d) + torch.triu(d, 1).mT)
                H[b:, a:b].copy_(H[a:b, b:].mT)
        self._upper = False
        return self._H

    @H.setter
    def H(self, value: Tensor | None) -> None:
        self._H, self._upper = value, False

    @property
    def D(self) -> Tensor | None:
        """GPTAQ's ``sum (x_fp - x)^T x`` (float32, a new tensor when accumulated as ``sum x_fp^T x``;
        see ``_add_cross``); None without full-precision inputs."""
        if self.cross is None:
            return None
        return self.cross - self.H if self._cross_is_c else self.cross

    @classmethod
    def from_hessian(cls, H: Tensor, nsamples: int, D: Tensor | None = None) -> GPTQ:
        """Wrap an already-summed ``H = sum x^T x`` (e.g. all-reduced across ranks), and GPTAQ's
        ``D = sum (x_fp - x)^T x`` over the same tokens where there is one."""
        if H.ndim != 2 or H.shape[0] != H.shape[1]:
            raise SqError(f"Hessian must be square, got shape {tuple(H.shape)}")
        if D is not None and D.shape != H.shape:
            raise SqError(f"GPTAQ's cross term has shape {tuple(D.shape)}, the Hessian {tuple(H.shape)}")
        g = cls.__new__(cls)
        g.in_features = H.shape[0]
        g.H = H
        g.cross, g._cross_is_c = D, False
        g.nsamples = int(nsamples)
        g._prepared = None
        g.owner = g.report_dtype = None
        return g

    @torch.no_grad()
    def add_batch(self, x: Tensor, x_fp: Tensor | None = None) -> None:
        """Accumulate inputs: ``x [samples, tokens, in]`` (a calibration batch) or ``x [tokens, in]``.

        ``x_fp`` (GPTAQ): the same tokens' inputs on the full-precision chain, for the cross term
        ``D += (x_fp - x)^T x`` (per sample, summed in float32 like ``H``); given for every
        batch or for none."""
        if self._H is None:
            raise RuntimeError("GPTQ.add_batch after free()")
        if x.shape[-1] != self.in_features:
            raise SqError(f"GPTQ input width {x.shape[-1]} != in_features {self.in_features}")
        if (x_fp is None) != (self.cross is None) and self.nsamples:
            raise RuntimeError("GPTQ.add_batch: full-precision inputs given for some batches only")
        self._prepared = None
        if x_fp is not None:
            if x_fp.shape != x.shape:
                raise SqError(f"GPTAQ: full-precision inputs {tuple(x_fp.shape)} != inputs {tuple(x.shape)}")
            self._add_cross(x, x_fp)
        if x.dim() >= 3:
            # [samples, tokens, in]: each sample's x^T x in float32, summed in float32 (the module doc).
            # Inputs in bf16 multiply as bf16 operands with float32 sums and results where that was
            # measured faster (_bf16_operands, sq.probe.hessian_products_choice: exact operands; with
            # AMX 2x faster).  (Not bf16 *results*:
            # rounding each sample's x^T x to bf16 leaves some Hessians indefinite; SmolLM2's layer 0 and
            # 15 o_proj need 10x the dampening then.)  x^T x is symmetric: only
            # its upper block triangle is computed, in row bands of _SYM_BAND (an entry is the same
            # float32 dot product over the sample's tokens either way); the lower triangle is
            # mirrored from it when H is next read.
            H, n = self._H, self.in_features
            with _bf16_operands(x.dtype == torch.bfloat16 and H.device.type == "cpu"):
                for sample in x.reshape(x.shape[0], -1, n):
                    xs = sample.to(device=H.device, dtype=torch.float32)
                    sym_products(H, xs)
                    self.nsamples += xs.shape[0]
            self._upper = self._upper or n > _SYM_BAND
            return
        H = self.H  # complete (mirrored) before a full update
        x = x.reshape(-1, self.in_features).to(device=H.device, dtype=H.dtype)
        H.addmm_(x.T, x)  # H += x^T x, a token set (e.g. an expert's routed tokens)
        self.nsamples += x.shape[0]

    def _add_cross(self, x: Tensor, x_fp: Tensor) -> None:
        """The cross term, a sample at a time, summed in float32.

        Inputs in bf16 where the job chose bf16 products (``_bf16_operands``): ``sum x_fp^T x`` from bf16
        operands (exact products, float32 sums: 2x faster than float32's, 4x less than the direct
        product below, which the difference of two bf16 inputs cannot use), ``D = that - H`` when read
        (the drift is small beside the inputs: D keeps ~1e-5 relative).  Else ``(x_fp - x)^T x``
        directly.  The first batch decides; the form is kept for the rest."""
        n = self.in_features
        fast = (x.dtype == torch.bfloat16 and x_fp.dtype == torch.bfloat16 and self._H.device.type == "cpu"
                and bf16_products())
        if self.cross is None:
            self.cross = torch.zeros(n, n, dtype=self._H.dtype, device=self._H.device)
            self._cross_is_c = fast
        xs = x.reshape(-1, x.shape[-2] if x.dim() >= 3 else x.shape[0], n)
        fs = x_fp.reshape(xs.shape)
        dev = self.cross.device
        with _bf16_operands(fast and self._cross_is_c):
            for a, f in zip(xs, fs):
                a32, f32 = a.to(device=dev, dtype=torch.float32), f.to(device=dev, dtype=torch.float32)
                self.cross.add_((f32 if self._cross_is_c else f32 - a32).T @ a32)

    def hessian(self) -> Tensor:
        """The normalized Hessian ``2 / n * sum x^T x`` (a new tensor)."""
        if self.H is None:
            raise RuntimeError("GPTQ.hessian after free()")
        if self.nsamples == 0:
            raise SqError("GPTQ: no calibration samples were accumulated")
        return self.H * (2.0 / self.nsamples)

    def free(self) -> None:
        self.H = None
        self.cross = None
        self._prepared = None

    def _check_solvable(self, w: Tensor, name: str) -> None:
        """Refuse a weight this accumulator cannot solve: freed, another width, not float, no tokens."""
        if self.H is None:
            raise RuntimeError(f"{name}: GPTQ.quantize after free()")
        if w.ndim != 2 or w.shape[1] != self.in_features:
            raise SqError(
                f"{name}: weight shape {tuple(w.shape)} does not match the Hessian width {self.in_features}"
            )
        if not w.is_floating_point():
            raise SqError(f"{name}: expected a floating-point weight, got {w.dtype}")
        if self.nsamples == 0:
            raise SqError(
                f"{name}: no calibration tokens reached this layer, so GPTQ has nothing to solve "
                f"against; calibrate all experts, use more samples, or quantize it with rtn"
            )

    def _prepare(self, cfg: GPTQConfig, dev: torch.device, name: str, fit: str = "all") -> _Prepared:
        """The solve's Hessian-only part, computed once per settings and device (see the module doc).

        The normalized Hessian ``2 / n * H`` is formed once, already permuted into act-order and
        reversed for the factorization (one gather of the raw sum); the float32 copy the reported
        error reads is made only if one is asked for."""
        key = (cfg.percdamp, cfg.actorder, cfg.max_retries, cfg.damp_growth, str(dev), self.nsamples,
               self.cross is not None and fit)
        if self._prepared is not None and self._prepared.key == key:
            return self._prepared
        self._prepared = None
        H = self.H.to(device=dev)  # the raw sum [cols, cols] (tokens: _check_solvable); no copy where it is
        if not rtn.all_finite(H):
            raise SqError(f"{name}: the calibration Hessian has non-finite entries (inf/NaN inputs)")
        c = 2.0 / self.nsamples
        diag = (torch.diagonal(H) * c).to(torch.float64)
        # Input channels never active carry no information: the reference zeroes them (and sets
        # their diagonal to 1).
        dead = diag == 0
        diag[dead] = 1
        perm = torch.argsort(diag, descending=True, stable=True) if cfg.actorder else None
        rev = (perm if perm is not None else torch.arange(diag.numel(), device=dev)).flip(0)
        Hf = _permuted(H, rev, c)  # J P^T (2/n H) P J: the sweep order, reversed
        Hf.diagonal()[dead[rev]] = 1
        if H.dtype == torch.float32 and self.report_dtype not in (None, H.dtype) and self.cross is None:
            H = self._H = H.to(self.report_dtype)  # (the float32 sum is not read again)
        mean_diag = float(torch.mean(diag if perm is None else diag[perm]))
        Hinv, damp, retries = _inverse_cholesky(Hf, mean_diag, cfg, name)
        hdiag = Hinv.diagonal().clone()
        asym = None if self.cross is None else _asymmetric_map(self.D, c, Hinv, perm, dead, fit)
        # the sweep reads Hinv's rows over their diagonal: divided in place, one in x in matrix kept
        self._prepared = _Prepared(key, dead, int(dead.sum()), H, c, perm, hdiag, Hinv.div_(hdiag[:, None]), damp,
                                   retries, asym)
        return self._prepared

    @torch.no_grad()
    def quantize(
        self,
        w: Tensor,
        scheme: QuantScheme,
        *,
        name: str = "linear",
        stats: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor] | None] | None = None,
        **settings: Any,
    ) -> GPTQResult:
        """Quantize ``w [rows, in]`` (any subset of the layer's rows) against ``H``.

        ``name`` is used in errors and logs.  ``w`` is not modified; its dtype is the
        storage dtype of the scales and of the dequantized weight.  ``settings``: ``GPTQConfig``'s
        fields (``blocksize``, ``percdamp``, ``actorder`` -- off unless given --, ``static_groups``,
        ``max_retries``, ``damp_growth``) and GPTAQ's ``gptaq_alpha`` / ``gptaq_fit``.  Group scales computed mid-sweep use the fully updated
        weights (the blocksize is rounded to a multiple of the group size so a group
        never straddles a lazy-update block; the IST-DASLab code reads stale columns
        there).  Solving rows ``[a, b)`` alone reproduces those rows of the full solve
        (bit for bit on CPU in the tests; elsewhere up to BLAS kernel choice).

        ``stats``: the weight's cross-row statistics, all-reduced over the ranks holding its rows
        and shared by fused partners (``rtn.local_stats``; NVFP4's ``global_absmax``), when ``w``
        is a shard; None: ``w`` is the whole weight.  A list of n of them: ``w`` stacks n weights
        of equal height (experts solved against one Hessian), each quantized under its own.

        ``gptaq_alpha``: where full-precision inputs were accumulated (``add_batch(x, x_fp)``), the
        weight of GPTAQ's correction toward the full-precision outputs, ``gptaq_fit`` its form
        (``_asymmetric_map``); 0: GPTQ.  ``quantize_together`` solves several weights in one sweep.
        """
        return quantize_together([Problem(self, w, scheme, name, stats)], **settings)[0]

    def _setup(self, p: Problem, cfg: GPTQConfig, gptaq_alpha: float, gptaq_fit: str) -> _Solve:
        """``p``'s solve up to its sweep: the prepared Hessian, the float32 weights in sweep order,
        the scales fixed up front (or room for the sweep's)."""
        t0 = time.perf_counter()
        w, scheme, name = p.w, p.scheme, p.name
        self._check_solvable(w, name)
        check_group_size(name, self.in_features, scheme)
        spec = spec_for(scheme)
        if not isinstance(spec.granularity, (primitives.PerChannel, primitives.PerGroup)):
            raise SqError(f"{name}: GPTQ solves per-channel and per-group scales; scheme {scheme.name} has "
                          f"{type(spec.granularity).__name__} scales (use rtn for it)")
        rows, cols = w.shape
        wdtype = w.dtype
        dev = w.device
        segs = _segments(w, spec, p.stats, name)  # [(row slice, stats)]: one per stacked weight
        gscales = [_global_scale(st, spec, wdtype) for _, st in segs]

        if gptaq_fit not in GPTAQ_FITS:
            raise SqError(f"{name}: gptaq_fit must be one of {', '.join(GPTAQ_FITS)}, got {gptaq_fit!r}")
        prep = self._prepare(cfg, dev, name, gptaq_fit)
        W = w.to(torch.float32, copy=True)
        if prep.n_dead:
            W[:, prep.dead] = 0
        if gptaq_alpha and prep.asym is not None:
            W.add_(W @ prep.asym, alpha=gptaq_alpha)
            if prep.n_dead:
                W[:, prep.dead] = 0

        # Scales fixed up front come from the unpermuted, dead-zeroed weights in their
        # storage dtype: for a layer without dead columns they equal RTN's exactly.
        fixed = _fixed_scales(scheme, cfg)
        if fixed:
            scale, zp = _qparams(W.to(wdtype), spec, segs)
        else:
            sdtype = torch.promote_types(wdtype, torch.float32) if spec.global_scale else wdtype
            scale = torch.empty(rows, scheme.num_groups(cols), dtype=sdtype, device=dev)
            zp = None if scheme.symmetric else torch.empty(scale.shape, dtype=torch.int8, device=dev)
        # a column's effective scale is scale / global scale (the library's quantize and
        # dequantize divide first, in float32): one global scale per row
        gs_rows = None
        if spec.global_scale:
            gs_rows = torch.cat([g.expand(sl.stop - sl.start) for (sl, _), g in zip(segs, gscales)]).to(dev)
        # transposed for the sweep ([cols, rows]: a column is a contiguous row), in sweep order: one copy, which
        # a sweep of one solve takes as its buffer (a 7168 x 16384 o_proj: 0.45 GiB in float32)
        W = W.T.index_select(0, prep.perm) if prep.perm is not None else W.T.contiguous()
        # per-group scale / zero point as contiguous float32 rows: [n_groups, rows]
        scale_t = scale.T.to(torch.float32).contiguous()
        if gs_rows is not None:
            scale_t = scale_t / gs_rows
        zp_t = None if zp is None else zp.T.to(torch.float32).contiguous()
        return _Solve(p, cfg, prep, spec, segs, gscales, W, scale, zp, scale_t, zp_t, gs_rows,
                      _group_of(scheme, cols, prep.perm), t0)

    def _result(self, s: _Solve, Q: Tensor, losses: Tensor) -> GPTQResult:
        """The solve's result: the dequantized weight (each stacked weight under its own global
        scale), the loss and relative error, and the solve's facts (``s.prep``: the Hessian's)."""
        w, scheme, segs, scale, zp, gscales = s.problem.w, s.problem.scheme, s.segs, s.scale, s.zp, s.gscales
        wdtype, prep, cfg = w.dtype, s.prep, s.cfg
        dead, damp = prep.dead, prep.damp
        if len(segs) > 1:
            weight = torch.cat([rtn.dequantize(Q[sl], scale[sl], None if zp is None else zp[sl], scheme, global_scale=g)
                                for (sl, _), g in zip(segs, gscales)]).to(wdtype)
        else:
            weight = rtn.dequantize(Q, scale, zp, scheme, global_scale=gscales[0]).to(wdtype)
        loss = float(losses.sum())
        return GPTQResult(
            q=Q,
            scale=scale,
            zero_point=zp,
            weight=weight,
            loss=loss,
            damp=damp,
            percdamp=cfg.percdamp * cfg.damp_growth**prep.retries,
            retries=prep.retries,
            dead_columns=prep.n_dead,
            nsamples=self.nsamples,
            seconds=time.perf_counter() - s.t0,
            global_scale=torch.cat(gscales) if s.spec.global_scale else None,
            _rel_err=lambda: _relative_error(w, weight, dead, prep.h_err(), loss, damp),
        )


@dataclass(frozen=True)
class Problem:
    """One weight to solve: ``GPTQ.quantize``'s arguments, for ``quantize_together``."""

    gptq: GPTQ
    w: Tensor
    scheme: QuantScheme
    name: str = "linear"
    stats: Any = None


# the most weight elements one sweep of several problems holds at once (float32: 64 MiB), unless one
# problem alone is larger (``quantize_together``)
BATCH_ELEMS = 1 << 24


def _fixed_scales(scheme: QuantScheme, cfg: GPTQConfig) -> bool:
    """Whether the scales are fixed before the sweep (per channel, act-order, static groups)."""
    return scheme.strategy == "channel" or cfg.actorder or cfg.static_groups


@torch.no_grad()
def quantize_together(problems: Sequence[Problem], *, blocksize: int = 128, percdamp: float = 0.01,
                      actorder: bool = False, static_groups: bool = False, max_retries: int = 4,
                      damp_growth: float = 10.0, gptaq_alpha: float = 0.0, gptaq_fit: str = "all",
                      max_elems: int = BATCH_ELEMS) -> list[GPTQResult]:
    """Each problem's ``GPTQ.quantize`` (same settings), in order, bit for bit, with one column sweep for
    the problems of one width, scheme, dtype and device (each under its own Hessian: q/k/v, o_proj
    and gate/up of a block; experts' down projections), up to ``max_elems`` weight elements a sweep.

    The sweep's per-column work is Python-bound on CPU and kernel-launch-bound on GPU (a column of a
    few hundred rows costs microseconds of maths and a dozen dispatches): with the problems' rows side
    by side the column's quantization is one set of ops over all of them, and only each problem's
    error push stays its own (one rank-1 product per problem, on its columns of the shared buffer; for
    problems of one height, as experts', one batched product over all of them).
    Every element sees the same operations in the same order as in its own sweep (the products on a
    problem's slice are its own products; tests/test_quant_gptq.py checks the bits)."""
    cfg = GPTQConfig(blocksize, percdamp, actorder, static_groups, max_retries, damp_growth)
    out: list[GPTQResult | None] = [None] * len(problems)
    groups: dict[tuple, list[list[int]]] = {}
    for k, p in enumerate(problems):
        chunks = groups.setdefault((p.w.shape[1] if p.w.ndim == 2 else None, p.scheme, p.w.dtype, p.w.device), [[]])
        elems = sum(problems[j].w.numel() for j in chunks[-1])
        if chunks[-1] and elems + p.w.numel() > max_elems:
            chunks.append([])
        chunks[-1].append(k)
    for chunks in groups.values():
        for idx in chunks:
            solves = [problems[k].gptq._setup(problems[k], cfg, gptaq_alpha, gptaq_fit) for k in idx]
            for k, s, (Q, losses) in zip(idx, solves, _sweep(solves)):
                out[k] = s.problem.gptq._result(s, Q, losses)
    return out


@dataclass
class _Solve:
    """One weight's solve, set up (``GPTQ._setup``): its stored scales, fixed up front or set per group as
    the sweep reaches it, and the float32 rows per group the sweep reads them through."""

    problem: Problem
    cfg: GPTQConfig
    prep: _Prepared
    spec: primitives.QuantSpec
    segs: list  # [(row slice, stats)]: one per stacked weight
    gscales: list  # each segment's global scale (NVFP4) or None
    W: Tensor | None  # [cols, rows] float32, transposed, in sweep order, dead columns zeroed (the sweep's buffer)
    scale: Tensor  # [rows, n_groups], the stored scales
    zp: Tensor | None
    scale_t: Tensor  # [n_groups, rows] float32 (divided by the global scale, NVFP4)
    zp_t: Tensor | None
    gs_rows: Tensor | None  # each row's global scale (NVFP4)
    group_of: list[int]  # column j (in sweep order) uses scale column group_of[j]
    t0: float


class _Sweep:
    """The column sweep of one or more solves of one width and scheme, their rows side by side:
    ``Wt [cols, R]`` (transposed: a column is a contiguous row of all solves' rows), each solve's
    rows a slice ``span`` of ``R``."""

    def __init__(self, solves: list[_Solve]):
        first = solves[0]
        self.solves = solves
        scheme, cfg = first.problem.scheme, first.cfg
        self.scheme, self.wdtype, self.fixed = scheme, first.problem.w.dtype, _fixed_scales(scheme, cfg)
        rows = [s.W.shape[1] for s in solves]
        self.spans = [slice(a, a + r) for a, r in zip(itertools.accumulate([0] + rows), rows)]
        self.height = rows[0] if len(rows) > 1 and len(set(rows)) == 1 else 0  # one height: batched products
        cols, R, dev = first.W.shape[0], sum(rows), first.W.device
        self.cols = cols
        if len(solves) == 1:  # its transposed copy is the buffer
            self.Wt = first.W
        else:
            self.Wt = torch.empty(cols, R, dtype=torch.float32, device=dev)
            for s, sl in zip(solves, self.spans):
                self.Wt[:, sl].copy_(s.W)
        for s in solves:
            s.W = None
        self.Qt = torch.empty(cols, R, dtype=scheme.storage_dtype, device=dev)
        # the scales each column is quantized with, one float32 row over R: rows of the per-group
        # scales where every solve takes its groups in one order (mid-sweep scales write through
        # them), else gathered per column (act-order: each Hessian its own column order)
        one = len(solves) == 1
        if one or all(s.group_of == first.group_of for s in solves):
            self.order = first.group_of
            self.scale_t = first.scale_t if one else torch.cat([s.scale_t for s in solves], dim=1)
            self.zp_t = first.zp_t if one or first.zp_t is None else torch.cat([s.zp_t for s in solves], dim=1)
            self.s_rows = self.scale_t.unbind(0)  # views: the mid-sweep scales write through them
            self.z_rows = None if self.zp_t is None else self.zp_t.unbind(0)
        else:  # scales fixed up front, each solve's own column order: gathered a block at a time
            self.order = None
            self.idx = [torch.tensor(s.group_of, device=dev) for s in solves]
            self.s_buf = torch.empty(min(cfg.blocksize, cols), R, dtype=torch.float32, device=dev)
            self.z_buf = None if first.zp_t is None else torch.empty_like(self.s_buf)
        self.group_spec = dataclasses.replace(first.spec, granularity=primitives.PerChannel())  # one group a row
        # Groups must not straddle blocks when their scales are computed mid-sweep: the
        # columns of the next block have not yet received this block's lazy update.
        bs = cfg.blocksize
        if not self.fixed and bs % scheme.group_size:
            bs = max(scheme.group_size, bs - bs % scheme.group_size)
        self.bs = bs
        # sub-blocks likewise: a group starting mid-block starts a sub-block
        self.sub = _SUB_BLOCK if self.fixed else math.gcd(_SUB_BLOCK, scheme.group_size)
        self.int_codes = first.spec.qtype.kind == "int" and self.Qt.dtype == torch.int8
        self.qmin, self.qmax = first.spec.qtype.qmin, first.spec.qtype.qmax

    def parts(self, W: Tensor, E: Tensor, H: list[Tensor]) -> list[tuple]:
        """Each solve's columns of ``W [k, R]`` and ``E [m, R]`` with its block ``H [m, k]`` of Hinv's scaled
        rows, transposed, and the product ``W -= H^T E`` on such operands; for solves of one height ``r``,
        one set: ``[B, k, r]`` / ``[B, m, r]`` / ``[B, k, m]`` views, every product one batched over the
        solves (each batch entry is its solve's own product: the same bits)."""
        if self.height:
            B, r = len(self.spans), self.height
            return [(W.view(W.shape[0], B, r).transpose(0, 1), E.view(E.shape[0], B, r).transpose(0, 1),
                     torch.stack(H).transpose(1, 2), _bpush)]
        return [(W[:, sl], E[:, sl], h.T, _push) for sl, h in zip(self.spans, H)]

    def new_scales(self, W1: Tensor, i: int, g: int) -> None:
        """Each solve's scales of group ``g`` from its current (error-updated) weights, the group's
        columns ``W1[i : i + group_size]``: compressed-tensors' scales of those weights."""
        gsize = self.scheme.group_size
        for s, sl in zip(self.solves, self.spans):
            sc, z = _qparams(W1[i : i + gsize, sl].to(self.wdtype).T.contiguous(), self.group_spec, s.segs)
            s.scale[:, g : g + 1] = sc
            self.scale_t[g, sl] = sc[:, 0] if s.gs_rows is None else sc[:, 0].to(torch.float32) / s.gs_rows
            if s.zp is not None:
                s.zp[:, g : g + 1] = z
                self.zp_t[g, sl] = z[:, 0]

    def block_scales(self, i1: int, count: int) -> tuple[list[Tensor], list[Tensor | None]]:
        """The scale and zero-point rows ``[R]`` of the columns ``i1 .. i1 + count`` (sweep order)."""
        if self.order is not None:
            groups = self.order[i1 : i1 + count]
            return ([self.s_rows[g] for g in groups],
                    [self.z_rows[g] for g in groups] if self.z_rows is not None else [None] * count)
        for s, sl, idx in zip(self.solves, self.spans, self.idx):
            self.s_buf[:count, sl] = s.scale_t.index_select(0, idx[i1 : i1 + count])
            if self.z_buf is not None:
                self.z_buf[:count, sl] = s.zp_t.index_select(0, idx[i1 : i1 + count])
        return (self.s_buf[:count].unbind(0),
                self.z_buf[:count].unbind(0) if self.z_buf is not None else [None] * count)


def _push(W: Tensor, HT: Tensor, E: Tensor) -> None:
    W.addmm_(HT, E, alpha=-1)


def _bpush(W: Tensor, HT: Tensor, E: Tensor) -> None:
    W.baddbmm_(HT, E, alpha=-1)


def _sweep(solves: list[_Solve]) -> list[tuple[Tensor, Tensor]]:
    """The column sweep of ``solves`` (one width, scheme and dtype): each solve's codes ``Q [rows, in]``
    in its column order and its loss per row."""
    sw = _Sweep(solves)
    Wt, Qt, cols, bs = sw.Wt, sw.Qt, sw.cols, sw.bs
    dev = Wt.device
    losses = [torch.zeros(sl.stop - sl.start, dtype=torch.float32, device=dev) for sl in sw.spans]
    # The error pushed onto later columns is (w - dq) / Hinv_jj times Hinv's row j: the rows are
    # divided by their diagonal once (Hs), so a column's error is w - dq alone
    Hs = [s.prep.Hs for s in solves]
    qf = torch.empty(min(bs, cols), Wt.shape[1], dtype=torch.float32, device=dev) if sw.int_codes else None
    for i1 in range(0, cols, bs):
        i2 = min(i1 + bs, cols)
        Err1 = _sweep_block(sw, Wt[i1:i2], Qt[i1:i2], [h[i1:i2, i1:i2] for h in Hs], i1, qf)
        for s, sl, loss in zip(solves, sw.spans, losses):
            loss += (Err1[:, sl] / s.prep.hdiag[i1:i2, None]).square_().sum(dim=0) / 2
        if i2 < cols:  # lazy batch update of every column after the block, each solve's own
            for Wb, Eb, HbT, push in sw.parts(Wt[i2:], Err1, [h[i1:i2, i2:] for h in Hs]):
                push(Wb, HbT, Eb)
    del sw.Wt, Wt
    out = []
    for s, sl, loss in zip(solves, sw.spans, losses):
        Qb = Qt[:, sl]
        if s.prep.perm is not None:  # back to the weight's column order: whole rows of Qt gathered
            Qb = Qb.index_select(0, torch.argsort(s.prep.perm))
        out.append((Qb.T.contiguous(), loss))
    return out


def _sweep_block(sw: _Sweep, W1: Tensor, Q1: Tensor, Hs1: list[Tensor], i1: int, qf: Tensor | None) -> Tensor:
    """Quantize the columns ``W1 [count, R]`` (transposed: a column is a contiguous row; updated in
    place) into ``Q1``, each column's error pushed onto the block's later columns of its own solve;
    returns the errors ``w - dq`` ``[count, R]``.  ``Hs1``: each solve's block of ``Hinv``'s rows over
    their diagonal; ``i1``: the block's first column in sweep order; ``qf``: float32 scratch for int codes."""
    count = W1.shape[0]
    wdtype, sub = sw.wdtype, sw.sub
    Err1 = torch.empty_like(W1)
    # every per-column view made at once: indexing a tensor per column cost as much as the
    # column's maths (Python overhead dominates the sweep on CPU)
    w_rows, e_rows, q_rows = W1.unbind(0), Err1.unbind(0), Q1.unbind(0)
    qf_rows = qf[:count].unbind(0) if sw.int_codes else [None] * count  # the codes, in float32
    # per solve: each column's error goes onto the later columns of its sub-block at once (one rank-1
    # product per column over sub rows, not over the block's), onto the rest of the block by one
    # product per sub-block: the block's lazy update, one level down
    pushes = []
    ends = [min(i - i % sub + sub, count) for i in range(count)]  # where each column's sub-block ends
    parts = sw.parts(W1, Err1, Hs1)  # each solve's views (or one set, batched, for solves of one height)
    for Wb, Eb, HbT, _ in parts:
        # per column but a sub-block's last: the sub-block's later columns, their entries of the column's
        # row of H1 ([k, 1]), and the column's error row ([1, rows]), each product's operands as views
        pushes.append([None if ends[i] == i + 1 else
                       (Wb[..., i + 1 : ends[i], :].addmm_ if Wb.ndim == 2 else Wb[..., i + 1 : ends[i], :].baddbmm_,
                        HbT[..., i + 1 : ends[i], i : i + 1], Eb[..., i : i + 1, :]) for i in range(count)])
    s_cols, z_cols = sw.block_scales(i1, count)  # (views: mid-sweep scales land in them)
    recompute, gsize, int_codes, cast = not sw.fixed, sw.scheme.group_size, sw.int_codes, wdtype != torch.float32
    scheme, qmin, qmax = sw.scheme, sw.qmin, sw.qmax
    div, sub_ = torch.div, torch.sub
    # the loop is Python-bound on CPU (a few microseconds per op on a column of a few hundred rows):
    # everything it reads is a local, made above
    for i, (w_col, s32, z32, e_row, qrow) in enumerate(zip(w_rows, s_cols, z_cols, e_rows, qf_rows)):
        if recompute and (i1 + i) % gsize == 0:
            sw.new_scales(W1, i, sw.order[i1 + i])
        # float32 copies of the scale give the same bits as the stored dtype: the
        # library promotes it to float32 for this division anyway (NVFP4: scale /
        # global scale, which the library computes in float32 first, is s32)
        if int_codes:
            # primitives.quantize_values then dequantize_values for an int type, the same operations in
            # the same order (the same bits): the codes made in qrow (float32), (q - zp) * scale out
            div(w_col, s32, out=qrow)
            if z32 is None:
                qrow.clamp_(qmin, qmax).round_()
                dq = qrow * s32
            else:
                qrow.add_(z32).clamp_(qmin, qmax).round_()
                dq = (qrow - z32).mul_(s32)
        else:
            q = rtn.quantize_values(w_col, s32, z32, scheme)
            q_rows[i].copy_(q)
            dq = rtn.dequantize_values(q, s32, z32)
        # (q - zp) * scale is exact in float32; one rounding to the weight dtype
        # then equals the loader's own dequantization in that dtype (the subtraction
        # promotes it back to float32 exactly)
        if cast:
            dq = dq.to(wdtype)
        sub_(w_col, dq, out=e_row)
        # push the error onto this sub-block's later columns (rank-1: addmm_ with an inner dim
        # of 1 is BLAS, addr_ is far slower on CPU; the views were made before the loop)
        if ends[i] != i + 1:
            for later in pushes:
                product, h_col, e_mat = later[i]
                product(h_col, e_mat, alpha=-1)
        elif i + 1 < count:  # the sub-block done: its errors onto the block's later columns
            a = i + 1 - sub
            for Wb, Eb, HbT, push in parts:
                push(Wb[..., i + 1 :, :], HbT[..., i + 1 :, a : i + 1], Eb[..., a : i + 1, :])
    if sw.int_codes:
        Q1.copy_(qf[:count])  # integral values: the int8 cast is exact
    return Err1


def _group_of(scheme: QuantScheme, cols: int, perm: Tensor | None) -> list[int]:
    """The scale column of each column in sweep order (act-order permutes them)."""
    if scheme.strategy == "channel":
        return [0] * cols
    group_of = torch.arange(cols) // scheme.group_size
    return (group_of[perm.cpu()] if perm is not None else group_of).tolist()


@dataclass
class _Prepared:
    """What a solve needs from the Hessian alone (shared by every weight quantized against it)."""

    key: tuple
    dead: Tensor  # [cols] bool: input channels never active
    n_dead: int
    H_raw: Tensor  # the raw sum x^T x (float32: the accumulator itself), for the reported error's metric
    h_scale: float  # 2 / n
    perm: Tensor | None  # act-order permutation
    hdiag: Tensor  # the diagonal of Hinv, the upper factor of the damped inverse in sweep order (float32)
    Hs: Tensor  # Hinv's rows divided by their diagonal entry (what a column's error is pushed with)
    damp: float
    retries: int
    asym: Tensor | None = None  # GPTAQ's map M (``_asymmetric_map``): the weights' correction is W M

    def h_err(self) -> Tensor:
        """The undamped, dead-fixed, unpermuted normalized Hessian in float32."""
        H = self.H_raw * self.h_scale
        H[self.dead, self.dead] = 1
        return H.to(torch.float32)


def _asymmetric_map(D: Tensor, c: float, U: Tensor, perm: Tensor | None, dead: Tensor, fit: str) -> Tensor:
    """GPTAQ's correction toward the full-precision chain's outputs, as a map of the weights: ``W M``,
    ``M [in, in]`` float32 in the weights' own column order.

    The layer sees ``x`` (the quantized chain) where the full-precision model saw ``x_fp = x + dx``;
    GPTAQ (Li et al., 2025) fits ``Q x`` to ``W x_fp`` instead of ``W x``.  ``D = E[dx^T x]``
    (normalized like ``H``), ``U`` the upper factor of ``(H + damp I)^-1`` in sweep order:

    - ``fit="all"``: ``M = D (H + damp I)^-1 = D U^T U``, the least-squares fit of the whole target
      ``W x_fp`` by the quantized chain's inputs (at weight 1, GPTQ's sweep on ``W (I + M)`` is the
      greedy solve of the asymmetric objective exactly).
    - ``fit="later"``: the paper's ``P = triu(D U^T, 1) U``: the part ``w_j dx_j`` of the target
      that input ``j`` adds is fitted by the inputs after ``j`` alone (row ``j``:
      ``D[j, >j] H[>j, >j]^-1``).  The paper applies ``w_j P[j]`` inside the sweep with ``w_j`` the
      column's value when it is quantized; here the weights before the sweep stand for it (on
      synthetic layers the two reach the same objective within 1%).

    Either way the whole correction is one product up front, and the sweep (with every format it
    supports) is GPTQ's own.  Dead input columns get none (their ``D`` column is zero, and ``U``
    keeps them apart).  Weighted 1, the fit overshoots (the cross term is estimated from the
    calibration tokens and amplified by the inverse): docs/gptaq.md has the measured weights."""
    Dp = D.to(U.device) * c
    Dp[:, dead] = 0
    if perm is not None:
        Dp = Dp.index_select(0, perm).index_select(1, perm)
    DU = Dp.to(torch.float32) @ U.T
    M = (DU.triu_(1) if fit == "later" else DU) @ U  # sweep order
    if perm is not None:
        inv = torch.argsort(perm)
        M = M.index_select(0, inv).index_select(1, inv)
    return M


def _relative_error(w: Tensor, weight: Tensor, dead: Tensor, H_err: Tensor, loss: float, damp: float) -> float:
    """Output error through the Hessian, relative: ``||(W - Q) X^T|| / ||W X^T||``.

    With ``U^T U = (H + damp I)^-1`` the sweep's errors satisfy ``D = Err U``, so
    ``tr(D (H + damp I) D^T) = ||Err||^2 = 2 * loss``: only the denominator needs a matmul.
    (Checked against the direct trace to ~1e-7.)  Dead columns are zero in both W and Q as
    GPTQ saw them and have no weight in the true H.
    """
    Wd = w.to(torch.float32, copy=True)
    Wd[:, dead] = 0
    D = Wd - weight.to(torch.float32)
    num = max(2.0 * loss - damp * float((D * D).sum()), 0.0)
    den = float(((Wd @ H_err) * Wd).sum())
    return math.sqrt(num / den) if den > 0 else 0.0


def _segments(w: Tensor, spec: primitives.QuantSpec, stats, name: str) -> list[tuple[slice, dict | None]]:
    """``w``'s row segments and the cross-row statistics each is quantized under: one segment
    (the whole ``w``) for a mapping or None, n equal ones for a list of n.  Without statistics a
    scheme with a global scale reads it from its segment (which is then its whole weight)."""
    rows = w.shape[0]
    parts = list(stats) if isinstance(stats, (list, tuple)) else [stats]
    if not parts or rows % len(parts):
        raise SqError(f"{name}: {rows} rows do not split into {len(parts)} stacked weights")
    h = rows // len(parts)
    need = primitives.cross_row_stats(spec)
    out = []
    for i, st in enumerate(parts):
        sl = slice(i * h, (i + 1) * h)
        if need:
            if st is None:
                st = {k: primitives.local_stat(w[sl], spec, k) for k in need}
            elif set(need) - set(st):
                raise SqError(f"{name}: statistics {sorted(set(need) - set(st))} missing for scheme {spec}")
            st = {k: st[k] for k in need}
        else:
            st = None
        out.append((sl, st))
    return out


def _global_scale(stats: Mapping[str, Tensor] | None, spec: primitives.QuantSpec, wdtype: torch.dtype) -> Tensor | None:
    """NVFP4's global scale from the (all-reduced) ``global_absmax``, as ``choose_qparams``
    computes it for a weight of ``wdtype`` (float32 ``[1]``); None without one."""
    if not spec.global_scale:
        return None
    absmax = stats["global_absmax"].to(wdtype)
    return primitives.global_scale(absmax, spec.qtype, spec.scale_dtype or torch.float8_e4m3fn)


def _qparams(x: Tensor, spec: primitives.QuantSpec, segs) -> tuple[Tensor, Tensor | None]:
    """``(scale, zero_point)`` of ``x [rows, k]`` (rows as ``w``'s) under ``spec``, each row
    segment under its own statistics: the format's ``choose_qparams``, exactly."""
    qps = [primitives.choose_qparams(x[sl], spec, stats=st) for sl, st in segs]
    if len(qps) == 1:
        return qps[0].scale, qps[0].zero_point
    zp = None if qps[0].zero_point is None else torch.cat([q.zero_point for q in qps])
    return torch.cat([q.scale for q in qps]), zp


def hessian_dtype(in_features: int) -> torch.dtype:
    """The accumulator's dtype for a Hessian ``in_features`` wide: float64 while that is at most
    ``F64_HESSIAN_BYTES`` (up to 4096 wide), float32 beyond (the module doc)."""
    return torch.float64 if 8 * in_features * in_features <= F64_HESSIAN_BYTES else torch.float32


# the largest Hessian accumulated in float64 (SQ_F64_HESSIAN_BYTES: tests run the float32 path on toy widths)
F64_HESSIAN_BYTES = int(os.environ.get("SQ_F64_HESSIAN_BYTES", 128 << 20))


def _permuted(H: Tensor, rev: Tensor, c: float, band: int = 1024) -> Tensor:
    """``c * H[rev][:, rev]`` in ``H``'s dtype, gathered ``band`` rows at a time: the result and one band beside
    ``H``, not two whole permuted copies (at DeepSeek-V3's o_proj, 16384 wide, a GiB each in float32)."""
    n = H.shape[0]
    out = torch.empty(n, n, dtype=H.dtype, device=H.device)
    for a in range(0, n, band):
        rows = H.index_select(0, rev[a : a + band])
        torch.mul(rows.index_select(1, rev), c, out=out[a : a + band])
    return out


def _inverse_cholesky(Hf: Tensor, mean_diag: float, cfg: GPTQConfig, name: str) -> tuple[Tensor, float, int]:
    """Upper Cholesky factor ``U`` of ``(H + damp I)^-1`` (``U^T U = (H + damp I)^-1``), given
    ``Hf = J H J`` (``H`` reversed in both axes; its diagonal is changed here) and ``mean(diag(H))``.

    Computed without forming the inverse: with ``J`` the index reversal and ``J H J = L L^T``,
    ``U = J L^-1 J`` (one Cholesky and one triangular inverse instead of the reference's Cholesky,
    ``cholesky_inverse``, Cholesky).  In float32 first, both at once by halves at GEMM speed
    (``_cholesky_lower_inverse``; the sweep uses ``U`` in float32 either way;
    on SmolLM2's real Hessians, condition numbers 5e3-1e5, float32's ``U`` is within 1e-5 relative
    of float64's and gives the same codes but for 0.06% of one layer's), accepted only if
    ``U^T U (H + damp I) v = v`` for a random ``v`` within ``_F32_RESIDUAL`` (1e-5 to 6e-5 on those
    Hessians), else the same dampening again in float64.  A wide (float32-accumulated) Hessian never takes
    the float64 path -- at 16384 wide its float64 factor and inverse are 6 GiB beside the job -- but accepts
    a float32 factor within ``_WIDE_RESIDUAL``: its sums carry float32 rounding already, and the float32
    factor's residual grows with the width (at 4096 wide, rank-64 inputs: 6e-4 to 8e-4, and the solve's
    output error 0.3% above the float64 factor's).  Dampening grows by ``damp_growth`` on each
    failure; the retries are returned for the report.  Never falls back to RTN silently: after
    ``max_retries`` failures it raises ``SqError`` naming the layer.
    """
    wide = Hf.dtype == torch.float32
    diag = Hf.diagonal()
    undamped = diag.clone()
    Hf32 = Hf.to(torch.float32)  # (Hf itself where it is float32)
    why = ""
    for attempt in range(cfg.max_retries + 1):
        rel = cfg.percdamp * cfg.damp_growth**attempt
        damp = rel * mean_diag
        torch.add(undamped, damp, out=diag)
        U = None
        if Hf32 is not Hf:
            Hf32.diagonal().copy_(diag)
        Linv = _cholesky_lower_inverse(Hf32)
        # (a non-finite Linv gives a NaN or infinite residual, which fails the comparison)
        residual = _inverse_residual(Hf, Linv) if Linv is not None else math.inf
        if residual < (_WIDE_RESIDUAL if wide else _F32_RESIDUAL):
            # a float32 Hf is not read again: U takes its memory
            U = _flipped_into(Hf, Linv) if Hf32 is Hf else Linv.flip(0, 1)
        del Linv
        if U is None and wide:
            why = f"the float32 inverse factor's residual is {residual:.3g}"
            continue
        if U is None:  # float64, as a failure there decides (a float64 copy: only on this rare path)
            logger.info("%s: the float32 inverse factor's residual is %.3g; factorizing in float64", name, residual)
            L, info = torch.linalg.cholesky_ex(Hf.to(torch.float64))
            if int(info) != 0:
                why = f"leading minor of order {int(info)} is not positive"
                continue
            # A positive semi-definite H plus damp has every pivot^2 >= damp; a pivot that
            # only survives by rounding (a singular H + damp) counts as a failure too.
            if float(torch.diag(L).min()) ** 2 < 1e-10 * (mean_diag + damp):
                why = "numerically singular"
                continue
            U = _lower_inverse(L).to(torch.float32).flip(0, 1)
            if not rtn.all_finite(U):
                why = "the inverse factor is not finite"
                continue
        if attempt:
            logger.warning(
                "%s: Hessian not positive definite at dampening %.3g of mean(diag(H)); "
                "succeeded at %.3g after %d retries", name, cfg.percdamp, rel, attempt,
            )
        return U, damp, attempt
    raise SqError(
        f"{name}: Cholesky factorization of the Hessian failed at every dampening from "
        f"{cfg.percdamp:g} to {cfg.percdamp * cfg.damp_growth**cfg.max_retries:g} of mean(diag(H)) "
        f"({why}); the calibration data for this layer is degenerate"
    )


_WIDE_RESIDUAL = 1e-2  # a wide Hessian's accepted residual (the docstring above)
# the float32 inverse factor's largest accepted residual |U^T U (H + damp I) v - v| / |v| (a damped
# singular H at 1e-4 of mean(diag) gave 1.2e-3 in float32, 8.5e-5 from float64; at 1e-8, 21 vs 0.75)
_F32_RESIDUAL = 1e-3


def _inverse_residual(Hf: Tensor, Linv: Tensor, band: int = 1024) -> float:
    """``|Hf Linv^T Linv v - v| / |v|`` for a fixed random ``v``: how far ``Linv^T Linv`` is from
    ``Hf^-1`` (three matrix-vector products, the last in float64 over ``band`` rows of ``Hf`` at a time)."""
    v = torch.randn(Hf.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(Hf.device)
    y = (Linv.T @ (Linv @ v.to(Linv.dtype))).to(torch.float64)
    r = torch.cat([Hf[a : a + band].to(torch.float64) @ y for a in range(0, Hf.shape[0], band)]) - v
    return float(r.norm() / v.norm())


def _flipped_into(out: Tensor, x: Tensor, band: int = 1024) -> Tensor:
    """``x.flip(0, 1)`` written into ``out`` ``band`` rows at a time (no whole flipped copy beside both)."""
    n = x.shape[0]
    for a in range(0, n, band):
        b = min(n, a + band)
        out[a:b].copy_(x[n - b : n - a].flip(0, 1))
    return out


def _cholesky_lower_inverse(A: Tensor, leaf: int = 256) -> Tensor | None:
    """``L^-1`` for ``A = L L^T`` (symmetric positive definite), None if a pivot fails; ``L`` itself is
    never kept.  By halves, as ``_lower_inverse``: with ``A = [[A11, .], [A21, A22]]``,
    ``L21 = A21 L11^-T``, the Schur complement ``S = A22 - L21 L21^T = L22 L22^T``, and
    ``L^-1 = [[L11^-1, 0], [-L22^-1 L21 L11^-1, L22^-1]]``: matrix products but for the leaves'
    factorizations, so it runs at GEMM speed (1536 wide, float32, one CPU thread: 36 ms against
    62 ms for ``cholesky_ex`` then ``_lower_inverse``; the same accuracy on SmolLM2-like Hessians,
    ~1e-7 relative to float64's).  Products with an inverse instead of triangular solves are the
    less stable choice for a badly conditioned ``A``: the caller's residual check decides."""
    out = A.new_zeros(A.shape)
    return out if _lower_inverse_into(A, out, leaf) else None


def _lower_inverse_into(A: Tensor, out: Tensor, leaf: int) -> bool:
    """``_cholesky_lower_inverse`` into ``out`` (zeros above the diagonal): each half's inverse written in place,
    so beside ``A`` and ``out`` only a quarter-size product and Schur complement exist at a time."""
    n = A.shape[0]
    if n <= leaf:
        L, info = torch.linalg.cholesky_ex(A)
        if int(info):
            return False
        torch.linalg.solve_triangular(L, torch.eye(n, dtype=A.dtype, device=A.device), upper=False, out=out)
        return True
    m = n // 2
    i11 = out[:m, :m]
    if not _lower_inverse_into(A[:m, :m], i11, leaf):
        return False
    l21 = A[m:, :m] @ i11.T
    schur = torch.addmm(A[m:, m:], l21, l21.T, alpha=-1)
    if not _lower_inverse_into(schur, out[m:, m:], leaf):
        return False
    del schur
    torch.mm(out[m:, m:], l21 @ i11, out=out[m:, :m])
    out[m:, :m].neg_()
    return True


def _lower_inverse(L: Tensor, leaf: int = 256) -> Tensor:
    """``L^-1`` of a lower-triangular ``L`` by halves: ``[[A, 0], [B, C]]^-1 = [[A^-1, 0],
    [-C^-1 B A^-1, C^-1]]``, triangular solves below ``leaf`` rows.  Two thirds of the flops of a
    triangular solve against the identity, most of them in matrix products (1536 wide, float64,
    one CPU thread: 40 ms vs 60 ms)."""
    n = L.shape[0]
    if n <= leaf:
        return torch.linalg.solve_triangular(L, torch.eye(n, dtype=L.dtype, device=L.device), upper=False)
    m = n // 2
    out = torch.zeros_like(L)
    a_inv = out[:m, :m]
    a_inv.copy_(_lower_inverse(L[:m, :m], leaf))
    c_inv = out[m:, m:]
    c_inv.copy_(_lower_inverse(L[m:, m:], leaf))
    torch.mm(c_inv, L[m:, :m] @ a_inv, out=out[m:, :m])
    out[m:, :m].neg_()
    return out
