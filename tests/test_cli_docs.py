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


@pytest.mark.parametrize("module", ["sq.ptq", "sq.inspect", "sq.eval"])
def test_help_explains_every_option_and_its_default(module):
    """``--help``: a user-facing description, a help text for every option, the default where there is one."""
    import importlib

    parser = importlib.import_module(module).build_parser()
    assert parser.description and "``" not in parser.description and "thin:" not in parser.description
    formatter = parser._get_formatter()
    text = parser.format_help()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings or "--help" in action.option_strings:
            continue
        assert action.help, f"{module} {action.option_strings[0]} has no help text"
        default = action.default
        if action.required or default is None or isinstance(default, bool) or default == []:
            continue
        shown = formatter._get_help_string(action)
        assert "default" in shown, f"{module} {action.option_strings[0]}: --help does not show its default"
    if module == "sq.ptq":
        for option, default in [("--scheme", "W4A16"), ("--nsamples", "128"), ("--seqlen", "512"),
                                ("--dataset", "builtin:pydoc"), ("--group-size", "128"), ("--seed", "0")]:
            block = text.split("options:", 1)[1].split(f"  {option} ", 1)[1].split("\n  --", 1)[0]
            assert f"(default: {default})" in " ".join(block.split()), f"{option}: {block!r}"


def test_plan_documents_the_options_it_adds_to_ptqs():
    """``sq.plan`` takes sq.ptq's arguments (documented in that section) and adds its own, documented in its."""
    import importlib

    ptq = {o for a in importlib.import_module("sq.ptq").build_parser()._actions for o in a.option_strings}
    plan = {o for a in importlib.import_module("sq.plan").build_parser()._actions for o in a.option_strings}
    section = DOC.split("-m sq.plan`", 1)[1].split("\n## ", 1)[0]
    added = sorted(o for o in plan - ptq if o.startswith("--"))
    assert added and all(f"`{o}`" in section for o in added), added
