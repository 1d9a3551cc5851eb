"""The hostile-input contract, checked the same way for every case.

A hostile or careless input must end in a clean refusal:

- every rank exits 2 (``sq.cli.run_cli``), none is left hanging (the launch has a timeout);
- stderr carries ``sq: error: ...`` lines, one of which matches the case's pattern (naming the
  file, key or flag involved), and no Python traceback;
- the source checkpoint and every file the case marks as protected are byte-for-byte and
  link-for-link as they were (``snapshot`` before and after).

A case is a function ``(tmp_path, checkpoints) -> Hostile``: it builds its inputs under
``tmp_path`` and says what to run and what the refusal must say.  ``tests/test_hostile*.py``
hold the tables; each row runs at 1 and 2 ranks.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from harness import run_cli

__all__ = ["Hostile", "snapshot", "run_hostile", "assert_refused"]


@dataclass
class Hostile:
    """One hostile invocation: ``python -m MODULE ARGV`` must be refused with ``pattern``."""

    argv: list[str]
    pattern: str  # re.search against the ``sq: error:`` lines
    protect: list[Path] = field(default_factory=list)  # folders / files that must stay untouched
    module: str = "sq.ptq"
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 90.0
    check_after: object = None  # optional callable(tmp_path) -> None, more assertions after the run


def snapshot(*roots: Path) -> dict[str, tuple]:
    """Every file and link under ``roots``: (kind, size, sha256 | link target), without following links."""
    out: dict[str, tuple] = {}
    for root in roots:
        root = Path(root)
        if not os.path.lexists(root):
            out[str(root)] = ("absent",)
            continue
        walk = [root] if not root.is_dir() or root.is_symlink() else None
        paths = walk or [root, *sorted(root.rglob("*"))]
        for p in paths:
            if p.is_symlink():
                out[str(p)] = ("link", os.readlink(p))
            elif p.is_dir():
                out[str(p)] = ("dir",)
            elif p.is_file():
                out[str(p)] = ("file", p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def assert_refused(result, world: int, pattern: str) -> None:
    text = result.stdout + result.stderr
    assert "Traceback" not in text, f"traceback instead of a refusal:\n{text[-6000:]}"
    errors = [l for l in result.stderr.splitlines() if l.startswith("sq: error: ")]
    assert errors, f"no 'sq: error:' line:\n{text[-6000:]}"
    assert any(re.search(pattern, l) for l in errors), f"no error line matches {pattern!r}:\n" + "\n".join(errors)
    assert result.codes == [2] * world, f"exit codes {result.codes}, expected 2 on each of {world} ranks:\n{text[-4000:]}"


def run_hostile(case: Hostile, world: int, tmp_path: Path):
    """Run ``case`` on ``world`` forked ranks and check the whole contract; returns the result."""
    before = snapshot(*case.protect)
    result = run_cli([case.module, *case.argv], world, timeout=case.timeout, env=case.env or None,
                     stop_on_failure=False)
    assert_refused(result, world, case.pattern)
    after = snapshot(*case.protect)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"refusal changed protected files: {changed[:10]}"
    if case.check_after is not None:
        case.check_after(tmp_path)
    return result
