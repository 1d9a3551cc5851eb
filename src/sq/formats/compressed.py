"""The compressed-tensors checkpoint form of quantized Linear weights.

``compress_weight`` turns quantized data (ints, fp8 or fp4 values, scales, zero points, NVFP4's
global scale, and the calibrated activation scales a scheme declares) into exactly the
tensors compressed-tensors 0.20 writes for one Linear.  What those tensors are, and how they
are packed (with the library's own helpers, so the bits match), is the scheme's format's
declaration in ``sq.formats.specs`` (each registration's docstring has its table); this
module checks the data against the declaration and dispatches.  Names are relative to the
module (the writer prefixes ``model.layers.0.mlp.experts.3.gate_proj.``).

:func:`row_alignment` says how many rows a shard boundary must be a multiple of for a
shard's packed tensors to be rows of the full ones (asymmetric int zero points are packed
along the output dimension, 8 rows per int32 for int4).

``quantization_config`` builds the ``config.json`` entry with the library's own
``QuantizationConfig``, in the form ``ModelCompressor.update_config`` writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from sq.errors import SqError
from sq.formats.specs import activation_observers, format_for
from sq.formats.primitives import QParams, scale_shape
from sq.formats.schemes import QuantScheme, format_name, to_compressed_tensors

__all__ = [
    "compress_weight",
    "decompress_weight",
    "compressed_names",
    "row_alignment",
    "quantization_config",
]


def _unpack_result(result) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    if isinstance(result, (tuple, list)):
        if len(result) == 2 and isinstance(result[1], QParams):
            qp = result[1]
            return result[0], qp.scale, qp.zero_point, qp.global_scale
        if len(result) != 3:
            raise TypeError("expected (q, scale, zero_point) or (q, QParams)")
        return result[0], result[1], result[2], None
    return result.q, result.scale, result.zero_point, getattr(result, "global_scale", None)


def _check_global_scale(gs: Tensor | None, needed: bool, scheme: QuantScheme) -> None:
    if not needed:
        if gs is not None:
            raise SqError(f"scheme {scheme.name} has no global scale, but one was given")
        return
    if gs is None:
        raise SqError(f"scheme {scheme.name} needs its weight_global_scale (rtn.qparams(...).global_scale, "
                      "from the all-reduced global_absmax)")
    if gs.dtype != torch.float32 or gs.numel() != 1:
        raise SqError(f"weight_global_scale must be one float32 value, got {gs.dtype} {tuple(gs.shape)}")


def _activation_tensors(scheme: QuantScheme, given: Mapping[str, Tensor] | None, dtype: torch.dtype) -> dict:
    declared = {t.name: t for t in (o.tensor(dtype) for o in activation_observers(scheme))}
    given = dict(given or {})
    if set(given) != set(declared):
        missing, extra = sorted(set(declared) - set(given)), sorted(set(given) - set(declared))
        raise SqError(
            f"scheme {scheme.name} writes the calibrated activation tensors {sorted(declared) or 'none'}: "
            + (f"missing {missing}" if missing else "") + (" " if missing and extra else "")
            + (f"not declared {extra}" if extra else "")
        )
    for name, t in given.items():
        spec = declared[name]
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise SqError(f"{name} must be {spec.dtype} {spec.shape}, got {t.dtype} {tuple(t.shape)}")
        if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise SqError(f"{name} must be finite and positive, got {t.tolist()}")
    return {k: v.clone() for k, v in given.items()}  # partners (gate/up) read one input: never share storage


def compressed_names(scheme: QuantScheme) -> tuple[str, ...]:
    """Relative tensor names ``compress_weight`` returns for ``scheme``."""
    return format_for(scheme).names(scheme)


def row_alignment(scheme: QuantScheme) -> int:
    """Rows a shard boundary must be a multiple of for packing a shard on its own.

    Only asymmetric packed zero points mix rows (``32 / num_bits`` rows per int32
    along ``out``); everything else is packed along ``in``.
    """
    return format_for(scheme).row_alignment(scheme)


def compress_weight(result, scheme: QuantScheme, shape: Sequence[int] | None = None, *,
                    global_scale: Tensor | None = None,
                    activation_scales: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Checkpoint tensors for one Linear from ``result`` = a ``GPTQResult``, ``(q, scale, zp)``
    or ``(q, QParams)``.

    ``q`` holds the whole weight ``[out, in]`` (int8 values in the scheme's range,
    float8_e4m3fn, or bf16 holding fp4 e2m1 values); ``shape``, if given, must equal it.
    ``global_scale``: NVFP4's float32 ``[1]`` (``QParams.global_scale``; taken from a ``QParams``
    or a result's ``global_scale`` when not given).  ``activation_scales``: the calibrated
    tensors the scheme declares (``formats.activation_observers``: FP8's ``input_scale``,
    NVFP4's ``input_global_scale``), by name; required exactly when declared.
    """
    fmt = format_for(scheme)
    q, scale, zp, gs = _unpack_result(result)
    if global_scale is not None:
        if gs is not None and not torch.equal(gs, global_scale):
            raise SqError("compress_weight: a global scale was given twice")
        gs = global_scale
    if q.ndim != 2:
        raise SqError(f"quantized weight must be 2-D [out, in], got shape {tuple(q.shape)}")
    out_f, in_f = q.shape
    if shape is not None and tuple(shape) != (out_f, in_f):
        raise SqError(f"quantized weight shape {(out_f, in_f)} != expected {tuple(shape)}")
    if q.dtype != scheme.storage_dtype:
        raise SqError(f"scheme {scheme.name} stores {scheme.storage_dtype} values, got {q.dtype}")
    if scheme.group_size is not None and in_f % scheme.group_size:
        raise SqError(f"group size {scheme.group_size} does not divide in_features {in_f}")
    spec = fmt.spec(scheme)
    _check_global_scale(gs, spec.global_scale, scheme)
    s_shape = scale_shape(spec.granularity, (out_f, in_f))
    if tuple(scale.shape) != s_shape:
        raise SqError(f"weight_scale shape {tuple(scale.shape)} != {s_shape} for {scheme.name}")
    if scheme.symmetric != (zp is None):
        raise SqError(
            f"scheme {scheme.name} is {'symmetric' if scheme.symmetric else 'asymmetric'} "
            f"but a zero point was {'given' if zp is not None else 'not given'}"
        )
    if zp is not None and (tuple(zp.shape) != s_shape or zp.dtype != torch.int8):
        raise SqError(f"weight_zero_point must be int8 {s_shape}, got {zp.dtype} {tuple(zp.shape)}")
    acts = _activation_tensors(scheme, activation_scales, scale.dtype)
    return fmt.compress(q, QParams(scale, zp, gs), scheme) | acts


def decompress_weight(tensors: Mapping[str, Tensor], scheme: QuantScheme) -> Tensor:
    """The dense weight a loader reconstructs from ``compress_weight``'s tensors."""
    return format_for(scheme).decompress(tensors, scheme)


def quantization_config(groups: Mapping[QuantScheme, Sequence[str]], ignore: Sequence[str], *,
                        kv_cache_scheme=None, transform_config: Mapping | None = None) -> dict:
    """``config.json``'s ``quantization_config`` for ``{scheme: targets}`` and ``ignore``
    (``kv_cache_scheme``: the library's ``QuantizationArgs`` of a calibrated KV cache, or None;
    ``transform_config``: the online rotations' ``TransformConfig`` fields, validated by the library).

    Built with compressed-tensors' ``QuantizationConfig`` (one config group per scheme,
    ``format`` per group and overall -- ``mixed-precision`` when the groups differ --,
    status ``compressed``, the explicit ignore list) and laid out as the library's
    ``ModelCompressor.update_config`` writes it.
    """
    import compressed_tensors
    from compressed_tensors.base import (
        COMPRESSION_VERSION_NAME,
        QUANTIZATION_METHOD,
        QUANTIZATION_METHOD_NAME,
        SPARSITY_CONFIG_NAME,
        TRANSFORM_CONFIG_NAME,
    )
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from compressed_tensors.transform import TransformConfig

    if not groups:
        raise SqError("quantization_config: no quantized layers (empty scheme groups)")
    config_groups = {}
    for i, (scheme, targets) in enumerate(groups.items()):
        if isinstance(targets, str) or not targets:
            raise SqError(f"quantization_config: scheme {scheme.name} needs a non-empty list of targets")
        config_groups[f"group_{i}"] = to_compressed_tensors(scheme, list(targets))
    formats = {format_name(s) for s in groups}
    fmt = formats.pop() if len(formats) == 1 else "mixed-precision"
    qc = QuantizationConfig(
        config_groups=config_groups,
        format=fmt,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(ignore),
        kv_cache_scheme=kv_cache_scheme,
    )
    return {
        COMPRESSION_VERSION_NAME: compressed_tensors.__version__,
        QUANTIZATION_METHOD_NAME: QUANTIZATION_METHOD,
        SPARSITY_CONFIG_NAME: {},
        TRANSFORM_CONFIG_NAME: (TransformConfig.model_validate(dict(transform_config)).model_dump(mode="json")
                                if transform_config else {}),
        **qc.model_dump(mode="json", exclude={"quant_method"}),
    }
