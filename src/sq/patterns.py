"""User regular expressions (``--ignore``, recipe rules), proven to match in bounded time.

Python's ``re`` is a backtracking engine: a pattern such as ``^([a-z._0-9]+)+X$`` tries every way
of splitting a module name between its two quantifiers before it gives up, 2^n of them for a name
of n characters, and a job that matches it against a few hundred module names never gets to its
first line.  sq keeps ``re`` (its syntax and its answers are what users know) and refuses, before
anything runs, the patterns on which it can take that long.  The check is static -- a pure function
of the pattern, no clock involved -- so every rank refuses the same pattern with the same words.

How: the pattern is parsed with ``re``'s own parser and turned into an automaton that keeps the
backtracking engine's choices (every way a quantifier or an alternation can consume the same text
is a separate path).  Then, following Weideman et al. ("Analyzing matching time behavior of
backtracking regular expression matchers by using ambiguity of NFA", 2016):

- *exponential* ambiguity (a state with two different paths back to itself on the same text: a
  quantified group whose body can match the same text in two ways -- ``(a+)+``, ``(a|a)*``,
  ``(\\w+\\.?)*``) makes matching time exponential in the name's length: refused;
- *polynomial* ambiguity of degree d (a chain of d + 1 loops, each able to hand the same text to
  the next -- ``.*.*.*``) makes it about n^(d + 2) for ``re.search``; a degree up to
  ``MAX_DEGREE`` is allowed (``.*a.*b.*c`` on 100-character names: milliseconds), beyond it refused.

The analysis over-approximates (anchors and lookarounds are assumed to always pass; counted
repeats beyond a few copies are treated as unbounded), so it may refuse a pattern ``re`` would
in fact match fast, never the reverse; each refusal says how to rewrite the pattern.
Backreferences and conditional groups are refused outright: module names never need them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sq.errors import SqError

try:  # Python 3.11+: the parser and compiler re itself uses
    from re import _compiler as _sre_compile
    from re import _constants as _C
    from re import _parser as _sre_parse
except ImportError:  # pragma: no cover - older Pythons ship them under the old names
    import sre_compile as _sre_compile  # type: ignore[no-redef]
    import sre_constants as _C  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

__all__ = ["MAX_DEGREE", "pattern_problem", "check_patterns", "compile_pattern"]

MAX_DEGREE = 2  # the largest polynomial degree of ambiguity allowed (see the module docstring)
MAX_LENGTH = 4096  # characters of one pattern
_COPIES = 3  # copies of a counted repeat's body kept exact; beyond that the rest counts as unbounded
_MAX_POSITIONS = 2000  # character-consuming states after expansion
_MAX_STEPS = 2_000_000  # steps of the analysis itself: a pattern needing more is refused, deterministically
_MAX_DEPTH = 200  # nesting of groups and quantifiers

# characters a class is tested against: ASCII, plus one of each kind of non-ASCII character whose
# membership can differ from class to class (letters of both cases, digits, spaces, case-folding
# oddities such as the Kelvin sign, a character outside the BMP)
_UNIVERSE = [chr(i) for i in range(128)] + list(
    "\u00e9\u00c9\u00df\u0130\u0131\u017f\u212a\u03a9\u03c9\u0663\u00b2\u00a0\u2028\u3000\u4e2d\u00aa\ufb01\uffff") + [
    "\U0001f600", "\U0001d7d8"]

_ATOMS = {_C.LITERAL, _C.NOT_LITERAL, _C.ANY, _C.IN}
_REPEATS = {_C.MAX_REPEAT, _C.MIN_REPEAT} | ({_C.POSSESSIVE_REPEAT} if hasattr(_C, "POSSESSIVE_REPEAT") else set())


class _Refused(Exception):
    """Why a pattern is refused: ``reason`` finishes the sentence '... is refused: <reason>'."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class _NFA:
    """An epsilon-NFA built the way a backtracking engine explores a pattern: one path per choice."""

    n: int = 0
    eps: list[list[int]] = field(default_factory=list)  # node -> epsilon successors (repeats = parallel paths)
    chars: list[tuple[int, int, int]] = field(default_factory=list)  # (source node, class mask, target node)
    steps: int = 0

    def node(self) -> int:
        self.n += 1
        self.eps.append([])
        if self.n > 8 * _MAX_POSITIONS + 64:
            raise _Refused("it is too large to check (write a shorter pattern, or several)")
        return self.n - 1

    def edge(self, a: int, b: int) -> None:
        self.eps[a].append(b)

    def tick(self, k: int = 1) -> None:
        self.steps += k
        if self.steps > _MAX_STEPS:
            raise _Refused("it is too complex to prove that matching it ends quickly (simplify it, or split it "
                           "into several patterns)")


def _mask(node, flags: int) -> int:
    """The ``_UNIVERSE`` characters one atom (a literal, ``.``, a class) accepts, as a bit mask,
    decided by ``re`` itself on each single character (so flags and categories mean what they mean)."""
    state = _sre_parse.State()
    state.flags = flags
    code = _sre_compile.compile(_sre_parse.SubPattern(state, [node]), 0)
    m = 0
    for i, ch in enumerate(_UNIVERSE):
        if code.fullmatch(ch) is not None:
            m |= 1 << i
    return m


class _Builder:
    def __init__(self, nfa: _NFA, lookarounds: list):
        self.nfa = nfa
        self.lookarounds = lookarounds  # (sub-pattern, flags): analysed on their own
        self.masks: dict[tuple, int] = {}

    def seq(self, items, flags: int, depth: int) -> tuple[int, int]:
        nfa = self.nfa
        start = cur = nfa.node()
        for op, av in items:
            s, e = self.item(op, av, flags, depth)
            nfa.edge(cur, s)
            cur = e
        return start, cur

    def item(self, op, av, flags: int, depth: int) -> tuple[int, int]:
        nfa = self.nfa
        nfa.tick()
        if depth > _MAX_DEPTH:
            raise _Refused("it nests groups or quantifiers too deeply")
        if op in _ATOMS:
            key = (op, repr(av), flags)
            if key not in self.masks:
                self.masks[key] = _mask((op, av), flags)
            s, e = nfa.node(), nfa.node()
            if self.masks[key]:  # a class nothing matches is a dead end, not a position
                nfa.chars.append((s, self.masks[key], e))
                if len(nfa.chars) > _MAX_POSITIONS:
                    raise _Refused("it is too large to check (write a shorter pattern, or several)")
            return s, e
        if op is _C.SUBPATTERN:
            _group, add, remove, sub = av
            return self.seq(sub, (flags | add) & ~remove, depth + 1)
        if op is _C.ATOMIC_GROUP:
            return self.seq(av, flags, depth + 1)
        if op is _C.BRANCH:
            s, e = nfa.node(), nfa.node()
            for alt in av[1]:
                bs, be = self.seq(alt, flags, depth + 1)
                nfa.edge(s, bs)
                nfa.edge(be, e)
            return s, e
        if op in _REPEATS:
            return self.repeat(av, flags, depth + 1)
        if op in (_C.ASSERT, _C.ASSERT_NOT):
            self.lookarounds.append((av[1], flags))
            return self.empty()
        if op is _C.AT:
            return self.empty()  # anchors and \b: assumed to pass (an over-approximation)
        if op in (_C.GROUPREF, _C.GROUPREF_EXISTS) or str(op).startswith("GROUPREF"):
            raise _Refused("backreferences and conditional groups are not supported in module-name patterns "
                           "(write the alternatives out)")
        raise _Refused(f"it uses {op}, which sq cannot check")

    def empty(self) -> tuple[int, int]:
        s, e = self.nfa.node(), self.nfa.node()
        self.nfa.edge(s, e)
        return s, e

    def repeat(self, av, flags: int, depth: int) -> tuple[int, int]:
        """``body{lo,hi}``, as a superset of the engine's choices (so the analysis stays on the safe
        side): a body of fixed text (no quantifier, no alternative inside) counted a few times is
        expanded exactly; any other counted repeat counts as unbounded -- ``(x{2,5}){3}`` splits a
        run of x's in many ways without any loop, and is analysed as the loop ``(x{2,5})+``."""
        lo, hi, body = av
        nfa = self.nfa
        unbounded = hi == _C.MAXREPEAT
        if not unbounded and (lo > _COPIES or hi - lo > _COPIES or not _fixed(body)):
            unbounded, lo = True, min(lo, 1)
        start = cur = nfa.node()
        for _ in range(min(lo, _COPIES)):
            s, e = self.seq(body, flags, depth)
            nfa.edge(cur, s)
            cur = e
        if unbounded:
            # star: enter the body or leave; after the body, again or leave
            s, e = self.seq(body, flags, depth)
            end = nfa.node()
            nfa.edge(cur, s)
            nfa.edge(cur, end)
            nfa.edge(e, s)
            nfa.edge(e, end)
            return start, end
        # hi - lo optional copies, nested: body(body(body)?)? -- one way to match k copies
        end = nfa.node()
        for _ in range(hi - lo):
            s, e = self.seq(body, flags, depth)
            nfa.edge(cur, s)
            nfa.edge(cur, end)
            cur = e
        nfa.edge(cur, end)
        return start, end


def _fixed(items) -> bool:
    """Whether a parsed sequence matches text of one shape only: atoms, anchors and groups of them."""
    for op, av in items:
        if op is _C.SUBPATTERN:
            if not _fixed(av[3]):
                return False
        elif op is _C.ATOMIC_GROUP:
            if not _fixed(av):
                return False
        elif op not in _ATOMS and op is not _C.AT:
            return False
    return True


def _sccs(n: int, succ) -> list[int]:
    """Strongly connected components (iterative Tarjan): node -> component id."""
    index, low, comp = [-1] * n, [0] * n, [-1] * n
    stack, on, counter, ncomp = [], [False] * n, 0, 0
    for root in range(n):
        if index[root] != -1:
            continue
        work = [(root, iter(succ(root)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on[root] = True
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if index[w] == -1:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on[w] = True
                    work.append((w, iter(succ(w))))
                    advanced = True
                    break
                if on[w]:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on[w] = False
                    comp[w] = ncomp
                    if w == v:
                        break
                ncomp += 1
    return comp


def _epsilon_counts(nfa: _NFA, targets: set[int]) -> list[dict[int, int]]:
    """For every node, the ``targets`` its epsilon paths reach, each with the number of distinct
    paths, capped at 2 (two ways to reach the same point is all the analysis needs; an epsilon
    cycle on the way counts as two)."""
    n = nfa.n
    comp = _sccs(n, lambda v: nfa.eps[v])
    members: dict[int, list[int]] = {}
    for v in range(n):
        members.setdefault(comp[v], []).append(v)
    out: dict[int, dict[int, int]] = {}
    for c in sorted(members):  # Tarjan numbers a component after every component it reaches
        vs = members[c]
        cyclic = len(vs) > 1 or vs[0] in nfa.eps[vs[0]]
        counts: dict[int, int] = {v: 1 for v in vs if v in targets}
        for v in vs:
            nfa.tick(len(nfa.eps[v]) + 1)
            for w in nfa.eps[v]:
                if comp[w] == c:
                    continue
                for t, k in out[comp[w]].items():
                    counts[t] = min(2, counts.get(t, 0) + k)
        out[c] = {t: 2 for t in counts} if cyclic else counts
    return [out[comp[v]] for v in range(n)]


def _position_graph(nfa: _NFA) -> tuple[list[int], list[dict[int, int]]]:
    """The epsilon-free automaton: its states are the character-consuming edges (positions);
    ``succ[p]`` maps the positions that can read the next character to the number of ways (1 or 2)."""
    counts = _epsilon_counts(nfa, {s for s, _m, _e in nfa.chars})
    by_source: dict[int, list[int]] = {}
    for k, (s, _m, _e) in enumerate(nfa.chars):
        by_source.setdefault(s, []).append(k)

    def successors(node: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for t, c in counts[node].items():
            for k in by_source.get(t, ()):
                out[k] = min(2, out.get(k, 0) + c)
        return out

    masks = [m for _s, m, _e in nfa.chars]
    return masks, [successors(e) for _s, _m, e in nfa.chars]


def _exponential(masks, succ, comp, nfa: _NFA) -> bool:
    """Two different paths from a position back to itself on the same text (within one loop)."""
    members: dict[int, list[int]] = {}
    for p, c in enumerate(comp):
        members.setdefault(c, []).append(p)
    for c, ps in members.items():
        inside = set(ps)
        if len(ps) == 1 and ps[0] not in succ[ps[0]]:
            continue  # not a loop
        # the product of the loop with itself: pairs reading the same characters
        for p in ps:
            for q, k in succ[p].items():
                if q in inside and k > 1:
                    return True  # two ways from p to q on one character, inside a loop: p ->..-> p twice
        pairs = [(p, q) for p in ps for q in ps if masks[p] & masks[q]]
        index = {pq: i for i, pq in enumerate(pairs)}

        def psucc(i: int):
            p, q = pairs[i]
            nfa.tick(len(succ[p]) * len(succ[q]) + 1)
            return [index[(a, b)] for a in succ[p] if a in inside for b in succ[q]
                    if b in inside and masks[a] & masks[b]]

        pcomp = _sccs(len(pairs), psucc)
        diagonal = {pcomp[index[(p, p)]] for p in ps if (p, p) in index}
        for i, (p, q) in enumerate(pairs):
            if p != q and pcomp[i] in diagonal:
                return True
    return False


def _ida_degree(masks, succ, comp, nfa: _NFA) -> int:
    """The longest chain of loops each of which can hand the same text to the next (Weideman's
    degree of infinite ambiguity); polynomial matching time of about n^(degree + 2) for search."""
    loops = [p for p in range(len(masks)) if any(comp[q] == comp[p] for q in succ[p])]
    if len(loops) < 2:
        return 0
    members: dict[int, set[int]] = {}
    for p in loops:
        members.setdefault(comp[p], set()).add(p)
    # which loops reach which (over the whole automaton)
    reach: dict[int, set[int]] = {}
    for p in loops:
        seen, todo = {p}, [p]
        while todo:
            u = todo.pop()
            nfa.tick(len(succ[u]) + 1)
            for w in succ[u]:
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        reach[p] = seen
    edges: dict[int, set[int]] = {c: set() for c in members}
    for cp, ps in members.items():
        for cq, qs in members.items():
            if cp == cq or cq in edges[cp]:
                continue
            if any(_ida_pair(p, q, members[cp], members[cq], masks, succ, nfa)
                   for p in ps for q in qs if q in reach[p]):
                edges[cp].add(cq)
    memo: dict[int, int] = {}

    def longest(c: int) -> int:  # the component graph is acyclic
        if c not in memo:
            memo[c] = max((1 + longest(d) for d in edges[c]), default=0)
        return memo[c]

    return max(longest(c) for c in members)


def _ida_pair(p: int, q: int, cp: set[int], cq: set[int], masks, succ, nfa: _NFA) -> bool:
    """Paths p -> p, p -> q and q -> q on one text: the triple (p, p, q) reaches (p, q, q)."""
    start, goal = (p, p, q), (p, q, q)
    seen, todo = {start}, [start]
    while todo:
        a, b, c = todo.pop()
        nfa.tick(len(succ[a]) * len(succ[b]) + 1)
        for a2 in succ[a]:
            if a2 not in cp:
                continue
            for b2 in succ[b]:
                ab = masks[a2] & masks[b2]
                if not ab:
                    continue
                for c2 in succ[c]:
                    if c2 in cq and ab & masks[c2]:
                        t = (a2, b2, c2)
                        if t == goal:
                            return True
                        if t not in seen:
                            seen.add(t)
                            todo.append(t)
    return False


def _analyse(items, flags: int) -> tuple[bool, int]:
    """(exponential?, polynomial degree) of one parsed (sub-)pattern, lookarounds included."""
    nfa = _NFA()
    pending = [(items, flags)]
    worst = (False, 0)
    while pending:
        sub, f = pending.pop()
        nfa = _NFA(steps=nfa.steps)
        b = _Builder(nfa, pending)
        b.seq(sub, f, 0)
        masks, succ = _position_graph(nfa)
        comp = _sccs(len(masks), lambda v: list(succ[v]))
        if _exponential(masks, succ, comp, nfa):
            return True, worst[1]
        worst = (False, max(worst[1], _ida_degree(masks, succ, comp, nfa)))
    return worst


def pattern_problem(pattern, what: str) -> str | None:
    """Why ``pattern`` cannot be used as a module-name regex (``what`` names it for the user, e.g.
    ``--ignore 'x'`` or ``recipe r.yaml: rule 2: match 'x'``), or None if it can."""
    if not isinstance(pattern, str):
        return f"{what} must be a string (a regular expression), got {type(pattern).__name__}"
    if len(pattern) > MAX_LENGTH:
        return f"{what} is {len(pattern)} characters long; at most {MAX_LENGTH} are accepted (use several patterns)"
    try:
        parsed = _sre_parse.parse(pattern, 0)
    except re.error as e:
        return f"{what} is not a valid regular expression: {e}"
    except (RecursionError, OverflowError, ValueError) as e:
        return f"{what} is not a valid regular expression: {' '.join(str(e).split())[:200] or type(e).__name__}"
    try:
        exponential, degree = _analyse(list(parsed), parsed.state.flags)
    except _Refused as e:
        return f"{what} is refused: {e.reason}"
    except RecursionError:
        return f"{what} is refused: it nests groups or quantifiers too deeply"
    if exponential:
        return (f"{what} is refused: a quantified group can match the same text in more than one way (a "
                "quantifier inside a quantifier, or alternatives that overlap, such as '(x+)+' or '(a|ab)*'), so "
                "Python's regex engine can take exponential time on a long module name; write it with one "
                "quantifier per stretch of text, e.g. '[a-z._0-9]+X' instead of '([a-z._0-9]+)+X'")
    if degree > MAX_DEGREE:
        return (f"{what} is refused: {degree + 1} quantifiers in a row can each match the same text (such as "
                "'.*.*.*.*'), so matching takes time growing as the name's length to the power "
                f"{degree + 2}; anchor them with literal text between them (e.g. 'layers\\.1\\..*mlp' "
                "instead of '.*1.*.*mlp.*')")
    return None


def check_patterns(patterns, what) -> list[str]:
    """``pattern_problem`` for several patterns; ``what(pattern)`` names each."""
    return [p for p in (pattern_problem(pat, what(pat)) for pat in patterns) if p is not None]


def compile_pattern(pattern: str, what: str) -> re.Pattern:
    """``re.compile(pattern)`` once ``pattern_problem`` found nothing; else an ``SqError`` naming it."""
    problem = pattern_problem(pattern, what)
    if problem is not None:
        raise SqError(problem)
    return re.compile(pattern)
