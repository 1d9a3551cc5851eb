"""QuantScheme: presets equal compressed-tensors' presets, validation, serialization."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization import preset_name_to_scheme

from sq.errors import SqError
from sq.formats.schemes import (
    SCHEME_NAMES,
    QuantScheme,
    check_group_size,
    format_name,
    get_scheme,
    to_compressed_tensors,
)


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_presets_equal_library_presets(name):
    ours = to_compressed_tensors(get_scheme(name), ["Linear"])
    lib = preset_name_to_scheme(name, ["Linear"])
    assert ours.weights == lib.weights
    assert ours.input_activations == lib.input_activations
    assert ours.output_activations == lib.output_activations
    # the format we write is the one the library infers for a Linear with this scheme
    assert infer_module_format(torch.nn.Linear, lib).value == format_name(get_scheme(name))
    assert ours.format == format_name(get_scheme(name))


def test_w8a16_is_group_wise_like_the_library():
    s = get_scheme("W8A16")
    assert (s.strategy, s.group_size, s.num_bits, s.symmetric) == ("group", 128, 8, True)
    assert s.format == "pack-quantized"


def test_group_size_and_case():
    s = get_scheme("w4a16", group_size=64)
    assert s.name == "W4A16" and s.group_size == 64
    fp8 = get_scheme("FP8_DYNAMIC", group_size=64)  # per-channel: group size ignored
    assert fp8.strategy == "channel" and fp8.group_size is None
    assert fp8.format == "float-quantized" and fp8.storage_dtype == torch.float8_e4m3fn
    assert get_scheme("W4A16_ASYM").symmetric is False


def test_ranges():
    assert (get_scheme("W4A16").qmin, get_scheme("W4A16").qmax) == (-8.0, 7.0)
    assert (get_scheme("W8A16").qmin, get_scheme("W8A16").qmax) == (-128.0, 127.0)
    assert get_scheme("FP8_DYNAMIC").qmax == 448.0


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_dict_round_trip_and_hashable(name):
    s = get_scheme(name, 32)
    d = s.to_dict()
    assert QuantScheme.from_dict(d) == s
    assert hash(QuantScheme.from_dict(d)) == hash(s)
    assert {s: 1}[QuantScheme.from_dict(d)] == 1


def test_from_dict_rejects_unknown_fields():
    d = get_scheme("W4A16").to_dict() | {"bogus": 1}
    with pytest.raises(ValueError, match="bogus"):
        QuantScheme.from_dict(d)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(name="x", num_bits=4, strategy="group", group_size=None),
        dict(name="x", num_bits=4, strategy="group", group_size=0),
        dict(name="x", num_bits=4, strategy="channel", group_size=128),
        dict(name="x", num_bits=9),
        dict(name="x", num_bits=1),
        dict(name="x", num_bits=4, type="float"),
        dict(name="x", num_bits=8, type="float", symmetric=False, strategy="channel", group_size=None),
        dict(name="x", num_bits=4, type="nf4"),
        dict(name="x", num_bits=4, strategy="tensor"),
        # (int4 weights with fp8 dynamic activations are W4AFP8 now: int-quantized)
        dict(name="x", num_bits=4, activations="mxfp4_dynamic"),
        dict(name="", num_bits=4),
    ],
)
def test_validation(kwargs):
    with pytest.raises(ValueError):
        QuantScheme(**kwargs)


def test_get_scheme_refuses_bad_input():
    with pytest.raises(SqError, match="unknown scheme 'W3A3'"):
        get_scheme("W3A3")
    with pytest.raises(SqError, match="group size"):
        get_scheme("W4A16", group_size=0)


def test_check_group_size_names_layer_and_widths():
    s = get_scheme("W4A16", 128)
    check_group_size("model.layers.0.mlp.down_proj", 1536, s)
    with pytest.raises(SqError) as e:
        check_group_size("model.layers.0.self_attn.q_proj", 576, s)
    msg = str(e.value)
    assert "model.layers.0.self_attn.q_proj" in msg and "128" in msg and "576" in msg
    check_group_size("anything", 577, get_scheme("FP8_DYNAMIC"))  # per-channel: any width
