"""FP8 block-scaled sources (DeepSeek-V3/R1, Kimi-K2): detection and dequantization on the fly.

Such a checkpoint stores a Linear weight ``W [out, in]`` as ``float8_e4m3fn`` plus
``W_scale_inv [ceil(out / bo), ceil(in / bi)]`` (float32), one multiplier per ``bo x bi``
block; the last block of a dimension may be partial (DeepSeek-V3's ``kv_a_proj_with_mqa``
has 576 rows: 4.5 blocks of 128).  ``config.json`` says so::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

Norms, embeddings, ``lm_head`` and the MoE router stay in bf16 without a scale.

A read request is a box ``[r0, r0 + nr) x [c0, c0 + nc)`` of one weight (a rank's rows, an
expert's slab of a fused parameter).  The reader takes that box of the FP8 weight and only the
scale blocks it touches, ``[r0 // bo, ceil((r0 + nr) / bo)) x [c0 // bi, ceil((c0 + nc) / bi))``,
and writes ``float32(w) * scale`` cast to the destination dtype, so a box boundary inside a
block and a partial last block come out exactly as a whole-tensor dequantization would.

torch's ``QuantizedHuggingFaceStorageReader`` does the same maths, but reads the whole scale
tensor for every box, takes one square block size, needs the index file for its weight/scale
pairs and loops in Python over every block; here the pairs come from sq's header scan and the
product is vectorized in bounded row chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from sq.load.fill import SqStorageReader
from sq.load.mxfp4 import ACCEPTED as MXFP4_ACCEPTED
from sq.load.source import CheckpointSource

SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACCEPTED = ("quant_method 'fp8' with weight_block_size [rows, cols], fmt 'e4m3', activation_scheme 'dynamic' "
            "(DeepSeek-V3/R1, Kimi-K2)")
# elements dequantized per step: bounds the float32 temporaries (weight and expanded scales) to 128 MB
CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Fp8Layout:
    """Which checkpoint weights are FP8 and where their scales are."""

    block: tuple[int, int]  # (rows, cols) of one scale block
    scales: dict[str, str]  # weight key -> its weight_scale_inv key

    @property
    def scale_keys(self) -> set[str]:
        return set(self.scales.values())


def scale_key_of(weight_key: str) -> str:
    return weight_key + SCALE_SUFFIX


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Scale tensor shape of a ``[out, in]`` weight: one entry per (possibly partial) block."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def scale_box(offsets, lengths, block: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(offsets, lengths) in the scale grid of the blocks that weight box ``offsets + lengths`` touches."""
    lo = [o // b for o, b in zip(offsets, block)]
    hi = [math.ceil((o + n) / b) for o, n, b in zip(offsets, lengths, block)]
    return tuple(lo), tuple(h - l for l, h in zip(lo, hi))


def quantization_config_problems(qc, cfg_path: Path) -> list[str]:
    """Refusals for a source that is already quantized; [] for the FP8 block-scaled layout sq reads.
    (An MXFP4 config is judged by ``sq.load.mxfp4``: ``sq.load.meta.quantized_config_problems``.)"""
    only = (f"only FP8 block-scaled sources ({ACCEPTED}) and MXFP4 sources ({MXFP4_ACCEPTED}) are read directly, "
            "dequantized on the fly")
    if not isinstance(qc, dict):
        return [f"{cfg_path} has a quantization_config that is not an object ({qc!r}): the source is already "
                f"quantized; {only}"]
    method = qc.get("quant_method", "?")
    if method != "fp8":
        return [f"{cfg_path} has quantization_config (quant_method={method!r}): the source is already quantized; "
                f"{only}; for other formats use the full-precision checkpoint"]
    bs = qc.get("weight_block_size")
    if bs is None:
        return [f"{cfg_path} has quantization_config quant_method 'fp8' without weight_block_size (per-tensor or "
                f"per-channel FP8): the source is already quantized; {only}"]
    if not (isinstance(bs, (list, tuple)) and len(bs) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bs)):
        return [f"{cfg_path}: quantization_config weight_block_size {bs!r} is not two positive integers "
                "[rows, cols] (e.g. [128, 128]): unsupported block size format"]
    problems = []
    if qc.get("fmt", "e4m3") != "e4m3":
        problems.append(f"{cfg_path}: quantization_config fmt {qc.get('fmt')!r}: {only}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"{cfg_path}: quantization_config activation_scheme {qc.get('activation_scheme')!r} "
                        f"(stored activation scales are not read): {only}")
    return problems


def config_block(config: dict) -> tuple[int, int] | None:
    """The block size if config.json describes an FP8 block-scaled source sq reads, else None."""
    qc = config.get("quantization_config")
    if not qc or quantization_config_problems(qc, Path("config.json")):
        return None
    return tuple(qc["weight_block_size"])


def detect_fp8(source: CheckpointSource) -> tuple[Fp8Layout | None, list[str]]:
    """Pair every FP8 weight with its scale from the headers; name every weight or scale that does not fit.

    Returns (None, []) for a source without FP8 config or scale tensors.  A source with scale
    tensors but no FP8 block-scaled config, or the reverse, is refused: the block size would be
    unknown, or the config would describe weights that are not there.
    """
    cfg_path = source.root / "config.json"
    block = config_block(source.config)
    scale_keys = sorted(k for k in source.tensors if k.endswith(".weight" + SCALE_SUFFIX))
    if block is None:
        if scale_keys and not source.config.get("quantization_config"):
            t = source.tensors[scale_keys[0]]
            return None, [f"{len(scale_keys)} checkpoint tensors are FP8 block scales (e.g. {t.key!r} in {t.file}) "
                          f"but {cfg_path} has no quantization_config: the block size is unknown; {ACCEPTED} "
                          "is read directly"]
        return None, []  # a bad quantization_config is refused from config.json alone

    problems: list[str] = []
    scales: dict[str, str] = {}
    qc_text = f"quant_method 'fp8', weight_block_size {list(block)}"
    for sk in scale_keys:
        s = source.tensors[sk]
        wk = sk.removesuffix(SCALE_SUFFIX)
        w = source.tensors.get(wk)
        if w is None:
            problems.append(f"FP8 scale {sk!r} {list(s.shape)} ({s.file}) has no weight {wk!r}")
            continue
        if w.dtype != FP8_DTYPE:
            problems.append(f"{wk!r} {list(w.shape)} ({w.file}) is {w.dtype} but has a scale {sk!r}: FP8 block-scaled "
                            f"weights must be {FP8_DTYPE}")
            continue
        if len(w.shape) != 2:
            problems.append(f"FP8 weight {wk!r} is {len(w.shape)}-D {list(w.shape)} ({w.file}): only 2-D [out, in] "
                            "weights are block-scaled (per-expert checkpoints; a fused 3-D layout is not read)")
            continue
        want = scale_grid(w.shape, block)
        if tuple(s.shape) != want:
            problems.append(f"scale shape mismatch: {sk!r} is {list(s.shape)} ({s.file}) but weight {wk!r} "
                            f"{list(w.shape)} with weight_block_size {list(block)} needs {list(want)}")
            continue
        if s.dtype not in SCALE_DTYPES:
            problems.append(f"FP8 scale {sk!r} ({s.file}) is {s.dtype}; expected one of "
                            f"{[str(d).removeprefix('torch.') for d in SCALE_DTYPES]}")
            continue
        scales[wk] = sk
    paired = set(scales) | {k.removesuffix(SCALE_SUFFIX) for k in scale_keys}
    unscaled = sorted(k for k, t in source.tensors.items()
                      if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and k not in paired)
    for k in unscaled:
        t = source.tensors[k]
        problems.append(f"FP8 weight {k!r} {list(t.shape)} {t.dtype} ({t.file}) has no scale {scale_key_of(k)!r}: "
                        "cannot dequantize it")
    if not scale_keys and not unscaled:
        problems.append(f"{cfg_path} says the source is already quantized ({qc_text}) but none of its "
                        f"{len(source.tensors)} tensors is an FP8 weight with a {SCALE_SUFFIX.lstrip('_')}: "
                        "config.json and the weights disagree")
    return Fp8Layout(block, scales), problems


@torch.no_grad()
def dequantize_into(dest: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, start: tuple[int, int],
                    block: tuple[int, int]) -> None:
    """``dest = float32(weight) * scale`` per block, cast to ``dest.dtype``, on ``dest``'s device.

    ``weight`` is an FP8 box ``[nr, nc]`` whose first element lies at ``start`` inside its first
    block; ``scale`` holds exactly the blocks the box touches (``scale_box``).  Works in row chunks
    so the float32 temporaries stay under ``CHUNK_ELEMENTS`` elements each.
    """
    nr, nc = weight.shape
    if tuple(dest.shape) != (nr, nc):
        raise ValueError(f"destination {list(dest.shape)} does not match the FP8 box {[nr, nc]}")
    device = dest.device
    # the scale row / column of every weight row / column of the box
    ri = torch.div(torch.arange(nr, device=device) + start[0], block[0], rounding_mode="floor")
    ci = torch.div(torch.arange(nc, device=device) + start[1], block[1], rounding_mode="floor")
    if nr and nc and (int(ri[-1]) >= scale.shape[0] or int(ci[-1]) >= scale.shape[1]):
        raise ValueError(f"scale box {list(scale.shape)} does not cover FP8 box {[nr, nc]} at {list(start)} "
                         f"with blocks {list(block)}")
    s = scale.to(device=device, dtype=torch.float32)
    cols_aligned = start[1] == 0 and nc % block[1] == 0  # each row's columns fall in whole scale blocks
    step = max(1, CHUNK_ELEMENTS // max(1, nc))
    for a in range(0, nr, step):
        b = min(nr, a + step)
        w = fp8_to_float32(weight[a:b].to(device=device))  # [rows, nc]; exact
        if cols_aligned:  # each element's scale by broadcasting its row's scales over their blocks' columns
            w.view(b - a, nc // block[1], block[1]).mul_(s[ri[a:b], : nc // block[1], None])
        else:
            w.mul_(s[ri[a:b]][:, ci])  # [rows, nc] scale of each element's block
        dest[a:b].copy_(w)


_FP8_TABLES: dict = {}


def fp8_to_float32(x: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's values as float32, by one gather from its 256 byte values' conversions (the same bits as
    ``x.to(torch.float32)``, NaNs included: the table is made by that conversion): ~5x faster than torch's own
    conversion on a CPU core, which dominated reading an FP8 checkpoint (``tests/test_fp8.py`` checks all 256
    bytes of both kinds).  With the scales broadcast over whole blocks, a DeepSeek-V3 weight dequantizes into
    bfloat16 ~1.8x faster than by torch's conversion and a per-element scale gather (``bench/fp8_dequant.py``,
    docs/benchmarks.md "FP8 dequantization")."""
    key = (x.dtype, x.device)
    table = _FP8_TABLES.get(key)
    if table is None:
        table = _FP8_TABLES[key] = torch.arange(256, dtype=torch.uint8, device=x.device).view(x.dtype).to(torch.float32)
    return torch.index_select(table, 0, x.reshape(-1).view(torch.uint8).to(torch.int32)).view(x.shape)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A whole FP8 weight dequantized into ``dtype`` (carried-over tensors, small tensors)."""
    out = torch.empty(weight.shape, dtype=dtype)
    dequantize_into(out, weight, scale, (0, 0), block)
    return out


class Fp8StorageReader(SqStorageReader):
    """``SqStorageReader`` that dequantizes FP8 block-scaled weights while reading a box of them.

    Other tensors are read as they are.  The scale's file is the weight's own (the usual case)
    or opened for the request.
    """

    def __init__(self, source: CheckpointSource, layout: Fp8Layout, thread_count: int = 1, transforms=None):
        super().__init__(source, thread_count=thread_count, transforms=transforms)
        self.layout = layout

    def _raw(self, key: str) -> bool:
        return super()._raw(key) and key not in self.layout.scales

    def _process_read_request(self, f, req, planner) -> None:
        key = req.storage_index.fqn
        scale_key = self.layout.scales.get(key)
        if scale_key is None:
            return super()._process_read_request(f, req, planner)
        w_info, s_info = self.source.tensors[key], self.source.tensors[scale_key]
        (r0, c0), (nr, nc) = tuple(req.storage_offsets), tuple(req.lengths)
        (sr, sc), (snr, snc) = scale_box((r0, c0), (nr, nc), self.layout.block)
        weight = f.get_slice(key)[r0:r0 + nr, c0:c0 + nc]
        if s_info.file == w_info.file:
            scale = f.get_slice(scale_key)[sr:sr + snr, sc:sc + snc]
        else:
            with safe_open(str(self.source.path(s_info.file)), framework="pt") as sf:
                scale = sf.get_slice(scale_key)[sr:sr + snr, sc:sc + snc]
        self.bytes_read += weight.numel() * weight.element_size() + scale.numel() * scale.element_size()
        dest = planner.resolve_tensor(req).detach()
        dequantize_into(dest, weight, scale, (r0 - sr * self.layout.block[0], c0 - sc * self.layout.block[1]),
                        self.layout.block)
        planner.commit_tensor(req, dest)
