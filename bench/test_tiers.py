"""The fast test tier: ``tests/slow.txt`` (what ``-m "not slow"`` leaves out) regenerated from a timed run.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests --junitxml=/tmp/suite.xml
    .venv/bin/python bench/test_tiers.py /tmp/suite.xml          # rewrites tests/slow.txt, prints both tiers
    .venv/bin/python -m pytest -q -p no:cacheprovider tests -m "not slow" --junitxml=/tmp/fast.xml
    .venv/bin/python bench/test_tiers.py /tmp/suite.xml /tmp/fast.xml   # and what the fast run found slow

A test is slow when it took over ``LIMIT`` seconds (its setup included: a session fixture's cost lands on
the first test that asks for it); whole files are slow where a module fixture serves every test (``FILES``:
otherwise the first fast test of the file would pay for the fixture).  ``tests/conftest.py`` marks what the
file lists; a renamed test falls into the fast tier until the next regeneration.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

LIMIT = 1.5  # seconds
# one module / session fixture quantizes or serves for every test of the file
FILES = ("tests/test_serving.py", "tests/test_zoo.py", "tests/test_footprint.py", "tests/test_presets_pipeline.py",
         "tests/test_presets_moe.py", "tests/test_awq.py")
OUT = Path(__file__).resolve().parent.parent / "tests" / "slow.txt"


def nodeid(classname: str, name: str) -> str:
    parts = classname.split(".")
    cls = [p for p in parts if p[:1].isupper()]
    path = "/".join(p for p in parts if not p[:1].isupper()) + ".py"
    return "::".join([path, *cls, name])


def main(full: str, *more: str) -> None:
    """``full``: a run of the whole suite; ``more``: runs of the fast tier, where a session fixture's cost lands
    on a test other than the one the full run charged it to (each test's time: its largest over the runs)."""
    def read(xml):
        return {nodeid(tc.get("classname", ""), tc.get("name", "")): float(tc.get("time", 0))
                for tc in ET.parse(xml).getroot().iter("testcase")}

    times = read(full)
    for xml in more:
        for n, s in read(xml).items():
            times[n] = max(times.get(n, 0.0), s)
    tests = list(times.items())
    slow = sorted(n for n, s in tests if s > LIMIT and not n.startswith(FILES))
    fast = sum(s for n, s in tests if n not in slow and not n.startswith(FILES))
    OUT.write_text("# tests outside the fast tier (-m \"not slow\"); bench/test_tiers.py regenerates this list\n"
                   + "".join(f"{f}\n" for f in FILES) + "".join(f"{n}\n" for n in slow))
    print(f"{len(tests)} tests, {sum(s for _, s in tests):.0f} s; fast tier: "
          f"{sum(1 for n, _ in tests if n not in slow and not n.startswith(FILES))} tests, {fast:.0f} s; "
          f"{OUT} lists {len(FILES)} files and {len(slow)} tests")


if __name__ == "__main__":
    main(*sys.argv[1:])
