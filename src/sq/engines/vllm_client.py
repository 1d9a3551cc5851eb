"""vLLM as the second engine: score a checkpoint the way it will be served.

vLLM pins its own torch build, transformers and compressed-tensors, so it lives in a venv of its own
(``serving/setup_vllm.sh`` makes ``.venv-vllm``) and never in sq's.  sq tokenizes here and hands
vLLM token ids: ``vllm_worker.py`` runs in that venv as a subprocess (vLLM's offline ``LLM`` API,
in-process engine, ``enforce_eager``, a small KV cache) and writes a JSON result this module reads.

Which interpreter: ``--engine-python`` / ``python=``, else ``$SQ_VLLM_PYTHON``, else
``.venv-vllm/bin/python`` beside the current venv, else the current interpreter when it imports
vLLM itself.  Every failure is one ``SqError`` naming the checkpoint and vLLM's own message.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sq.engines.reference import perplexity_from_logprobs
from sq.errors import SqError

WORKER = Path(__file__).with_name("vllm_worker.py")
ENV_PYTHON = "SQ_VLLM_PYTHON"

# WARNING lines vLLM's CPU build logs about this machine, the settings sq asks for, and a second checkpoint
# started in the same process (VLLM_DIST_IDENT is vLLM's own variable; kernels registered again) -- never
# about the checkpoint.
# Anything else is reported as a serving problem (``EngineRun.problems``).
ENVIRONMENT_NOTES = tuple(re.compile(p) for p in (
    r"^Triton is (installed, but doesn't include CPU backend|not installed)",
    r"^Enforce eager set",
    r"^Inductor compilation was disabled",
    r"^Model Runner V2 requires Triton",
    r"^(libtcmalloc|libiomp) is not found in LD_PRELOAD",
    r"^Reset SSM cache type to float32",
    r"^Upcasting torch\.bfloat16 to torch\.float32",
    r"^Casting torch\.\w+ to torch\.\w+",
    r"^Default sampling parameters have been overridden",
    r"^Environment variable VLLM_CPU_OMP_THREADS_BIND",
    r"^Pin memory is not supported",
    r"^VLLM_ENABLE_V1_MULTIPROCESSING=0",
    r"^Using default MoE config",
    r"^CPU backend doesn't allow to use `torch.set_num_threads`",
    r"^The global random seed is set to",
    r"^Unknown vLLM environment variable detected: VLLM_DIST_IDENT$",
    r"^Kernel [\w.]+ is already registered\. Overwriting\.$",
))


@dataclass
class EngineRun:
    """What vLLM made of one checkpoint (``vllm_worker.py``'s result, read back)."""

    model: str
    token_logprobs: list[list[float]]  # per window: logprob of tokens 1..seqlen-1 given the ones before
    greedy: list[dict]
    quant_methods: dict[str, int]
    schemes: dict[str, int]
    log: list[dict]
    versions: dict[str, str]
    seconds: dict[str, float] = field(default_factory=dict)
    fp8_gemm: dict = field(default_factory=dict)  # how torch's CPU fp8 GEMM ran (vllm_worker._route_fp8_gemm)
    w4a8: int = 0  # int4 Linears vLLM ran with int8 activations (VLLM_CPU_INT4_W4A8 on a CPU with AMX)

    @property
    def perplexity(self) -> float:
        return perplexity_from_logprobs(self.token_logprobs, f"{self.model} in vLLM")

    @property
    def problems(self) -> list[str]:
        """vLLM's warnings about this checkpoint (ignored or missing weights, fallbacks, ...): none expected."""
        return [f"{r['logger']}: {r['message']}" for r in self.log
                if not any(p.search(r["message"]) for p in ENVIRONMENT_NOTES)]


def engine_python(python: str | os.PathLike | None = None) -> str:
    """The interpreter of a venv that imports vLLM; a clear SqError when there is none."""
    if python:
        path = Path(python)
        if not path.is_file():
            raise SqError(f"--engine-python {path}: no such file")
        return str(path)
    if os.environ.get(ENV_PYTHON):
        return engine_python(os.environ[ENV_PYTHON])
    beside = Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python"
    if beside.is_file():
        return str(beside)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise SqError(f"no vLLM to run: pass --engine-python PATH (the python of a venv with vLLM), set ${ENV_PYTHON}, "
                  "or build one with serving/setup_vllm.sh (.venv-vllm beside .venv)")


def _environment() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # sq's venv paths must not shadow the engine venv's transformers
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the model is reachable for inspection
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")  # vLLM's CPU default leaves one core idle
    # vLLM 0.32's CPU build serves int4 weights with int8 activations where the CPU has AMX tiles, unless told
    # not to: that is W4A8, not the checkpoint's W4A16 (docs/serving.md measures the difference)
    env.setdefault("VLLM_CPU_INT4_W4A8", "0")
    env["VLLM_CONFIGURE_LOGGING"] = "0"  # its records reach the worker's root logger, which keeps them
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


@dataclass
class Job:
    """One checkpoint for vLLM: windows ([n, seqlen] ids) to score, a prompt to continue greedily."""

    model: str | os.PathLike
    windows: object = None
    prompt: list[int] | None = None
    new_tokens: int = 0
    dtype: str = "float32"
    kv_cache_bytes: int = 256 << 20

    def request(self) -> dict:
        rows = self.windows.tolist() if self.windows is not None else []
        prompt = list(self.prompt or [])
        # +1: vLLM generates a token after each window; 64 at least: vLLM renders a chat template at
        # start-up and warns when it does not fit
        longest = max([len(r) + 1 for r in rows] + [len(prompt) + self.new_tokens, 64])
        return {"model": str(Path(self.model).resolve()), "windows": rows, "prompt": prompt,
                "new_tokens": int(self.new_tokens), "dtype": self.dtype, "max_model_len": longest,
                "kv_cache_bytes": int(self.kv_cache_bytes)}


def run_vllm(model: str | os.PathLike, *, python: str | os.PathLike | None = None, timeout: float = 1800.0,
             **job) -> EngineRun:
    """Load ``model`` in vLLM; score ``windows`` and greedily continue ``prompt`` (``Job``'s fields).

    Raises SqError when vLLM refuses the checkpoint, fails, or runs past ``timeout`` seconds.
    """
    (run,) = run_vllm_jobs([Job(model, **job)], python=python, timeout=timeout)
    if isinstance(run, SqError):
        raise run
    return run


def run_vllm_jobs(jobs: list[Job], *, python: str | os.PathLike | None = None,
                  timeout: float = 1800.0) -> list[EngineRun | SqError]:
    """Every job in one vLLM process, one checkpoint after the other (start-up paid once).

    Returns, per job, its ``EngineRun`` or the SqError that says why vLLM could not serve it; raises
    SqError when the engine itself cannot run (no interpreter, a crash, ``timeout`` seconds passed).
    """
    requests = [job.request() for job in jobs]
    interpreter = engine_python(python)
    with tempfile.TemporaryDirectory(prefix="sq-vllm-") as tmp:
        request_path = Path(tmp) / "request.json"
        result_path = Path(tmp) / "result.json"
        request_path.write_text(json.dumps({"jobs": requests}))
        # its own session, so a timeout kills whatever the engine started, not only the worker
        proc = subprocess.Popen([interpreter, str(WORKER), str(request_path), str(result_path)], env=_environment(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            names = ", ".join(r["model"] for r in requests)
            raise SqError(f"vLLM did not finish with {names} within {timeout:.0f} s") from e
        if not result_path.is_file():
            tail = " ".join((stderr or stdout or "").strip().splitlines()[-3:])
            raise SqError(f"vLLM ({interpreter}) exited {proc.returncode} without a result: {tail}")
        result = json.loads(result_path.read_text())
    versions = result.get("versions", {})
    if "error" in result:
        error = result["error"]
        raise SqError(f"{interpreter} cannot run vLLM: {error['type']}: {error['message']}")
    out: list[EngineRun | SqError] = []
    for i, request in enumerate(requests):
        model = request["model"]
        if i >= len(result["results"]):
            out.append(SqError(f"vLLM stopped before {model}: an earlier checkpoint left the engine unusable"))
            continue
        r = result["results"][i]
        if "error" in r:
            error = r["error"]
            out.append(SqError(f"vLLM {engine_version(versions)} cannot serve {model}: "
                               f"{error['type']}: {error['message']}"))
            continue
        out.append(EngineRun(model=model, token_logprobs=r.get("token_logprobs", []), greedy=r.get("greedy", []),
                             quant_methods=r.get("quant_methods", {}), schemes=r.get("schemes", {}),
                             log=r.get("log", []), versions=versions, seconds=r.get("seconds", {}),
                             fp8_gemm=result.get("fp8_gemm", {}), w4a8=r.get("w4a8", 0)))
    return out


def engine_version(versions: dict) -> str:
    """vLLM's version from a worker result (the CPU build is the ``vllm-cpu`` distribution)."""
    return versions.get("vllm") or versions.get("vllm-cpu") or "?"
