"""Reference for exported checkpoints: the source model with every quantized weight fake-quantized."""

from __future__ import annotations

import torch
import torch.nn as nn

from sq.anatomy import decoder_blocks, experts_modules
from sq.quant import rtn


def read_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``folder`` (a checkpoint or an sq output)."""
    from pathlib import Path

    from safetensors import safe_open

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@torch.no_grad()
def fake_quantized_reference(model: nn.Module, scheme) -> nn.Module:
    """RTN fake-quantize every decoder-block Linear and every fused expert projection in place."""
    for _, block in decoder_blocks(model):
        for _, m in block.named_modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(rtn.fake_quantize(m.weight, scheme))
        for _, ex in experts_modules(block):
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(ex, name)
                for e in range(p.shape[0]):
                    p[e].copy_(rtn.fake_quantize(p[e], scheme))
    return model


def load_any(path, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(path)
    cls = AutoModelForCausalLM if type(cfg) in AutoModelForCausalLM._model_mapping else AutoModelForImageTextToText
    out = cls.from_pretrained(path, **kw)
    (out[0] if isinstance(out, tuple) else out).eval()
    return out


@torch.no_grad()
def library_rtn_freeze(module: nn.Module) -> None:
    """compressed-tensors' own RTN for one module with an applied scheme: min/max qparams, FROZEN.

    The reference path both the per-Linear and the whole-model library-equality tests compare with.
    """
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    w = module.weight.data
    if args.strategy == "group":
        w = w.unflatten(-1, (-1, args.group_size))
        mn, mx = w.amin(-1), w.amax(-1)
    else:
        mn, mx = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale, zp = calculate_qparams(mn, mx, args)
    module.weight_scale.data.copy_(scale)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zp)
    module.quantization_status = QuantizationStatus.FROZEN


def quantize_jobs(rank, world, jobs) -> list[str | None]:
    """``run_ranks`` target: ``quantize_model(PTQConfig.build(**job))`` for each job in turn; per job
    ``None`` or the ``SqError`` it raised (identical on every rank)."""
    from sq.errors import SqError
    from sq.config import PTQConfig
    from sq.pipeline.job import quantize_model

    out = []
    for job in jobs:
        try:
            quantize_model(PTQConfig.build(**job))
            out.append(None)
        except SqError as e:
            out.append(str(e))
    return out


def exact_bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's exact bits as integers (a signed zero differs from +0; NaN payloads compare)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def checkpoint_bit_diff(a_dir, b_dir) -> list[str]:
    """Tensors two checkpoint folders do not share bit for bit (dtype, shape and bits; a name in one
    folder only counts as a difference)."""
    a, b = read_tensors(a_dir), read_tensors(b_dir)
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
                  or not torch.equal(exact_bits(a[k]), exact_bits(b[k])))
