"""``--model`` specs -> a local checkpoint folder: ``demo:NAME``, a local folder, or a hub id.

    path = resolve_model_dist(spec)   # on every rank, after init_distributed, before other collectives

Local folders and ``demo:NAME`` (``sq.demo``) resolve on every rank with no collective
(:func:`resolve_model`); a hub id is downloaded by rank 0 alone (:func:`sq.hub.download_model`)
while the others wait, and every rank then gets the same path or raises the same ``SqError``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

from sq.demo import DEMO_PREFIX, demo_path
from sq.dist import run_on_rank0
from sq.errors import SqError
from sq.hub import Downloader, download_model

__all__ = ["resolve_model", "resolve_model_dist"]


def resolve_model(
    spec: str, *, cache_dir: Path | None = None, environ: Mapping[str, str] = os.environ
) -> Path | str:
    """Turn a ``--model`` argument into something ``from_pretrained`` accepts.

    Returns:
        - ``Path`` of the cached checkpoint for ``demo:NAME`` (built on first use);
        - ``Path`` of an existing local directory;
        - the ``str`` unchanged otherwise: the caller treats it as a Hugging Face hub id.

    Raises:
        SqError: unknown demo name (listing the known ones), a path-like spec (absolute,
            ``./``, ``../``, ``~``) that is not a directory, or a failed demo build.
    """
    if spec.startswith(DEMO_PREFIX):
        return demo_path(spec, cache_dir=cache_dir, environ=environ)
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise SqError(f"model {spec!r} is a file; expected a checkpoint directory, a hub id or demo:NAME")
    if spec.startswith(("/", "./", "../", "~")):
        raise SqError(f"model directory {spec} does not exist")
    return spec


def resolve_model_dist(
    spec: str,
    *,
    cache_dir: Path | None = None,
    environ: Mapping[str, str] = os.environ,
    download: Downloader | None = None,
    poll_s: float = 1.0,
) -> Path:
    """The local checkpoint folder of a ``--model`` spec, the same on every rank.

    Call it on every rank at the same point.  ``cache_dir`` / ``environ`` are passed to
    :func:`resolve_model` (demo cache); ``download`` replaces
    ``huggingface_hub.snapshot_download`` (tests).  Without a process group (or at world
    size 1) it is a plain call.

    Raises:
        SqError: on every rank, with rank 0's message: offline or unreachable hub, unknown
            or gated repo, no safetensors weights, or a snapshot some rank cannot see.
    """
    source = resolve_model(spec, cache_dir=cache_dir, environ=environ)
    if isinstance(source, Path):
        return source
    path = Path(run_on_rank0(lambda: str(download_model(source, download=download)),
                             what=f"downloading hub model {spec!r}", poll_s=poll_s))
    _check_every_rank_sees(spec, path)
    return path


def _check_every_rank_sees(spec: str, path: Path) -> None:
    """Rank 0 downloaded to its own disk: every rank must see the folder (a shared filesystem)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, path.is_dir())
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise SqError(f"hub model {spec!r}: rank 0 downloaded it to {path}, which rank(s) {blind} cannot see; put the "
                      "Hugging Face cache (HF_HOME) on a filesystem every node shares, or download it once and pass "
                      "the folder to --model")
