"""Seeded random Hugging Face checkpoints with a real tokenizer: ``demo:tiny-moe`` and the test fixtures.

:func:`build_checkpoint` makes a model of any transformers ``model_type`` from a config under
``torch.manual_seed(seed)``, perturbs its constant tensors, and saves it as the Hub ships one
(sharded safetensors + index, ``config.json``, ``generation_config.json``) with a byte-level BPE
tokenizer trained on the ``builtin:pydoc`` corpus (:func:`build_tokenizer`).  The same seed,
config and versions give the same bytes.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path

import torch

from sq.calib.data import builtin_pydoc_text

logger = logging.getLogger(__name__)

BOS, EOS = "<s>", "</s>"


# ----------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train a byte-level BPE on the embedded corpus; cached so fixtures train once per size.

    Returns the serialized ``tokenizer.json`` (an immutable string, so the cache hands out no
    shared mutable object).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([builtin_pydoc_text()], trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"tokenizer trained to {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok.to_str()


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> Path:
    """Save a ``PreTrainedTokenizerFast`` (tokenizer.json + tokenizer_config.json) to ``out_dir``.

    Special tokens: ``<s>`` = id 0 (bos), ``</s>`` = id 1 (eos); byte-level, so no unknown token.
    ``vocab_size`` counts special tokens and the 256 byte symbols, so it must be > 258.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    tok = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.save_pretrained(out_dir)
    return out_dir


# ----------------------------------------------------------------------------- common build


def _perturb_constants(model: torch.nn.Module, seed: int) -> None:
    """Add noise to every constant float tensor (norms = 1, biases = 0, router biases = 0).

    Persistent buffers are included (they are checkpoint tensors too); a separate generator
    keeps the init stream of transformers untouched.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    seen: set[int] = set()
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            if id(tensor) in seen or not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            seen.add(id(tensor))
            first = tensor.reshape(-1)[0]
            if not bool((tensor == first).all()):
                continue
            scale = 0.1 if float(first) != 0.0 else 0.02
            noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32) * scale
            tensor.add_(noise.to(tensor.dtype))


def _state_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def build_checkpoint(
    out_dir: Path,
    model_type: str,
    config: dict,
    *,
    seed: int,
    dtype: torch.dtype,
    shards: int,
    image_text: bool = False,
    save_original_format: bool = True,
    tokenizer_vocab_size: int | None = None,
) -> tuple[Path, object]:
    """Random model from a config -> sharded safetensors + tokenizer; returns (dir, config)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **config)
    auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=dtype)
    _perturb_constants(model, seed)
    # transformers fills shards greedily up to max_shard_size, so total/shards gives
    # about `shards` files (a single tensor bigger than the limit gets its own file).
    max_shard = max(1, math.ceil(_state_bytes(model) / max(1, shards)))
    save_any_rank(model, out_dir, max_shard_size=max_shard, save_original_format=save_original_format)
    text_cfg = cfg.get_text_config()
    build_tokenizer(out_dir, tokenizer_vocab_size or text_cfg.vocab_size)
    logger.debug("built a random %s checkpoint in %s", model_type, out_dir)
    return out_dir, cfg


def save_any_rank(model, out_dir: Path, **kwargs) -> None:
    """``model.save_pretrained(out_dir, **kwargs)`` from whichever process calls it: under an initialized
    process group transformers 5 writes nothing on a rank other than 0 and says nothing
    (``should_save_on_this_rank``), and a demo or fixture built under a job's lock may be built by any rank."""
    model.should_save_on_this_rank = lambda is_main_process: True  # (an instance attribute: this model only)
    try:
        model.save_pretrained(out_dir, **kwargs)
    finally:
        del model.should_save_on_this_rank
    if not (Path(out_dir) / "config.json").is_file():
        raise RuntimeError(f"{out_dir}: save_pretrained wrote no config.json")
