"""transformers as the reference engine: the fp32 CPU model, perplexity, per-token log-probabilities, greedy steps.

``python -m sq.eval`` scores with these; ``sq.engines.compare`` puts them beside vLLM's.  Windows are
``[n, seqlen]`` token ids, each scored alone (no context carried over), logits in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sq.errors import SqError
from sq.formats.transforms import apply_online_transforms


# compressed-tensors 0.20 decompresses these formats to bfloat16 whatever the model's dtype, so a float32
# model fails its first forward ("expected m1 and m2 to have the same dtype"): such a checkpoint is
# scored in bfloat16 (docs/output.md, "Which engines load them").
BF16_FORMATS = frozenset({"nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized"})


def compute_dtype(source) -> torch.dtype:
    """float32, or bfloat16 for a checkpoint holding a format the library decompresses only to bfloat16."""
    import json
    from pathlib import Path

    config = Path(source) / "config.json"
    qc = json.loads(config.read_text()).get("quantization_config") or {} if config.is_file() else {}
    formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()}
    return torch.bfloat16 if formats & BF16_FORMATS else torch.float32


def load(spec: str, source, *, model: bool):
    """The tokenizer (or, with ``model``, the CPU model in ``compute_dtype``, the checkpoint's online transforms
    hooked on) of ``source``; a failure as one sq line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        if not model:
            return AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        m = AutoModelForCausalLM.from_pretrained(source, dtype=compute_dtype(source), device_map="cpu",
                                                 trust_remote_code=False, use_safetensors=True).eval()
    except (OSError, ValueError, KeyError) as e:
        reason = " ".join(str(e).split())  # one line per problem, as every sq error
        raise SqError(f"cannot load model {spec!r} ({source}): {reason}") from e
    apply_online_transforms(m, source)  # transformers ignores transform_config (sq.formats.transforms)
    return m


@torch.no_grad()
def perplexity(
    model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 4, progress: bool = False
) -> float:
    """exp(mean next-token NLL) of ``windows[n, seqlen]``, each window scored independently.

    Every window predicts its tokens 1..seqlen-1, so ``n * (seqlen - 1)`` tokens count.  The
    NLL sum is accumulated in float64 so the result does not depend on ``batch_size``
    beyond fp32 logit rounding.
    """
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise SqError(f"perplexity needs windows [n, seqlen >= 2], got shape {tuple(windows.shape)}")
    if batch_size < 1:
        raise SqError(f"batch size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    batches = list(torch.split(windows, batch_size))
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="perplexity", unit="batch")
    nll = 0.0
    count = 0
    for batch in batches:
        batch = batch.to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()  # [b, seqlen, vocab]
        pred = logits[:, :-1].reshape(-1, logits.shape[-1])  # [b*(seqlen-1), vocab]
        target = batch[:, 1:].reshape(-1)  # [b*(seqlen-1)]
        nll += F.cross_entropy(pred, target, reduction="sum").double().item()
        count += target.numel()
    return math.exp(nll / count)


def perplexity_from_logprobs(per_window: list[list[float]], what: str) -> float:
    """exp(-mean) of per-token log-probabilities (``token_logprobs``' rows, or vLLM's); ``what`` names the source."""
    values = [v for window in per_window for v in window]
    if not values:
        raise SqError(f"no tokens were scored for {what}")
    return math.exp(-math.fsum(values) / len(values))


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    """``[n, seqlen - 1]`` fp32 log-probabilities of every window's tokens 1.. given the tokens before."""
    device = next(model.parameters()).device
    out = []
    for batch in torch.split(windows, batch_size):
        batch = batch.to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
        out.append(logprobs.gather(-1, batch[:, 1:, None])[..., 0].cpu())
    return torch.cat(out)


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[dict]:
    """``new_tokens`` greedy steps after ``prompt`` (no stop on EOS), each ``{"token", "top": [[id, logprob] x2]}``.

    The top-2 log-probabilities (fp32 log-softmax of the step's logits) say how close each choice
    was, so a divergence from another engine can be told apart from a near-tie.
    """
    if not prompt:
        raise SqError("greedy decoding needs a non-empty prompt")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    past = None
    steps = []
    for _ in range(new_tokens):
        out = model(input_ids=ids if past is None else ids[:, -1:], cache=past, use_cache=True)
        past = out.cache
        logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        top = torch.topk(logprobs, 2)
        token = int(top.indices[0])
        steps.append({"token": token, "top": [[int(i), float(v)] for i, v in zip(top.indices, top.values)]})
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return steps
