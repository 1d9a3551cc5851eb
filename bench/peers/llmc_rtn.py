"""llm-compressor 0.14's round-to-nearest output of one compressed-tensors preset: the reference of issue 17.

Runs INSIDE bench/_work/venv-llmc (bench/peers/setup_llmc.sh), never in sq's venv:

    bench/_work/venv-llmc/bin/python bench/peers/llmc_rtn.py MODEL_DIR OUT_DIR PRESET \
        [--group-size 64] [--nsamples 128] [--seqlen 512] [--dtype auto|bfloat16|float32]

- Loads MODEL_DIR on CPU (``--dtype auto``: the dtype config.json names, as sq does; bf16 for
  demo:smollm2), applies ``QuantizationModifier(targets="Linear", scheme=PRESET, ignore=["lm_head"])``
  through ``oneshot`` and saves with ``save_pretrained(OUT_DIR, save_compressed=True)`` plus the
  tokenizer.
- ``--group-size N`` overrides the group size of presets whose weights are int and group-wise (W4A16,
  W4A16_ASYM, W3A16, W2A16, W4AFP8, W4A8; SmolLM2's 576 is not a multiple of 128). The preset string
  cannot carry a group size, so the scheme is then passed as ``config_groups={"group_0": scheme}``
  with ``scheme = preset_name_to_scheme(PRESET, ["Linear"])`` and only ``weights.group_size``
  changed, which is exactly what ``scheme=PRESET`` resolves to otherwise. FP/MX/NV presets keep
  their format's group (16 / 32) and FP8_BLOCK its 128x128 blocks.
- Presets with a static activation scale (``input_activations.dynamic`` False or "local": FP8, NVFP4)
  get the standard calibration data: CPython's ``pydoc_data.topics`` joined in sorted order,
  tokenized once without special tokens, tokens [0, nsamples * seqlen) as consecutive windows
  (default 128 x 512, as docs and DESIGN.md's standard benchmark), in order (no shuffle).
  Data-free presets get no dataset.
- Writes ``OUT_DIR/llmc_run.json``: preset, scheme as resolved, versions, calibration, and the wall
  time of load / oneshot / save.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def calibration_dataset(tokenizer, nsamples: int, seqlen: int):
    import torch
    from datasets import Dataset
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    need = nsamples * seqlen
    if need > len(ids):
        sys.exit(f"llmc_rtn: {nsamples} x {seqlen} = {need} tokens, but the corpus has {len(ids)}")
    windows = torch.tensor(ids[:need], dtype=torch.long).reshape(nsamples, seqlen).tolist()
    ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * seqlen for _ in windows]})
    return ds, len(ids)


def needs_calibration(scheme) -> bool:
    """A static activation scale (per tensor, or NVFP4's global scale) comes from data."""
    for args in (scheme.input_activations, scheme.output_activations):
        if args is not None and args.dynamic is not True:
            return True
    return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("preset")
    p.add_argument("--group-size", type=int, default=None,
                   help="override weights.group_size of int group-wise presets (default: the preset's)")
    p.add_argument("--nsamples", type=int, default=128, help="calibration windows (static-activation presets)")
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="model dtype; auto = config.json's dtype (what sq uses)")
    args = p.parse_args()

    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES, preset_name_to_scheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    preset = args.preset.upper()
    if preset not in PRESET_SCHEMES:
        print(f"llmc_rtn: preset {preset!r} does not exist in compressed-tensors "
              f"{compressed_tensors.__version__}; presets: {', '.join(sorted(PRESET_SCHEMES))}", file=sys.stderr)
        return 3
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        print(f"llmc_rtn: {out} exists and is not empty", file=sys.stderr)
        return 2

    scheme = preset_name_to_scheme(preset, ["Linear"])
    overridden = False
    w = scheme.weights
    if (args.group_size is not None and w is not None and w.type == QuantizationType.INT
            and w.strategy == QuantizationStrategy.GROUP and w.group_size != args.group_size):
        scheme.weights = w.model_copy(update={"group_size": args.group_size})
        overridden = True
    if overridden:
        modifier = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    else:
        modifier = QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"])
    calibrate = needs_calibration(scheme)

    times = {}
    t0 = time.perf_counter()
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, device_map="cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    times["load_s"] = time.perf_counter() - t0

    calib = {}
    kwargs = {}
    if calibrate:
        t = time.perf_counter()
        ds, ntokens = calibration_dataset(tokenizer, args.nsamples, args.seqlen)
        times["tokenize_s"] = time.perf_counter() - t
        kwargs = dict(dataset=ds, num_calibration_samples=args.nsamples, max_seq_length=args.seqlen,
                      shuffle_calibration_samples=False)
        calib = {"corpus": "pydoc_data.topics", "corpus_tokens": ntokens, "nsamples": args.nsamples,
                 "seqlen": args.seqlen, "tokens": [0, args.nsamples * args.seqlen]}

    t = time.perf_counter()
    oneshot(model=model, recipe=modifier, tokenizer=tokenizer, **kwargs)
    times["oneshot_s"] = time.perf_counter() - t

    t = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    times["save_s"] = time.perf_counter() - t
    times["total_s"] = time.perf_counter() - t0

    record = {
        "preset": preset,
        "model_dir": str(Path(args.model_dir).resolve()),
        "dtype": str(model.dtype),
        "group_size_override": args.group_size if overridden else None,
        "scheme": json.loads(scheme.model_dump_json()),
        "calibration": calib or None,
        "versions": {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        **{k: round(v, 2) for k, v in times.items()},
    }
    (out / "llmc_run.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("preset", "dtype", "group_size_override", "calibration")}))
    print(" ".join(f"{k}={v:.1f}" for k, v in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
