"""``python -m sq.testing.zoo_one_rank ROOT [--modes M,...] TYPE...``: every zoo type at 1 rank through GPTQ W4A16,
model-free RTN W4A16 and RTN W8A16 under ``--rotate r1,r2``, each in this one process (``sq.ptq.main``, the CLI's
own entry point), each output proven by ``check_output`` (the rotated one by ``check_rotated``: its logits
are the source's up to W8A16's error, or the rotation was refused by name).

One interpreter for the whole matrix: a fresh one per run would spend ~3 s of the 2 cores importing torch and
transformers, ten times the run itself.  Prints one JSON line per run: ``{"type", "mode", "rc", "errors",
"traceback", "carried", "check"}`` where ``carried`` holds the logged reasons for what was carried unquantized
and ``check`` is ``check_output``'s summary or its ``AssertionError``.  ``tests/test_zoo.py`` and
``bench/zoo.py`` run it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import traceback
from pathlib import Path

MODES = {
    "gptq": ["--algo", "gptq", "--nsamples", "4", "--seqlen", "32"],
    "model-free": ["--algo", "rtn", "--model-free"],
    "rotate": ["--algo", "rtn", "--scheme", "W8A16", "--rotate", "r1,r2"],
}


def main(root: Path, types: list[str], modes: list[str] | None = None) -> None:
    from sq.ptq import main as ptq
    from sq.testing.zoo import ZOO, check_output, check_rotated

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(var, None)  # one rank, a private in-memory store: no port bound and released per run
    for t in types:
        src = root / t
        for mode, args in MODES.items():
            if modes is not None and mode not in modes:
                continue
            out = root / f"{t}-{mode}-1"
            err = io.StringIO()
            handler = logging.StreamHandler(err)  # sq's log lines: what was carried and why
            logging.getLogger("sq").addHandler(handler)
            # types whose experts sq carries: the run says so (refused without the flag)
            allow = ["--allow-unquantized-experts"] if ZOO[t].allow_carried(mode == "model-free") else []
            with contextlib.redirect_stderr(err):
                try:
                    rc = ptq(["--model", str(src), "--output", str(out), "--scheme", "W4A16", "--group-size", "8",
                              *args, *allow])
                except Exception:  # noqa: BLE001 - a raw traceback is a finding: reported, the matrix goes on
                    traceback.print_exc()
                    rc = "raised"
            logging.getLogger("sq").removeHandler(handler)
            text = err.getvalue()
            record = {"type": t, "mode": mode, "rc": rc,
                      "errors": [ln for ln in text.splitlines() if ln.startswith("sq: error:")],
                      "traceback": text[text.find("Traceback"):][-3000:] if "Traceback" in text else None,
                      "carried": sorted({ln for ln in text.splitlines() if "carried unquantized" in ln})}
            if rc == 0:
                try:
                    record["check"] = check_rotated(src, out) if mode == "rotate" else check_output(src, out)
                except AssertionError as e:
                    record["check"] = f"AssertionError: {e}"
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    argv = sys.argv[2:]
    picked = None
    if argv[:1] == ["--modes"]:
        picked, argv = argv[1].split(","), argv[2:]
    main(Path(sys.argv[1]), argv, picked)
