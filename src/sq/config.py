"""One quantization job's settings (``PTQConfig``): what ``sq.ptq``'s flags and ``sq.quantize``'s keywords
become, with their refusals, what goes into the report (``to_dict``) and into the resume signature
(``signature_args``).  The algorithm's own settings are its config (``sq.quant.algorithms``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


from sq.errors import SqError
from sq.patterns import check_patterns
from sq.quant.activations import KV_CACHE_SCHEMES, observes_activations
from sq.quant.algorithms import AlgoConfig, algo_config, make_algorithm
from sq.quant.gptq import GPTQConfig
from sq.quant.recipe import ignore_label, make_assigner
from sq.quant.rotate import ROTATIONS

__all__ = ["PTQConfig", "CALIBRATION_FIELDS", "CALIB_DTYPES"]


# job settings read only by algorithms that run calibration data (not in an RTN run's signature)
CALIBRATION_FIELDS = ("nsamples", "seqlen", "seed", "dataset", "calibrate_all_experts", "calib_dtype")
# --calib-dtype words: the dtype calibration forwards compute in (``sq.probe.calib_dtype_choice``)
CALIB_DTYPES = ("auto", "float32", "model", "mixed")


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
    ep: int | None = None  # None: auto (sq.pipeline.targets.auto_ep), resolved before the pipeline runs
    resume: str = "auto"  # auto | never | require
    kv_cache: str = "none"  # none | fp8: calibrated per-layer k/v scales (sq.quant.activations)
    calib_dtype: str = "auto"  # auto | float32 | model | mixed: what calibration forwards compute in (sq.probe)
    int_grid: str = "auto"  # auto | standard | full: the grid of symmetric int schemes (QuantScheme.int_grid)
    skip_nonfinite: bool = False  # leave NaN/Inf Linears unquantized instead of refusing
    verify_source: str = "stat"  # stat | content: how the resume signature and the ranks identify source shards
    allow_unmatched: bool = False  # --ignore patterns / recipe rules matching no module: warned about, not refused
    allow_unquantized_experts: bool = False  # routed experts sq cannot quantize: carried (reported), not refused
    trust_remote_code: bool = False  # run the checkpoint's own code (auto_map): only on the user's word
    bookkeeping: bool = True  # benchmark-only switch: no manifests, chain cache or checksums
    fault: str | None = None  # test-only: SQ_FAULT=point:rank[:block] (sq.resume.FAULT_POINTS)
    # mixed precision under a bit budget (sq.pipeline.search): stored bits per weight, and the schemes to choose from
    target_bits: float | None = None
    candidates: tuple[str, ...] = ("W4A16", "W8A16")
    search_score: str = "auto"  # auto | fisher | mse: how the search scores a unit (sq.pipeline.search.search_score)
    # offline rotations fused into the weights before the algorithm (sq.pipeline.rotation): r1, r2
    rotate: tuple[str, ...] = ()
    rotate_block: int | None = None  # None: one rotation over the whole hidden size (head size for r2)
    # GPTQ's quantized chain rounds each Linear's input as served (sq.quant.served)
    served_activations: bool = False
    # SmoothQuant's migration strength: activation outliers moved into the weights before the algorithm (sq.quant.smooth)
    smooth: float | None = None
    preflight: bool = True  # refuse a job whose predicted disk need exceeds the free space (sq.pipeline.disk)
    # where the memory preflight says the job does not fit: take the settings that shrink it without changing the
    # output (each block's files written before the next block starts) if that makes it fit; the report says so
    fit_memory: bool = False

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
        for flag in ("nsamples", "seqlen", "ep", "rotate_block"):
            v = getattr(self, flag)
            if v is not None and v <= 0:
                out.append(f"--{flag.replace('_', '-')} must be positive, got {v}")
        out += [f"--rotate {r}: unknown rotation (known: {', '.join(ROTATIONS)})" + (
                    "; r3 (queries and keys, for a quantized KV cache) is not built: vLLM applies no attention "
                    "transforms, so a checkpoint with one would be served without it" if r == "r3" else "")
                for r in self.rotate if r not in ROTATIONS]
        if self.rotate_block is not None and not self.rotate:
            out.append("--rotate-block sizes the blocks of --rotate's rotations; give --rotate too")
        if len(set(self.rotate)) != len(self.rotate):
            out.append(f"--rotate names a rotation twice: {','.join(self.rotate)}")
        if self.calib_dtype not in CALIB_DTYPES:
            out.append(f"--calib-dtype must be one of {', '.join(CALIB_DTYPES)}, got {self.calib_dtype!r}")
        if self.search_score not in ("auto", "fisher", "mse"):
            out.append(f"--search-score must be auto, fisher or mse, got {self.search_score!r}")
        if self.kv_cache not in KV_CACHE_SCHEMES:
            out.append(f"--kv-cache must be one of {', '.join(KV_CACHE_SCHEMES)}, got {self.kv_cache!r}")
        if not 0 < self.timeout_s < float("inf"):  # NaN fails too; the collective timeout is a timedelta
            out.append(f"--timeout must be a positive number of seconds, got {self.timeout_s}")
        if self.target_bits is None and self.candidates != PTQConfig.candidates:
            out.append(f"--candidates {','.join(self.candidates)} are the schemes --target-bits chooses from; without "
                       "--target-bits nothing chooses: give --target-bits BITS too, or drop --candidates (--scheme / "
                       "--recipe choose the schemes then)")
        out += self._int_grid_problems()
        out += check_patterns(self.ignore, ignore_label)  # bounded matching time: sq.patterns
        try:
            make_assigner(self.scheme, self.group_size, (), None, self.grid)
        except SqError as e:
            out += e.problems
        return out

    def _int_grid_problems(self) -> list[str]:
        """``--int-grid full`` where no scheme the job can assign is a symmetric integer one: it would change
        nothing (a recipe's schemes are its own: not checked here)."""
        from sq.formats.schemes import PRESET_NAMES, get_scheme

        if self.int_grid != "full" or self.recipe is not None:
            return []
        names = self.candidates if self.target_bits is not None else (self.scheme,)
        if not all(n in PRESET_NAMES for n in names):
            return []  # an unknown name is refused by name elsewhere
        schemes = [get_scheme(n) for n in names]
        if any(sc.type == "int" and sc.symmetric for sc in schemes):
            return []
        return [f"--int-grid full changes only symmetric integer schemes; {', '.join(names)} "
                f"{'is' if len(names) == 1 else 'are'} not one (an asymmetric scheme's zero point already spans "
                "the whole grid): drop --int-grid, or choose a symmetric int scheme (W4A16, W8A16, ...)"]

    @property
    def grid(self) -> str:
        """``int_grid`` resolved: ``auto`` is the algorithm's (``AlgoConfig.default_int_grid``)."""
        if self.int_grid == "auto" and isinstance(self.algo, AlgoConfig):
            return self.algo.default_int_grid
        return self.int_grid

    def assigner(self):
        """Which scheme each module gets (``sq.quant.recipe.make_assigner``) from the job's scheme flags,
        ``--ignore``, ``--recipe`` and ``--int-grid``; raises ``SqError`` naming every problem."""
        return make_assigner(self.scheme, self.group_size, self.ignore, self.recipe, self.grid)

    def data_reason(self, assigner) -> str | None:
        """Why the job reads calibration data (None: it does not): a data-driven algorithm, a scheme
        with static activation scales, or a calibrated KV cache."""
        if make_algorithm(self.algo).calibrated:
            return f"--algo {self.algo.name}"
        if self.smooth is not None:
            return "--smooth (the activations' ranges)"
        if observes_activations(assigner):
            return "static activation scales (FP8 input_scale, NVFP4 input_global_scale)"
        if self.kv_cache != "none":
            return f"--kv-cache {self.kv_cache}"
        if self.target_bits is not None:
            return "--target-bits (its scores run calibration data)"
        return None

    def observes(self, assigner) -> bool:
        """Whether the job writes calibrated activation or KV cache scales (an observed forward per block)."""
        return self.kv_cache != "none" or observes_activations(assigner)

    def needs_data(self, assigner) -> bool:
        return self.data_reason(assigner) is not None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["ignore"] = list(self.ignore)
        d["candidates"] = list(self.candidates)
        d["rotate"] = list(self.rotate)
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
        # allow_unmatched only decides whether a pattern that matches nothing is refused; int_grid is in
        # the schemes (a scheme names its grid), where it is kept out while standard; preflight only checks disk
        for k in ("model", "output", "timeout_s", "resume", "bookkeeping", "fault", "recipe", "skip_nonfinite",
                  "algo", "algo_settings", "trust_remote_code", "verify_source", "allow_unmatched",
                  "allow_unquantized_experts", "int_grid",
                  "preflight", "fit_memory"):
            d.pop(k)
        if not calibrated:
            for k in CALIBRATION_FIELDS:
                d.pop(k)
        if self.target_bits is None:
            d.pop("search_score")
        return d
