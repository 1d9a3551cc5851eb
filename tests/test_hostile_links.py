"""Links and remote code (issue 15, items 2, 5 and 6).

- A checkpoint file that is a symbolic link leaving the folder (``chat_template.jinja`` ->
  ``/etc/passwd``, a shard -> a file elsewhere) is refused at scan time, naming the file and where
  it points, before the output folder is touched: its content never reaches the output.
- A link to a file inside the checkpoint folder is fine: its content is part of the folder the
  user handed over (the output gets a plain copy).
- The Hugging Face hub cache's own layout, ``models--ORG--NAME/snapshots/REV/FILE`` ->
  ``../../blobs/HASH``, is accepted: ``--model org/name`` offline, and the snapshot folder as a
  path, quantize end to end.  Links that only look like it are refused.
- ``auto_map`` in tokenizer_config.json (custom tokenizer code) is refused by sq.ptq (every
  algorithm) and sq.eval, as config.json's is.

The refusal rows hold to ``hostile.run_hostile``'s contract at 1 and 2 ranks, and also check that
the secret's bytes appear nowhere under the output folder.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from harness import run_cli, run_torchrun
from hostile import Hostile, run_hostile, snapshot
from sq.errors import SqError
from sq.export.writer import copy_side_files
from sq.files import SIDE_FILES
from sq.load import source as source_mod
from sq.load.meta import tokenizer_problems
from sq.load.source import link_problem, open_checked, scan_checkpoint

GS = "32"
RTN = ["--algo", "rtn", "--scheme", "W4A16", "--group-size", GS]
GPTQ = ["--algo", "gptq", "--scheme", "W4A16", "--group-size", GS, "--nsamples", "4", "--seqlen", "16"]
EVAL = ["--seqlen", "16", "--nwindows", "2"]
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- sq-test-secret-4f1c9a -----END OPENSSH PRIVATE KEY-----\n"
REV = "0123456789abcdef0123456789abcdef01234567"


def _copy(ck, tmp: Path) -> Path:
    return Path(shutil.copytree(ck["llama"], tmp / "ckpt"))


def _secret(tmp: Path, data: bytes = SECRET, name: str = "id_ed25519") -> Path:
    (tmp / "private").mkdir(exist_ok=True)
    p = tmp / "private" / name
    p.write_bytes(data)
    return p.resolve()


def _no_secret_in(out: Path, secret: bytes = SECRET):
    """check_after: nothing under ``out`` holds the secret's bytes (and no file was written at all)."""

    def check(tmp):
        written = [p for p in out.rglob("*") if p.is_file()] if out.is_dir() else []
        leaked = [str(p) for p in written if secret in p.read_bytes()]
        assert not leaked, f"the linked file's content reached the output: {leaked}"
        assert not written, f"a refusal wrote into the output folder: {written}"

    return check


def _link_out(tmp: Path, ck, name: str, *, module: str = "sq.ptq", target: Path | None = None) -> Hostile:
    """``name`` in a copy of the llama fixture replaced by a link to a file outside the folder."""
    src = _copy(ck, tmp)
    target = target or _secret(tmp)
    (src / name).unlink(missing_ok=True)
    (src / name).symlink_to(target)
    out = tmp / "out"
    argv = ["--model", str(src), *(["--output", str(out), *RTN] if module == "sq.ptq" else EVAL)]
    pattern = (rf"{re.escape(str(src / name))} is a symbolic link to {re.escape(str(target))}, "
               rf"outside the checkpoint folder")
    secret = target.read_bytes() if target.stat().st_size < 1 << 20 else SECRET
    return Hostile(argv, pattern, protect=[src, target], module=module, check_after=_no_secret_in(out, secret))


def chat_template_outside(tmp, ck):
    return _link_out(tmp, ck, "chat_template.jinja")


def merges_outside(tmp, ck):
    return _link_out(tmp, ck, "merges.txt")


def tokenizer_json_outside(tmp, ck):
    return _link_out(tmp, ck, "tokenizer.json")


def shard_outside(tmp, ck):
    """A real shard kept elsewhere (quantizing it worked silently before: no corrupt header to trip on)."""
    shard = sorted(ck["llama"].glob("*.safetensors"))[1]
    return _link_out(tmp, ck, shard.name, target=_secret(tmp, shard.read_bytes(), "elsewhere.safetensors"))


def config_outside(tmp, ck):
    """A valid config.json kept elsewhere (read before the scan, by the model skeleton)."""
    return _link_out(tmp, ck, "config.json",
                     target=_secret(tmp, (ck["llama"] / "config.json").read_bytes(), "config.json"))


def eval_chat_template_outside(tmp, ck):
    return _link_out(tmp, ck, "chat_template.jinja", module="sq.eval")


def _auto_map(tmp: Path, ck, module: str, extra: list[str]) -> Hostile:
    src = _copy(ck, tmp)
    p = src / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    p.write_text(json.dumps(cfg))
    out = tmp / "out"
    argv = ["--model", str(src), *(["--output", str(out)] if module == "sq.ptq" else []), *extra]
    pattern = (rf"{re.escape(str(p))} has auto_map \['AutoTokenizer'\]: the checkpoint's tokenizer needs its own "
               r"Python code, which sq does not run")
    return Hostile(argv, pattern, protect=[src], module=module, check_after=_no_secret_in(out))


def auto_map_gptq(tmp, ck):
    return _auto_map(tmp, ck, "sq.ptq", GPTQ)


def auto_map_rtn(tmp, ck):
    return _auto_map(tmp, ck, "sq.ptq", RTN)


def auto_map_eval(tmp, ck):
    return _auto_map(tmp, ck, "sq.eval", EVAL)


CASES = {f.__name__: f for f in (chat_template_outside, merges_outside, tokenizer_json_outside, shard_outside,
                                 config_outside, eval_chat_template_outside,
                                 auto_map_gptq, auto_map_rtn, auto_map_eval)}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_refused(case, world, tmp_path, checkpoints):
    run_hostile(CASES[case](tmp_path, checkpoints), world, tmp_path)


# ---------------------------------------------------------------- the rule, in one process


def hub_cache(src: Path, cache: Path, repo_id: str = "org/name", rev: str = REV) -> Path:
    """``src``'s files laid out as huggingface_hub caches them; returns the snapshot folder.

    ``models--ORG--NAME/blobs/SHA256`` holds each file, ``snapshots/REV/NAME`` is a relative link
    ``../../blobs/SHA256`` to it, ``refs/main`` names the revision.
    """
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / sha)
        (snap / f.name).symlink_to(f"../../blobs/{sha}")
    return snap


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "a-shard", *SIDE_FILES])
def test_every_file_sq_reads_is_checked_at_scan_time(checkpoints, tmp_path, name):
    """The rows above through the command line; here every name, in one process: named, never opened."""
    src = _copy(checkpoints, tmp_path)
    if name == "a-shard":
        name = sorted(src.glob("*.safetensors"))[1].name
    secret = _secret(tmp_path)
    (src / name).unlink(missing_ok=True)
    (src / name).symlink_to(secret)
    problems = scan_checkpoint(src).problems
    assert f"{src / name} is a symbolic link to {secret}, outside the checkpoint folder" in "\n".join(problems)
    assert not any(SECRET.decode().strip() in p for p in problems)


def test_hub_snapshot_scans_clean_and_reads_the_checked_blobs(checkpoints, tmp_path):
    snap = hub_cache(checkpoints["llama"], tmp_path / "hub")
    src = scan_checkpoint(snap)
    assert src.problems == [] and src.tensors
    blobs = (snap.parent.parent / "blobs").resolve()
    assert all(src.path(f).parent == blobs for f in src.files)  # reads go to the checked targets
    assert tokenizer_problems(snap, trust_remote_code=False) == []
    out = tmp_path / "out"
    out.mkdir()
    copied = copy_side_files(snap, out)
    assert "tokenizer.json" in copied
    for name in copied:  # plain files with the blob's bytes, never links
        assert not (out / name).is_symlink() and (out / name).read_bytes() == (snap / name).read_bytes()


@pytest.mark.parametrize("how", ["not_a_hash", "other_repo", "other_snapshot", "blobs_is_a_link", "not_models",
                                 "absolute_outside"])
def test_links_that_only_look_like_the_hub_cache_are_refused(checkpoints, tmp_path, how):
    snap = hub_cache(checkpoints["llama"], tmp_path / "hub")
    repo = snap.parent.parent
    name = "chat_template.jinja"
    secret = _secret(tmp_path)
    if how == "not_a_hash":  # a blob-folder file whose name is not a sha1/sha256
        shutil.copyfile(secret, repo / "blobs" / "id_ed25519")
        (snap / name).symlink_to("../../blobs/id_ed25519")
    elif how == "other_repo":  # another cached repo's blob
        other = hub_cache(checkpoints["llama"], tmp_path / "hub", "org/other")
        sha = hashlib.sha256(SECRET).hexdigest()
        (other.parent.parent / "blobs" / sha).write_bytes(SECRET)
        (snap / name).symlink_to(f"../../../models--org--other/blobs/{sha}")
    elif how == "other_snapshot":  # a file of another revision's folder, not a blob
        (repo / "snapshots" / "old").mkdir()
        shutil.copyfile(secret, repo / "snapshots" / "old" / name)
        (snap / name).symlink_to(f"../old/{name}")
    elif how == "blobs_is_a_link":  # the whole blobs folder pointing elsewhere
        hidden = tmp_path / "hidden"
        hidden.mkdir()
        sha = hashlib.sha256(SECRET).hexdigest()
        (hidden / sha).write_bytes(SECRET)
        shutil.rmtree(repo / "blobs")
        (repo / "blobs").symlink_to(hidden)
        (snap / name).symlink_to(f"../../blobs/{sha}")
    elif how == "not_models":  # the same shape under a folder that is no hub-cache repo
        fake = tmp_path / "notacache" / "snapshots" / REV
        fake.parent.parent.joinpath("blobs").mkdir(parents=True)
        shutil.copytree(snap, fake, symlinks=True)
        sha = hashlib.sha256(SECRET).hexdigest()
        (fake.parent.parent / "blobs" / sha).write_bytes(SECRET)
        (fake / name).symlink_to(f"../../blobs/{sha}")
        snap = fake
    else:
        (snap / name).symlink_to(secret)
    problems = scan_checkpoint(snap).problems
    assert any(p.startswith(f"{snap / name} is a symbolic link to ") and "outside the checkpoint folder" in p
               for p in problems), problems
    with pytest.raises(SqError, match="outside the checkpoint folder"):
        open_checked(snap, name)


def test_a_link_inside_the_folder_is_read_and_copied_as_a_file(checkpoints, tmp_path):
    """Decided: fine.  The target is part of the folder the user handed over, so nothing leaks."""
    src = _copy(checkpoints, tmp_path)
    (src / "extra").mkdir()
    (src / "extra" / "template.jinja").write_text("{{ messages }}")
    (src / "chat_template.jinja").symlink_to("extra/template.jinja")
    (src / "merges.txt").symlink_to(src / "extra" / "template.jinja")  # absolute, still inside
    assert scan_checkpoint(src).problems == []
    out = tmp_path / "out"
    out.mkdir()
    copied = copy_side_files(src, out)
    assert {"chat_template.jinja", "merges.txt"} <= set(copied)
    copy = out / "chat_template.jinja"
    assert copy.read_text() == "{{ messages }}" and not copy.is_symlink()
    # ...but a link inside the folder to a folder that is itself a link outside resolves outside
    (src / "away").symlink_to(tmp_path / "private", target_is_directory=True)
    _secret(tmp_path)
    (src / "vocab.txt").symlink_to("away/id_ed25519")
    assert link_problem(src, "vocab.txt") is not None


def test_a_link_swapped_in_after_the_check_is_not_followed(checkpoints, tmp_path, monkeypatch):
    """open_checked opens with O_NOFOLLOW and checks what it opened (/proc/self/fd), so a file that
    became a link after link_problem looked at it is refused, not read."""
    src = _copy(checkpoints, tmp_path)
    (src / "merges.txt").symlink_to(_secret(tmp_path))
    monkeypatch.setattr(source_mod, "link_problem", lambda root, name: None)  # the check saw a plain file
    with pytest.raises(SqError, match=r"merges.txt was opened as .*id_ed25519, outside the checkpoint folder"):
        open_checked(src, "merges.txt")


def test_side_files_are_one_list():
    import sq.export.writer as writer
    import sq.hub as hub
    import sq.load.source as source

    assert writer.SIDE_FILES is SIDE_FILES and source.SIDE_FILES is SIDE_FILES  # imported from sq.files
    assert set(SIDE_FILES) | {"config.json"} <= set(hub.METADATA_PATTERNS)
    assert "vocab.txt" in SIDE_FILES and "config.json" not in SIDE_FILES


def test_tokenizer_auto_map_is_allowed_only_with_the_flag(checkpoints, tmp_path):
    src = _copy(checkpoints, tmp_path)
    p = src / "tokenizer_config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), "auto_map": ["tokenization_x.X", None]}))
    assert tokenizer_problems(src, trust_remote_code=False)
    assert tokenizer_problems(src, trust_remote_code=True) == []
    p.write_text("[1, 2]")  # not an object: left to the tokenizer's own loader, no crash here
    assert tokenizer_problems(src, trust_remote_code=False) == []


# ---------------------------------------------------------------- the hub cache, end to end


def _shards(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def hub_runs(checkpoints, tmp_path_factory) -> dict:
    """The llama fixture as a hub-cache snapshot, quantized at 2 ranks as ``--model org/name``
    (offline) and as the snapshot folder's path."""
    root = tmp_path_factory.mktemp("hf")
    cache = root / "hub"
    snap = hub_cache(checkpoints["llama"], cache)
    before = snapshot(cache)
    # real torchrun: huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE when it is imported, and
    # run_cli's forked ranks imported it in the test's own environment
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(root)}
    by_id = run_torchrun(["sq.ptq", "--model", "org/name", "--output", str(root / "by-id"), *RTN], 2,
                         timeout=180, env=env, cwd=str(root))
    by_path = run_cli(["sq.ptq", "--model", str(snap), "--output", str(root / "by-path"), *RTN], 2, timeout=120)
    return dict(snap=snap, cache=cache, before=before, by_id=by_id, by_path=by_path,
                out_id=root / "by-id", out_path=root / "by-path")


def test_hub_id_offline_quantizes_end_to_end(hub_runs):
    """``--model org/name`` with HF_HUB_OFFLINE=1: the snapshot's blob links are read as the checkpoint;
    the output loads, its side files are plain files with the blobs' bytes, the cache is untouched."""
    from sq.testing.checkpoints import load_with_transformers

    res, out, snap = hub_runs["by_id"], hub_runs["out_id"], hub_runs["snap"]
    assert res.returncode == 0, res.output[-4000:]
    assert f"hub model org/name is in {snap}" in res.output
    model = load_with_transformers(out)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    side = [n for n in SIDE_FILES if (snap / n).exists()]
    assert "tokenizer.json" in side
    for name in side:
        assert not (out / name).is_symlink() and (out / name).read_bytes() == (snap / name).read_bytes(), name
    assert snapshot(hub_runs["cache"]) == hub_runs["before"]  # the cache is read, never written


def test_hub_snapshot_folder_as_a_path_quantizes_end_to_end(hub_runs):
    """The snapshot folder given as a local path: the same output, byte for byte, as the hub id."""
    res = hub_runs["by_path"]
    assert res.returncode == 0, res.output[-4000:]
    a, b = _shards(hub_runs["out_id"]), _shards(hub_runs["out_path"])
    assert a and a == b
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json"):
        assert (hub_runs["out_id"] / name).read_bytes() == (hub_runs["out_path"] / name).read_bytes(), name


def test_eval_reads_a_hub_snapshot(hub_runs):
    res = run_cli(["sq.eval", "--model", str(hub_runs["snap"]), *EVAL], 1, timeout=120)
    assert res.returncode == 0 and "perplexity: " in res.stdout, res.output[-4000:]
