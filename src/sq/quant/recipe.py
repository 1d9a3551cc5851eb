"""Which scheme each module gets: one scheme for all, or a mixed-precision recipe.

A recipe file (``--recipe FILE``, YAML or JSON) is an ordered list of ``regex -> scheme`` rules
and a default::

    default: W4A16              # a preset, a mapping (below), or null (leave unquantized)
    group_size: 128             # group size for presets named as plain strings (optional)
    rules:                      # first match wins, in file order (re.search on the module name)
      - match: 'self_attn\\.(q|k|v|o)_proj$'
        scheme: W8A16
      - match: 'mlp\\.experts'
        scheme: {preset: W4A16, group_size: 64}
      - match: 'mlp\\.down_proj$'
        scheme: null            # not quantized

Precedence, for a module name (checkpoint layout: ``model.layers.3.self_attn.q_proj``; routed
experts are matched by their experts module, ``model.layers.3.mlp.experts``):

1. ``--ignore`` regexes: unquantized, always;
2. the recipe's rules, in file order, first ``re.search`` match;
3. the recipe's ``default`` (if the file has no ``default`` key: ``--scheme`` / ``--group-size``).

Without a recipe every module gets ``--scheme`` unless ignored.  The resolved assignment (every
module -> scheme) is part of the resume signature, so two runs that differ only in bit
allocation never resume each other.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sq.errors import SqError
from sq.quant.schemes import QuantScheme, get_scheme

_MISSING = object()


@dataclass(frozen=True)
class Rule:
    pattern: str
    scheme: QuantScheme | None

    def __post_init__(self):
        object.__setattr__(self, "_re", re.compile(self.pattern))

    def matches(self, name: str) -> bool:
        return self._re.search(name) is not None


@dataclass(frozen=True)
class Assigner:
    """``assign(name) -> QuantScheme | None`` with the precedence in the module docstring."""

    default: QuantScheme | None
    rules: tuple[Rule, ...] = ()
    ignore: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "_ignore", [re.compile(p) for p in self.ignore])

    def assign(self, name: str) -> QuantScheme | None:
        if any(p.search(name) for p in self._ignore):
            return None
        for rule in self.rules:
            if rule.matches(name):
                return rule.scheme
        return self.default

    def to_dict(self) -> dict[str, Any]:
        return {"default": _scheme_dict(self.default), "ignore": list(self.ignore),
                "rules": [{"match": r.pattern, "scheme": _scheme_dict(r.scheme)} for r in self.rules]}


def _scheme_dict(s: QuantScheme | None):
    return None if s is None else s.to_dict()


def scheme_tag(s: QuantScheme | None) -> str:
    """A short, complete description of a scheme, e.g. ``int4-sym-group64`` (``none`` if unquantized)."""
    if s is None:
        return "none"
    if s.strategy in ("group", "tensor_group"):
        gran = f"{s.strategy}{s.group_size}"
    elif s.strategy == "block":
        gran = "block{}x{}".format(*s.block_structure)
    else:
        gran = s.strategy
    scale = "" if s.scale_dtype is None else f"-s:{s.scale_dtype}"
    act = "" if s.activations == "none" else f"-a:{s.activations}"
    return f"{s.type}{s.num_bits}-{'sym' if s.symmetric else 'asym'}-{gran}{scale}{act}"


def make_assigner(scheme: str, group_size: int, ignore=(), recipe: str | Path | None = None) -> Assigner:
    """The CLI's flags (and optional recipe file) -> an ``Assigner``; every problem raised at once."""
    default = get_scheme(scheme, group_size)
    if recipe is None:
        return Assigner(default, (), tuple(ignore))
    data = _read(Path(recipe))
    problems = []
    if not isinstance(data, dict):
        raise SqError(f"recipe {recipe}: expected a mapping with 'rules' (and optionally 'default', 'group_size')")
    unknown = sorted(set(data) - {"default", "group_size", "rules"})
    if unknown:
        problems.append(f"recipe {recipe}: unknown key(s) {unknown}; expected default, group_size, rules")
    gs = data.get("group_size", group_size)
    if "default" in data:
        try:
            default = _parse_scheme(data["default"], gs, f"recipe {recipe}: default")
        except SqError as e:
            problems += e.problems
    rules = []
    raw_rules = data.get("rules", [])
    if not isinstance(raw_rules, list):
        problems.append(f"recipe {recipe}: 'rules' must be a list of {{match, scheme}} entries")
        raw_rules = []
    for i, r in enumerate(raw_rules):
        where = f"recipe {recipe}: rule {i + 1}"
        if not isinstance(r, dict) or set(r) != {"match", "scheme"}:
            problems.append(f"{where}: expected exactly the keys 'match' and 'scheme', got {r!r}")
            continue
        try:
            re.compile(str(r["match"]))
        except re.error as e:
            problems.append(f"{where}: match {r['match']!r} is not a valid regular expression: {e}")
            continue
        try:
            rules.append(Rule(str(r["match"]), _parse_scheme(r["scheme"], gs, where)))
        except SqError as e:
            problems += e.problems
    if problems:
        raise SqError(problems)
    return Assigner(default, tuple(rules), tuple(ignore))


def _read(path: Path):
    if not path.exists():
        raise SqError(f"recipe file {path} does not exist")
    if not path.is_file():
        raise SqError(f"recipe {path} is not a file (a folder?); pass a .yaml, .yml or .json file")
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise SqError(f"recipe {path}: expected a .yaml, .yml or .json file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SqError(f"recipe {path}: not UTF-8 text (byte {e.start}); a recipe is a YAML or JSON text file") from None
    except OSError as e:
        raise SqError(f"recipe {path}: cannot be read ({e.strerror or e})") from None
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise SqError(f"recipe {path}: not valid JSON (line {e.lineno}: {e.msg})") from None
        except (ValueError, RecursionError) as e:  # an integer of more than 4300 digits, deep nesting
            raise SqError(f"recipe {path}: not valid JSON ({' '.join(str(e).split())[:200]})") from None
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SqError(f"recipe {path}: not valid YAML ({' '.join(str(e).split())})") from None
        except (ValueError, RecursionError) as e:  # e.g. a timestamp out of range, deep nesting
            raise SqError(f"recipe {path}: not valid YAML ({' '.join(str(e).split())[:200]})") from None
    raise SqError(f"recipe {path}: expected a .yaml, .yml or .json file")


def _parse_scheme(spec, group_size, where: str) -> QuantScheme | None:
    """``null`` | ``"W8A16"`` | ``{preset: W4A16, group_size: 64}`` | every ``QuantScheme`` field."""
    if spec is None or (isinstance(spec, str) and spec.lower() in ("none", "null")):
        return None
    if isinstance(spec, str):
        return get_scheme(spec, group_size)
    if isinstance(spec, dict):
        if "preset" in spec:
            extra = sorted(set(spec) - {"preset", "group_size"})
            if extra:
                raise SqError(f"{where}: with 'preset' only 'group_size' may be given, not {extra}")
            return get_scheme(spec["preset"], spec.get("group_size", group_size))
        try:
            return QuantScheme.from_dict(spec)
        except (TypeError, ValueError) as e:
            raise SqError(f"{where}: {e}") from None
    raise SqError(f"{where}: scheme must be a preset name, a mapping or null, got {spec!r}")
