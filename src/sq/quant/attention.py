"""Causal self-attention in query chunks, so that the keys a causal mask hides are never multiplied.

torch's CPU SDPA kernels split a sequence of up to ~512 tokens into no key blocks at all: a causal
mask is applied after every query met every key, so half the work is thrown away (on SmolLM2's
9 heads x 512 tokens, ``is_causal=True`` costs what no mask does). Queries ``[s, e)`` need keys
``[0, e)`` only: computed chunk by chunk, the hidden upper triangle is skipped (at 512 tokens in
chunks of 64, 0.69x the time on an AMD EPYC core). Whether and how to chunk is measured per machine
and shape (``sq.probe.attention_chunk_choice``); a chunk's rows differ from the unchunked kernel's by
float rounding (the softmax's sums run over fewer keys), so the choice is part of a run's signature.

Only the plain causal case is chunked: no mask given (transformers passes none exactly when the
mask is causal without padding or a sliding window), queries as long as keys, no dropout or bias.
Anything else goes to transformers' SDPA as it is.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["IMPL", "attention_shape", "causal_chunks", "sdpa", "use_sdpa"]

IMPL = "sq_sdpa"
_chunk: int | None = None  # queries per chunk for the model the job set IMPL on (use_sdpa)


def sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """transformers' ``sdpa_attention_forward``, in query chunks where the attention is plainly causal."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    c, n = _chunk, query.shape[2]
    if (c is None or n <= c or attention_mask is not None or key.shape[2] != n or kwargs.get("is_causal") is False
            or not getattr(module, "is_causal", True) or kwargs.get("position_bias") is not None
            or kwargs.get("dropout") or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # torch's SDPA itself, as transformers calls it, with its grouped keys and values as they are (transformers
    # repeats them when a mask is given: once per chunk here)
    out = causal_chunks(query, key, value, c, scale=kwargs.get("scaling"))
    return out.transpose(1, 2).contiguous(), None  # [batch, queries, heads, dim], as transformers


def causal_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: int,
                  scale: float | None = None) -> torch.Tensor:
    """Causal SDPA over ``[batch, heads, tokens, dim]`` with queries ``[s, e)`` against keys ``[0, e)`` only,
    ``chunk`` queries at a time (the causal mask on the diagonal block); keys and values may have fewer
    heads (grouped).  What the job's attention runs, and what the probe times."""
    n = query.shape[2]
    pos = torch.arange(n, device=query.device)
    gqa = key.shape[1] != query.shape[1]
    outs = []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        outs.append(F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, :e], value[:, :, :e],
                                                   attn_mask=pos[s:e, None] >= pos[None, :e],  # True: attend
                                                   scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def attention_shape(model: nn.Module) -> tuple[int, int]:
    """``(heads, head_dim)`` of the model's (text) attention from its config; ``(0, 0)`` if it names none."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(cfg, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return 0, 0
    dim = getattr(cfg, "head_dim", None)
    if not isinstance(dim, int) or dim < 1:
        hidden = getattr(cfg, "hidden_size", None)
        dim = hidden // heads if isinstance(hidden, int) else 0
    return heads, dim


def use_sdpa(model: nn.Module, chunk: int | None) -> None:
    """The model's attention: transformers' SDPA (``None`` mask == causal: calibration windows have no
    padding), in query chunks of ``chunk`` where given.  Models that cannot take SDPA keep their own
    attention, unchunked."""
    global _chunk
    _chunk = None
    try:
        model.set_attn_implementation("sdpa")  # refused where the model does not support SDPA
        if chunk:
            from transformers import AttentionInterface
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

            if IMPL not in AttentionInterface._global_mapping:
                AttentionInterface.register(IMPL, sdpa)
                # SDPA's masks (None where causal alone): a name without a mask function gets no mask at
                # all from transformers, sliding windows included
                ALL_MASK_ATTENTION_FUNCTIONS.register(IMPL, sdpa_mask)
            model.set_attn_implementation(IMPL)
            _chunk = chunk
    except Exception:  # noqa: BLE001 - a model without SDPA support (or an older transformers): its default
        pass
