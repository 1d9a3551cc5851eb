"""docs/cli.md documents every option of every command-line parser (and nothing that is gone)."""

import argparse
import re
from pathlib import Path

import pytest

DOC = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()


@pytest.mark.parametrize("module", ["sq.ptq", "sq.inspect", "sq.eval"])
def test_every_option_is_documented(module):
    import importlib

    parser = importlib.import_module(module).build_parser()
    section = DOC.split(f"-m {module}`", 1)[1].split("\n## ", 1)[0]
    options = [o for a in parser._actions if a.help != argparse.SUPPRESS
               for o in a.option_strings if o.startswith("--") and o != "--help"]
    missing = [o for o in options if f"`{o}" not in section]
    assert not missing, f"{module}: undocumented options {missing}"
    documented = set(re.findall(r"^\| `(--[a-z-]+)", section, flags=re.M))
    assert documented <= set(options), f"{module}: documented but gone {sorted(documented - set(options))}"
