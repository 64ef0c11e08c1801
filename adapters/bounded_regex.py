"""Regexes from an uploaded adapter_config.json, matched in bounded work.

peft matches `target_modules` (a str), `exclude_modules` (a str),
`layers_pattern`, and the keys of `rank_pattern` and `alpha_pattern` with
Python's `re`, a backtracking engine: `(a+)+$` against a 30-character module
name takes minutes, and it holds the GIL throughout, so one upload would
freeze the whole gateway. Here every such regex is

- parsed by Python's own parser (`re._parser`), so the syntax, the errors and
  the meaning are the `re` module's, and compiled by `re` too, so whatever
  `re` (and therefore peft) rejects is rejected here as an `AdapterError`;
- limited to `MAX_PATTERN_CHARS` characters and, once counted repeats
  (`x{3,5}`) are unrolled, to `MAX_PROGRAM` NFA instructions;
- matched by a Pike VM (Thompson's NFA simulation, as in RE2): at most one
  thread per instruction per text position, so a match costs
  O(instructions x text length) whatever the pattern. Lookarounds are
  evaluated once per (lookaround, position) and memoized. Thread priority
  follows backtracking order, so the first match, and whether a group took
  part in it, are the ones `re` would find.
- charged to a `MatchBudget` shared by one config: the total work over the
  base model's finite list of module names has a hard ceiling, counted in
  VM steps, never in seconds.

Backreferences, conditionals, atomic groups and possessive repeats have no
NFA (backreferences make matching NP-hard) and are refused; no PEFT adapter
needs them. Character classes are exact on ASCII text, which every module
name is.

A pattern made only of single-character tests (`q_proj`, `layers.0.mlp`,
`[kv]_proj`) is handed to `re` itself: it cannot backtrack inside, and the
wrappers peft puts around it (`(.*\\.)?(P)$`) cost O(n^2) at worst on a name
of n characters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from re import _constants as sre  # Python's own regex parser: same syntax and meaning as `re`
from re import _parser as sre_parse

from adapters.errors import AdapterError

MAX_PATTERN_CHARS = 512
MAX_PROGRAM = 2_000
# Pike VM steps (thread visits) for all the regexes of one adapter_config.json
# against all the base model's module names. Real configs use well under 1%
# of it (an 80-layer model, `.*\.(q_proj|v_proj)`: about 60k steps).
MATCH_BUDGET = 5_000_000

_CHAR, _SPLIT, _JMP, _SAVE, _AT, _LOOK, _MATCH = range(7)
_SINGLE_CHAR_OPS = (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN)
_ANCHORS = (sre.AT_BEGINNING, sre.AT_BEGINNING_STRING, sre.AT_END, sre.AT_END_STRING,
            sre.AT_BOUNDARY, sre.AT_NON_BOUNDARY)
_NO_NFA = {
    sre.GROUPREF: "backreferences", sre.GROUPREF_EXISTS: "conditional groups",
    sre.ATOMIC_GROUP: "atomic groups", sre.POSSESSIVE_REPEAT: "possessive repeats",
}


class MatchBudget:
    """VM steps left for one adapter config; running out is a refusal, not a timeout."""

    def __init__(self, steps: int = MATCH_BUDGET):
        self.left = steps

    def spend(self, steps: int) -> None:
        self.left -= steps
        if self.left < 0:
            raise AdapterError(
                f"adapter_config.json: matching its regexes against the base model's module names "
                f"needs more than {MATCH_BUDGET} steps; use plainer target_modules/rank_pattern/"
                "alpha_pattern patterns (e.g. lists of module names)"
            )


@dataclass(frozen=True)
class Match:
    """A successful match; `group` is the tracked group's span, None if it took no part."""

    group: tuple[int, int] | None


class BoundedRegex:
    """`pattern` (what peft would hand to `re`), ready to match in bounded work.

    `where` names the config field for messages; `user_part` is the part the
    tenant wrote (for the size limit and the single-character fast path),
    `track` the name of one group whose span `match` reports.
    """

    def __init__(self, pattern: str, *, where: str, user_part: str | None = None, track: str | None = None):
        user_part = pattern if user_part is None else user_part
        if not isinstance(user_part, str):
            raise AdapterError(f"{where}: a regex must be a string, got {user_part!r}")
        if len(user_part) > MAX_PATTERN_CHARS:
            raise AdapterError(f"{where}: regex of {len(user_part)} characters; at most {MAX_PATTERN_CHARS}")
        try:
            user_tree = sre_parse.parse(user_part)
            tree = sre_parse.parse(pattern)
            group = tree.state.groupdict.get(track) if track else None
            program = None if _single_chars(user_tree) else _Compiler(group, where).compile(tree)
            compiled = re.compile(pattern)  # also refuses what only re's compiler checks (look-behind width)
        except re.error as exc:
            raise AdapterError(f"{where}: invalid regex {user_part!r}: {exc}") from None
        except (RecursionError, OverflowError) as exc:
            raise AdapterError(f"{where}: regex {user_part!r} is too deeply nested ({exc})") from None
        self.pattern = pattern
        self._program = program
        self._re = compiled if program is None else None
        self._track = track

    @property
    def states(self) -> int:
        """NFA instructions (0 when `re` runs it): a match costs at most
        2 x states x (len(text) + 1) steps, lookarounds aside."""
        return 0 if self._program is None else len(self._program)

    def fullmatch(self, text: str, budget: MatchBudget) -> bool:
        if self._re is not None:
            budget.spend(1)  # one C-speed match of at most O(n^2) steps on a short name
            return self._re.fullmatch(text) is not None
        return _Vm(text, budget).run(self._program, 0, len(text)) is not None

    def match(self, text: str, budget: MatchBudget) -> Match | None:
        """`re.match`: anchored at the start, ending anywhere."""
        if self._re is not None:
            budget.spend(1)
            m = self._re.match(text)
            if m is None:
                return None
            return Match(m.span(self._track) if self._track and m.group(self._track) is not None else None)
        span = _Vm(text, budget).run(self._program, 0, None)
        return None if span is None else Match(span if span[0] >= 0 else None)


def _single_chars(tree) -> bool:
    return all(op in _SINGLE_CHAR_OPS for op, _ in tree)


# ---- compiling a parse tree to a Pike VM program ---------------------------


class _Compiler:
    """Emits [op, ...] instructions; counted repeats are unrolled, so the
    program size is the honest measure of a pattern's cost."""

    def __init__(self, track_group: int | None, where: str):
        self.track_group = track_group
        self.where = where
        self.prog: list[list] = []

    def compile(self, tree) -> list[list]:
        self.seq(tree, tree.state.flags)
        self.emit(_MATCH)
        return self.prog

    def emit(self, op: int, *args) -> int:
        self._reserve(1)
        self.prog.append([op, *args])
        return len(self.prog) - 1

    def _reserve(self, count: int) -> None:
        if len(self.prog) + count > MAX_PROGRAM:
            raise AdapterError(
                f"{self.where}: regex too complex (over {MAX_PROGRAM} NFA states once counted repeats are "
                "unrolled)"
            )

    def seq(self, items, flags: int) -> None:
        for op, av in items:
            self.node(op, av, flags)

    def node(self, op, av, flags: int) -> None:
        if op in _SINGLE_CHAR_OPS:
            self.emit(_CHAR, _char_test(op, av, flags))
        elif op is sre.SUBPATTERN:
            group, add_flags, del_flags, body = av
            inner = (flags | add_flags) & ~del_flags
            tracked = group is not None and group == self.track_group
            if tracked:
                self.emit(_SAVE, 0)
            self.seq(body, inner)
            if tracked:
                self.emit(_SAVE, 1)
        elif op is sre.BRANCH:
            self.branch(av[1], flags)
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            self.repeat(*av, greedy=op is sre.MAX_REPEAT, flags=flags)
        elif op is sre.AT:
            if av not in _ANCHORS:
                raise AdapterError(f"{self.where}: the anchor {av} is not supported in adapter regexes")
            self.emit(_AT, av, flags)
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            direction, body = av
            sub = _Compiler(None, self.where)
            sub.seq(body, flags)
            sub.emit(_MATCH)
            self._reserve(len(sub.prog) + 1)  # a lookaround's program counts toward the limit
            width = None if direction == 1 else body.getwidth()[0]
            self.emit(_LOOK, sub.prog, width, op is sre.ASSERT_NOT)
        elif op is sre.FAILURE:
            self.emit(_CHAR, lambda c: False)
        else:
            what = _NO_NFA.get(op, f"the regex construct {op}")
            raise AdapterError(f"{self.where}: {what} are not supported in adapter regexes")

    def branch(self, alternatives, flags: int) -> None:
        exits = []
        for i, alternative in enumerate(alternatives):
            if i < len(alternatives) - 1:
                split = self.emit(_SPLIT, None, None)
                self.prog[split][1] = split + 1
                self.seq(alternative, flags)
                exits.append(self.emit(_JMP, None))
                self.prog[split][2] = len(self.prog)
            else:
                self.seq(alternative, flags)
        for jump in exits:
            self.prog[jump][1] = len(self.prog)

    def repeat(self, lo: int, hi: int, body, *, greedy: bool, flags: int) -> None:
        for _ in range(lo):
            start = len(self.prog)
            self.seq(body, flags)
            if len(self.prog) == start:
                return  # an empty body repeated is empty, however many times
        if hi == sre.MAXREPEAT:
            loop = self.emit(_SPLIT, None, None)
            self.seq(body, flags)
            self.emit(_JMP, loop)
            self._point(loop, greedy)
            return
        splits = []
        for _ in range(hi - lo):
            splits.append(self.emit(_SPLIT, None, None))
            self.seq(body, flags)
        for split in splits:
            self._point(split, greedy)

    def _point(self, split: int, greedy: bool) -> None:
        """Aim `split` at its body (split + 1) and at the end, in priority order."""
        body, out = split + 1, len(self.prog)
        self.prog[split][1:] = [body, out] if greedy else [out, body]


def _char_test(op, av, flags: int):
    ignore = bool(flags & sre.SRE_FLAG_IGNORECASE)
    if op is sre.ANY:
        return (lambda c: True) if flags & sre.SRE_FLAG_DOTALL else (lambda c: c != "\n")
    if op in (sre.LITERAL, sre.NOT_LITERAL):
        want = chr(av).lower() if ignore else chr(av)
        hit = (lambda c: c.lower() == want) if ignore else (lambda c: c == want)
        return hit if op is sre.LITERAL else (lambda c: not hit(c))
    negate = bool(av) and av[0][0] is sre.NEGATE
    tests = [_set_item(kind, value, flags, ignore) for kind, value in av if kind is not sre.NEGATE]
    return lambda c: any(t(c) for t in tests) != negate


def _set_item(kind, value, flags: int, ignore: bool):
    if kind is sre.LITERAL:
        return _char_test(sre.LITERAL, value, flags)
    if kind is sre.RANGE:
        lo, hi = value
        if ignore:
            return lambda c: any(lo <= ord(x) <= hi for x in (c, c.lower(), c.upper()))
        return lambda c: lo <= ord(c) <= hi
    if kind is sre.CATEGORY:
        return _category(value, flags)
    raise AdapterError(f"character class item {kind} is not supported in adapter regexes")


def _category(category, flags: int):
    ascii_only = bool(flags & sre.SRE_FLAG_ASCII)
    word = _word_test(flags)
    base = {
        "DIGIT": (lambda c: "0" <= c <= "9") if ascii_only else str.isdecimal,
        "SPACE": (lambda c: c in " \t\n\r\f\v") if ascii_only else str.isspace,
        "WORD": word,
        "LINEBREAK": lambda c: c == "\n",
    }
    name = str(category).removeprefix("CATEGORY_")
    positive = base.get(name.removeprefix("NOT_"))
    if positive is None:
        raise AdapterError(f"character category {category} is not supported in adapter regexes")
    return (lambda c: not positive(c)) if name.startswith("NOT_") else positive


def _word_test(flags: int):
    if flags & sre.SRE_FLAG_ASCII:
        return lambda c: c.isascii() and (c.isalnum() or c == "_")
    return lambda c: c.isalnum() or c == "_"


# ---- the Pike VM -----------------------------------------------------------


class _Vm:
    """One text; lookaround results memoized per (program, position)."""

    def __init__(self, text: str, budget: MatchBudget):
        self.text = text
        self.budget = budget
        self._looks: dict[tuple[int, int], bool] = {}

    def run(self, prog: list[list], start: int, end_at: int | None) -> tuple[int, int] | None:
        """The tracked group's span (-1, -1 if it took no part) of the
        highest-priority match from `start`, ending at `end_at` if given."""
        text, n = self.text, len(self.text)
        threads = self._closure(prog, [(0, (-1, -1))], start)
        found = None
        pos = start
        while threads:
            self.budget.spend(len(threads))
            seeds = []
            for pc, caps in threads:
                instruction = prog[pc]
                if instruction[0] == _MATCH:
                    if end_at is None or pos == end_at:
                        found = caps
                        break  # every lower-priority thread loses to this match
                elif pos < n and instruction[1](text[pos]):
                    seeds.append((pc + 1, caps))
            if pos >= n or (end_at is not None and pos >= end_at):
                break
            pos += 1
            threads = self._closure(prog, seeds, pos)
        return found

    def _closure(self, prog: list[list], seeds, pos: int) -> list:
        """Follow the empty transitions from `seeds` in priority order: the
        threads waiting on a character (or at MATCH), one per instruction."""
        out, seen = [], set()
        for seed in seeds:
            stack = [seed]
            while stack:
                pc, caps = stack.pop()
                if pc in seen:
                    continue
                seen.add(pc)
                instruction = prog[pc]
                op = instruction[0]
                if op == _JMP:
                    stack.append((instruction[1], caps))
                elif op == _SPLIT:
                    stack.append((instruction[2], caps))
                    stack.append((instruction[1], caps))
                elif op == _SAVE:
                    caps = (pos, caps[1]) if instruction[1] == 0 else (caps[0], pos)
                    stack.append((pc + 1, caps))
                elif op == _AT:
                    if self._at(instruction[1], instruction[2], pos):
                        stack.append((pc + 1, caps))
                elif op == _LOOK:
                    if self._look(instruction, pos):
                        stack.append((pc + 1, caps))
                else:
                    out.append((pc, caps))
        self.budget.spend(len(seen))
        return out

    def _look(self, instruction: list, pos: int) -> bool:
        _, sub, width, negate = instruction
        key = (id(sub), pos)
        if key not in self._looks:
            if width is None:
                hit = self.run(sub, pos, None) is not None
            else:
                hit = pos >= width and self.run(sub, pos - width, pos) is not None
            self._looks[key] = hit
        return self._looks[key] != negate

    def _at(self, where, flags: int, pos: int) -> bool:
        text, n = self.text, len(self.text)
        multiline = flags & sre.SRE_FLAG_MULTILINE
        if where is sre.AT_BEGINNING:
            return pos == 0 or bool(multiline and text[pos - 1] == "\n")
        if where is sre.AT_BEGINNING_STRING:
            return pos == 0
        if where is sre.AT_END:
            return (pos == n or (pos == n - 1 and text[pos] == "\n")
                    or bool(multiline and pos < n and text[pos] == "\n"))
        if where is sre.AT_END_STRING:
            return pos == n
        if n == 0:  # \b and \B never match the empty string in re
            return False
        word = _word_test(flags)
        before = pos > 0 and word(text[pos - 1])
        after = pos < n and word(text[pos])
        return (before != after) == (where is sre.AT_BOUNDARY)
