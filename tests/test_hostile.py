"""Hostile inputs and concurrent runs (issue 15): every row is refused cleanly at 1 and 2 ranks.

The contract each row is held to is ``hostile.run_hostile``: exit 2 on every rank, an
``sq: error:`` line naming what is wrong, no traceback, protected files untouched, no hang.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hostile import Hostile, run_hostile


def bad_seqlen(tmp: Path, ck) -> Hostile:
    src = ck["llama"]
    return Hostile(["--model", str(src), "--output", str(tmp / "out"), "--seqlen", "0"], r"--seqlen must be positive",
                   protect=[src])


CASES = {f.__name__: f for f in (bad_seqlen,)}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile(case, world, tmp_path, checkpoints):
    run_hostile(CASES[case](tmp_path, checkpoints), world, tmp_path)
