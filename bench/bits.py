"""Same bits before and after a refactor: every algorithm x preset, model path and model-free, hashed.

    .venv/bin/python bench/bits.py snapshot bench/_work/bits-before.json            # this tree
    .venv/bin/python bench/bits.py snapshot bench/_work/bits-base.json --src DIR     # another tree's src/
    .venv/bin/python bench/bits.py compare bench/_work/bits-before.json bench/_work/bits-after.json

``snapshot`` builds the tiny fixtures once (dense Llama, per-expert Qwen3-MoE, DeepSeek-V3 with an FP8
block-scaled source) under ``bench/_work/bits-fixtures``, runs ``sq.ptq`` in-process (one rank) for
each case of ``CASES`` and the 2-rank GPTQ / SignRound / AWQ cases under torchrun, and writes
``{case: {tensor: sha256 of its bytes, "config": sha256 of the quantization_config}}``.  ``compare``
lists every case and tensor whose hash differs.  A refactor that claims "same behaviour" shows
``identical: N of N cases``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "bench" / "_work" / "bits-fixtures"
CALIB = ["--nsamples", "4", "--seqlen", "32"]
PRESETS = ["W4A16", "W4A16_ASYM", "W3A16", "W8A16", "FP8_DYNAMIC", "FP8", "FP8_BLOCK", "NVFP4A16", "NVFP4",
           "MXFP4A16", "MXFP8", "W8A8", "W4A8", "W4AFP8"]
GROUP = ["--group-size", "16"]


def cases() -> dict[str, tuple[str, int, list[str]]]:
    """name -> (fixture, ranks, sq.ptq arguments after --model/--output)."""
    out: dict[str, tuple[str, int, list[str]]] = {}
    for p in PRESETS:
        out[f"llama/rtn/{p}"] = ("llama", 1, ["--algo", "rtn", "--scheme", p, *GROUP, *CALIB])
        out[f"llama/modelfree/{p}"] = ("llama", 1, ["--algo", "rtn", "--scheme", p, *GROUP, "--model-free"])
    for p in ("W4A16", "W4A16_ASYM", "W8A16", "FP8_DYNAMIC", "NVFP4A16", "MXFP4A16", "W8A8", "W4A8"):
        out[f"llama/gptq/{p}"] = ("llama", 1, ["--algo", "gptq", "--scheme", p, *GROUP, *CALIB])
    for p in ("W4A16", "W4A16_ASYM", "NVFP4A16"):
        out[f"llama/signround/{p}"] = ("llama", 1, ["--algo", "signround", "--iters", "3", "--batch-size", "2",
                                                    "--scheme", p, *GROUP, *CALIB])
    for p in ("W4A16", "W8A8"):
        out[f"llama/awq/{p}"] = ("llama", 1, ["--algo", "awq", "--scheme", p, *GROUP, *CALIB])
    out["llama/awq-gptq/W4A16"] = ("llama", 1, ["--algo", "awq", "--awq-gptq", "on", *GROUP, *CALIB])
    out["llama/gptq-kv/W4A16"] = ("llama", 1, ["--algo", "gptq", "--kv-cache", "fp8", *GROUP, *CALIB])
    out["llama/gptq-2ranks/W4A16"] = ("llama", 2, ["--algo", "gptq", *GROUP, *CALIB])
    out["llama/signround-2ranks/W4A16"] = ("llama", 2, ["--algo", "signround", "--iters", "3", "--batch-size", "2",
                                                        *GROUP, *CALIB])
    out["llama/awq-2ranks/W4A16"] = ("llama", 2, ["--algo", "awq", *GROUP, *CALIB])
    for algo in ("rtn", "gptq"):
        out[f"moe/{algo}/W4A16"] = ("moe", 1, ["--algo", algo, *GROUP, *CALIB])
        out[f"moe/{algo}-2ranks-ep2/W4A16"] = ("moe", 2, ["--algo", algo, "--ep", "2", *GROUP, *CALIB])
    out["moe/modelfree/NVFP4A16"] = ("moe", 1, ["--algo", "rtn", "--scheme", "NVFP4A16", *GROUP, "--model-free"])
    out["moe/modelfree-2ranks/W4A16"] = ("moe", 2, ["--algo", "rtn", *GROUP, "--model-free"])
    out["dsv3fp8/gptq/W4A16"] = ("dsv3fp8", 1, ["--algo", "gptq", *GROUP, *CALIB])
    for algo in ("gptq", "awq", "signround"):  # a bf16 model, forwards pinned to float32 (auto is measured)
        extra = ["--iters", "3", "--batch-size", "2"] if algo == "signround" else []
        out[f"llama-bf16/{algo}-f32/W4A16"] = ("llama-bf16", 2, ["--algo", algo, "--calib-dtype", "float32", *extra,
                                                                 *GROUP, *CALIB])
    out["llama-bf16/gptq-model/W4A16"] = ("llama-bf16", 2, ["--algo", "gptq", "--calib-dtype", "model", *GROUP, *CALIB])
    out["dsv3fp8/modelfree/FP8_BLOCK"] = ("dsv3fp8", 1, ["--algo", "rtn", "--scheme", "FP8_BLOCK", "--model-free"])
    return out


def fixtures(src: Path) -> dict[str, Path]:
    paths = {"llama": FIXTURES / "llama", "moe": FIXTURES / "moe", "dsv3fp8": FIXTURES / "dsv3fp8",
             "llama-bf16": FIXTURES / "llama-bf16"}
    if all(p.exists() for p in paths.values()):
        return paths
    code = (
        "import sys, torch; from pathlib import Path; from sq.testing import checkpoints as c\n"
        "d = Path(sys.argv[1]); c.build_llama(d / 'llama', hidden_size=64, intermediate_size=128)\n"
        "c.build_qwen3_moe(d / 'moe')\n"
        "c.build_deepseek_v3_fp8(d / 'dsv3fp8')\n"
        "c.build_llama(d / 'llama-bf16', hidden_size=64, intermediate_size=128, dtype=torch.bfloat16)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(FIXTURES)], check=True, env=_env(src))
    return paths


def _env(src: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "SQ_LOG": "warning"}


def digest(folder: Path) -> dict[str, str]:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                out[k] = f"{t.dtype}:{list(t.shape)}:" + hashlib.sha256(t.contiguous().view(-1).view(
                    __import__("torch").uint8).numpy().tobytes()).hexdigest()[:16]
    cfg = json.loads((folder / "config.json").read_text()).get("quantization_config")
    out["config"] = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
    return out


def snapshot(path: Path, src: Path, only: str | None) -> None:
    fx = fixtures(src)
    result = {}
    todo = {k: v for k, v in cases().items() if only is None or only in k}
    with tempfile.TemporaryDirectory(dir=ROOT / "bench" / "_work") as tmp:
        for i, (name, (fixture, ranks, args)) in enumerate(todo.items()):
            out = Path(tmp) / "out"
            shutil.rmtree(out, ignore_errors=True)
            launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                        if ranks > 1 else [sys.executable])
            cmd = [*launcher, "-m", "sq.ptq", "--model", str(fx[fixture]), "--output", str(out), *args]
            r = subprocess.run(cmd, env=_env(src), capture_output=True, text=True, timeout=900)
            if r.returncode:
                result[name] = {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"rc {r.returncode}"}
            else:
                result[name] = digest(out)
            print(f"[{i + 1}/{len(todo)}] {name}: {result[name].get('error', 'ok')}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, sort_keys=True))


def compare(a: Path, b: Path) -> int:
    A, B = json.loads(a.read_text()), json.loads(b.read_text())
    same = 0
    for name in sorted(set(A) | set(B)):
        x, y = A.get(name), B.get(name)
        if x == y:
            same += 1
            continue
        if x is None or y is None:
            print(f"{name}: only in {'B' if x is None else 'A'}")
            continue
        diff = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        print(f"{name}: {len(diff)} differ: {', '.join(diff[:6])}{' ...' if len(diff) > 6 else ''}")
    print(f"identical: {same} of {len(set(A) | set(B))} cases")
    return 0 if same == len(set(A) | set(B)) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("path", type=Path)
    s.add_argument("--src", type=Path, default=ROOT / "src", help="the src/ folder of the tree to run")
    s.add_argument("--only", help="cases whose name contains this")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args()
    if args.cmd == "snapshot":
        snapshot(args.path, args.src.resolve(), args.only)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
