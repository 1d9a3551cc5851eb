"""What an algorithm is handed for one decoder block, and what it hands back: typed, so a hook reads
fields, not keys of a shared bag.

- ``Linear`` / ``ExpertGroup``: the block's quantization targets (decided by ``sq.pipeline.targets``);
- ``ObservedScales``: static activation and KV cache scales (``sq.quant.activations``), by kind;
- ``BlockWork``: the block, its targets, this rank's calibration batches, the cross-row statistics
  its formats need (dense weights and experts apart), and a per-block dict private to the algorithm;
- ``Solved``: one weight's quantized rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from sq.formats.schemes import QuantScheme

__all__ = ["Linear", "ExpertGroup", "ObservedScales", "BlockWork", "Solved", "Cost", "err_terms", "row_forms"]


@dataclass
class Linear:
    """One quantized dense Linear of a block."""

    name: str  # model name of the module, e.g. model.layers.3.self_attn.q_proj
    module: nn.Linear
    ckpt_prefix: str  # checkpoint name minus "weight", e.g. model.layers.3.self_attn.q_proj.
    owner: int  # writer rank
    scheme: QuantScheme


class ExpertGroup(NamedTuple):
    """One fused experts module of a block (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)."""

    prefix: str  # model name of the module, e.g. model.layers.3.mlp.experts
    module: nn.Module
    scheme: QuantScheme


@dataclass
class ObservedScales:
    """Calibrated activation tensors, each ``{tensor name: tensor}``: by dense Linear name; by
    ``(experts prefix, expert, "in" | "mid")``; by attention module name (``k_scale`` / ``v_scale``)."""

    linears: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    experts: dict[tuple[str, int, str], dict[str, torch.Tensor]] = field(default_factory=dict)
    kv: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    absmax: dict[str, torch.Tensor] = field(default_factory=dict)  # dense Linear name -> its input's absmax


@dataclass
class Solved:
    """One weight's quantized rows, as data: ``q``/``scale``/``zero_point`` in the scheme's layout,
    ``deq`` the dequantized rows (written back into the model: the quantized chain), ``H`` the
    matrix the error is measured through (None: weight space)."""

    q: torch.Tensor | None  # None where ``writer`` holds the whole weight's codes
    scale: torch.Tensor | None
    zero_point: torch.Tensor | None
    deq: torch.Tensor
    H: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None  # NVFP4's per-tensor scale (the same on every rank)
    # A weight solved whole on one rank: that rank (the same on every rank) writes it from ``whole``,
    # its ``(q, scale, zero_point)`` for every row, which only it holds; the rest of the ranks hold
    # their ``deq`` rows alone (q and scale None).  None: each rank holds its rows of everything.
    writer: int | None = None
    whole: tuple | None = None
    # the report's error terms (``err_terms``: ``[num, den]`` per dequantization) where the solver computed
    # them over the whole weight (its Hessian lives on that rank alone); zeros on the other ranks
    terms: list[float] | None = None


@dataclass
class BlockWork:
    """Everything the pipeline knows about the block being quantized, for the algorithm's hooks.

    ``inputs`` / ``fp_inputs`` are this rank's local batches ``[(hidden, kwargs), ...]`` of the
    quantized and full-precision chains; ``steps`` is the number of forwards every rank runs
    (ranks with fewer local batches pad with ``dummy``); ``fp_out`` the full-precision block
    outputs where the algorithm asked for them; ``state`` is the algorithm's own per-block data.
    """

    index: int
    prefix: str
    block: nn.Module
    linears: list[Linear]
    experts: list[ExpertGroup]
    inputs: list
    fp_inputs: list
    steps: int
    dummy: Any
    device: torch.device
    rank: int
    world: int
    nsamples: int
    seed: int
    calibrate_all_experts: bool
    # the checkpoint's dtype of the block's weights; the forwards may compute in another
    # (--calib-dtype: FSDP2 then gathers the weights cast to it)
    weight_dtype: torch.dtype | None = None
    # --calib-dtype mixed: the half dtype the block's matmuls and attention autocast to (SignRound's
    # tuning and the pipeline's chain forwards); None: none
    autocast: torch.dtype | None = None
    fp_out: list | None = None
    # cross-row statistics (sq.formats.specs reductions), already all-reduced and shared by fused
    # partners: dense weight name -> {stat: tensor}
    linear_stats: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    # (experts prefix, param) -> per local expert, a list of sq.quant.experts.SlotStats (one per
    # checkpoint tensor of the fused rows)
    expert_stats: dict[tuple[str, str], list] = field(default_factory=dict)
    row_offset: dict[str, int] = field(default_factory=dict)  # dense weight name -> this rank's first row
    acts: ObservedScales = field(default_factory=ObservedScales)
    served_activations: bool = False  # --served-activations (sq.quant.served): GPTQ's quantized chain rounds inputs
    state: dict = field(default_factory=dict)


@dataclass
class Cost:
    """What one phase of a block does, in the units ``sq.pipeline.timing.Rates`` prices (``Algorithm.cost``)."""

    gemm: float = 0.0  # matmul FLOPs in the forwards' dtype
    attention: float = 0.0  # attention FLOPs (scores and values), the forwards' dtype
    experts: float = 0.0  # experts' matmul FLOPs (the tokens routed to each expert), the forwards' dtype
    gemm32: float = 0.0  # float32 matmul FLOPs
    gemm64: float = 0.0  # float64 matmul FLOPs (experts' Hessians over token sets)
    hessian: float = 0.0  # GPTQ's per-sample Hessian accumulation: tokens x width^2
    factor: float = 0.0  # GPTQ's damped inverse factorization: width^3
    solves: float = 0.0  # GPTQ solves (each factorization's fixed cost)
    columns: float = 0.0  # GPTQ sweep columns (Python-bound)
    cells: float = 0.0  # GPTQ sweep columns x rows (each column's work on its rows, its error pushed on)
    mem: float = 0.0  # bytes through elementwise passes
    ops: float = 0.0  # small tensor ops (Python and dispatch bound)
    read: float = 0.0  # checkpoint bytes read
    write: float = 0.0  # bytes serialized and written
    files: float = 0.0  # files written durably (fsync of the file and its folder)
    link: float = 0.0  # bytes through collectives
    collectives: float = 0.0  # collectives joined (each a rendezvous of the ranks: latency, and the skew between them)

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __mul__(self, k: float) -> Cost:
        return Cost(*(a * k for a in dataclasses.astuple(self)))

    __rmul__ = __mul__


def err_terms(w: torch.Tensor, deqs: list[torch.Tensor], H: torch.Tensor | None,
              h_cast: dict[tuple, torch.Tensor], dtype: torch.dtype = torch.float32) -> list[float]:
    """``[num, den] * len(deqs)``: each dequantization's squared error and the weight's squared norm,
    through ``H`` when given (else in weight space), for this rank's rows.  A report's number: the
    stacked ``[w; w - deq...]`` rows in ``dtype`` (bf16 where the forwards are: ``w - deq`` of two
    nearby bf16 values is mostly exact), each row's quadratic form ``a H a^T`` read off one block
    triangle of ``H`` (``row_forms``; ``H`` cast once per Hessian into ``h_cast``, shared by the Linears
    that share it) and summed in float32,
    the rows in float64 (gate/up's 1536 x 576 rows of a SmolLM2 rank: 6 ms, against 31 ms all in
    float32; the same numbers to 4 digits).  A quadratic form that bf16's rounding leaves negative (an
    error small against H's large entries: seen on SmolLM2 under the full-range grid) is computed
    again in float32.  The rows go ``_TERM_ELEMS`` stacked elements at a time (a 7168 x 16384 o_proj's
    three stacked copies would be 0.7 GiB in bf16)."""
    hc = None
    if H is not None:
        hc = h_cast.get((id(H), dtype))
        if hc is None:
            hc = h_cast[(id(H), dtype)] = H if H.dtype == dtype else H.to(dtype)
    parts = [0.0] * (1 + len(deqs))
    step = max(1, _TERM_ELEMS // max(1, (1 + len(deqs)) * w.shape[-1]))
    for r in range(0, max(w.shape[0], 1), step):
        wd = w[r : r + step].to(dtype)
        a = torch.cat([wd, *(wd - d[r : r + step].to(dtype) for d in deqs)])
        forms = row_forms(a, hc) if hc is not None else (a * a).sum(dim=1, dtype=torch.float32)
        for i, x in enumerate(forms.view(1 + len(deqs), -1).sum(dim=1, dtype=torch.float64).tolist()):
            parts[i] += x
    if dtype != torch.float32 and min(parts) < 0:
        return err_terms(w, deqs, H, h_cast, torch.float32)
    return [x for num in parts[1:] for x in (num, parts[0])]


_TERM_ELEMS = 1 << 24  # err_terms' stacked rows at a time (elements)
# row_forms' column band: H's lower block triangle is read (0.6x the products of a @ H at 1536 wide)
_FORM_BAND = 128


def row_forms(a: torch.Tensor, H: torch.Tensor, band: int = _FORM_BAND) -> torch.Tensor:
    """``a_i H a_i^T`` for every row of ``a`` (``H`` symmetric), in float32: over column bands ``I``,
    ``a_I H_II a_I + 2 a_I (H_>I,I a_>I)``, so only H's lower block triangle is multiplied (on a SmolLM2
    block's stacked rows, one CPU thread, bf16: 30 ms against 44 ms for ``((a @ H) * a).sum(1)``)."""
    n = a.shape[1]
    out = torch.zeros(a.shape[0], dtype=torch.float32, device=a.device)
    for p in range(0, n, band):
        q = min(n, p + band)
        t = a[:, p:q] @ H[p:q, p:q]
        if q < n:
            t.add_(a[:, q:] @ H[q:, p:q], alpha=2)
        out += (a[:, p:q] * t).sum(dim=1, dtype=torch.float32)
    return out
