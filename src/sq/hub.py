"""Hugging Face hub ids as ``--model``: rank 0 downloads the safetensors checkpoint, every rank gets its path.

    path = resolve_model_dist(spec)   # on every rank, after init_distributed, before other collectives

Local folders and ``demo:NAME`` resolve as in :func:`sq.demo.resolve_model`, on every rank,
with no collective.  A hub id is fetched by rank 0 alone with ``huggingface_hub.snapshot_download``
into the Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``), in two steps:

1. ``config.json``, ``generation_config.json``, the tokenizer files, and
   ``model.safetensors.index.json`` or a single ``model.safetensors``;
2. exactly the shard files the index names.

Only those files: never pickle weights (``*.bin``, ``*.pt``, ... are also passed as
``ignore_patterns``), and never a second copy of the weights in another layout (Mistral repos
ship ``consolidated.safetensors`` next to the shards; DCP's reader would take every
``*.safetensors`` in the folder).  Offline (``HF_HUB_OFFLINE=1``) a complete cached snapshot is
used as is.  Every rank then gets the same path or raises the same ``SqError``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from sq.dist import broadcast_object
from sq.errors import DistError, SqError
from sq.load.source import INDEX_NAME, SIDE_FILES, SINGLE_NAME

logger = logging.getLogger(__name__)

T = TypeVar("T")

# config.json and what transformers reads next to the weights (SIDE_FILES: generation config,
# every tokenizer format it knows, the same list sq copies into its output); none of these is pickle.
METADATA_PATTERNS = ("config.json", *SIDE_FILES, INDEX_NAME, SINGLE_NAME)
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt")

Downloader = Callable[..., str]  # huggingface_hub.snapshot_download's signature


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
    :func:`sq.demo.resolve_model` (demo cache); ``download`` replaces
    ``huggingface_hub.snapshot_download`` (tests).  Without a process group (or at world
    size 1) it is a plain call.

    Raises:
        SqError: on every rank, with rank 0's message: offline or unreachable hub, unknown
            or gated repo, no safetensors weights, or a snapshot some rank cannot see.
    """
    from sq.demo import resolve_model

    source = resolve_model(spec, cache_dir=cache_dir, environ=environ)
    if isinstance(source, Path):
        return source
    path = Path(run_on_rank0(lambda: str(download_model(source, download=download)),
                             what=f"downloading hub model {spec!r}", poll_s=poll_s))
    _check_every_rank_sees(spec, path)
    return path


def download_model(repo_id: str, *, download: Downloader | None = None) -> Path:
    """Fetch ``repo_id``'s config, tokenizer and safetensors weights (this process only); its folder."""
    if download is None:
        from huggingface_hub import snapshot_download as download
    logger.info("downloading hub model %s (config, tokenizer, safetensors weights)", repo_id)
    folder = _fetch(download, repo_id, METADATA_PATTERNS)
    if not (folder / "config.json").is_file():
        raise SqError(f"hub model {repo_id!r} has no config.json; pass a local checkpoint folder to --model instead")
    if (folder / INDEX_NAME).is_file():
        shards = index_shards(folder / INDEX_NAME, repo_id)
        again = _fetch(download, repo_id, shards)
        if again.resolve() != folder.resolve():
            raise SqError(f"hub model {repo_id!r} changed during the download ({folder} then {again}); run again")
    elif (folder / SINGLE_NAME).is_file():
        shards = [SINGLE_NAME]
    else:
        raise SqError(f"hub model {repo_id!r} has no safetensors weights ({INDEX_NAME} or {SINGLE_NAME}); sq never "
                      "downloads pickle (.bin) checkpoints: convert it to safetensors and pass the folder to --model")
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise SqError(f"hub model {repo_id!r}: {len(missing)} weight file(s) named in {INDEX_NAME} did not arrive "
                      f"in {folder} (first: {missing[0]})")
    logger.info("hub model %s is in %s", repo_id, folder)
    return folder


def index_shards(index: Path, repo_id: str) -> list[str]:
    """The shard files ``index``'s weight map names: plain ``.safetensors`` names in its folder."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SqError(f"hub model {repo_id!r}: {index} is not a safetensors index ({e})") from e
    bad = [n for n in names if not isinstance(n, str) or n != Path(n).name or not n.endswith(".safetensors")]
    if bad or not names:
        raise SqError(f"hub model {repo_id!r}: {index} names no weight files or ones outside its folder "
                      f"or not .safetensors: {bad[:3]}")
    return names


def hub_offline() -> bool:
    """Whether huggingface_hub was told to stay offline (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    from huggingface_hub import constants

    is_offline = getattr(constants, "is_offline_mode", None)
    return bool(is_offline() if is_offline is not None else constants.HF_HUB_OFFLINE)


def run_on_rank0(fn: Callable[[], T], *, what: str, poll_s: float = 1.0) -> T:
    """``fn()`` on rank 0 only; every rank returns its result, or raises an error with its message.

    The other ranks wait in a series of short broadcasts (one per ``poll_s``) rather than
    one long one, so a download of hours never meets the collective timeout; rank 0 runs
    ``fn`` in a thread meanwhile.  ``fn``'s result must be picklable.  An ``SqError`` from
    ``fn`` is raised on every rank with the same problems; any other exception is re-raised
    on rank 0 and reported as a ``DistError`` on the others.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    if dist.get_rank() != 0:
        while (outcome := broadcast_object(None)) is None:
            pass
        kind, payload = outcome
        if kind == "ok":
            return payload
        raise SqError(payload) if kind == "refused" else DistError(payload)

    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["ok"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which re-raises it
            box["error"] = e

    thread = threading.Thread(target=work, name=f"sq rank 0: {what}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=poll_s)
        if thread.is_alive():
            broadcast_object(None)  # "still working": keeps every rank inside short collectives
    error = box.get("error")
    if error is None:
        broadcast_object(("ok", box["ok"]))
        return box["ok"]
    if isinstance(error, SqError):
        broadcast_object(("refused", error.problems))
    else:
        broadcast_object(("crashed", f"{what} failed on rank 0: {type(error).__name__}: {error}"))
    raise error


def _fetch(download: Downloader, repo_id: str, patterns) -> Path:
    try:
        folder = download(repo_id, allow_patterns=list(patterns), ignore_patterns=list(PICKLE_PATTERNS))
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one line naming the id
        raise SqError(_download_problem(repo_id, e)) from e
    return Path(folder)


def _download_problem(repo_id: str, e: Exception) -> str:
    from huggingface_hub import errors

    instead = "pass a local checkpoint folder to --model instead"
    reason = " ".join(str(e).split())[:300]
    if _caused_by(e, errors.OfflineModeIsEnabled) or (isinstance(e, errors.LocalEntryNotFoundError) and hub_offline()):
        return (f"hub model {repo_id!r}: not (completely) in the local Hugging Face cache and downloads are off "
                f"(HF_HUB_OFFLINE=1); {instead}")
    if isinstance(e, errors.GatedRepoError):
        return f"hub model {repo_id!r} is gated: accept its terms on the hub and log in (hf auth login), or {instead}"
    if isinstance(e, errors.RepositoryNotFoundError):
        return f"hub model {repo_id!r} not found on the hub (or private: log in with hf auth login); {instead}"
    if isinstance(e, errors.LocalEntryNotFoundError) or _caused_by(e, ConnectionError, TimeoutError):
        return (f"hub model {repo_id!r}: cannot reach the Hugging Face hub and it is not in the local cache "
                f"({type(e).__name__}: {reason}); {instead}")
    if isinstance(e, errors.HFValidationError):
        return f"model {repo_id!r} is neither a local folder nor a valid hub id ({reason})"
    return f"hub model {repo_id!r}: download failed ({type(e).__name__}: {reason}); {instead}"


def _caused_by(e: BaseException | None, *types: type) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, types):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


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
