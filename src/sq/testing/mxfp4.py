"""A gpt-oss checkpoint as OpenAI ships it: routed experts in MXFP4, everything else in bf16.

:func:`build_gpt_oss_mxfp4` takes the conformance zoo's tiny ``gpt_oss`` checkpoint
(``sq.testing.zoo.build_zoo``) and writes two folders with the same shards and side files:

- ``mxfp4``: the source, as gpt-oss ships: every tensor in bf16 except each expert projection ``X``
  (``mlp.experts.gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``), rounded to MXFP4 and stored as
  ``X_blocks`` (uint8 ``[E, R, G, 16]``) and ``X_scales`` (uint8 ``[E, R, G]``); config.json's
  ``quantization_config`` is the one gpt-oss ships;
- ``reference``: its exact value, every tensor under the model's name (the experts dequantized).
  Every value is a bf16 value; the tensors are stored in float32 (config dtype float32) so that a
  check which casts dequantized W4A16 weights to the reference's dtype
  (``sq.testing.zoo.check_output``) loses nothing to bf16 rounding.

The packer is written here from the format's definition (OCP Microscaling: 32-element blocks of
e2m1 values, one E8M0 exponent each, stored along the projection's input with its output rows
first, two codes per byte, the even element in the low nibble), not from ``sq.load.mxfp4``, so a
test comparing the two is a cross-check.

    python -m sq.testing.mxfp4 OUT_DIR     # writes OUT_DIR/mxfp4 and OUT_DIR/reference
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

EXPERT_LEAVES = ("gate_up_proj", "down_proj")
# what gpt-oss-20b / 120b's config.json says
GPT_OSS_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}
_WRITTEN = ("config.json", "model.safetensors.index.json")  # written here, not copied
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitudes of codes 0..7; bit 3 is the sign
_EMAX_E2M1 = 2  # the largest e2m1 value is 1.5 * 2 ** 2


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., K]`` (K a multiple of 32) -> (blocks uint8 ``[..., K / 32, 16]``, scales uint8 ``[..., K / 32]``).

    Per block of 32: the shared exponent is ``floor(log2(absmax)) - 2`` (OCP MX: the block's largest
    power of two over e2m1's largest), each element rounded to the nearest e2m1 value of
    ``x / 2 ** exponent`` (clamped to +-6).
    """
    *lead, k = w.shape
    if k % 32:
        raise ValueError(f"the last dimension {k} is not a multiple of 32")
    x = w.detach().to(torch.float32).reshape(*lead, k // 32, 32)
    amax = x.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - _EMAX_E2M1, torch.full_like(amax, -127.0))
    exp = exp.clamp(-127, 127)
    y = (x / torch.exp2(exp).unsqueeze(-1)).clamp(-6.0, 6.0)
    code = (y.abs().unsqueeze(-1) - _E2M1).abs().argmin(-1)  # nearest magnitude
    code = torch.where((y < 0) & (code > 0), code + 8, code).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)  # element 2j low nibble, 2j + 1 high nibble
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`quantize_mxfp4`, in float32 ``[..., K]`` (exact)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32).long()
    mag = _E2M1[codes & 7]
    val = torch.where(codes >= 8, -mag, mag) * torch.exp2(scales.to(torch.float32) - 127).unsqueeze(-1)
    return val.reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def pack_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A gpt-oss expert parameter ``w [E, in, out]`` -> (blocks ``[E, out, in / 32, 16]``, scales
    ``[E, out, in / 32]``, the dequantized value ``[E, in, out]`` in bf16): the blocks run along each
    output row's inputs, i.e. along ``w.transpose(1, 2)``."""
    blocks, scales = quantize_mxfp4(w.transpose(1, 2))
    value = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    exact = value.to(torch.bfloat16)
    if not torch.equal(exact.float(), value):
        raise ValueError("an MXFP4 value bf16 does not hold (a scale below 2 ** -133)")
    return blocks, scales, exact


def _is_expert(key: str) -> bool:
    return key.rpartition(".")[2] in EXPERT_LEAVES and ".mlp.experts." in key


def build_gpt_oss_mxfp4(out_dir: str | Path, *, seed: int = 0) -> tuple[Path, Path]:
    """Write ``out_dir/mxfp4`` (the source) and ``out_dir/reference`` (its exact bf16 value); return both."""
    from safetensors.torch import load_file, save_file

    from sq.testing.zoo import build_zoo

    out_dir = Path(out_dir)
    mx_dir, ref_dir = out_dir / "mxfp4", out_dir / "reference"
    with tempfile.TemporaryDirectory(prefix="sq-gpt-oss-") as tmp:
        src = build_zoo(Path(tmp) / "gpt_oss", "gpt_oss", seed=seed)
        for d in (mx_dir, ref_dir):
            d.mkdir(parents=True, exist_ok=False)
            for f in src.iterdir():  # tokenizer, generation config
                if f.is_file() and not f.name.endswith(".safetensors") and f.name not in _WRITTEN:
                    shutil.copy(f, d / f.name)
        index = json.loads((src / "model.safetensors.index.json").read_text())
        mx_map, ref_map, sizes = {}, {}, {}
        for shard in sorted(set(index["weight_map"].values())):
            ref_t, mx_t = {}, {}
            for key, t in load_file(src / shard).items():
                if _is_expert(key):
                    blocks, scales, value = pack_expert(t)
                    ref_t[key] = value.float()
                    mx_t[key + "_blocks"], mx_t[key + "_scales"] = blocks, scales
                else:
                    mx_t[key] = t.to(torch.bfloat16).contiguous()
                    ref_t[key] = mx_t[key].float()
            save_file(ref_t, ref_dir / shard, metadata={"format": "pt"})
            save_file(mx_t, mx_dir / shard, metadata={"format": "pt"})
            ref_map.update({k: shard for k in ref_t})
            mx_map.update({k: shard for k in mx_t})
            sizes[ref_dir] = sizes.get(ref_dir, 0) + sum(t.numel() * t.element_size() for t in ref_t.values())
            sizes[mx_dir] = sizes.get(mx_dir, 0) + sum(t.numel() * t.element_size() for t in mx_t.values())
        config = json.loads((src / "config.json").read_text())
        (ref_dir / "config.json").write_text(json.dumps(dict(config, dtype="float32"), indent=2) + "\n")
        config.update(dtype="bfloat16", quantization_config=dict(GPT_OSS_QUANTIZATION_CONFIG))
        (mx_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for d, wm in ((ref_dir, ref_map), (mx_dir, mx_map)):
            (d / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": sizes[d]}, "weight_map": dict(sorted(wm.items()))}, indent=2))
    return mx_dir, ref_dir


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m sq.testing.mxfp4 OUT_DIR", file=sys.stderr)
        return 2
    mx_dir, ref_dir = build_gpt_oss_mxfp4(argv[0])
    print(f"MXFP4 source: {mx_dir}\nbf16 reference: {ref_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
