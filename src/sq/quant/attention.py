"""Causal self-attention in query chunks, so that the keys a causal mask hides are never multiplied.

torch's CPU SDPA kernels split a sequence of up to ~512 tokens into no key blocks at all: a causal
mask is applied after every query met every key, so half the work is thrown away (on SmolLM2's
9 heads x 512 tokens, ``is_causal=True`` costs what no mask does). Queries ``[s, e)`` need keys
``[0, e)`` only: computed chunk by chunk, the hidden upper triangle is skipped (at 512 tokens in
chunks of 64, 0.69x the time on an AMD EPYC core). Whether and how to chunk is measured per machine
and shape (``sq.probe.attention_chunk_choice``); a chunk's rows differ from the unchunked kernel's by
float rounding (the softmax's sums run over fewer keys), so the choice is part of a run's signature.

Where SignRound's steps need the attention's gradient, the chunks' backward is SDPA's or, where the probe
measures it faster (``sq.probe.attention_backward_choice``), ``_CausalChunks``' products.

Only the plain causal case is chunked: no mask given (transformers passes none exactly when the
mask is causal without padding or a sliding window), queries as long as keys, no dropout or bias.
Anything else goes to transformers' SDPA as it is.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from sq.anatomy import config_size

__all__ = ["HAND_BACKWARD_BYTES", "IMPL", "attention_shape", "causal_chunks", "hand_backward_bytes", "sdpa", "use_sdpa"]

IMPL = "sq_sdpa"
_chunk: int | None = None  # queries per chunk for the model the job set IMPL on (use_sdpa)
_backward = "sdpa"  # the chunks' backward where a gradient flows: SDPA's, or "sq" (_CausalChunks; use_sdpa)
# _CausalChunks' backward holds a chunk's scores four times (float32 scores and score gradients, their bf16
# copies: 12 bytes per query-key pair); past this, SDPA's backward (tiled, no such buffers) is taken instead
HAND_BACKWARD_BYTES = 256 << 20


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
    out = causal_chunks(query, key, value, c, scale=kwargs.get("scaling"), backward=_backward)
    return out.transpose(1, 2).contiguous(), None  # [batch, queries, heads, dim], as transformers


def hand_backward_bytes(batch: int, heads: int, tokens: int, chunk: int) -> int:
    """What ``_CausalChunks``' backward holds at once in a call over ``[batch, heads, tokens]`` in query chunks
    of ``chunk``: a chunk's scores, probabilities and their gradients, 12 bytes a query-key pair.  0 where
    that is over ``HAND_BACKWARD_BYTES``: SDPA's tiled backward runs there instead."""
    held = batch * heads * min(chunk, tokens) * tokens * 12
    return held if held <= HAND_BACKWARD_BYTES else 0


def causal_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: int,
                  scale: float | None = None, backward: str = "sdpa") -> torch.Tensor:
    """Causal SDPA over ``[batch, heads, tokens, dim]`` with queries ``[s, e)`` against keys ``[0, e)`` only,
    ``chunk`` queries at a time (the causal mask on the diagonal block); keys and values may have fewer
    heads (grouped).  What the job's attention runs, and what the probe times.  ``backward="sq"``: where a
    gradient is wanted on CPU, the same forward with ``_CausalChunks``' backward instead of SDPA's."""
    n = query.shape[2]
    if (backward == "sq" and query.device.type == "cpu" and torch.is_grad_enabled()
            and any(t.requires_grad for t in (query, key, value))
            and hand_backward_bytes(query.shape[0], query.shape[1], n, chunk)):
        if torch.is_autocast_enabled("cpu"):  # as autocast would cast them for SDPA (rotary leaves q, k float32)
            query, key, value = (t.to(torch.get_autocast_dtype("cpu")) for t in (query, key, value))
        if query.dtype == key.dtype == value.dtype:
            return _CausalChunks.apply(query, key, value, chunk, scale)
    pos = torch.arange(n, device=query.device)
    gqa = key.shape[1] != query.shape[1]
    outs = []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        outs.append(F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, :e], value[:, :, :e],
                                                   attn_mask=pos[s:e, None] >= pos[None, :e],  # True: attend
                                                   scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


class _CausalChunks(torch.autograd.Function):
    """Causal attention in query chunks with a backward of plain products (CPU), for SignRound's steps.

    Forward: torch's CPU flash kernel per chunk (as ``causal_chunks``), keeping each row's logsumexp.
    Backward, chunk by chunk: the probabilities ``P = exp(S - lse)`` from the scores ``S = q k^T`` recomputed
    in float32, ``dV += P^T dO``, ``dS = P (dO V^T - rowsum(dO O))`` in float32, ``dQ = dS K`` and
    ``dK += dS^T Q`` (P, dS in the inputs' dtype for those products, float32 results summed over chunks).
    The query heads that share a key head are one product (``[batch, kv heads, group x chunk, dim]``).
    The flash kernel's own backward is 1.5x slower on an AMD EPYC core (SmolLM2, 4 x 9 heads x 512:
    72.5 against 48.9 ms; ``bench/signround_step.py --attention``), with the same precision (gradients
    within 3.2e-3 of float64's against its 4.7e-3): chosen by measurement (``sq.probe``)."""

    @staticmethod
    def forward(ctx, q, k, v, chunk: int, scale: float | None):
        n = q.shape[2]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        pos = torch.arange(n, device=q.device)
        outs, lses = [], []
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            hidden = torch.zeros(e - s, e, dtype=q.dtype, device=q.device)
            hidden.masked_fill_(pos[s:e, None] < pos[None, :e], float("-inf"))
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, s:e], k[:, :, :e], v[:, :, :e], attn_mask=hidden, scale=scale)
            outs.append(o)
            lses.append(lse)
        out = torch.cat(outs, dim=2)
        ctx.save_for_backward(q, k, v, out, torch.cat(lses, dim=2))
        ctx.chunk, ctx.scale = chunk, scale
        return out

    @staticmethod
    @torch.autocast("cpu", enabled=False)  # float32 where written, whatever the caller's autocast
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        (b, h, n, d), kv = q.shape, k.shape[1]
        g, c, scale = h // kv, ctx.chunk, ctx.scale
        qg, dog = q.reshape(b, kv, g, n, d), dout.reshape(b, kv, g, n, d)
        rowdot = (dog.float() * out.reshape(b, kv, g, n, d).float()).sum(-1)
        lse = lse.reshape(b, kv, g, n)
        dq = torch.empty_like(qg)
        dk = torch.zeros(b, kv, n, d, device=q.device)
        dv = torch.zeros(b, kv, n, d, device=q.device)
        pos = torch.arange(n, device=q.device)
        k32, v32 = k.float(), v.float()
        for s in range(0, n, c):
            e = min(n, s + c)
            qc = qg[:, :, :, s:e].reshape(b, kv, g * (e - s), d)
            doc = dog[:, :, :, s:e].reshape(b, kv, g * (e - s), d)
            S = (qc.float() @ k32[:, :, :e].transpose(-1, -2)).mul_(scale).view(b, kv, g, e - s, e)
            S[..., s:e].masked_fill_(pos[s:e, None] < pos[None, s:e], float("-inf"))
            P = S.sub_(lse[:, :, :, s:e, None]).exp_()
            dv[:, :, :e] += (P.to(q.dtype).view(b, kv, -1, e).transpose(-1, -2) @ doc).float()
            dP = (doc.float() @ v32[:, :, :e].transpose(-1, -2)).view(b, kv, g, e - s, e)
            dS = P.mul_(dP.sub_(rowdot[:, :, :, s:e, None])).mul_(scale).to(q.dtype).view(b, kv, -1, e)
            dq[:, :, :, s:e] = (dS @ k[:, :, :e]).view(b, kv, g, e - s, d)
            dk[:, :, :e] += (dS.transpose(-1, -2) @ qc).float()
        return dq.view(b, h, n, d), dk.to(k.dtype), dv.to(v.dtype), None, None


def attention_shape(model: nn.Module) -> tuple[int, int]:
    """``(heads, head_dim)`` of the model's (text) attention from its config (the largest over the layers where
    they vary by layer); ``(0, 0)`` if it names none."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = config_size(cfg, "num_attention_heads")
    if heads is None:
        return 0, 0
    dim = config_size(cfg, "head_dim")
    if dim is None:
        hidden = getattr(cfg, "hidden_size", None)
        dim = hidden // heads if isinstance(hidden, int) else 0
    return heads, dim


def use_sdpa(model: nn.Module, chunk: int | None, backward: str = "sdpa") -> None:
    """The model's attention: transformers' SDPA (``None`` mask == causal: calibration windows have no
    padding), in query chunks of ``chunk`` where given, with ``backward`` (``causal_chunks``) where a
    gradient flows.  Models that cannot take SDPA keep their own attention, unchunked."""
    global _chunk, _backward
    _chunk, _backward = None, backward
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
