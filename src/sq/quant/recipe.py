"""Which scheme each module gets: one scheme for all, or a mixed-precision recipe.

A recipe file (``--recipe FILE``, YAML or JSON) is an ordered list of ``regex -> scheme`` rules
and a default::

    default: W4A16              # a preset, a mapping (below), or null (leave unquantized)
    group_size: 128             # group size for presets named as plain strings (optional)
    rules:                      # first match wins, in file order (re.search on the module name)
      - match: 'self_attn\\.(q|k|v|o)_proj$'
        scheme: W8A16
      - match: 'mlp\\.experts'
        scheme: {preset: W4A16, group_size: 64, int_grid: full}   # int_grid: see --int-grid
      - match: 'mlp\\.down_proj$'
        scheme: null            # not quantized

Precedence, for a module name (checkpoint layout: ``model.layers.3.self_attn.q_proj``; routed
experts are matched by their experts module, ``model.layers.3.mlp.experts``):

1. ``--ignore`` regexes: unquantized, always;
2. the recipe's rules, in file order, first ``re.search`` match;
3. the recipe's ``default`` (if the file has no ``default`` key: ``--scheme`` / ``--group-size``).

Without a recipe every module gets ``--scheme`` unless ignored.  ``--int-grid full`` puts every
symmetric integer scheme that names no ``int_grid`` of its own on the full-range grid
(``QuantScheme.int_grid``).  The resolved assignment (every
module -> scheme) is part of the resume signature, so two runs that differ only in bit
allocation never resume each other.

Mistakes are refused, not guessed at: a pattern on which Python's backtracking engine could run
for ever (``sq.patterns``), a key given twice in the file (YAML and JSON keep the last one
silently), and -- once the model is known -- an ``--ignore`` pattern or rule that matches no
module (``Assigner.unmatched_problems``; ``--allow-unmatched`` accepts them with a warning).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sq.errors import SqError
from sq.patterns import compile_pattern, pattern_problem
from sq.formats.schemes import INT_GRIDS, QuantScheme, get_scheme, with_int_grid

logger = logging.getLogger(__name__)

_MISSING = object()
ALLOW_UNMATCHED = "pass --allow-unmatched (sq.quantize: allow_unmatched=True) to run anyway"


def ignore_label(pattern) -> str:
    """How an ``--ignore`` pattern is named in messages."""
    return f"--ignore {pattern!r}"


@dataclass(frozen=True)
class Rule:
    pattern: str
    scheme: QuantScheme | None
    where: str = field(default="", compare=False)  # how messages name it: "recipe F: rule 2"

    def __post_init__(self):
        object.__setattr__(self, "_re", compile_pattern(self.pattern, self.label))

    @property
    def label(self) -> str:
        return f"{self.where or 'recipe rule'} (match {self.pattern!r})"

    def matches(self, name: str) -> bool:
        return self._re.search(name) is not None


@dataclass(frozen=True)
class Assigner:
    """``assign(name) -> QuantScheme | None`` with the precedence in the module docstring.

    It remembers every name it was asked about, so that once a job has asked about each module
    it may quantize, ``unmatched_problems`` can name the user's patterns that matched none."""

    default: QuantScheme | None
    rules: tuple[Rule, ...] = ()
    ignore: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "_ignore", [compile_pattern(p, ignore_label(p)) for p in self.ignore])
        object.__setattr__(self, "_asked", set())

    def assign(self, name: str) -> QuantScheme | None:
        self._asked.add(name)
        if any(p.search(name) for p in self._ignore):
            return None
        for rule in self.rules:
            if rule.matches(name):
                return rule.scheme
        return self.default

    def unmatched_problems(self, others: Iterable[str] = (), *, allow: bool = False) -> list[str]:
        """The ``--ignore`` patterns and recipe rules that match no module (typos: a silent no-op
        otherwise), judged against every name ``assign`` was asked about and ``others`` (Linears sq
        never quantizes: ``lm_head``, routers -- an ``--ignore`` of them is harmless, a rule giving
        them a scheme does nothing and is refused too).  With ``allow`` they are logged as warnings
        and nothing is refused.  Identical on every rank (the same model, the same names)."""
        asked = sorted(self._asked)
        others = sorted(set(others) - self._asked)
        like = ", ".join(repr(n) for n in (asked or others)[:2])
        hint = f"module names look like {like}" if like else "the model has no module such a pattern could name"
        found = []  # (what is wrong, how to fix it)
        for pat, rx in zip(self.ignore, self._ignore):
            if not any(rx.search(n) for n in asked) and not any(rx.search(n) for n in others):
                found.append((f"{ignore_label(pat)} matches no module of this model ({hint}; matched with "
                              "re.search, e.g. 'lm_head' or 'mlp\\.down_proj$')", "fix the pattern"))
        for rule in self.rules:
            if any(rule.matches(n) for n in asked):
                continue
            hits = [n for n in others if rule.matches(n)]
            if not hits:
                found.append((f"{rule.label} matches no module of this model ({hint})", "fix the pattern"))
            elif rule.scheme is not None:
                more = f" and {len(hits) - 3} more" if len(hits) > 3 else ""
                found.append((f"{rule.label} matches only {', '.join(map(repr, hits[:3]))}{more}, which sq keeps "
                              "in full precision (outside the decoder blocks, or MoE routers), so the rule changes "
                              "nothing", "remove the rule"))
        if allow:
            for what, _fix in found:
                logger.warning("%s (accepted: --allow-unmatched)", what)
            return []
        return [f"{what}; {fix}, or {ALLOW_UNMATCHED}" for what, fix in found]

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
    sym = ("sym" if s.int_grid is None else f"sym{s.int_grid}") if s.symmetric else "asym"
    return f"{s.type}{s.num_bits}-{sym}-{gran}{scale}{act}"


def make_assigner(scheme: str, group_size: int, ignore=(), recipe: str | Path | None = None,
                  int_grid: str = "standard") -> Assigner:
    """The CLI's flags (and optional recipe file) -> an ``Assigner``; every problem raised at once.
    ``int_grid`` (``--int-grid``) applies to every symmetric integer scheme that names no grid itself."""
    if int_grid not in INT_GRIDS:
        raise SqError(f"--int-grid must be one of auto, {', '.join(INT_GRIDS)}, got {int_grid!r}")
    if int_grid != "standard":
        a = make_assigner(scheme, group_size, ignore, recipe)
        return Assigner(with_int_grid(a.default, int_grid),
                        tuple(dataclasses.replace(r, scheme=with_int_grid(r.scheme, int_grid)) for r in a.rules),
                        a.ignore)
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
        match = r["match"]
        if isinstance(match, (int, float)) and not isinstance(match, bool):
            match = str(match)  # YAML reads `match: 61` as a number
        bad = pattern_problem(match, f"{where}: match {match!r}")
        if bad is not None:
            problems.append(bad)
            continue
        try:
            rules.append(Rule(match, _parse_scheme(r["scheme"], gs, where), where=where))
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
            return json.loads(text, object_pairs_hook=_unique_pairs)
        except _DuplicateKey as e:
            lines = [text.count("\n", 0, m.start()) + 1
                     for m in re.finditer(re.escape(json.dumps(e.key)) + r"\s*:", text)]
            at = f" (lines {', '.join(map(str, lines[:-1]))} and {lines[-1]})" if len(lines) > 1 else ""
            raise SqError(f"recipe {path}: key {e.key!r} is given twice in one object{at}; JSON keeps only the last "
                          "one silently, so sq refuses the file: remove one") from None
        except json.JSONDecodeError as e:
            raise SqError(f"recipe {path}: not valid JSON (line {e.lineno}: {e.msg})") from None
        except (ValueError, RecursionError) as e:  # an integer of more than 4300 digits, deep nesting
            raise SqError(f"recipe {path}: not valid JSON ({' '.join(str(e).split())[:200]})") from None
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
        except _DuplicateKey as e:
            raise SqError(f"recipe {path}: key {e.key!r} is given twice in one mapping (lines {e.first} and "
                          f"{e.second}); YAML keeps only the last one silently, so sq refuses the file: remove "
                          "one") from None
        except yaml.YAMLError as e:
            raise SqError(f"recipe {path}: not valid YAML ({' '.join(str(e).split())})") from None
        except (ValueError, RecursionError) as e:  # e.g. a timestamp out of range, deep nesting
            raise SqError(f"recipe {path}: not valid YAML ({' '.join(str(e).split())[:200]})") from None
    raise SqError(f"recipe {path}: expected a .yaml, .yml or .json file")


class _DuplicateKey(Exception):
    def __init__(self, key, first: int | None = None, second: int | None = None):
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def _unique_pairs(pairs: list) -> dict:
    """``json.loads``' ``object_pairs_hook``: a key given twice in one object is refused."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _unique_key_loader():
    """A ``yaml.SafeLoader`` that refuses a key given twice in one mapping (``<<`` merges keep
    their YAML meaning: an explicit key overrides a merged one)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen: dict = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: the constructor below names it
                continue
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return UniqueKeyLoader


def _parse_scheme(spec, group_size, where: str) -> QuantScheme | None:
    """``null`` | ``"W8A16"`` | ``{preset: W4A16, group_size: 64}`` | every ``QuantScheme`` field."""
    if spec is None or (isinstance(spec, str) and spec.lower() in ("none", "null")):
        return None
    if isinstance(spec, str):
        return get_scheme(spec, group_size)
    if isinstance(spec, dict):
        if "preset" in spec:
            extra = sorted(set(spec) - {"preset", "group_size", "int_grid"})
            if extra:
                raise SqError(f"{where}: with 'preset' only 'group_size' and 'int_grid' may be given, not {extra}")
            try:
                scheme = get_scheme(spec["preset"], spec.get("group_size", group_size))
                # named explicitly: validated (a grid the preset cannot take is refused, not ignored)
                return dataclasses.replace(scheme, int_grid=spec["int_grid"]) if "int_grid" in spec else scheme
            except ValueError as e:
                raise SqError(f"{where}: {e}") from None
        try:
            return QuantScheme.from_dict(spec)
        except (TypeError, ValueError) as e:
            raise SqError(f"{where}: {e}") from None
    raise SqError(f"{where}: scheme must be a preset name, a mapping or null, got {spec!r}")
