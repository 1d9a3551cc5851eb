"""MXFP4 sources (gpt-oss as OpenAI ships it): detection and dequantization on the fly.

gpt-oss-20b / 120b store each routed-expert projection as two uint8 tensors instead of the bf16
parameter ``X`` (``model.layers.N.mlp.experts.gate_up_proj`` / ``down_proj``)::

    X_blocks  uint8 [E, R, G, 16]   two FP4 (e2m1) codes per byte, low nibble first:
                                    byte j of a block holds elements 2j (bits 0-3) and 2j+1 (bits 4-7)
    X_scales  uint8 [E, R, G]       one E8M0 exponent per block of 32 elements, bias 127

``R`` is the projection's output width (``2I`` for ``gate_up_proj``, ``H`` for ``down_proj``) and
``G * 32`` its input width.  Element ``(e, r, 32 g + k)`` is ``FP4_VALUES[code] * 2 ** (scale - 127)``,
and the model parameter is that ``[E, R, G * 32]`` tensor transposed to ``[E, G * 32, R]`` (gpt-oss
computes ``x @ W``): ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``.  This is transformers'
own reading (``transformers.integrations.mxfp4.convert_moe_packed_tensors``); ``tests/test_mxfp4.py``
checks it value for value against that function.  ``config.json`` says::

    "quantization_config": {"quant_method": "mxfp4",
                            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"]}

Everything else (attention, router, sinks, expert biases, embeddings) is bf16.

How sq reads it: each ``X_blocks`` / ``X_scales`` pair stands in the key map as one tensor ``X`` of
the dequantized shape ``[E, G * 32, R]`` (:meth:`Mxfp4Layout.tensors`), so ``X`` maps exactly onto the
model parameter of that name, experts split over ranks like any fused parameter, and an unquantized
``X`` is written under the model's name.  A read box ``[e0, e0 + ne) x [a0, a0 + na) x [r0, r0 + nr)`` of
``X`` reads only blocks ``[e0, e0 + ne) x [r0, r0 + nr) x [a0 // 32, ceil((a0 + na) / 32))`` and their
scales, dequantizes them in chunks of at most ``CHUNK_ELEMENTS`` elements on the destination's device,
and writes the transposed values in the destination's dtype.
"""

from __future__ import annotations

import math
import re
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from sq.load.fill import BoxTransform, ReadFiles
from sq.load.source import CheckpointSource, TensorInfo

QUANT_METHOD = "mxfp4"
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
BLOCK = 32  # elements per scale
BLOCK_BYTES = BLOCK // 2  # two FP4 codes per byte
SCALE_BIAS = 127  # E8M0: 2 ** (byte - 127)
# e2m1 codes 0..15: sign bit 3, then exponent and mantissa (transformers' FP4_VALUES, the OCP MX table)
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
CONFIG_FIELDS = ("quant_method", "modules_to_not_convert", "dequantize")  # what transformers' Mxfp4Config writes
ACCEPTED = ("quant_method 'mxfp4' (gpt-oss: experts as X_blocks uint8 [E, R, G, 16] + X_scales uint8 [E, R, G], "
            "32-element blocks, E8M0 scales)")
# elements dequantized per step: bounds the float32 values (16 MB) and the int32 byte indices (8 MB)
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Mxfp4Pair(BoxTransform):
    """One MXFP4 tensor: ``name`` (the dequantized tensor, model layout) from its blocks and scales; the
    reader makes a box of it from only the blocks and scales the box touches (a ``BoxTransform``)."""

    name: str
    blocks: TensorInfo  # uint8 [E, R, G, 16]
    scales: TensorInfo  # uint8 [E, R, G]

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dequantized shape ``[E, G * 32, R]`` (transposed against the blocks' rows)."""
        e, r, g, _ = self.blocks.shape
        return e, g * BLOCK, r

    @property
    def file(self) -> str:
        return self.blocks.file

    def sources(self, offsets, lengths):
        """The blocks and scales a box ``[e0, a0, r0] + [ne, na, nr]`` reads."""
        (e0, a0, r0), (ne, na, nr) = tuple(offsets), tuple(lengths)
        g0, g1 = a0 // BLOCK, math.ceil((a0 + na) / BLOCK)
        return [(self.blocks.key, (e0, r0, g0, 0), (ne, nr, g1 - g0, BLOCK_BYTES)),
                (self.scales.key, (e0, r0, g0), (ne, nr, g1 - g0))]

    def read_into(self, files: ReadFiles, dest: torch.Tensor, offsets, lengths) -> int:
        b, s = files.slice(self.blocks), files.slice(self.scales)
        return dequantize_box_into(dest, lambda e, ne, r, nr, g0, g1: b[e:e + ne, r:r + nr, g0:g1],
                                   lambda e, ne, r, nr, g0, g1: s[e:e + ne, r:r + nr, g0:g1], offsets, lengths)


@dataclass(frozen=True)
class Mxfp4Layout:
    """Which checkpoint tensors are MXFP4 pairs, by the name of the tensor they dequantize to."""

    pairs: dict[str, Mxfp4Pair]

    @property
    def packed_keys(self) -> set[str]:
        """The blocks and scales keys: consumed by their tensor, never mapped, carried or written."""
        return {k for p in self.pairs.values() for k in (p.blocks.key, p.scales.key)}

    def tensors(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, TensorInfo]:
        """The dequantized tensors as the key map sees them (no bytes of their own: read through the pair)."""
        return {n: TensorInfo(n, p.blocks.file, dtype, p.shape, (0, 0)) for n, p in self.pairs.items()}

    def describe(self, problems: list[str]) -> list[str]:
        """``problems`` (from the key map, which knows only ``X``) with each ``checkpoint 'X'`` naming its pair."""
        out = []
        for text in problems:
            for n, p in self.pairs.items():
                text = text.replace(f"checkpoint {n!r} is", f"checkpoint {p.blocks.key!r} + {p.scales.key!r} "
                                                            f"(MXFP4, {list(p.blocks.shape)} blocks) dequantizes to")
            out.append(text)
        return out


def blocks_and_scales(source: CheckpointSource) -> set[str]:
    """Every uint8 ``*_blocks`` / ``*_scales`` tensor: paired, they are read through their tensor ``X``;
    unpaired, :func:`detect_mxfp4` names them.  Either way never a key of their own."""
    return {k for k, t in source.tensors.items()
            if t.dtype == torch.uint8 and k.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX))}


def is_mxfp4(config: dict) -> bool:
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def _not_converted(module: str, patterns) -> bool:
    """Whether ``modules_to_not_convert`` names ``module``, as transformers reads it
    (``quantizers_utils.should_convert_module``): a regex from the start up to a module boundary
    (``model.layers.*.self_attn``), or a plain suffix (``lm_head``)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


def quantization_config_problems(qc: dict, cfg_path) -> list[str]:
    """Refusals of an MXFP4 ``quantization_config`` read from config.json alone."""
    problems = []
    unknown = sorted(str(k) for k in qc if k not in CONFIG_FIELDS)
    if unknown:
        problems.append(f"{cfg_path}: quantization_config (quant_method 'mxfp4') has fields {unknown} sq does not "
                        f"know (it reads {list(CONFIG_FIELDS)}): an MXFP4 variant sq does not read; {ACCEPTED} is "
                        "read directly")
    if "dequantize" in qc and not isinstance(qc["dequantize"], bool):
        problems.append(f"{cfg_path}: quantization_config dequantize {qc['dequantize']!r} is not true / false")
    mnc = qc.get("modules_to_not_convert")
    if mnc is None:
        return problems
    if not isinstance(mnc, list) or not all(isinstance(p, str) and p for p in mnc):
        return problems + [f"{cfg_path}: quantization_config modules_to_not_convert {str(mnc)[:200]} is not a list "
                           "of module name patterns"]
    for p in mnc:
        try:
            re.compile(p)
        except re.error as e:
            problems.append(f"{cfg_path}: quantization_config modules_to_not_convert entry {p!r} is not a valid "
                            f"pattern ({e})")
    return problems


def detect_mxfp4(source: CheckpointSource) -> tuple[Mxfp4Layout | None, list[str]]:
    """Pair every ``X_blocks`` with its ``X_scales`` from the headers; name every tensor that does not fit.

    Returns (None, []) for a source that is neither MXFP4 by its config nor holds uint8 blocks /
    scales.  uint8 ``*_blocks`` / ``*_scales`` without an MXFP4 config, an MXFP4 config without
    them, a half pair, a shape that is not ``[E, R, G, 16]`` / ``[E, R, G]``, a tensor stored both
    packed and plain, and a ``modules_to_not_convert`` entry that names the MXFP4 tensors' modules
    or no module of the checkpoint at all are refused, by key, shape and file.
    """
    cfg_path = source.root / "config.json"
    tensors = source.tensors
    packed = sorted(blocks_and_scales(source))
    if not is_mxfp4(source.config):
        if packed and not source.config.get("quantization_config"):
            t = tensors[packed[0]]
            return None, [f"{len(packed)} checkpoint tensors are MXFP4 blocks / scales (e.g. {t.key!r} uint8 "
                          f"{list(t.shape)} in {t.file}) but {cfg_path} has no quantization_config: the format is "
                          f"unknown; {ACCEPTED} is read directly"]
        return None, []  # another quantization_config is refused from config.json alone
    qc = source.config["quantization_config"]
    if quantization_config_problems(qc, cfg_path):
        return None, []  # named by the config check

    problems: list[str] = []
    pairs: dict[str, Mxfp4Pair] = {}
    blocks = sorted(k for k in tensors if k.endswith(BLOCKS_SUFFIX))
    for bk in blocks:
        name = bk.removesuffix(BLOCKS_SUFFIX)
        sk = name + SCALES_SUFFIX
        b, s = tensors[bk], tensors.get(sk)
        where = f"{bk!r} {str(b.dtype).removeprefix('torch.')} {list(b.shape)} ({b.file})"
        if s is None:
            problems.append(f"MXFP4 blocks {where} have no scales {sk!r}: cannot dequantize them")
            continue
        if b.dtype != torch.uint8 or s.dtype != torch.uint8:
            problems.append(f"MXFP4 pair {where} / {sk!r} {str(s.dtype).removeprefix('torch.')} ({s.file}): blocks "
                            "and scales must both be uint8 (packed FP4 codes, E8M0 exponents)")
            continue
        if len(b.shape) != 4 or b.shape[-1] != BLOCK_BYTES or 0 in b.shape:
            problems.append(f"MXFP4 blocks {where} are not [experts, rows, blocks, {BLOCK_BYTES}]: only gpt-oss' fused "
                            f"3-D experts are read ({BLOCK} FP4 codes in {BLOCK_BYTES} bytes per block)")
            continue
        if tuple(s.shape) != tuple(b.shape[:-1]):
            problems.append(f"MXFP4 scale shape mismatch: {sk!r} is {list(s.shape)} ({s.file}) but blocks {where} "
                            f"need {list(b.shape[:-1])} (one scale per block)")
            continue
        if name in tensors:
            t = tensors[name]
            problems.append(f"{name!r} is stored twice: plain ({str(t.dtype).removeprefix('torch.')} {list(t.shape)} "
                            f"in {t.file}) and as MXFP4 blocks {where}")
            continue
        pairs[name] = Mxfp4Pair(name, b, s)
    for sk in sorted(k for k in tensors if k.endswith(SCALES_SUFFIX)):
        bk = sk.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX
        if bk not in tensors and tensors[sk].dtype == torch.uint8:
            s = tensors[sk]
            problems.append(f"MXFP4 scales {sk!r} uint8 {list(s.shape)} ({s.file}) have no blocks {bk!r}")
    if not blocks and not problems:
        problems.append(f"{cfg_path} says the source is MXFP4 (quant_method 'mxfp4') but none of its "
                        f"{len(tensors)} tensors is an *{BLOCKS_SUFFIX} / *{SCALES_SUFFIX} pair: config.json and the "
                        "weights disagree")
    problems += _not_converted_problems(source, qc.get("modules_to_not_convert") or [], pairs)
    return Mxfp4Layout(pairs), problems


def _not_converted_problems(source: CheckpointSource, patterns: list[str], pairs: dict[str, Mxfp4Pair]) -> list[str]:
    """``modules_to_not_convert`` must name modules of this checkpoint, and none that holds MXFP4 tensors."""
    cfg_path = source.root / "config.json"
    problems = []
    modules = set()
    for k in source.tensors:
        parts = k.split(".")
        modules.update(".".join(parts[:i]) for i in range(1, len(parts)))
    tied = bool(source.config.get("tie_word_embeddings"))
    for p in patterns:
        if p == "lm_head" and tied:  # a tied head has no tensor of its own
            continue
        if not any(_not_converted(m, [p]) for m in modules):
            problems.append(f"{cfg_path}: quantization_config modules_to_not_convert names {p!r}, which matches no "
                            f"module of the checkpoint (modules look like {sorted(modules)[:3]}): the config does not "
                            "describe these weights")
    for name, pair in sorted(pairs.items()):
        module = name.rpartition(".")[0]
        hit = [p for p in patterns if _not_converted(module, [p])]
        if hit:
            problems.append(f"{cfg_path}: quantization_config modules_to_not_convert {hit} names {module!r}, yet "
                            f"{pair.blocks.key!r} ({pair.blocks.file}) is MXFP4: the config and the weights disagree")
    return problems


def _byte_table(device) -> torch.Tensor:
    """float32 ``[256, 2]``: twice the two values each byte holds (low nibble first), so one gather
    decodes a byte (the factor 2 is taken back from the scale, see :func:`dequantize_blocks`)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=device) * 2
    byte = torch.arange(256, device=device)
    return torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=-1)


@torch.no_grad()
def dequantize_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks`` uint8 ``[..., G, 16]`` and ``scales`` uint8 ``[..., G]`` -> float32 ``[..., G * 32]``.

    ``value * 2 ** (scale - 127)`` computed as ``(2 * value) * 2 ** (scale - 128)``: the factor then
    runs from ``2 ** -128`` to ``2 ** 127``, all float32 numbers, and every product of a (doubled) FP4
    value by it is exact or overflows exactly where transformers' ``ldexp(value, scale - 127)`` does
    (scale byte 255, the format's NaN, times a value of 1 or more: inf).  One gather per byte from a
    256-entry table and one multiply per element: 6x faster on CPU than a lookup per nibble and an
    ``ldexp`` per element.
    """
    out = torch.index_select(_byte_table(blocks.device), 0, blocks.reshape(-1).to(torch.int32))
    out = out.view(*scales.shape, BLOCK)  # [..., G, 32]: element 2j from byte j's low nibble, 2j + 1 its high
    factor = torch.ldexp(torch.ones(scales.shape, dtype=torch.float32, device=scales.device),
                         scales.to(torch.int32) - (SCALE_BIAS + 1))
    out.mul_(factor.unsqueeze(-1))
    return out.view(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def _chunks(ne: int, nr: int, width: int):
    """(expert offset, experts, row offset, rows) steps over a ``[ne, nr, width]`` box, each at most
    ``CHUNK_ELEMENTS`` elements (one row at least)."""
    per_expert = nr * width
    if per_expert <= CHUNK_ELEMENTS:
        step = max(1, CHUNK_ELEMENTS // max(1, per_expert))
        for e in range(0, ne, step):
            yield e, min(step, ne - e), 0, nr
        return
    rows = max(1, CHUNK_ELEMENTS // max(1, width))
    for e in range(ne):
        for r in range(0, nr, rows):
            yield e, 1, r, min(rows, nr - r)


@torch.no_grad()
def dequantize_box_into(dest: torch.Tensor, read_blocks, read_scales, offsets, lengths) -> int:
    """Write the box ``offsets + lengths`` (``[e0, a0, r0]`` + ``[ne, na, nr]``, model layout ``[E, in, out]``)
    of an MXFP4 tensor into ``dest`` (``[ne, na, nr]``, any dtype and device).

    ``read_blocks(e, ne, r, nr, g0, g1)`` / ``read_scales(...)`` return the stored blocks / scales of
    experts ``[e, e + ne)``, rows ``[r, r + nr)``, blocks ``[g0, g1)``: only the blocks the box touches
    are read, chunk by chunk.  Returns the bytes read.
    """
    (e0, a0, r0), (ne, na, nr) = tuple(offsets), tuple(lengths)
    if tuple(dest.shape) != (ne, na, nr):
        raise ValueError(f"destination {list(dest.shape)} does not match the MXFP4 box {[ne, na, nr]}")
    g0, g1 = a0 // BLOCK, math.ceil((a0 + na) / BLOCK)
    c0 = a0 - g0 * BLOCK  # the box's first column inside the first block
    nbytes = 0
    if not (ne and na and nr):
        return nbytes
    for e, n, r, m in _chunks(ne, nr, (g1 - g0) * BLOCK):
        blk = read_blocks(e0 + e, n, r0 + r, m, g0, g1)  # [n, m, g1 - g0, 16]
        sc = read_scales(e0 + e, n, r0 + r, m, g0, g1)  # [n, m, g1 - g0]
        nbytes += blk.numel() + sc.numel()
        vals = dequantize_blocks(blk.to(dest.device), sc.to(dest.device))  # [n, m, (g1 - g0) * 32]
        # [n, m, in] -> [n, in, m]: the model's x @ W orientation
        dest[e:e + n, :, r:r + m].copy_(vals[..., c0:c0 + na].transpose(1, 2))
    return nbytes


def dequantize(source: CheckpointSource, pair: Mxfp4Pair, dtype: torch.dtype) -> torch.Tensor:
    """A whole MXFP4 tensor dequantized into ``dtype`` (a carried-over tensor)."""
    out = torch.empty(pair.shape, dtype=dtype)
    with ExitStack() as stack:
        pair.read_into(ReadFiles(source, stack), out, (0, 0, 0), pair.shape)
    return out
