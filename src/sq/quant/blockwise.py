"""A quantization job on a checkpoint: its config, and the glue from a folder to the pipeline.

    PTQConfig (the job) -> resolve the model -> skeleton on meta -> load plan (every refusal)
    -> calibration windows (calibrated algorithms) -> sq.quant.pipeline.run_pipeline

The per-block work is ``sq.quant.pipeline``; the algorithms are ``sq.quant.algorithms``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sq.anatomy import decoder_blocks, experts_modules
from sq.calib.data import calibration_windows, load_tokenizer, read_corpus_dist, tokenize_corpus
from sq.demo import resolve_model_dist
from sq.dist import ParallelDims, all_reduce_min_int, rank_device
from sq.errors import SqError
from sq.files import sha256_bytes
from sq.load.loader import plan_load
from sq.load.meta import build_skeleton
from sq.parallel.fsdp import apply_parallel
from sq.patterns import check_patterns
from sq.quant.activations import KV_CACHE_SCHEMES, observes_activations
from sq.quant.algorithms import AlgoConfig, algo_config, make_algorithm
from sq.agree import agree, argument_facts
from sq.quant.gptq import GPTQConfig
from sq.quant.pipeline import raise_all, run_pipeline
from sq.quant.recipe import ignore_label, make_assigner
from sq.quant.weights import CheckpointWeights

__all__ = ["PTQConfig", "quantize_model", "auto_ep"]

logger = logging.getLogger(__name__)

@functools.lru_cache(maxsize=1)
def cpu_has_bf16_matrix_units() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (Intel AMX, ``amx_bf16`` in
    /proc/cpuinfo's flags), so that bf16 forwards are faster than float32 ones, not slower."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)
    except OSError:
        return False


# job settings read only by algorithms that run calibration data (not in an RTN run's signature)
CALIBRATION_FIELDS = ("nsamples", "seqlen", "seed", "dataset", "calibrate_all_experts", "calib_dtype")
# --calib-dtype words: the dtype calibration forwards compute in (``PTQConfig.compute_dtype``)
CALIB_DTYPES = ("auto", "float32", "model")


@dataclass(frozen=True)
class PTQConfig:
    """One quantization job.  ``algo`` is the algorithm's own config (``sq.quant.algorithms``);
    ``to_dict`` goes into the report, ``signature_args`` into the resume signature."""

    model: str
    output: str
    scheme: str = "W4A16"
    algo: AlgoConfig = field(default_factory=GPTQConfig)
    group_size: int = 128
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    dataset: str = "builtin:pydoc"
    calibrate_all_experts: bool = True
    ignore: tuple[str, ...] = ()
    recipe: str | None = None  # mixed-precision recipe file (sq.quant.recipe)
    timeout_s: float = 600.0
    ep: int | None = None  # None: auto (sq.quant.blockwise.auto_ep), resolved before the pipeline runs
    resume: str = "auto"  # auto | never | require
    kv_cache: str = "none"  # none | fp8: calibrated per-layer k/v scales (sq.quant.activations)
    calib_dtype: str = "auto"  # auto | float32 | model: what calibration forwards compute in (compute_dtype)
    skip_nonfinite: bool = False  # leave NaN/Inf Linears unquantized instead of refusing
    verify_source: str = "stat"  # stat | content: how the resume signature and the ranks identify source shards
    allow_unmatched: bool = False  # --ignore patterns / recipe rules matching no module: warned about, not refused
    trust_remote_code: bool = False  # run the checkpoint's own code (auto_map): only on the user's word
    bookkeeping: bool = True  # benchmark-only switch: no manifests, chain cache or checksums
    fault: str | None = None  # test-only: SQ_FAULT=point:rank[:block] (sq.resume.FAULT_POINTS)

    @classmethod
    def build(cls, *, algo: str | AlgoConfig = "gptq", **kw) -> PTQConfig:
        """Job fields and the algorithm's settings in one flat set of keywords (the Python API's and
        the tests' form): ``PTQConfig.build(model=..., output=..., algo="signround", iters=8)``."""
        mine = {f.name for f in dataclasses.fields(cls)}
        job = {k: v for k, v in kw.items() if k in mine}
        settings = {k: v for k, v in kw.items() if k not in mine}
        if isinstance(algo, str):
            algo = algo_config(algo, **settings)
        elif settings:
            raise SqError(f"algorithm settings {sorted(settings)} given beside a {type(algo).__name__}")
        return cls(algo=algo, **job)

    def problems(self) -> list[str]:
        """Argument refusals (identical on every rank)."""
        out = []
        if self.verify_source not in ("stat", "content"):
            out.append(f"--verify-source must be stat or content, got {self.verify_source!r}")
        if self.resume not in ("auto", "never", "require"):
            out.append(f"--resume must be auto, never or require, got {self.resume!r}")
        if not isinstance(self.algo, AlgoConfig):
            out.append(f"algo must be an algorithm config, got {self.algo!r}")
        else:
            out += self.algo.problems()
        for flag in ("nsamples", "seqlen", "ep"):
            v = getattr(self, flag)
            if v is not None and v <= 0:
                out.append(f"--{flag} must be positive, got {v}")
        if self.calib_dtype not in CALIB_DTYPES:
            out.append(f"--calib-dtype must be one of {', '.join(CALIB_DTYPES)}, got {self.calib_dtype!r}")
        if self.kv_cache not in KV_CACHE_SCHEMES:
            out.append(f"--kv-cache must be one of {', '.join(KV_CACHE_SCHEMES)}, got {self.kv_cache!r}")
        if not 0 < self.timeout_s < float("inf"):  # NaN fails too; the collective timeout is a timedelta
            out.append(f"--timeout must be a positive number of seconds, got {self.timeout_s}")
        out += check_patterns(self.ignore, ignore_label)  # bounded matching time: sq.patterns
        try:
            make_assigner(self.scheme, self.group_size, (), None)
        except SqError as e:
            out += e.problems
        return out

    def data_reason(self, assigner) -> str | None:
        """Why the job reads calibration data (None: it does not): a data-driven algorithm, a scheme
        with static activation scales, or a calibrated KV cache."""
        if make_algorithm(self.algo).calibrated:
            return f"--algo {self.algo.name}"
        if observes_activations(assigner):
            return "static activation scales (FP8 input_scale, NVFP4 input_global_scale)"
        if self.kv_cache != "none":
            return f"--kv-cache {self.kv_cache}"
        return None

    def observes(self, assigner) -> bool:
        """Whether the job writes calibrated activation or KV cache scales (an observed forward per block)."""
        return self.kv_cache != "none" or observes_activations(assigner)

    def compute_dtype(self, device_type: str) -> torch.dtype | None:
        """The dtype the calibration forwards compute in (None: the model's own).

        ``auto``: float32 on a CPU without bfloat16 matrix units, where bfloat16 matmuls run at about
        half float32's speed (a SmolLM2 block forward 5.2 s in bf16, 2.7 s in fp32 on the 2-core AMD
        EPYC of docs/benchmarks.md); the model's dtype on GPU and on a CPU with AMX (``amx_bf16``:
        a 4096 x 576 x 1536 linear on one thread of a Sapphire Rapids Xeon took 5 ms in bf16, 51 ms
        in float32).  The weights stay in the checkpoint's dtype (FSDP2 casts the gathered copies:
        ``sq.parallel.fsdp.apply_parallel``); every quantized value is computed from them exactly as
        before, only the activations are more precise.

        Collective for ``auto`` on CPU (every rank must have AMX: one all-reduce), so the pipeline
        resolves it once, on every rank, and hands the result to ``parallelize``.
        """
        if self.calib_dtype == "float32" or (self.calib_dtype == "auto" and device_type == "cpu"
                                              and not all_reduce_min_int(int(cpu_has_bf16_matrix_units()))):
            return torch.float32
        return None

    def needs_data(self, assigner) -> bool:
        return self.data_reason(assigner) is not None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["ignore"] = list(self.ignore)
        d["algo"] = self.algo.name
        d["algo_settings"] = self.algo.to_dict()
        return d

    def signature_args(self, *, calibrated: bool) -> dict[str, Any]:
        """The job's settings a resumed run must share: not where to write, how to launch, faults, or
        the algorithm (its config is a signature section of its own); calibration settings only
        where the algorithm reads calibration data."""
        d = self.to_dict()
        # the recipe's content (rules and the resolved assignment) is in the signature, not its path;
        # skip_nonfinite decides only what happens to a non-finite weight, which refuses the run
        # without it: a rerun that adds the flag continues the blocks already done
        # allow_unmatched only decides whether a pattern that matches nothing is refused
        for k in ("model", "output", "timeout_s", "resume", "bookkeeping", "fault", "recipe", "skip_nonfinite",
                  "algo", "algo_settings", "trust_remote_code", "verify_source", "allow_unmatched"):
            d.pop(k)
        if not calibrated:
            for k in CALIBRATION_FIELDS:
                d.pop(k)
        return d


def auto_ep(model, world: int, algo) -> int:
    """``--ep auto``: the world size for an MoE whose experts split evenly over it, so each rank holds
    and computes only its experts and the tokens move to them (at ``--ep 1`` every rank gathers a
    whole MoE block: 666 MiB of the 30.5 GB checkpoint run's peak per rank); else the largest
    divisor of the world that splits every experts module evenly; 1 for a dense model and for an
    algorithm that tunes experts under FSDP2 only.  Every choice writes the same bits (tests:
    --ep 1 vs 2); the resolved value is what the resume signature records."""
    counts = sorted({ex._parameters["down_proj"].shape[0] for _, b in decoder_blocks(model)
                     for _, ex in experts_modules(b)})
    if not counts or world == 1:
        return 1
    if not algo.expert_parallel:
        logger.info("--ep auto: 1 (--algo %s holds experts under FSDP2)", algo.config.name)
        return 1
    ep = max(d for d in range(1, world + 1) if world % d == 0 and all(c % d == 0 for c in counts))
    if ep < world:
        logger.info("--ep auto: %s experts do not split evenly over %d ranks; --ep %d",
                    "/".join(map(str, counts)), world, ep)
    return ep


@torch.no_grad()
def quantize_model(cfg: PTQConfig) -> dict:
    """``sq.ptq``: a checkpoint folder in, a compressed-tensors checkpoint out.

    Runs inside an initialized process group; returns the report on rank 0, ``{}`` elsewhere.
    """
    t_start = time.perf_counter()
    world = dist.get_world_size()
    device = rank_device()
    agree(argument_facts(cfg), "arguments")  # before any collective the arguments decide
    raise_all(cfg.problems(), "argument checks")
    assigner, problems = None, []
    try:
        assigner = make_assigner(cfg.scheme, cfg.group_size, cfg.ignore, cfg.recipe)
    except SqError as e:
        problems += e.problems
    raise_all(problems, "recipe checks")

    src = resolve_model_dist(cfg.model)  # a hub id: rank 0 downloads, the others wait
    model = build_skeleton(src, trust_remote_code=cfg.trust_remote_code)
    plan = plan_load(model, src, trust_remote_code=cfg.trust_remote_code)
    if cfg.ep is None:
        cfg = dataclasses.replace(cfg, ep=auto_ep(model, world, make_algorithm(cfg.algo)))
    weights = CheckpointWeights(model, plan, src, device, verify_source=cfg.verify_source)
    text = tokenizer = None
    if cfg.needs_data(assigner):  # rank 0 reads the dataset (a hub dataset downloads once); chat records need the tokenizer
        tokenizer = load_tokenizer(src, model, purpose=f"{cfg.data_reason(assigner)} calibrates on data tokenized with it",
                                   trust_remote_code=cfg.trust_remote_code)  # auto_map: refused by plan_load unless allowed
        text = read_corpus_dist(cfg.dataset).text(tokenizer)

    # the windows are cut before the output folder is touched: a corpus too short for
    # --nsamples x --seqlen is refused like every other argument (every rank, same tokens)
    # (only the text those windows take is tokenized: sq.calib.data.tokenize_corpus)
    calib = (calibration_windows(tokenize_corpus(tokenizer, text, need=cfg.nsamples * cfg.seqlen), cfg.nsamples,
                                 cfg.seqlen) if text is not None else None)
    data = {"spec": cfg.dataset, "sha256": sha256_bytes(text.encode()) if text is not None else None}
    return run_pipeline(cfg, model, weights, assigner, data, lambda: calib,
                        parallelize=lambda compute_dtype: apply_parallel(
                            model, ParallelDims(world, cfg.ep).build_mesh(device.type), compute_dtype=compute_dtype),
                        t_start=t_start)

