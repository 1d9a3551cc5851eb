"""One checkpoint, two engines: transformers' perplexity and greedy tokens beside vLLM's.

Both engines get the same token ids (tokenized once, here).  transformers runs as ``sq.eval`` does
(fp32 on CPU, compressed-tensors' own dequantization and activation fake quantization); vLLM runs
in its venv (``vllm_client``) in the dtype asked for.  ``Comparison.failures`` says what a
serving check refuses:

- vLLM refused or failed to load (raised as SqError by ``run_vllm``, before any comparison);
- vLLM logged a warning about the checkpoint (ignored or missing weights, a fallback), i.e. any
  WARNING outside ``vllm_client.ENVIRONMENT_NOTES``;
- a quantized checkpoint whose Linears vLLM built unquantized (``UnquantizedLinearMethod`` only);
- perplexities more than ``max_gap`` apart (relative);
- greedy tokens that diverge where neither engine saw a near-tie: at the first differing step, the
  gap between the two candidate tokens' log-probabilities is at least the tie tolerance in both
  engines.  The tolerance is ``TIE`` nats, or ``NOISE_TIES`` times the engines' mean per-token
  |logprob difference| on the windows when that is larger: presets that quantize activations at run
  time (W8A8, FP8_DYNAMIC) round differently in each engine, and on SmolLM2 each engine's per-token
  logprobs move ~0.17 nats from the full-precision model's and ~0.13-0.2 from each other's, so
  their greedy paths part where the margin is of that size (docs/serving.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from sq.engines.reference import greedy, load, perplexity_from_logprobs, token_logprobs
from sq.engines.vllm_client import EngineRun, Job, run_vllm_jobs
from sq.errors import SqError

# A fixed prompt of the kind the demo corpus (Python's documentation) holds.
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
NEW_TOKENS = 32
MAX_GAP = 0.02
TIE = 0.1  # nats between the two candidate tokens: below it, rounding differences may pick either
NOISE_TIES = 4.0


@dataclass
class Divergence:
    """The first greedy step where the engines chose differently, with how close each call was."""

    position: int
    transformers_token: int
    vllm_token: int
    transformers_margin: float  # transformers' logprob(its token) - logprob(vLLM's token), if in its top 2
    vllm_margin: float  # vLLM's logprob(its token) - logprob(transformers' token), if in its top 2

    def near_tie(self, tolerance: float = TIE) -> bool:
        return min(self.transformers_margin, self.vllm_margin) < tolerance


def _margin(step: dict, other: int) -> float:
    """logprob(chosen) - logprob(other) from a step's top 2; inf when ``other`` is not in it."""
    top = {int(t): lp for t, lp in step["top"]}
    return top[step["token"]] - top[other] if other in top else math.inf


def first_divergence(reference: list[dict], served: list[dict]) -> Divergence | None:
    for i, (a, b) in enumerate(zip(reference, served)):
        if a["token"] != b["token"]:
            return Divergence(i, a["token"], b["token"], _margin(a, b["token"]), _margin(b, a["token"]))
    return None


@dataclass
class Comparison:
    model: str
    transformers_logprobs: list[list[float]]  # per window, as EngineRun.token_logprobs
    vllm: EngineRun
    transformers_greedy: list[dict]
    dtype: str
    quantized: bool
    max_gap: float = MAX_GAP

    @property
    def transformers_ppl(self) -> float:
        return perplexity_from_logprobs(self.transformers_logprobs, f"{self.model} in transformers")

    @property
    def vllm_ppl(self) -> float:
        return self.vllm.perplexity

    @property
    def noise(self) -> float:
        """Mean |logprob difference| per scored token between the engines (nats)."""
        pairs = [(a, b) for ta, tb in zip(self.transformers_logprobs, self.vllm.token_logprobs) for a, b in zip(ta, tb)]
        return math.fsum(abs(a - b) for a, b in pairs) / max(len(pairs), 1)

    @property
    def tie_tolerance(self) -> float:
        return max(TIE, NOISE_TIES * self.noise)

    @property
    def gap(self) -> float:
        """vLLM's perplexity relative to transformers' (0.01 = 1% higher)."""
        return self.vllm_ppl / self.transformers_ppl - 1.0

    @property
    def divergence(self) -> Divergence | None:
        return first_divergence(self.transformers_greedy, self.vllm.greedy)

    @property
    def tokens_agreeing(self) -> int:
        d = self.divergence
        return d.position if d else min(len(self.transformers_greedy), len(self.vllm.greedy))

    def failures(self) -> list[str]:
        out = [f"vLLM warned: {p}" for p in self.vllm.problems]
        methods = self.vllm.quant_methods
        if self.quantized and not self.vllm.schemes:
            out.append(f"vLLM built every Linear unquantized ({methods}) from a quantized checkpoint")
        if self.vllm.w4a8:
            out.append(f"vLLM ran {self.vllm.w4a8} int4 Linears with int8 activations (VLLM_CPU_INT4_W4A8=1 on a "
                       "CPU with AMX): not the checkpoint's weight-only scheme")
        if abs(self.gap) > self.max_gap:
            out.append(f"perplexity {self.vllm_ppl:.4f} in vLLM vs {self.transformers_ppl:.4f} in transformers "
                       f"({self.gap:+.2%}, more than {self.max_gap:.0%} apart)")
        d = self.divergence
        if d is not None and not d.near_tie(self.tie_tolerance):
            out.append(f"greedy tokens diverge at step {d.position}: transformers {d.transformers_token} "
                       f"(margin {d.transformers_margin:.3f}), vLLM {d.vllm_token} (margin {d.vllm_margin:.3f}); "
                       f"not a near-tie (< {self.tie_tolerance:.3f} nats) in either engine")
        return out

    def record(self) -> dict:
        """One JSON-able line for tables and CI logs."""
        d = self.divergence
        return {
            "model": self.model, "dtype": self.dtype, "transformers_ppl": round(self.transformers_ppl, 4),
            "vllm_ppl": round(self.vllm_ppl, 4), "gap": round(self.gap, 5), "noise": round(self.noise, 4),
            "greedy_agree": self.tokens_agreeing, "greedy_len": len(self.transformers_greedy),
            "divergence": None if d is None else {
                "position": d.position, "transformers": d.transformers_token, "vllm": d.vllm_token,
                "transformers_margin": round(d.transformers_margin, 4), "vllm_margin": round(d.vllm_margin, 4)},
            "schemes": self.vllm.schemes, "quant_methods": self.vllm.quant_methods,
            "problems": self.vllm.problems, "versions": self.vllm.versions, "seconds": self.vllm.seconds,
            "fp8_gemm": self.vllm.fp8_gemm, "w4a8": self.vllm.w4a8,
            "failures": self.failures(),
        }


def is_quantized(model_dir: str | Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("quantization_config"))


@dataclass
class Case:
    """One checkpoint to compare: vLLM's dtype, and what transformers reads as the reference -- the
    checkpoint itself, or ``reference``, a dense checkpoint of what it means where transformers cannot
    read it (an asymmetric pack-quantized output, docs/serving.md)."""

    model: str | Path
    dtype: str = "auto"
    reference: str | Path | None = None


def _transformers(case: Case, windows, prompt: list[int], new_tokens: int) -> tuple[list, list] | SqError:
    """transformers' per-token logprobs and greedy steps, or the SqError saying why it cannot score the case."""
    source = Path(case.reference or case.model)
    try:
        model = load(str(source), source, model=True)
        return token_logprobs(model, windows).tolist(), greedy(model, prompt, new_tokens)
    except SqError as e:
        return e
    except (RuntimeError, ValueError, KeyError, NotImplementedError) as e:  # the library's forward on this format
        return SqError(f"transformers cannot score {source}: {type(e).__name__}: {' '.join(str(e).split())[:500]}")


def compare_all(cases: list[Case], windows, prompt: list[int], *, new_tokens: int = NEW_TOKENS, python=None,
                max_gap: float = MAX_GAP, timeout: float = 1800.0) -> list[Comparison | SqError]:
    """Every case scored by transformers here (one model at a time), then by vLLM in one engine process.

    Per case: its Comparison, or the SqError saying why transformers could not score it (then vLLM is not
    asked) or why vLLM could not serve it.
    """
    references = [_transformers(case, windows, prompt, new_tokens) for case in cases]
    served = [c for c, r in zip(cases, references) if not isinstance(r, SqError)]
    jobs = [Job(case.model, windows=windows, prompt=prompt, new_tokens=new_tokens, dtype=case.dtype) for case in served]
    runs = iter(run_vllm_jobs(jobs, python=python, timeout=timeout) if jobs else [])
    out: list[Comparison | SqError] = []
    for case, reference in zip(cases, references):
        if isinstance(reference, SqError):  # no reference to compare with: not served either
            out.append(reference)
            continue
        run = next(runs)
        if isinstance(run, SqError):
            out.append(run)
            continue
        logprobs, tokens = reference
        out.append(Comparison(model=str(case.model), transformers_logprobs=logprobs, vllm=run,
                              transformers_greedy=tokens, dtype=case.dtype, quantized=is_quantized(case.model),
                              max_gap=max_gap))
    return out


def dequantized_copy(src: str | Path, dst: str | Path, scheme_name: str, group_size: int) -> Path:
    """``src`` (a sq output of one preset) as a dense bf16 checkpoint in ``dst``: every quantized Linear
    replaced by sq's own dequantization of its tensors, everything else copied.

    What the output means, readable without compressed-tensors: the reference for a preset transformers
    cannot load (an asymmetric pack-quantized checkpoint, docs/serving.md).
    """
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from sq.formats.compressed import decompress_weight
    from sq.formats.schemes import get_scheme

    src, dst = Path(src), Path(dst)
    scheme = get_scheme(scheme_name, group_size)
    dst.mkdir(parents=True)
    dense, groups = {}, {}
    for f in sorted(src.glob("*.safetensors")):
        for key, t in load_file(f).items():
            module, _, name = key.rpartition(".")
            if name.startswith("weight_"):  # weight_packed, weight_scale, weight_zero_point, weight_shape
                groups.setdefault(module, {})[name] = t
            else:
                dense[key] = t
    for module, parts in groups.items():
        dense[f"{module}.weight"] = decompress_weight(parts, scheme).to(torch.bfloat16)
    save_file(dense, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(f, dst / f.name)
    return dst


def compare(model_dir: str | Path, windows, prompt: list[int], *, dtype: str = "auto", reference=None,
            **kwargs) -> Comparison:
    """``compare_all`` for one checkpoint; raises SqError when vLLM cannot serve it."""
    (result,) = compare_all([Case(model_dir, dtype, reference)], windows, prompt, **kwargs)
    if isinstance(result, SqError):
        raise result
    return result
