"""AWQ's maths, free of plumbing: the settings, the smoothing mappings of a decoder block, the
grid of candidate scales and the weight statistic they read (the pipeline side:
``sq.quant.algorithms.awq``).

For a mapping ``smooth -> balance`` (a norm or Linear feeding Linears), the balance weights'
input channels are multiplied by ``s`` and the smooth op's output channels divided by it, which
leaves the full-precision function unchanged; ``s`` is chosen from a grid so that the
*quantized* balance weights give the smallest error on the output of the mapping's parent
module (the AWQ paper; llm-compressor 0.14's ``AWQModifier``)::

    x_mean = mean over tokens of |x|           per input channel (every rank's tokens)
    w_mean = mean over rows of |W| / max|W| of its quantization group, over every balance weight
    s(a)   = x_mean^a / (w_mean^(1-a) + 1e-4)  (duo scaling; else x_mean^a), clamped >= 1e-4,
             divided by sqrt(max(s) * min(s))
    grid   = a in {0 (s = 1: round to nearest), then n_grid - 1 points of [0, 1]}  (duo) or
             a = k / (n_grid - 1), k < n_grid  (no duo)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from sq.anatomy import EXPERT_PARAMS, expert_params, is_experts_module
from sq.quant.settings import AlgoConfig, option

__all__ = ["AWQConfig", "Mapping", "block_mappings", "grid", "candidate_scales", "weight_means",
           "clip_search", "SUPPORTED_BLOCKS"]

CLIP_GRID, CLIP_MAX_SHRINK = 20, 0.5  # AutoAWQ's auto_clip: max * (1 - i / 20), i < 10

_ON_OFF = {"on": True, "off": False}

# decoder block classes whose mappings are known (attention q/k/v/o or DeepSeek's MLA, RMSNorm
# weight * x, a gated MLP or fused routed experts behind a linear router, with a shared expert)
SUPPORTED_BLOCKS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                    "Qwen3MoeDecoderLayer", "MixtralDecoderLayer", "DeepseekV3DecoderLayer")


@dataclass(frozen=True)
class AWQConfig(AlgoConfig):
    name = "awq"
    version = 2  # 2: --awq-chain (auto = the full-precision chain after RTN), --awq-clip (auto = on after RTN)

    n_grid: int = option(20, "grid points of the scaling exponent searched per mapping")
    duo_scaling: bool = option(True, "scales from activations and weights (x_mean^a / w_mean^(1-a), "
                                     "llm-compressor's default) or from activations only",
                               choices=_ON_OFF)
    awq_gptq: bool = option(False, "after the scales are folded, quantize with GPTQ (its default "
                                   "settings) instead of round-to-nearest", choices=_ON_OFF)
    awq_chain: str = option("auto", "the next block's calibration inputs: the full-precision block's "
                                    "outputs (fp: AutoAWQ and llm-compressor with round-to-nearest) or the "
                                    "quantized block's (quantized: as GPTQ); auto = quantized with "
                                    "--awq-gptq on, else fp", choices={c: c for c in ("auto", "fp", "quantized")})
    awq_clip: str = option("auto", "after the fold, search each output row's clipping range per quantization "
                                   "group (AutoAWQ's clip: the max shrunk by up to half, 20 steps) on the group's "
                                   "output error; integer per-group schemes, dense Linears other than "
                                   "attention's query / key producers; auto = on unless --awq-gptq on",
                           choices={c: c for c in ("auto", "on", "off")})

    @property
    def clip(self) -> bool:
        return self.awq_clip == "on" or (self.awq_clip == "auto" and not self.awq_gptq)

    @property
    def fp_chain(self) -> bool:
        """Whether the next block is calibrated on this block's full-precision outputs."""
        return self.awq_chain == "fp" or (self.awq_chain == "auto" and not self.awq_gptq)

    def problems(self) -> list[str]:
        if isinstance(self.n_grid, bool) or not isinstance(self.n_grid, int) or self.n_grid < 2:
            return [f"--n-grid must be an int >= 2, got {self.n_grid!r}"]
        return []


@dataclass
class Mapping:
    """One smoothing mapping, by module names relative to the block.

    ``smooth``: the op whose output channels are divided by ``s`` (a norm's weight, or a
    Linear's output rows); ``balance``: the quantized consumers, Linears or ``"<experts>:gate_up_proj"``
    (every expert's ``[E, 2I, H]`` columns); ``extra``: consumers scaled but never quantized (an
    MoE router reading the same norm); ``parent``: the module whose output the search compares.
    ``per_expert``: each routed expert's up -> down (``parent`` the fused experts module): one
    scale vector per expert, searched on the down projection's output of the tokens routed to it.
    """

    smooth: str
    balance: list[str]
    parent: str
    extra: list[str] = field(default_factory=list)
    per_expert: bool = False


def _linear(block: nn.Module, name: str) -> nn.Linear | None:
    try:
        m = block.get_submodule(name)
    except AttributeError:
        return None
    return m if isinstance(m, nn.Linear) else None


def block_mappings(block: nn.Module) -> tuple[list[Mapping], list[str]]:
    """The block's mappings, or refusals naming the module without one."""
    names = [c.__name__ for c in type(block).__mro__]  # FSDP2 subclasses the block's class
    kind = next((n for n in names if n in SUPPORTED_BLOCKS), names[0].removeprefix("FSDP"))
    if kind not in SUPPORTED_BLOCKS:
        return [], [f"--algo awq has no smoothing mappings for {kind} (supported: {', '.join(SUPPORTED_BLOCKS)})"]
    attn, problems = _attention_mappings(block, kind)
    mlp, more = _mlp_mappings(block, kind)
    problems += more
    return ([], problems) if problems else ([*attn, *mlp], [])


def _attention_mappings(block: nn.Module, kind: str) -> tuple[list[Mapping], list[str]]:
    if _linear(block, "self_attn.kv_a_proj_with_mqa") is not None:  # DeepSeek's multi-head latent attention
        q = "self_attn.q_a_proj" if _linear(block, "self_attn.q_a_proj") is not None else "self_attn.q_proj"
        out = [Mapping("input_layernorm", [q, "self_attn.kv_a_proj_with_mqa"], "self_attn")]
        if q == "self_attn.q_a_proj":
            out.append(Mapping("self_attn.q_a_layernorm", ["self_attn.q_b_proj"], "self_attn.q_b_proj"))
        out.append(Mapping("self_attn.kv_a_layernorm", ["self_attn.kv_b_proj"], "self_attn.kv_b_proj"))
        return out, []
    attn = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    if not all(_linear(block, n) is not None for n in [*attn, "self_attn.o_proj"]):
        return [], [f"--algo awq: {kind}.self_attn has no q/k/v/o_proj Linears to smooth"]
    out = [Mapping("input_layernorm", attn, "self_attn")]
    v, o = _linear(block, "self_attn.v_proj"), _linear(block, "self_attn.o_proj")
    if v.out_features == o.in_features:  # not under grouped-query attention (as llm-compressor)
        out.append(Mapping("self_attn.v_proj", ["self_attn.o_proj"], "self_attn.o_proj"))
    return out, []


def _gated(block: nn.Module, prefix: str) -> list[Mapping] | None:
    """A gated MLP's up -> down, or None if ``prefix`` has no gate/up/down_proj Linears."""
    if not all(_linear(block, f"{prefix}.{p}") is not None for p in ("gate_proj", "up_proj", "down_proj")):
        return None
    return [Mapping(f"{prefix}.up_proj", [f"{prefix}.down_proj"], f"{prefix}.down_proj")]


def _mlp_mappings(block: nn.Module, kind: str) -> tuple[list[Mapping], list[str]]:
    mlp = block.get_submodule("mlp")
    experts = [n for n, m in mlp.named_modules() if is_experts_module(m)]
    if experts and expert_params(mlp.get_submodule(experts[0])) != EXPERT_PARAMS:
        return [], [f"--algo awq: {kind}.mlp.{experts[0]} are up/down-only experts (no gate rows to smooth with "
                    "their up rows); AWQ has no mapping for them: use --algo gptq or rtn"]
    if not experts:
        down = _gated(block, "mlp")
        if down is None:
            return [], [f"--algo awq: {kind}.mlp has no gate/up/down_proj Linears to smooth"]
        return [Mapping("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], "mlp"), *down], []
    router = mlp.get_submodule("gate") if hasattr(mlp, "gate") else None
    w = getattr(router, "weight", None)
    shared = next((n for n in ("shared_experts", "shared_expert") if hasattr(mlp, n)), None)
    others = [n for n, _ in mlp.named_parameters() if not n.startswith(f"{experts[0]}.") and n != "gate.weight"
              and not (shared and n.startswith(f"{shared}."))]
    down = _gated(block, f"mlp.{shared}") if shared else []
    if len(experts) != 1 or w is None or w.dim() != 2 or others or down is None:
        return [], [f"--algo awq: {kind}.mlp ({type(mlp).__name__}) is not one fused experts module behind a "
                    f"linear router, with at most a gated shared expert (found {', '.join(others) or 'no router weight'}"
                    "); no mapping for it"]
    ex = f"mlp.{experts[0]}"
    balance = [f"{ex}:gate_up_proj"] + ([f"mlp.{shared}.gate_proj", f"mlp.{shared}.up_proj"] if shared else [])
    return [Mapping("post_attention_layernorm", balance, "mlp", extra=["mlp.gate"]),
            Mapping(f"{ex}:up", [f"{ex}:down_proj"], ex, per_expert=True), *down], []


def grid(n_grid: int, duo: bool) -> list[tuple[float, bool]]:
    """(exponent, duo) candidates, the first one the identity (s = 1)."""
    if duo:
        return [(0.0, False)] + [(k / (n_grid - 2), True) for k in range(n_grid - 1)] if n_grid > 2 else \
            [(0.0, False), (1.0, True)]
    return [(k / (n_grid - 1), False) for k in range(n_grid)]


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float, duo: bool) -> torch.Tensor:
    """The per-input-channel scales of one grid point (float32)."""
    x = x_mean.float()
    if duo:
        s = (x.pow(ratio) / (w_mean.float().pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        s = x.pow(ratio).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    s[~torch.isfinite(s)] = 1
    return s


def weight_means(weights: list[tuple[torch.Tensor, object]]) -> torch.Tensor:
    """Mean over every balance weight's rows of ``|W|`` normalised by its quantization group's max:
    ``weights`` are ``(W [rows, in], scheme)`` (None scheme: left out, as llm-compressor)."""
    total, count = None, 0
    for w, scheme in weights:
        if scheme is None:
            continue
        rows, cols = w.shape
        chunk = scheme.group_size if scheme.strategy in ("group", "tensor_group") else cols
        a = w.detach().float().abs().reshape(-1, chunk)
        a = (a / (a.amax(dim=1, keepdim=True) + 1e-6)).reshape(rows, cols)
        part = a.sum(0, dtype=torch.float64)
        total = part if total is None else total + part
        count += rows
    return (total / count).float()


def clip_search(w: torch.Tensor, gram: torch.Tensor, qdq, *, n_grid: int = CLIP_GRID,
                max_shrink: float = CLIP_MAX_SHRINK, chunk_rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's clipping search on rows ``w [rows, in]``: per row and quantization group ``g``
    (``gram [n_groups, G, G]`` = sum over tokens of ``x_g x_g^T``, the group's inputs), the range
    ``[-m, m]`` with ``m = max|w_g| * (1 - i / n_grid)``, ``i < max_shrink * n_grid``, whose
    quantized weights ``qdq(clamp(w, -m, m))`` give the least output error ``d^T gram_g d``
    (``d`` the weight error; ``i = 0``, no clipping, wins ties).  Returns the clipped rows (``w``'s
    dtype) and each (row, group)'s chosen shrink ``i / n_grid``."""
    rows, cols = w.shape
    ng, gs = gram.shape[0], gram.shape[1]
    if ng * gs != cols:
        raise ValueError(f"clip_search: {ng} groups of {gs} do not tile {cols} columns")
    h = gram.float()
    out, shrink = torch.empty_like(w), torch.zeros(rows, ng)
    steps = max(1, int(max_shrink * n_grid))
    for r0 in range(0, rows, chunk_rows):
        wc = w[r0:r0 + chunk_rows].float().view(-1, ng, gs)
        top = wc.abs().amax(-1, keepdim=True)
        best_err = torch.full(wc.shape[:2], float("inf"))
        best_m = top.clone()
        for i in range(steps):
            m = top * (1 - i / n_grid)
            cur = torch.maximum(torch.minimum(wc, m), -m)
            d = (qdq(cur.view(-1, cols).to(w.dtype)).float().view_as(wc) - wc)
            err = (torch.einsum("rgi,gij->rgj", d, h) * d).sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_m = torch.where(better[..., None], m, best_m)
            shrink[r0:r0 + chunk_rows][better] = i / n_grid
        clipped = torch.maximum(torch.minimum(wc, best_m), -best_m)
        out[r0:r0 + chunk_rows] = clipped.view(-1, cols).to(w.dtype)
    return out, shrink
