"""The model skeleton on the meta device, and where its decoder blocks and experts are."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from sq.errors import LoadRefused
from sq.load.fp8 import quantization_config_problems

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def config_problems(config: dict, root: Path, *, trust_remote_code: bool, allow_quantized: bool = False) -> list[str]:
    """Refusals decided from config.json alone."""
    problems = []
    if config.get("auto_map") and not trust_remote_code:
        problems.append(
            f"{root / 'config.json'} has auto_map {sorted(config['auto_map'])}: the model needs its own Python code; "
            "pass --trust-remote-code only if you trust the checkpoint's author")
    qc = config.get("quantization_config")
    if qc and not allow_quantized:  # FP8 block-scaled is read (dequantized on the fly); the rest is refused
        problems += quantization_config_problems(qc, root / "config.json")
    return problems


def build_skeleton(root: str | Path, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False) -> nn.Module:
    """Build the model from ``root/config.json`` on the meta device (no memory, no reads)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    root = Path(root)
    raw = json.loads((root / "config.json").read_text())
    problems = config_problems(raw, root, trust_remote_code=trust_remote_code, allow_quantized=True)
    if problems:
        raise LoadRefused(problems)
    config = AutoConfig.from_pretrained(root, trust_remote_code=trust_remote_code)
    if dtype is None:
        name = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        dtype = _DTYPES.get(str(name).removeprefix("torch."), torch.bfloat16)
    last_error = None
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if type(config) not in auto._model_mapping and not (trust_remote_code and raw.get("auto_map")):
            continue
        try:
            with torch.device("meta"):
                model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
            return model.eval()
        except ValueError as e:
            last_error = e
    raise LoadRefused(f"{root / 'config.json'}: no causal-LM or image-text-to-text class for model_type "
                      f"{raw.get('model_type')!r} ({last_error or 'not in transformers'})")


def decoder_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder blocks, in order: the largest ``*.layers`` ModuleList (the text decoder in a VLM)."""
    best, best_n = None, -1
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.split(".")[-1] == "layers" and len(mod):
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = name, n
    if best is None:
        raise LoadRefused(f"{type(model).__name__} has no '*.layers' ModuleList of decoder blocks")
    blocks = model.get_submodule(best)
    return [(f"{best}.{i}", b) for i, b in enumerate(blocks)]


def is_experts_module(mod: nn.Module) -> bool:
    """transformers 5 fused experts: 3-D ``gate_up_proj`` / ``down_proj`` parameters."""
    p = mod._parameters
    return "down_proj" in p and p["down_proj"] is not None and p["down_proj"].dim() == 3


def experts_modules(block: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in block.named_modules() if is_experts_module(m)]
