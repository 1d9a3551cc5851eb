"""The model skeleton on the meta device, and where its decoder blocks and experts are."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from sq.anatomy import annotate_experts
from sq.errors import LoadRefused, SqError
from sq.load import fp8, mxfp4
from sq.load.source import link_problem, read_checked, read_config

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def config_problems(config: dict, root: Path, *, trust_remote_code: bool, allow_quantized: bool = False) -> list[str]:
    """Refusals decided from config.json alone."""
    problems = []
    if config.get("auto_map") and not trust_remote_code:
        problems.append(
            f"{root / 'config.json'} has auto_map {sorted(config['auto_map'])}: the model needs its own Python code; "
            "pass --trust-remote-code only if you trust the checkpoint's author")
    qc = config.get("quantization_config")
    if qc and not allow_quantized:  # FP8 block-scaled and MXFP4 are read (dequantized on the fly); the rest refused
        problems += quantized_config_problems(qc, root / "config.json")
    return problems


def quantized_config_problems(qc, cfg_path: Path) -> list[str]:
    """[] for a ``quantization_config`` whose weights sq dequantizes while reading them (FP8
    block-scaled: ``sq.load.fp8``; MXFP4: ``sq.load.mxfp4``), else why it is refused."""
    if isinstance(qc, dict) and qc.get("quant_method") == mxfp4.QUANT_METHOD:
        return mxfp4.quantization_config_problems(qc, cfg_path)
    return fp8.quantization_config_problems(qc, cfg_path)


TOKENIZER_CONFIG = "tokenizer_config.json"


def tokenizer_problems(root: str | Path, *, trust_remote_code: bool) -> list[str]:
    """Refusals decided from tokenizer_config.json alone: an ``auto_map`` is custom tokenizer code.

    transformers would ask "run the custom code? [y/N]" on a terminal (and run the checkpoint's
    code on y) or fail with a bare EOFError without one; sq refuses up front instead, on every
    rank alike.  An absent file, a link sq refuses (``scan_checkpoint`` names it) or one that is
    not a JSON object is left to the tokenizer's own loader.
    """
    root = Path(root)
    path = root / TOKENIZER_CONFIG
    if trust_remote_code or not path.is_file() or link_problem(root, TOKENIZER_CONFIG) is not None:
        return []
    try:
        tok = json.loads(read_checked(root, TOKENIZER_CONFIG))
    except SqError as e:
        return e.problems
    except (OSError, ValueError):
        return []
    auto_map = tok.get("auto_map") if isinstance(tok, dict) else None
    if not auto_map:
        return []
    names = sorted(map(str, auto_map)) if isinstance(auto_map, dict) else [str(auto_map)[:200]]
    return [f"{path} has auto_map {names}: the checkpoint's tokenizer needs its own Python code, which sq does not "
            "run unless you pass --trust-remote-code (sq.ptq, sq.inspect; sq.eval never): pass it only if you trust "
            "the checkpoint's author, or use a tokenizer that transformers knows (tokenizer.json with a built-in "
            "tokenizer_class)"]


def build_skeleton(root: str | Path, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False) -> nn.Module:
    """Build the model from ``root/config.json`` on the meta device (no memory, no reads)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    root = Path(root)
    raw = read_config(root)  # a link leaving the folder: refused, not read; a missing or malformed file: named
    problems = config_problems(raw, root, trust_remote_code=trust_remote_code, allow_quantized=True)
    problems += model_type_problems(raw, root, trust_remote_code=trust_remote_code)
    if problems:
        raise LoadRefused(problems)
    try:
        config = AutoConfig.from_pretrained(root, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - an untrusted config.json: whatever transformers trips on is its problem
        raise LoadRefused(f"{root / 'config.json'}: transformers cannot read it as a {raw.get('model_type')!r} "
                          f"config ({_one_line(e)})") from None
    if dtype is None:
        name = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        dtype = _DTYPES.get(str(name).removeprefix("torch."), torch.bfloat16)
    last_error = None
    # the class config.json names first: a VLM config (Qwen3.5, ...) may also map to a text-only causal-LM
    # class, whose names and modules are not those of the checkpoint the output must load as
    autos = sorted((AutoModelForCausalLM, AutoModelForImageTextToText),
                   key=lambda auto: _mapped_name(auto, config) not in (getattr(config, "architectures", None) or []))
    for auto in autos:
        if type(config) not in auto._model_mapping and not (trust_remote_code and raw.get("auto_map")):
            continue
        try:
            with torch.device("meta"):
                model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        except Exception as e:  # noqa: BLE001 - e.g. a field of the wrong type in config.json
            last_error = _one_line(e)
            continue
        annotate_experts(model)  # which fused experts sq quantizes, under which per-expert names
        return model.eval()
    raise LoadRefused(f"{root / 'config.json'}: no causal-LM or image-text-to-text class for model_type "
                      f"{raw.get('model_type')!r} ({last_error or 'not in transformers'})")


def _mapped_name(auto, config) -> str | None:
    cls = auto._model_mapping[type(config)] if type(config) in auto._model_mapping else None
    return getattr(cls, "__name__", None)


def model_type_problems(config: dict, root: Path, *, trust_remote_code: bool) -> list[str]:
    """Refusals of config.json's ``model_type`` (missing, not a string, unknown to transformers).

    transformers would otherwise guess the architecture from the folder's name, or fail with a
    raw error.  With ``--trust-remote-code`` and an ``auto_map``, the checkpoint's own config
    class names the architecture.
    """
    from transformers import CONFIG_MAPPING, __version__

    path = root / "config.json"
    model_type = config.get("model_type")
    remote = trust_remote_code and bool(config.get("auto_map"))
    if model_type is None or model_type == "":
        return [] if remote else [
            f"{path} has no 'model_type': transformers cannot tell which architecture it is; use the config.json "
            "that came with the weights"]
    if not isinstance(model_type, str):
        return [f"{path} has model_type {_one_line(repr(model_type))}, not a string"]
    if model_type not in CONFIG_MAPPING and not remote:
        return [f"{path} has model_type {_one_line(repr(model_type))}, an architecture transformers {__version__} "
                "does not know: upgrade transformers, or pass --trust-remote-code if the checkpoint ships its own "
                "code (auto_map)"]
    return []


def _one_line(e, limit: int = 300) -> str:
    text = " ".join((e if isinstance(e, str) else f"{type(e).__name__}: {e}").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
