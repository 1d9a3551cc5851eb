"""``python -m sq.ptq`` / ``torchrun -m sq.ptq``: quantize a checkpoint (thin: parse -> quantize_model)."""

from __future__ import annotations

import argparse
import os

from sq.cli import ArgParser, positive_seconds, run_cli
from sq.formats.schemes import PRESET_NAMES

DESCRIPTION = """\
Quantize a Hugging Face safetensors checkpoint into a compressed-tensors checkpoint
(loadable by vLLM and transformers), block by block, each rank holding and reading
only its shard. Run it under torchrun for several ranks, or with python -m for one."""
EPILOG = """examples:
  torchrun --nproc-per-node 4 -m sq.ptq --model org/name --output out/w4a16
  python -m sq.ptq --model demo:smollm2 --output out/smollm2-w4 --group-size 64 --algo rtn

A refusal prints 'sq: error: ...' (one line per problem, on every rank) and exits 2.
Reference: docs/cli.md; every refusal and its fix: docs/troubleshooting.md."""


def _ep(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}") from None


def build_parser() -> ArgParser:
    import dataclasses

    from sq.quant.algorithms import add_arguments, algorithm_names
    from sq.config import CALIB_DTYPES, PTQConfig
    from sq.formats.schemes import INT_GRIDS

    # the job's defaults are PTQConfig's (written once); the algorithm's, its config's
    job_algo = PTQConfig.__dataclass_fields__["algo"].default_factory.name
    job = {f.name: f.default for f in dataclasses.fields(PTQConfig) if f.default is not dataclasses.MISSING}

    p = ArgParser(prog="torchrun -m sq.ptq", description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("--model", required=True,
                   help="checkpoint folder, Hugging Face hub id org/name (rank 0 downloads config, tokenizer and "
                        "safetensors only), or demo:smollm2 / demo:tiny-moe")
    p.add_argument("--output", required=True,
                   help="new or empty output folder, or the folder of an unfinished run to resume")
    p.add_argument("--scheme", default=job["scheme"], type=str.upper, choices=PRESET_NAMES, metavar="SCHEME",
                   help=f"quantization scheme for every Linear: {', '.join(PRESET_NAMES)}")
    p.add_argument("--algo", default=job_algo, choices=algorithm_names(),
                   help="rtn: round to nearest (no data); gptq: Hessians from calibration data; signround: "
                        "tuned rounding and clipping per block (docs/signround.md)")
    p.add_argument("--group-size", type=int, default=job["group_size"], metavar="N",
                   help="columns per quantization group; must divide every quantized layer's input width")
    p.add_argument("--nsamples", type=int, default=job["nsamples"], metavar="N",
                   help="calibration windows, split across ranks (gptq, signround; static activation and KV cache scales)")
    p.add_argument("--seqlen", type=int, default=job["seqlen"], metavar="N", help="tokens per calibration window")
    p.add_argument("--seed", type=int, default=job["seed"], help="random seed (part of the resume signature)")
    p.add_argument("--dataset", default=job["dataset"], metavar="SPEC",
                   help="calibration text: builtin:pydoc, a .txt/.jsonl/.parquet file, or a hub dataset "
                        "org/name[:split] (docs/data.md)")
    p.add_argument("--ignore", nargs="*", default=[], metavar="REGEX",
                   help="Linear module names (re.search) left unquantized (default: none); a pattern that matches "
                        "no module, or that could make the regex engine run for ever, is refused")
    p.add_argument("--recipe", default=None, metavar="FILE",
                   help="mixed precision: YAML/JSON of ordered regex -> scheme rules and a default "
                        "(docs/recipes.md; default: --scheme for every Linear)")
    p.add_argument("--allow-unmatched", action="store_true",
                   help="accept --ignore patterns and recipe rules that match no module of the model (warned "
                        "about; default: refused, as a typo would be)")
    p.add_argument("--allow-unquantized-experts", action="store_true",
                   help="write routed experts sq cannot quantize in full precision (named in sq_report.json's "
                        "unquantized_experts and the summary; default: refused, before anything is written)")
    p.add_argument("--timeout", type=positive_seconds, default=job["timeout_s"], metavar="SECONDS",
                   help="collective timeout: a dead or hung rank ends the job instead of hanging it")
    p.add_argument("--ep", type=_ep, default=job["ep"], metavar="N|auto",
                   help="expert-parallel degree (divides the world size); auto (default): the world size for an "
                        "MoE whose experts split evenly over it, else the largest divisor that does; 1 for dense "
                        "models and for --algo signround / awq")
    p.add_argument("--no-calibrate-all-experts", dest="calibrate_all", action="store_false",
                   help="feed each expert's Hessian (and activation scale) only the tokens routed to it "
                        "(default: every token)")
    p.add_argument("--kv-cache", default=job["kv_cache"], choices=("none", "fp8"),
                   help="fp8: write calibrated per-layer k_scale / v_scale for an fp8 KV cache (kv_cache_scheme; "
                        "reads calibration data)")
    p.add_argument("--calib-dtype", default=job["calib_dtype"], choices=CALIB_DTYPES,
                   help="what calibration forwards compute in: auto (measured at start: the model's half dtype "
                        "where this machine runs it faster, else float32; SignRound: mixed or float32), float32, "
                        "model, or mixed (float32 weights and residual stream, matmuls and attention autocast to "
                        "the model's half dtype; SignRound only); weights keep the checkpoint's dtype (part of the "
                        "resume signature)")
    p.add_argument("--int-grid", default=job["int_grid"], choices=("auto", *INT_GRIDS),
                   help="the grid of symmetric integer schemes: standard (compressed-tensors' and "
                        "llm-compressor's: scale = absmax / 7.5 for int4), full (auto-round's: each group's "
                        "larger-magnitude extreme lands on -8, so the scale is signed; lower weight error, "
                        "other bits than llm-compressor's), or auto (full for --algo signround, as auto-round, "
                        "and for --algo gptaq; standard otherwise); a recipe's scheme may name its own int_grid")
    p.add_argument("--target-bits", type=float, default=None, metavar="BITS",
                   help="mixed precision under a budget: score every Linear (fused partners together) under each "
                        "of --candidates on the calibration data, choose per Linear so that the stored bits per "
                        "weight (codes, scales, zero points) stay within BITS, write the choice as "
                        "OUTPUT/sq_recipe.yaml and quantize with it (dense Linears; docs/recipes.md)")
    p.add_argument("--candidates", default=",".join(job["candidates"]), metavar="SCHEMES",
                   help="comma-separated presets --target-bits chooses from (default: %(default)s; int presets "
                        "take --group-size)")
    p.add_argument("--search-score", default=job["search_score"], choices=("auto", "fisher", "mse"),
                   help="how --target-bits scores a Linear under a candidate: fisher (the block output's change "
                        "weighted by the next-token loss's gradient there, carried back from the logits), mse "
                        "(the block output's squared error), or auto (fisher; mse on models with routed experts); "
                        "either quantizes the Linear as the job will (GPTQ for gptq and gptaq, else RTN) "
                        "(default: %(default)s)")
    p.add_argument("--rotate", default="", metavar="R1[,R2][,R4]",
                   help="rotations fused into the weights before the algorithm (docs/rotations.md): r1 "
                        "rotates the residual stream (norms folded in, tied embeddings untied), r2 each attention "
                        "head's values (both offline: nothing needed at serving time), r4 down_proj's input online "
                        "(written as compressed-tensors' transform_config, which vLLM applies; transformers does "
                        "not); each proven on every block (the rotated block computes the same function) "
                        "(default: none)")
    p.add_argument("--rotate-block", type=int, default=None, metavar="N",
                   help="block-diagonal rotations over groups of N channels (a divisor of the hidden size, head "
                        "size and, for r4, down_proj's input size) instead of one over all of them: with a format whose scales cover groups of N "
                        "(MXFP4 32, NVFP4 16), an outlier then spreads only within its own group (default: whole)")
    p.add_argument("--served-activations", action="store_true",
                   help="GPTQ / GPTAQ with a scheme that quantizes activations (NVFP4, MXFP4, W8A8, FP8, ...): "
                        "the quantized chain rounds each Linear's input as the serving engine will, in the "
                        "Hessians and in the inputs carried to the next block (default: float activations in "
                        "calibration, as llm-compressor)")
    p.add_argument("--smooth", type=float, default=None, metavar="ALPHA",
                   help="SmoothQuant before the algorithm (docs/smoothquant.md): each norm's output channels "
                        "divided by s and the Linears it feeds multiplied by it, s = act_range^ALPHA / "
                        "(2 max|W|)^(1-ALPHA) per channel (llm-compressor's SmoothQuantModifier; 0.5 its default, "
                        "0.8 its W8A8 examples'): activation outliers move into the weights, for schemes that "
                        "quantize activations (default: off)")
    p.add_argument("--resume", default=job["resume"], choices=("auto", "never", "require"),
                   help="auto: continue a matching unfinished run in --output; never: start over; "
                        "require: fail if there is nothing to resume")
    add_arguments(p)  # each algorithm's settings, from its config's fields (sq.quant.algorithms)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the checkpoint's own modeling and tokenizer code (auto_map); only if you trust "
                        "its author (default: refused)")
    p.add_argument("--verify-source", default=job["verify_source"], choices=("stat", "content"),
                   help="how a source shard is identified for resume and across ranks: stat (size and header; "
                        "resume also compares the modification time) or content (every shard's SHA-256, read "
                        "once per node: for shards edited in place, or node-local copies)")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="leave Linears whose weights hold NaN/Inf unquantized (listed in the config's ignore) "
                        "instead of refusing the run")
    p.add_argument("--model-free", action="store_true",
                   help="quantize straight from the safetensors files without building the model (data-free "
                        "schemes, --algo rtn; taken automatically when transformers cannot build the "
                        "architecture): docs/model-free.md")
    p.add_argument("--no-preflight", dest="preflight", action="store_false",
                   help="skip the check, before anything is written, that the disk where --output lives has room "
                        "for the predicted checkpoint and resume state (docs/cli.md)")
    p.add_argument("--fit-memory", action="store_true",
                   help="where the memory preflight predicts the job does not fit, write each block's files before "
                        "the next block starts (the same output, without the previous block's files beside the "
                        "next one) if that makes it fit; the report's memory.fit says what was chosen")
    p.add_argument("--no-bookkeeping", dest="bookkeeping", action="store_false", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None, with_model_free: bool = False):
    a = build_parser().parse_args(argv)
    cfg = config_from(a)
    return (cfg, a.model_free) if with_model_free else cfg


def config_from(a: argparse.Namespace):
    """The job's PTQConfig from parsed ``sq.ptq`` arguments (``sq.plan`` parses the same ones)."""
    from sq.quant.algorithms import config_from_namespace
    from sq.config import PTQConfig

    return PTQConfig(model=a.model, output=a.output, scheme=a.scheme, algo=config_from_namespace(a.algo, a),
                     group_size=a.group_size, nsamples=a.nsamples, seqlen=a.seqlen, seed=a.seed, dataset=a.dataset,
                     ignore=tuple(a.ignore), recipe=a.recipe, timeout_s=a.timeout, ep=a.ep,
                     calibrate_all_experts=a.calibrate_all, resume=a.resume, bookkeeping=a.bookkeeping,
                     skip_nonfinite=a.skip_nonfinite, allow_unmatched=a.allow_unmatched,
                     allow_unquantized_experts=a.allow_unquantized_experts, verify_source=a.verify_source,
                     trust_remote_code=a.trust_remote_code, kv_cache=a.kv_cache, calib_dtype=a.calib_dtype,
                     int_grid=a.int_grid, target_bits=a.target_bits, search_score=a.search_score,
                     candidates=tuple(c.strip() for c in a.candidates.split(",") if c.strip()),
                     rotate=tuple(r.strip().lower() for r in a.rotate.split(",") if r.strip()),
                     rotate_block=a.rotate_block, preflight=a.preflight, fit_memory=a.fit_memory, served_activations=a.served_activations,
                     smooth=a.smooth,
                     fault=os.environ.get("SQ_FAULT"))


def main(argv=None) -> int:
    def body():
        from sq import modelfree
        from sq.dist import init_distributed, setup_logging
        from sq.memory import tune_heap
        from sq.pipeline.job import quantize_model

        cfg, model_free = parse_args(argv, with_model_free=True)
        tune_heap()
        env = init_distributed(timeout_s=cfg.timeout_s)
        setup_logging(env.rank)
        run = modelfree.quantize_checkpoint if modelfree.wanted(cfg, model_free) else quantize_model
        report = run(cfg)
        if report.get("complete") and env.rank == 0:
            print(f"sq: {cfg.output} is already complete; nothing to do")

    return run_cli(body)


if __name__ == "__main__":
    from sq.cli import exit_process

    exit_process(main())
