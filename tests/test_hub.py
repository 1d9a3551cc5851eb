"""sq.hub and sq.resolve.resolve_model_dist: a hub id is downloaded by rank 0 alone (config, tokenizer, safetensors; never pickle),
every rank gets the same folder or the same error."""

from __future__ import annotations

import json
import shutil
import time
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch.distributed as dist

from sq.resolve import resolve_model_dist
from sq.dist import run_on_rank0
from sq.errors import SqError

from harness import run_ranks

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
WANTED = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json", *SHARDS]  # fmt: skip
# what a hub repo also holds and sq must not fetch: pickle weights, a second weight layout, docs
UNWANTED = ["pytorch_model.bin", "pytorch_model.bin.index.json", "training_args.bin", "consolidated.safetensors",
            "original/consolidated.00.pth", "optimizer.pt", "README.md", "params.json"]  # fmt: skip
PICKLES = [f for f in UNWANTED if f.endswith((".bin", ".pt", ".pth"))]
SNAPSHOT = "snapshots/0123456789abcdef"


def make_repo(root: Path, files=WANTED + UNWANTED, index=SHARDS) -> Path:
    """A folder laid out like a hub repo (contents are placeholders; sq reads only the index)."""
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"placeholder {name}\n")
    if "model.safetensors.index.json" in files:
        weight_map = {f"model.layers.{i}.weight": shard for i, shard in enumerate(index)}
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


class FakeSnapshotDownload:
    """Stands in for ``huggingface_hub.snapshot_download`` (no hub is reachable here).

    Copies the files of a local repo folder that the patterns select (``fnmatch`` on the
    relative path, as huggingface_hub filters) into one snapshot folder, and logs each call.
    """

    def __init__(self, repo: Path, cache: Path, delay_s: float = 0.0):
        self.repo, self.cache, self.delay_s, self.calls = repo, cache, delay_s, []

    def __call__(self, repo_id, *, allow_patterns=None, ignore_patterns=None, **kwargs):
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.calls.append(dict(rank=rank, repo_id=repo_id, allow=allow_patterns, ignore=ignore_patterns, kwargs=kwargs))
        time.sleep(self.delay_s)  # the other ranks wait through several polls
        snapshot = self.cache / SNAPSHOT
        for src in sorted(p for p in self.repo.rglob("*") if p.is_file()):
            rel = src.relative_to(self.repo).as_posix()
            if any(fnmatch(rel, p) for p in allow_patterns) and not any(fnmatch(rel, p) for p in ignore_patterns):
                (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, snapshot / rel)
        return str(snapshot)


def files_under(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def assert_no_pickle_requested(calls: list[dict]) -> None:
    for call in calls:
        assert all(p in call["ignore"] for p in ("*.bin", "*.pt", "*.pth"))
        requested = [f for f in PICKLES if any(fnmatch(f, p) for p in call["allow"])]
        assert not requested, f"pickle files requested: {requested}"


# ----------------------------------------------------------------------------- 2 ranks


def _resolve_from_fake_hub(rank, world, repo, cache):
    fake = FakeSnapshotDownload(Path(repo), Path(cache), delay_s=0.3)
    path = resolve_model_dist("sq-test/tiny-llama", download=fake, poll_s=0.05)
    return str(path), fake.calls


def test_rank0_downloads_and_every_rank_gets_the_folder(tmp_path):
    repo, cache = make_repo(tmp_path / "repo"), tmp_path / "cache"
    results = run_ranks(_resolve_from_fake_hub, 2, str(repo), str(cache), timeout=120)
    (path0, calls0), (path1, calls1) = results
    assert path0 == path1 == str(cache / SNAPSHOT)
    assert calls1 == []  # rank 1 never touched the hub
    assert [c["rank"] for c in calls0] == [0, 0] and {c["repo_id"] for c in calls0} == {"sq-test/tiny-llama"}
    first, second = calls0
    assert set(WANTED) - set(SHARDS) <= set(first["allow"])  # config, generation config, tokenizer, index
    assert second["allow"] == SHARDS  # then exactly the shards the index names
    assert all(c["kwargs"] == {} for c in calls0)
    assert_no_pickle_requested(calls0)
    assert files_under(Path(path0)) == sorted(WANTED)  # no .bin, no consolidated.safetensors, no README


def _resolve_offline(rank, world):
    try:
        resolve_model_dist("sq-test/not-cached", poll_s=0.05)
    except SqError as e:
        return type(e).__name__, str(e)
    return None


def test_offline_fails_with_the_same_line_on_every_rank(tmp_path, monkeypatch):
    # the ranks are spawned with this environment, so the real huggingface_hub starts offline there
    # (not forked from the harness's forkserver, which imported it online)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.chdir(tmp_path)  # no local folder of that name
    message = ("hub model 'sq-test/not-cached': not (completely) in the local Hugging Face cache and downloads are "
               "off (HF_HUB_OFFLINE=1); pass a local checkpoint folder to --model instead")  # fmt: skip
    assert run_ranks(_resolve_offline, 2, timeout=120, start="spawn") == [("SqError", message)] * 2


def _crash_on_rank0(rank, world):
    def work():
        raise RuntimeError("disk on fire")

    try:
        run_on_rank0(work, what="the work", poll_s=0.05)
    except Exception as e:  # noqa: BLE001 - the test compares what each rank saw
        return type(e).__name__, str(e)
    return None


def test_a_crash_on_rank0_reaches_every_rank():
    assert run_ranks(_crash_on_rank0, 2, timeout=120) == [
        ("RuntimeError", "disk on fire"), ("DistError", "the work failed on rank 0: RuntimeError: disk on fire")]


# ----------------------------------------------------------------------------- one process


def test_local_folders_and_demo_specs_never_reach_the_hub(tmp_path, monkeypatch):
    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    assert resolve_model_dist(str(tmp_path), download=no_hub) == tmp_path
    from sq import demo

    monkeypatch.setitem(demo.DEMOS, "fake", lambda out: (out / "config.json").write_text("{}"))
    path = resolve_model_dist("demo:fake", cache_dir=tmp_path / "cache", download=no_hub)
    assert (path / "config.json").is_file()
    with pytest.raises(SqError, match="does not exist"):
        resolve_model_dist(str(tmp_path / "missing"), download=no_hub)


def test_a_single_file_checkpoint_takes_one_call(tmp_path):
    repo = make_repo(tmp_path / "repo", files=["config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin"])
    fake = FakeSnapshotDownload(repo, tmp_path / "cache")
    path = resolve_model_dist("sq-test/single", download=fake)
    assert len(fake.calls) == 1 and files_under(path) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert_no_pickle_requested(fake.calls)


def test_a_pickle_only_repo_is_refused(tmp_path):
    repo = make_repo(tmp_path / "repo", files=["config.json", "tokenizer.json", "pytorch_model.bin"])
    fake = FakeSnapshotDownload(repo, tmp_path / "cache")
    with pytest.raises(SqError, match=r"hub model 'sq-test/old' has no safetensors weights .* sq never downloads "
                       r"pickle \(.bin\) checkpoints"):  # fmt: skip
        resolve_model_dist("sq-test/old", download=fake)
    assert_no_pickle_requested(fake.calls)
    assert not (tmp_path / "cache" / SNAPSHOT / "pytorch_model.bin").exists()


@pytest.mark.parametrize("shard", ["../outside.safetensors", "pytorch_model-00001-of-00002.bin"])
def test_an_index_naming_other_files_is_refused(tmp_path, shard):
    repo = make_repo(tmp_path / "repo", index=[SHARDS[0], shard])
    with pytest.raises(SqError, match=r"names no weight files or ones outside its folder or not .safetensors"):
        resolve_model_dist("sq-test/odd", download=FakeSnapshotDownload(repo, tmp_path / "cache"))


def test_a_missing_shard_is_named(tmp_path):
    repo = make_repo(tmp_path / "repo", files=[f for f in WANTED if f != SHARDS[1]])
    with pytest.raises(SqError, match=rf"1 weight file\(s\) named in model.safetensors.index.json did not arrive .* "
                       rf"\(first: {SHARDS[1]}\)"):  # fmt: skip
        resolve_model_dist("sq-test/partial", download=FakeSnapshotDownload(repo, tmp_path / "cache"))


@pytest.mark.parametrize("offline", [False, True])
def test_an_unreachable_hub_names_the_id(monkeypatch, offline):
    from huggingface_hub.errors import LocalEntryNotFoundError

    import sq.hub

    monkeypatch.setattr(sq.hub, "hub_offline", lambda: offline)

    def unreachable(repo_id, **kwargs):
        raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub")

    with pytest.raises(SqError) as info:
        resolve_model_dist("sq-test/far", download=unreachable)
    if offline:
        assert "not (completely) in the local Hugging Face cache and downloads are off (HF_HUB_OFFLINE=1)" in str(info.value)
    else:
        assert str(info.value) == (
            "hub model 'sq-test/far': cannot reach the Hugging Face hub and it is not in the local cache "
            "(LocalEntryNotFoundError: An error happened while trying to locate the files on the Hub); "
            "pass a local checkpoint folder to --model instead")


def test_an_invalid_hub_id_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SqError, match=r"model 'a/b/c' is neither a local folder nor a valid hub id"):
        resolve_model_dist("a/b/c")  # the real snapshot_download: it validates the id before any request
