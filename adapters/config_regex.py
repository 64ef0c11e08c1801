"""Regexes from an uploaded adapter_config.json, compiled and matched by RE2.

peft matches `target_modules` and `exclude_modules` given as a string,
`layers_pattern`, and the keys of `rank_pattern` and `alpha_pattern` with
Python's `re`, a backtracking engine: `(a+)+$` against a 30-character module
name takes minutes, in C, holding the GIL, so one upload would freeze the
whole gateway. Here every such regex is matched by Google's RE2
(`google-re2`), which runs a DFA or an NFA simulation and never backtracks:
a match costs at most O(program size x text length).

A pattern is accepted only if both engines compile it: `re`, so that
whatever peft (and so the tenant's own training code) rejects is rejected
here too, with `re`'s message; and RE2, which refuses what it cannot match
in linear time (lookarounds, backreferences, atomic groups, possessive
repeats, conditionals) and repeat counts above 1000. Two constructs that
both compile but mean different things to them are refused outright.

Work is bounded twice: `REGEX_MAX_MEM` caps each compiled program and its
DFA cache (RE2's `max_mem`), and one `MatchBudget` per config caps the sum
over all matches of program size x (text length + 1), RE2's worst case for
any of its engines.
"""

from __future__ import annotations

import re

import re2

from adapters.errors import AdapterError, shown

MAX_PATTERN_CHARS = 512
# RE2's memory for one regex: about 2/3 for its program (some 20k
# instructions) and the rest for its lazily built DFA. google-re2 keeps the
# last 128 compiled regexes, so at most 128 MiB stay cached process-wide.
REGEX_MAX_MEM = 1 << 20
# Program instructions x characters over all matches of one config. A full
# per-module rank_pattern and alpha_pattern on an 80-layer model (560
# entries each, matched against 560 module names) uses about 40% of it;
# spent entirely, it is a few seconds of one worker thread (RE2 releases the
# GIL while it matches).
MATCH_BUDGET = 2_000_000_000
# Both compile, with different meanings: Python reads `x{,3}` as `x{0,3}` and
# `[[:alpha:]]` as the set `[:alph` then `]`; RE2 reads a literal `{,3}` and a
# POSIX class.
_AMBIGUOUS = {
    "{,": "'{,n}' is a repeat to Python and literal text to RE2; write '{0,n}'",
    "[:": "'[:...:]' is a POSIX class to RE2 and a plain set to Python; list the characters",
}
Regex = re2._Regexp  # google-re2's compiled pattern; the package gives it no public name
_RE2_LACKS = ("lookaheads, lookbehinds, backreferences, atomic groups, possessive repeats, "
              "conditionals and repeat counts above 1000")


def compile_regex(pattern: str, where: str, *, tenant_part: str | None = None) -> Regex:
    """`pattern` compiled by RE2, or an AdapterError naming `where`.

    `tenant_part` is the config's own text when peft wraps it (layers_pattern,
    pattern keys); the limits and the messages are about that part."""
    text = pattern if tenant_part is None else tenant_part
    if len(text) > MAX_PATTERN_CHARS:
        raise AdapterError(f"{where}: a regex of {len(text)} characters; at most {MAX_PATTERN_CHARS}")
    for token, why in _AMBIGUOUS.items():
        if token in text:
            raise AdapterError(f"{where}: regex {shown(text)} is ambiguous: {why}")
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise AdapterError(f"{where}: invalid regex {shown(text)}: {exc}") from None
    options = re2.Options()
    options.max_mem = REGEX_MAX_MEM
    options.log_errors = False  # a refused pattern is the uploader's error, not a server log line
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise AdapterError(
            f"{where}: RE2 does not support regex {shown(text)} ({reason}); adapter regexes are matched by "
            f"RE2, which has no {_RE2_LACKS}"
        ) from None


class MatchBudget:
    """The matching work left for one adapter config; running out is a refusal, not a timeout."""

    def __init__(self, units: int = MATCH_BUDGET):
        self.left = units

    def fullmatch(self, regex: Regex, text: str) -> bool:
        self._charge(regex, text)
        return regex.fullmatch(text) is not None

    def match(self, regex: Regex, text: str):
        """RE2's match object for a match at the start of `text`, else None."""
        self._charge(regex, text)
        return regex.match(text)

    def _charge(self, regex: Regex, text: str) -> None:
        self.left -= regex.programsize * (len(text) + 1)
        if self.left < 0:
            raise AdapterError(
                "adapter_config.json: matching its regexes against the base model's module names needs more "
                f"than {MATCH_BUDGET} units (RE2 instructions x characters); use plainer target_modules/"
                "layers_pattern/rank_pattern/alpha_pattern patterns (e.g. lists of module names)"
            )
