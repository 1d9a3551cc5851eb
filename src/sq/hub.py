"""Hugging Face hub models: download one safetensors checkpoint (this process), and the hub's offline switch.

    folder = download_model(repo_id)   # rank 0 only: sq.resolve.resolve_model_dist shares it

``huggingface_hub.snapshot_download`` fetches into the Hugging Face cache (``HF_HOME`` /
``HF_HUB_CACHE``), in two steps:

1. ``config.json``, ``generation_config.json``, the tokenizer files, and
   ``model.safetensors.index.json`` or a single ``model.safetensors``;
2. exactly the shard files the index names.

Only those files: never pickle weights (``*.bin``, ``*.pt``, ... are also passed as
``ignore_patterns``), and never a second copy of the weights in another layout (Mistral repos
ship ``consolidated.safetensors`` next to the shards; DCP's reader would take every
``*.safetensors`` in the folder).  Offline (``HF_HUB_OFFLINE=1``) a complete cached snapshot is
used as is.  Every failure is one ``SqError`` line naming the id.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from sq.errors import SqError
from sq.files import INDEX_NAME, SIDE_FILES, SINGLE_NAME

logger = logging.getLogger(__name__)

# config.json and what transformers reads next to the weights (SIDE_FILES: generation config,
# every tokenizer format it knows, the same list sq copies into its output); none of these is pickle.
METADATA_PATTERNS = ("config.json", *SIDE_FILES, INDEX_NAME, SINGLE_NAME)
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt")

Downloader = Callable[..., str]  # huggingface_hub.snapshot_download's signature


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
