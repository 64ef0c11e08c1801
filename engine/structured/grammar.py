"""Specs to llguidance grammars: validation, compilation off the step loop,
and a cache of compiled grammars bounded in bytes, in entries, and per owner.

Why llguidance (and not xgrammar): both compute token masks on the CPU, but
llguidance bounds every phase of the work with "fuel" (LLParserLimits), so
a hostile schema or regex ends in an error rather than minutes of compile
time. Building a grammar takes about a millisecond; the lexer grows lazily
as masks are computed (~0.2 ms a mask for SmolLM2's 49k vocabulary).

A compiled grammar is an `LLMatcher` in its start state that nobody
advances; each sequence gets a `deep_copy()` of it. The compile drops the
GIL, so the pool's threads do not stall the step loop.

Owners. Each entry is charged to the owner that first compiled it (the
tenant's cache salt in serving). An owner holds at most `owner_share` of the
cache's entries and bytes, so one tenant's stream of unique schemas evicts
its own entries, never everyone's (cf. CVE-2025-32381).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from engine.errors import ValidationError
from engine.structured.spec import SpecKind, StructuredSpec

DEFAULT_CACHE_ENTRIES = 512
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
DEFAULT_OWNER_SHARE = 0.25
# What the cache charges per entry beyond its grammar text: the matcher's
# lexer and parser tables, which llguidance does not report.
_ENTRY_OVERHEAD_BYTES = 64 * 1024
# JSON output is compact: with flexible whitespace a small model can spend
# all of max_tokens on newlines inside a valid document.
_JSON_OPTIONS = {"whitespace_flexible": False}


def llguidance_limits():
    import llguidance

    # Defaults except the error text: a verbose error quotes the grammar and
    # parser state, which a 400 to a tenant must not carry.
    return llguidance.LLParserLimits(verbose_errors=False)


def to_llguidance(spec: StructuredSpec) -> str:
    """The llguidance grammar (its JSON form) for a spec."""
    from llguidance import LLMatcher

    if spec.kind is SpecKind.JSON_SCHEMA:
        return LLMatcher.grammar_from_json_schema(spec.source, defaults=_JSON_OPTIONS)
    if spec.kind is SpecKind.JSON_OBJECT:
        return LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=_JSON_OPTIONS)
    if spec.kind is SpecKind.REGEX:
        return LLMatcher.grammar_from_regex(spec.source)
    if spec.kind is SpecKind.CHOICE:
        import json

        # Lark string literals take JSON's escapes.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.source))
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return LLMatcher.grammar_from_lark(spec.source)


def make_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
    """llguidance's view of the model's tokenizer (about half a second to build)."""
    import llguidance.hf

    eos = sorted(eos_token_ids) or None
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)


def check_spec(spec: StructuredSpec, ll_tokenizer) -> None:
    """Raise ValidationError, naming the spec's parameter, unless the spec
    compiles. Cheap (no masks are computed), so the gateway runs it on every
    structured request before admission."""
    from llguidance import LLMatcher

    try:
        grammar = to_llguidance(spec)
    except ValueError as exc:
        raise ValidationError(spec.param, f"cannot compile: {exc}") from None
    error = LLMatcher.validate_grammar(grammar, ll_tokenizer, limits=llguidance_limits())
    if error:
        raise ValidationError(spec.param, f"cannot compile: {_first_line(error)}")


def _copy_into(copy: Future, template: Future) -> None:
    """Resolve `copy` with a fresh matcher from a compiled template (or its error)."""
    if copy.cancelled():  # its request gave up waiting
        return
    try:
        copy.set_result(template.result().deep_copy())
    except BaseException as exc:  # noqa: BLE001 - the waiter gets the compile's error
        copy.set_exception(exc)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:500] if message.strip() else "invalid grammar"


@dataclass
class _Entry:
    template: object  # LLMatcher in its start state; never advanced
    size: int
    owner: str


class GrammarCompiler:
    """Thread-safe. `submit` returns a future of a fresh per-sequence matcher
    (raising ValidationError when the spec does not compile)."""

    def __init__(self, ll_tokenizer, *, max_workers: int = 1, max_entries: int = DEFAULT_CACHE_ENTRIES,
                 max_bytes: int = DEFAULT_CACHE_BYTES, owner_share: float = DEFAULT_OWNER_SHARE):
        self.ll_tokenizer = ll_tokenizer
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.owner_share = owner_share
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._compiling: dict[tuple[str, str], Future] = {}
        self._bytes = 0
        self._owner_entries: dict[str, int] = {}
        self._owner_bytes: dict[str, int] = {}
        self.hits = 0
        self.misses = 0

    def submit(self, spec: StructuredSpec, owner: str | None = None) -> Future:
        """A future of a matcher for one new sequence. A cached grammar is
        copied at once, without a trip through the pool; a spec already
        compiling is compiled once for all who ask."""
        with self._lock:
            entry = self._cache.get(spec.key)
            if entry is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
                done: Future = Future()
                done.set_result(entry.template.deep_copy())
                return done
            template = self._compiling.get(spec.key)
            if template is None:
                self.misses += 1
                template = self._compiling[spec.key] = self._pool.submit(self._compile, spec, owner or "")
            else:
                self.hits += 1
        copy: Future = Future()
        template.add_done_callback(lambda f: _copy_into(copy, f))
        return copy

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def num_entries(self) -> int:
        return len(self._cache)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def owner_usage(self, owner: str) -> tuple[int, int]:
        """(entries, bytes) charged to `owner`."""
        with self._lock:
            return self._owner_entries.get(owner, 0), self._owner_bytes.get(owner, 0)

    def _compile(self, spec: StructuredSpec, owner: str):
        from llguidance import LLMatcher

        try:
            try:
                grammar = to_llguidance(spec)
            except ValueError as exc:
                raise ValidationError(spec.param, f"cannot compile: {exc}") from None
            template = LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=llguidance_limits())
            if template.is_error():
                raise ValidationError(spec.param, f"cannot compile: {_first_line(template.get_error())}")
            self._insert(spec.key, _Entry(template, len(grammar) + _ENTRY_OVERHEAD_BYTES, owner))
            return template
        finally:
            with self._lock:
                self._compiling.pop(spec.key, None)

    def _insert(self, key: tuple[str, str], entry: _Entry) -> None:
        with self._lock:
            if key in self._cache:
                return  # compiled twice at once; the first copy stays
            if entry.size > self.max_bytes * self.owner_share:
                return  # too big to keep for anyone
            owner_entries = max(1, int(self.max_entries * self.owner_share))
            owner_bytes = self.max_bytes * self.owner_share
            # The owner's own oldest entries go first, then everyone's oldest.
            while (self._owner_entries.get(entry.owner, 0) + 1 > owner_entries
                   or self._owner_bytes.get(entry.owner, 0) + entry.size > owner_bytes):
                self._evict(next(k for k, e in self._cache.items() if e.owner == entry.owner))
            while len(self._cache) + 1 > self.max_entries or self._bytes + entry.size > self.max_bytes:
                self._evict(next(iter(self._cache)))
            self._cache[key] = entry
            self._bytes += entry.size
            self._owner_entries[entry.owner] = self._owner_entries.get(entry.owner, 0) + 1
            self._owner_bytes[entry.owner] = self._owner_bytes.get(entry.owner, 0) + entry.size

    def _evict(self, key: tuple[str, str]) -> None:
        entry = self._cache.pop(key)
        self._bytes -= entry.size
        self._owner_entries[entry.owner] -= 1
        self._owner_bytes[entry.owner] -= entry.size
        if not self._owner_entries[entry.owner]:
            del self._owner_entries[entry.owner]
            del self._owner_bytes[entry.owner]
