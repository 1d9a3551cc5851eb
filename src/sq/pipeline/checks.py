"""Every refusal a ``sq.ptq`` job makes before it touches the output folder, in one place: ``sq.ptq`` (on every
rank, ``sq.pipeline.job`` / ``sq.pipeline.blocks``) and ``sq.plan`` (one process, the launch stated) call these
same functions, so the two cannot disagree on a refusal.

    argument_checks   the flags alone (PTQConfig.problems, the scheme flags / --ignore / --recipe): -> assigner
    job_problems      the flags against the model: group sizes, the EP split, the algorithm's, --target-bits,
                      --rotate, --served-activations, --smooth, --calib-dtype, where --output lives
    calibration_data  the corpus read and cut into windows (a corpus too short is refused here)
    output_problems   what --output holds, as far as it is decided without the run's signature

The memory and disk preflights (``sq.pipeline.preflight``) are predictions both print; their refusals are
the job's only where the preflight runs (``--no-preflight`` skips them in both).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from sq.errors import SqError
from sq.run import output_problems  # the lifecycle's (sq.run): what --output holds

__all__ = ["argument_checks", "job_problems", "calibration_data", "output_problems"]


def argument_checks(cfg):
    """The flags' own refusals (no model read), raised together as one ``SqError``; returns the assigner."""
    from sq.run import raise_all

    raise_all(cfg.problems(), "argument checks")
    try:
        return cfg.assigner()
    except SqError as e:
        raise_all(e.problems, "recipe checks")
        raise


def job_problems(cfg, model, assigner, algo, targets, *, world: int, in_memory: bool, weight_dtype,
                 calibrated: bool, src: Path | None) -> list[str]:
    """The refusals that read the model (identical on every rank), before anything is mutated."""
    from sq.export import writer
    from sq.pipeline.rotation import rotation_problems
    from sq.pipeline.search import cost_dtype, search_problems
    from sq.pipeline.targets import model_problems
    from sq.quant.served import served_activations_problems
    from sq.quant.smooth import smooth_problems

    problems = model_problems(model, cfg, assigner, algo, targets, calibrated, world=world)
    problems += search_problems(cfg, model, algo, targets, world, cost_dtype(weight_dtype))
    problems += rotation_problems(cfg, in_memory, model)
    problems += served_activations_problems(cfg, targets)
    problems += smooth_problems(cfg, targets.blocks)
    if cfg.calib_dtype == "mixed" and algo.half_forwards != "mixed":
        problems.append(f"--calib-dtype mixed is SignRound's (its tuning autocasts); --algo {cfg.algo.name} "
                        "computes in float32 or the model's dtype (--calib-dtype float32 / model / auto)")
    problems += writer.output_path_problems(Path(cfg.output), src)
    return problems


def calibration_data(cfg, src, model, assigner, *, read: Callable | None = None):
    """``(text, windows)`` of a job that reads calibration data (``(None, None)`` otherwise): the corpus read by
    ``read`` (``sq.calib.data.read_corpus_dist`` in a job: rank 0 reads, every rank gets it), only the text the
    windows take tokenized, cut into ``--nsamples`` windows of ``--seqlen`` tokens; a corpus too short for them is
    refused here, like every other argument, before the output folder is touched."""
    from sq.calib.data import calibration_windows, load_tokenizer, read_corpus_dist, tokenize_corpus

    if not cfg.needs_data(assigner):
        return None, None
    tokenizer = load_tokenizer(src, model, purpose=f"{cfg.data_reason(assigner)} calibrates on data tokenized with it",
                               trust_remote_code=cfg.trust_remote_code)  # auto_map: refused by plan_load unless allowed
    text = (read or read_corpus_dist)(cfg.dataset).text(tokenizer)
    need = cfg.nsamples * cfg.seqlen
    return text, calibration_windows(tokenize_corpus(tokenizer, text, need=need), cfg.nsamples, cfg.seqlen)


