"""Filling: streaming fill/free of blocks, unfilled-memory detection, bytes read and memory per rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from harness import run_ranks
from sq.errors import LoadRefused
from sq.memory import io_read_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes


def _stream_blocks(rank, world, path):
    from sq.dist import ParallelDims
    from sq.load.loader import fill, free, plan_load
    from sq.load.meta import build_skeleton
    from sq.parallel.fsdp import apply_parallel

    model = build_skeleton(path, dtype=torch.float32)
    plan = plan_load(model, path)
    apply_parallel(model, ParallelDims(world, 1).build_mesh("cpu"))
    fill(model, plan, plan.root_names)
    out = {}
    # rotary inv_freq recomputed, not to_empty garbage
    inv = dict(model.named_buffers())[next(b for b in plan.buffers if b.endswith("inv_freq"))]
    out["inv_freq_ok"] = torch.equal(inv, plan.buffers[next(b for b in plan.buffers if b.endswith("inv_freq"))])
    out["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    fill(model, plan, plan.block_names[0])
    plan.check_filled(plan.block_names[0])
    free(model, plan, plan.block_names[0])
    out["freed_on_meta"] = all(p.device.type == "meta" for p in model.model.layers[0].parameters())
    try:
        plan.check_filled(plan.block_names[0])
        out["detected"] = False
    except LoadRefused as e:
        out["detected"] = "not filled" in str(e)
    fill(model, plan, plan.block_names[0])
    plan.check_filled(plan.block_names[0])
    out["refilled_on_cpu"] = all(p.device.type == "cpu" for p in model.model.layers[0].parameters())
    return out


def test_stream_fill_free_and_detect_unfilled(checkpoints):
    for r in run_ranks(_stream_blocks, 2, str(checkpoints["llama"]), timeout=120):
        assert r == {"inv_freq_ok": True, "tied": True, "freed_on_meta": True, "detected": True,
                     "refilled_on_cpu": True}


def _measure_load(rank, world, path):
    import torch.distributed as dist

    from sq.load.loader import load_sharded
    from sq.load.meta import build_skeleton

    build_skeleton(path)  # imports and transformers' lazy modules are not the load's memory
    dist.barrier()
    reset_peak_rss()
    rss0, io0 = rss_bytes(), io_read_bytes()
    model = load_sharded(path, dtype=torch.float32)
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return dict(read=io_read_bytes() - io0, rise=peak_rss_bytes() - rss0, local=local)


def _evict(path):
    for f in os.listdir(path):
        fd = os.open(os.path.join(path, f), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


@pytest.fixture(scope="module")
def bigger_moe(tmp_path_factory):
    """~50 MB fp32 MoE in 16 shards, big enough that reads and memory are not header noise."""
    from sq.testing.checkpoints import build_qwen3_moe

    return build_qwen3_moe(tmp_path_factory.mktemp("big") / "moe", hidden_size=256, moe_intermediate_size=256,
                           num_experts=16, num_hidden_layers=4, shards=16)


def test_two_ranks_read_and_hold_about_half(bigger_moe):
    size = sum(f.stat().st_size for f in bigger_moe.glob("*.safetensors"))
    if io_read_bytes() == 0 and not os.path.exists("/proc/self/io"):
        pytest.skip("this kernel has no /proc/self/io accounting")
    _evict(bigger_moe)
    # fresh interpreters, as torchrun's ranks are: what the test server preloads for speed
    # (transformers' modeling modules) must not shift the baseline this measures against
    results = run_ranks(_measure_load, 2, str(bigger_moe), timeout=180, start="spawn")
    total_read = sum(r["read"] for r in results)
    for rank, r in enumerate(results):
        # each rank reads its own half (plus readahead), never the whole checkpoint
        assert r["read"] <= 0.7 * size, f"rank {rank} read {r['read']} of {size} bytes"
        # memory rise: its shard (about half) plus one file's mapped pages at a time
        assert r["rise"] <= 0.8 * size, f"rank {rank} RSS rose {r['rise']} for a {size}-byte checkpoint"
        assert r["local"] <= 0.55 * size
    assert total_read <= 1.15 * size, f"ranks together read {total_read} of {size} bytes"


# ----------------------------------------------------------------------------- direct (preadv) reads

FIXTURE_NAMES = ["llama", "qwen3_moe", "qwen3_moe_fused", "mixtral", "deepseek_v3", "deepseek_v3_fp8", "vlm"]
MOE_NAMES = ["qwen3_moe", "qwen3_moe_fused", "mixtral", "deepseek_v3", "deepseek_v3_fp8"]


def _checkpoint_maps(folder) -> list[str]:
    """Lines of /proc/self/maps that map a file of ``folder``."""
    folder = str(folder)
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if folder in line]


def _fill_all(path, world, ep, *, direct, dtype=None, watch_maps=False):
    """Fill every tensor of the checkpoint at ``path``; (local shards, reader, maps seen at each box)."""
    from sq.dist import ParallelDims
    from sq.load.fill import BoxLoadPlanner, local_box
    from sq.load.loader import fill, plan_load
    from sq.load.meta import build_skeleton
    from sq.parallel.fsdp import apply_parallel

    model = build_skeleton(path, dtype=dtype)
    plan = plan_load(model, path)
    if world > 1:
        apply_parallel(model, ParallelDims(world, ep).build_mesh("cpu"))
    plan.reader().direct = direct
    seen = []
    commit = BoxLoadPlanner.commit_tensor
    if watch_maps:
        real = os.path.realpath(path)
        BoxLoadPlanner.commit_tensor = lambda self, item, t: seen.extend(_checkpoint_maps(real))
    try:
        fill(model, plan, plan.root_names)
        for names in plan.block_names:
            fill(model, plan, names)
    finally:
        BoxLoadPlanner.commit_tensor = commit
    shards = {n: local_box(t)[0].clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    return shards, plan.reader(), seen


def _direct_vs_mapped(rank, world, paths: dict, ep: int):
    out = {}
    for name, path in paths.items():
        cases = [(name, None)] + ([(name + ":fp32->bf16", torch.bfloat16)] if name == "llama" else [])
        for label, dtype in cases:
            got, reader, _ = _fill_all(path, world, ep, direct=True, dtype=dtype)
            want, ref_reader, _ = _fill_all(path, world, ep, direct=False, dtype=dtype)
            differ = [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
            out[label] = dict(differ=differ, direct=reader.direct_reads, mapped=reader.mapped_reads,
                              bytes=reader.bytes_read, ref_bytes=ref_reader.bytes_read,
                              ref_direct=ref_reader.direct_reads)
    return out


@pytest.mark.parametrize("world,ep", [(1, 1), (2, 1), (2, 2)])
def test_direct_reads_equal_safetensors_reads(checkpoints, world, ep):
    """Shards read with preadv are bit-identical to those read through safetensors' get_slice (the
    loader before preadv), on every fixture layout; contiguous boxes take the preadv path, FP8
    weights and dtype conversions do not."""
    names = FIXTURE_NAMES if ep == 1 else MOE_NAMES
    paths = {n: str(checkpoints[n]) for n in names}
    for rank, res in enumerate(run_ranks(_direct_vs_mapped, world, paths, ep, timeout=600)):
        for label, r in res.items():
            assert r["differ"] == [], f"{label} rank {rank}: shards differ: {r['differ'][:5]}"
            assert r["bytes"] == r["ref_bytes"], (label, rank, r)
            assert r["ref_direct"] == 0, (label, rank, r)
            if label.endswith("->bf16"):
                assert r["direct"] == 0 and r["mapped"] > 0, (label, rank, r)  # a dtype conversion: get_slice
            elif label == "deepseek_v3_fp8":
                assert r["direct"] > 0 and r["mapped"] > 0, (label, rank, r)  # bf16 norms direct, FP8 dequantized
            else:
                assert r["direct"] > 0 and r["mapped"] == 0, (label, rank, r)  # every box is one byte range


def _maps_during_reads(rank, world, path):
    _, reader, seen_direct = _fill_all(path, world, 1, direct=True, watch_maps=True)
    _, _, seen_mapped = _fill_all(path, world, 1, direct=False, watch_maps=True)
    return dict(direct=reader.direct_reads, seen_direct=seen_direct[:3], seen_mapped=len(seen_mapped))


def test_no_checkpoint_file_is_mapped_while_reading(checkpoints):
    """While a box is committed, /proc/self/maps shows no checkpoint file: the preadv path maps
    nothing (no file-backed pages count in RSS).  The safetensors path does (the check can see it)."""
    for rank, r in enumerate(run_ranks(_maps_during_reads, 2, str(checkpoints["qwen3_moe"]), timeout=180)):
        assert r["direct"] > 0, r
        assert r["seen_direct"] == [], f"rank {rank}: checkpoint mapped during a preadv read: {r['seen_direct']}"
        assert r["seen_mapped"] > 0, f"rank {rank}: the maps check saw no mmap on the safetensors path"


def _open_fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the listing's own fd, closed already
    return out


@pytest.mark.parametrize("how", ["truncated", "read_error", "truncated_mapped"])
def test_a_failed_read_leaves_no_file_open(checkpoints, tmp_path, monkeypatch, how):
    """A read that fails half way (a file truncated after the scan, an I/O error in preadv, the
    safetensors path on a truncated file) raises LoadRefused and closes every file it opened."""
    import shutil

    import sq.load.fill as F
    from sq.load.loader import fill, plan_load
    from sq.load.meta import build_skeleton

    src = tmp_path / "ckpt"
    shutil.copytree(checkpoints["qwen3_moe"], src)
    model = build_skeleton(src, dtype=torch.float32)
    plan = plan_load(model, src)
    plan.reader().direct = how != "truncated_mapped"
    fill(model, plan, plan.block_names[0])  # warm: lazy imports, torch's own files
    names = plan.root_names + [n for ns in plan.block_names[1:] for n in ns]
    files = sorted({plan.source.tensors[p.ckpt_key].file for n in names for p in plan.keymap.pieces[n]})
    if how.startswith("truncated"):
        victim = src / files[-1]
        os.truncate(victim, victim.stat().st_size - 64)
    else:
        calls = []
        real = F.pread_into

        def failing(fd, buf, offset, path):
            calls.append(path)
            if len(calls) == 3:  # after two boxes went through: other files may be open too
                raise OSError(5, "Input/output error (injected)")
            return real(fd, buf, offset, path)

        monkeypatch.setattr(F, "pread_into", failing)
    before = _open_fds()
    with pytest.raises(LoadRefused) as e:
        fill(model, plan, names)
    after = _open_fds()
    assert "reading" in str(e.value) and "failed" in str(e.value)
    leaked = {fd: target for fd, target in after.items() if before.get(fd) != target}
    assert not leaked, f"files left open after a failed read: {leaked}"
    assert not [t for t in after.values() if str(src) in t]


def _one_rank_fails(rank, world, path):
    import torch.distributed as dist

    import sq.load.fill as F
    from sq.dist import ParallelDims
    from sq.load.loader import fill, plan_load
    from sq.load.meta import build_skeleton
    from sq.parallel.fsdp import apply_parallel

    model = build_skeleton(path, dtype=torch.float32)
    plan = plan_load(model, path)
    apply_parallel(model, ParallelDims(world, 1).build_mesh("cpu"))
    fill(model, plan, plan.root_names)
    if rank == 1:
        def failing(fd, buf, offset, path):
            raise OSError(5, "disk on fire (injected)")

        F.pread_into = failing
    try:
        fill(model, plan, plan.block_names[0])
        err = None
    except Exception as e:  # noqa: BLE001 - reported back
        err = (type(e).__name__, str(e))
    dist.barrier()  # no rank is left behind in a collective
    return err


def test_a_read_error_on_one_rank_is_raised_on_every_rank(checkpoints):
    """Reads are local (dcp no_dist): a rank's read error reaches the others through fill's one
    agreement, and every rank raises the same LoadRefused, naming the rank."""
    errs = run_ranks(_one_rank_fails, 2, str(checkpoints["qwen3_moe"]), timeout=180)
    assert errs[0] is not None and errs[0] == errs[1], errs
    kind, text = errs[0]
    assert kind == "LoadRefused" and "disk on fire" in text and "(rank 1)" in text, errs


def test_byte_range_is_exactly_the_contiguous_boxes():
    """byte_range returns a range iff the box's elements are one run of the row-major tensor, and
    then exactly that run (brute force over every box of small shapes)."""
    import itertools

    from sq.load.fill import byte_range
    from sq.load.source import TensorInfo

    for shape in [(5,), (4, 3), (3, 1, 4), (2, 3, 4), (1, 2, 3)]:
        info = TensorInfo("k", "f", torch.bfloat16, shape, (100, 100 + 2 * torch.Size(shape).numel()))
        flat = torch.arange(torch.Size(shape).numel()).view(shape)
        spans = [[(o, n) for o in range(s) for n in range(1, s - o + 1)] for s in shape]
        for box in itertools.product(*spans):
            offsets, lengths = [b[0] for b in box], [b[1] for b in box]
            idx = flat[tuple(slice(o, o + n) for o, n in box)].reshape(-1)
            run = bool(torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + idx.numel())))
            got = byte_range(info, offsets, lengths)
            assert (got is not None) == run, (shape, box)
            if run:
                assert got == (100 + 2 * int(idx[0]), 2 * idx.numel()), (shape, box)


# ----------------------------------------------------------------------------- mapped shards (load_sharded)


def _file_hashes(folder) -> dict[str, str]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.safetensors"))}


def _mapped_vs_copied(rank, world, paths: dict, ep: int):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from sq.load.fill import local_box
    from sq.load.loader import load_sharded

    out = {}
    for name, path in paths.items():
        mapped = load_sharded(path, ep=ep, map_files=True)
        copied = load_sharded(path, ep=ep, map_files=False)
        got = dict(mapped.named_parameters())
        differ = [n for n, t in copied.named_parameters()
                  if not torch.equal(local_box(t)[0], local_box(got[n])[0])]
        # FSDP2 all-gathers from the mapped memory itself: its sharded buffer is the view, no copy
        fsdp_copies = [fp._param_fqn for m in mapped.modules() if isinstance(m, FSDPModule)
                       for g in m._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params
                       if fp._sharded_param_data.numel() and fp._sharded_param_data.data_ptr()
                       != fp.sharded_param.to_local().data_ptr()]
        ids = torch.arange(1, 17).view(2, 8) % mapped.config.vocab_size
        with torch.no_grad():
            same_logits = torch.equal(mapped(ids).logits, copied(ids).logits)
        # a write to a mapped shard changes the model, never the file (private, copy-on-write)
        before = _file_hashes(Path(path)) if rank == 0 else None
        with torch.no_grad():
            for p in mapped.parameters():
                local = local_box(p)[0]
                if local.numel():
                    local.add_(1)
        dist.barrier()
        after = _file_hashes(Path(path)) if rank == 0 else None
        tied = getattr(mapped.config, "tie_word_embeddings", False)
        out[name] = dict(differ=differ, views=mapped.sq_plan.reader().file_views,
                         copied_views=copied.sq_plan.reader().file_views, same_logits=same_logits,
                         file_unchanged=before == after, fsdp_copies=fsdp_copies,
                         tied_ok=(not tied) or mapped.lm_head.weight is mapped.model.embed_tokens.weight,
                         maps=len(_checkpoint_maps(os.path.realpath(path))))
        del mapped, copied
    return out


@pytest.mark.parametrize("world,ep", [(1, 1), (2, 1), (2, 2)])
def test_mapped_shards_equal_copied_shards(checkpoints, world, ep):
    """``load_sharded`` maps instead of copying every shard that is one contiguous box of the
    checkpoint's dtype: the shards, the FSDP2 forward and the tied weights are those of the copying
    path, FSDP2 gathers from the mapping itself, and writing to the parameters leaves the files as
    they were.  FP8 weights (dequantized) are still read."""
    names = ["llama", "qwen3_moe_fused", "deepseek_v3_fp8"] if ep == 1 else ["qwen3_moe_fused", "qwen3_moe"]
    paths = {n: str(checkpoints[n]) for n in names}
    for rank, res in enumerate(run_ranks(_mapped_vs_copied, world, paths, ep, timeout=600)):
        for name, r in res.items():
            assert r["differ"] == [], f"{name} rank {rank}: shards differ: {r['differ'][:5]}"
            assert r["views"] > 0 and r["copied_views"] == 0, (name, rank, r)
            assert r["maps"] > 0, (name, rank, r)  # the model holds views of the checkpoint's files
            assert r["same_logits"] and r["file_unchanged"] and r["tied_ok"], (name, rank, r)
            assert r["fsdp_copies"] == [], (name, rank, r["fsdp_copies"][:5])


def test_fsdp_param_groups_reads_both_torch_layouts():
    """torch 2.13's FSDP2 state keeps a list of parameter groups, torch 2.11 (the GPU machine's)
    one group or None: both read as a list (every load failed on torch 2.11 before)."""
    from types import SimpleNamespace

    from sq.parallel.fsdp import fsdp_param_groups

    def module(state):
        return SimpleNamespace(_get_fsdp_state=lambda: state)

    g1, g2 = object(), object()
    assert fsdp_param_groups(module(SimpleNamespace(_fsdp_param_groups=[g1, g2], _fsdp_param_group=g1))) == [g1, g2]
    assert fsdp_param_groups(module(SimpleNamespace(_fsdp_param_group=g1))) == [g1]
    assert fsdp_param_groups(module(SimpleNamespace(_fsdp_param_group=None))) == []
