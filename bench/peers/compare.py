"""Tensor-for-tensor comparison of two safetensors checkpoints (e.g. sq vs llm-compressor), issue 17.

    .venv/bin/python bench/peers/compare.py A_DIR B_DIR [--all] [--config-ignore PATH ...] [--json FILE]

Raw stored tensors, nothing dequantized: every ``*.safetensors`` file of each folder is read (the
index is not trusted), and for each tensor name: present in both, dtype, shape, and, where dtype
and shape agree, the number of elements that are bitwise identical and the max |a - b| (in float64;
for int and fp8 tensors on their stored values). Then the two ``config.json``
``quantization_config`` dicts, key by key (``--config-ignore version`` skips a dotted path,
e.g. ``version`` or ``config_groups.group_0.weights.observer``; none by default).

Prints a summary table by tensor kind (the name's last component: weight_packed, weight_scale,
...), then one line per differing tensor (every tensor with ``--all``), then the config diff.
Exit status: 0 identical; otherwise a bit mask: 1 tensor names / dtypes / shapes / values differ,
2 quantization_config differs (with ``--lenient``: beyond 'version' and keys absent on one side and
null / {} on the other), 4 a folder has no safetensors or config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

_MISSING = object()


def tensor_files(root: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """name -> (file, dtype string, shape) over every *.safetensors in ``root``."""
    out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                if k in out:
                    raise SystemExit(f"compare: {k!r} is in both {out[k][0].name} and {f.name} of {root}")
                out[k] = (f, s.get_dtype(), tuple(s.get_shape()))
    return out


def read(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), "pt") as h:
        return h.get_tensor(name)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def compare_values(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """(bitwise-equal element count, max |a - b| in float64; nan if any side is non-finite there)."""
    if a.numel() == 0:
        return 0, 0.0
    if a.dtype == torch.bool:
        equal = int((a == b).sum())
    else:
        view = _BITS[a.element_size()]
        equal = int((a.contiguous().view(view) == b.contiguous().view(view)).sum())
    if a.dtype.is_floating_point:
        diff = (a.double() - b.double()).abs()
    else:
        diff = (a.long() - b.long()).abs().double()
    return equal, float(diff.max())


def flatten(d, prefix: str = "") -> dict[str, object]:
    out = {}
    if isinstance(d, dict):
        if not d and prefix:
            out[prefix] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = d
    return out


def quant_config(root: Path):
    p = root / "config.json"
    if not p.is_file():
        return None
    return json.loads(p.read_text()).get("quantization_config", _MISSING)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--all", action="store_true", help="one line per tensor, not only the differing ones")
    p.add_argument("--config-ignore", nargs="*", default=[], metavar="PATH",
                   help="dotted quantization_config paths left out of the diff (prefix match)")
    p.add_argument("--lenient", action="store_true",
                   help="config keys absent on one side and null / {} on the other, and 'version', do not "
                        "count as differences (still listed, marked 'default')")
    p.add_argument("--json", type=Path, help="also write the full result here")
    args = p.parse_args(argv)

    status = 0
    ta, tb = tensor_files(args.a), tensor_files(args.b)
    for root, t in ((args.a, ta), (args.b, tb)):
        if not t:
            print(f"compare: {root} has no *.safetensors", file=sys.stderr)
            status |= 4
    names = sorted(set(ta) | set(tb))
    rows = []
    for n in names:
        row = {"name": n, "kind": n.rsplit(".", 1)[-1]}
        if n not in ta or n not in tb:
            row["problem"] = "only in A" if n in ta else "only in B"
            row["dtype"] = (ta.get(n) or tb.get(n))[1]
            row["shape"] = list((ta.get(n) or tb.get(n))[2])
            rows.append(row)
            continue
        (fa, da, sa), (fb, db, sb) = ta[n], tb[n]
        row.update(dtype=da if da == db else f"{da} vs {db}", shape=list(sa) if sa == sb else f"{list(sa)} vs {list(sb)}")
        if da != db or sa != sb:
            row["problem"] = "dtype" if da != db else "shape"
            if sa == sb:  # same shape, different dtype: still show how far the values are
                a, b = read(fa, n), read(fb, n)
                row["max_abs_diff"] = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
            rows.append(row)
            continue
        a, b = read(fa, n), read(fb, n)
        equal, mad = compare_values(a, b)
        row.update(numel=a.numel(), equal=equal, max_abs_diff=mad)
        if equal != a.numel():
            row["problem"] = "values"
        rows.append(row)
    if any("problem" in r for r in rows):
        status |= 1

    # summary by kind
    kinds = defaultdict(lambda: {"tensors": 0, "identical": 0, "numel": 0, "equal": 0, "max_abs_diff": 0.0,
                                 "problems": defaultdict(int), "dtypes": set()})
    for r in rows:
        k = kinds[r["kind"]]
        k["tensors"] += 1
        k["dtypes"].add(r["dtype"])
        if "problem" in r:
            k["problems"][r["problem"]] += 1
        else:
            k["identical"] += 1
        k["numel"] += r.get("numel", 0)
        k["equal"] += r.get("equal", 0)
        if r.get("max_abs_diff") is not None:
            k["max_abs_diff"] = max(k["max_abs_diff"], r["max_abs_diff"])
    print(f"A: {args.a}  ({len(ta)} tensors)\nB: {args.b}  ({len(tb)} tensors)\n")
    print("| kind | dtype | tensors | identical | elements equal | max abs diff | problems |")
    print("|---|---|---:|---:|---:|---:|---|")
    for kind in sorted(kinds):
        k = kinds[kind]
        probs = ", ".join(f"{v} {p}" for p, v in sorted(k["problems"].items())) or "-"
        print(f"| {kind} | {', '.join(sorted(k['dtypes']))} | {k['tensors']} | {k['identical']} | "
              f"{k['equal']}/{k['numel']} | {k['max_abs_diff']:.6g} | {probs} |")
    shown = [r for r in rows if args.all or "problem" in r]
    if shown:
        print("\n| tensor | dtype | shape | equal | max abs diff | problem |")
        print("|---|---|---|---:|---:|---|")
        for r in shown[: None if args.all else 60]:
            eq = f"{r['equal']}/{r['numel']}" if "equal" in r else "-"
            mad = f"{r['max_abs_diff']:.6g}" if r.get("max_abs_diff") is not None else "-"
            print(f"| {r['name']} | {r['dtype']} | {r['shape']} | {eq} | {mad} | {r.get('problem', 'ok')} |")
        if not args.all and len(shown) > 60:
            print(f"... {len(shown) - 60} more differing tensors (--json for all)")

    # quantization_config
    qa, qb = quant_config(args.a), quant_config(args.b)
    config_diff = []
    if qa is None or qb is None:
        print(f"\ncompare: no config.json in {args.a if qa is None else args.b}", file=sys.stderr)
        status |= 4
    else:
        fa = flatten(qa) if qa is not _MISSING else {"<no quantization_config>": True}
        fb = flatten(qb) if qb is not _MISSING else {"<no quantization_config>": True}
        for key in sorted(set(fa) | set(fb)):
            if any(key == ig or key.startswith(ig + ".") for ig in args.config_ignore):
                continue
            va, vb = fa.get(key, _MISSING), fb.get(key, _MISSING)
            if va != vb:
                benign = key == "version" or (va is _MISSING and vb in (None, {})) or (vb is _MISSING and va in (None, {}))
                config_diff.append({"key": key, "a": "<absent>" if va is _MISSING else va,
                                    "b": "<absent>" if vb is _MISSING else vb, "default": benign})
        print()
        if config_diff:
            counted = [d for d in config_diff if not (args.lenient and d["default"])]
            if counted:
                status |= 2
            print("| quantization_config key | A | B | note |\n|---|---|---|---|")
            for d in config_diff:
                note = "version" if d["key"] == "version" else ("absent = null" if d["default"] else "DIFFERENT")
                print(f"| {d['key']} | {json.dumps(d['a'])} | {json.dumps(d['b'])} | {note} |")
        else:
            print("quantization_config: identical" + (f" (ignoring {', '.join(args.config_ignore)})"
                                                      if args.config_ignore else ""))

    n_bad = sum("problem" in r for r in rows)
    n_cfg = sum(not d["default"] for d in config_diff)
    verdict = (f"tensors: {'IDENTICAL' if n_bad == 0 else f'{n_bad}/{len(rows)} DIFFER'} ({len(rows)} tensors); "
               f"quantization_config: {len(config_diff)} keys differ, {n_cfg} beyond version / absent-vs-null")
    print(f"\n{verdict}")
    if args.json:
        args.json.write_text(json.dumps({"a": str(args.a), "b": str(args.b), "status": status, "tensors": rows,
                                         "config_diff": config_diff}, indent=1, default=str) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
