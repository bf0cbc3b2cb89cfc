"""xgrammar's view of a model's vocabulary, shared by the engines: grammar-constrained decoding,
and each token's own bytes for logprobs (:class:`Vocabulary`).

A :class:`~workers.base.JsonGrammar` (a JSON schema) is compiled with no free whitespace: the
separators are ``","`` and ``":"`` and nothing else may be inserted (compact JSON), so a closed schema (enums, booleans, bounded integers) ends in a few dozen tokens even
on random weights. ``strict_mode`` is on: an object that declares ``properties`` takes only those
(what the output may contain narrows; everything it does contain validates); one that declares no
keys at all (``{"type": "object"}``) is a free object, any keys, as vLLM's (the gateway closes a
tool's ``parameters`` root of that kind: ``gateway.tools.arguments_schema``).

* :func:`schema_error` builds a schema's grammar without a tokenizer: the gateway refuses a schema
  that does not build (400) before the request queues, and one whose patterns xgrammar 0.2.8
  fails to compile or takes long to build (:func:`patterns_problem`) before xgrammar sees it.
  What an engine still fails to compile is a 400 on the transformers engine and a 500 on vLLM's
  (which ends the request with an error), never an empty reply.
* The vLLM engine hands the schema to vLLM (``StructuredOutputsParams(json=...)``); the engine is
  started with ``structured_outputs_config(backend="xgrammar", disable_any_whitespace=True)``
  (vLLM 0.32 reads that flag per engine, not per request), which compiles it the same way.
* The transformers engine keeps one :class:`Grammars` per loaded model (the tokenizer's
  vocabulary and a compile cache, bounded) and one :class:`RowGrammar` per constrained row: before each
  sample the row's logits are masked to the tokens the grammar allows next, and the sampled token
  advances the row's matcher. Rows of one batch each have their own matcher.
* A reasoning model's reply (``ChatRequest.reasoning``) is constrained after its thinking, on
  both engines: from the token after its first ``</think>``, or from the first token when the
  prompt closed the thinking.
* Both engines are handed EBNF text (:func:`grammar_text`): a JSON schema's grammar as xgrammar
  writes it, with one mend. xgrammar 0.2 draws a string with ``minLength``/``maxLength`` as
  characters other than ``"``, ``\\``, CR and LF, so such a string could hold raw control
  characters (a tab), which strict JSON parsers refuse, and could never hold an escape (a quote
  in a title); here each of its characters is a JSON string's character or escape, as an
  unbounded string's are, and an escaped surrogate pair counts as the one character it is.
* A reply that may take either of two shapes is an :class:`~workers.base.EbnfGrammar`:
  :func:`reply_or_calls` joins the requested JSON (or other grammar) and the model's tool-call
  blocks (tools in ``auto`` mode with a response format), each JSON part compact as above.
* vLLM's other constraints (``structured_outputs``: a regex, a choice, a grammar in EBNF or
  Lark) are EBNF text as xgrammar writes it (:func:`regex_ebnf`, :func:`choice_ebnf`,
  :func:`ebnf_text`), checked as the gateway plans the request.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch

from workers.base import EbnfGrammar, Grammar, JsonGrammar, TokenLogprob

SEPARATORS = (",", ":")  # compact JSON, as vLLM's disable_any_whitespace compiles it


# OpenAI's limit for a Structured Outputs schema: "the total string length of all property names,
# definition names, enum values, and const values cannot exceed 120,000 characters". Here it bounds
# what a schema costs to compile against a vocabulary, which grows with its literals (100 KB of enum
# values: 1.5 s for tiny-chat's 568 tokens; a 1 MB one would hold its request's slot for minutes).
# An enum or const value that is not a string is a literal too, counted as its compact JSON text: a
# const object holding 1 MB took 215 s to compile, and an enum of 100,000 integers held the event
# loop 1.75 s to build (``schema_error``) before it took 40 s to serve.
MAX_SCHEMA_STRINGS = 120_000
_NAMED = ("properties", "patternProperties", "$defs", "definitions")


def schema_strings(schema: object) -> int:
    """The characters OpenAI's limit counts in ``schema``: property and definition names, enum
    values and consts, at any depth (a string its length, any other value its compact JSON's)."""
    total = 0
    for node in _schemas(schema):
        for key, value in node.items():
            if key in _NAMED and isinstance(value, dict):
                total += sum(len(name) for name in value)
            elif key == "enum" and isinstance(value, list):
                total += sum(_literal_size(v) for v in value)
            elif key == "const":
                total += _literal_size(value)
    return total


def _literal_size(value: object) -> int:
    if isinstance(value, str):
        return len(value)
    try:
        return len(json.dumps(value, separators=SEPARATORS))
    except (TypeError, ValueError):  # (a body's JSON always dumps; counted as one character otherwise)
        return 1


def _schemas(schema: object) -> Iterator[dict]:
    """Every schema object in ``schema``, itself and those under its keywords at any depth: a
    named map's (``properties``, ``$defs``...) values, not the map itself, whose names are not
    keywords, and nothing a keyword holds as data (``_NOT_SCHEMAS``: an enum's values...)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            yield node
            for key, value in node.items():
                if key in _NAMED and isinstance(value, dict):
                    stack.extend(value.values())
                elif key not in _NOT_SCHEMAS:
                    stack.append(value)


# xgrammar 0.2.8, the version vLLM 0.32 pins, cannot compile a JSON schema whose ``pattern`` repeats
# something a counted number of times above 128 (``[a-z]{1,200}``, ``\d{129}``) when its compiler keeps
# a grammar cache, as vLLM's does and the transformers engine's: "Check failed:
# per_rule_fsm_hashes[ref_rule_id].has_value()" (mlc-ai/xgrammar#863, fixed after 0.2.8). Such a
# request passed the gateway's check and failed in the engine: a 500 on the transformers engine, an
# empty "stop" on vLLM's. It is refused before it queues, naming the count.
MAX_COUNTED_REPEAT = 128
# What building a schema's grammar costs grows with its patterns' counted repetitions written out:
# ``([a-z]{1,100}){1,100}`` is 10,000 characters' worth, 0.1 s to build (on the event loop, where the
# gateway checks it) and seconds to compile against a model's vocabulary; ``[a-z]{1,10000}`` took 5-7 s
# to build. A schema's patterns together may be at most this size written out (32 ``[a-z]{1,128}``).
MAX_PATTERN_SIZE = 4096
_COUNT = re.compile(r"\{([0-9]*)(?:,([0-9]*))?\}")
_NOT_SCHEMAS = ("enum", "const", "default", "examples")  # values, not schemas: their "pattern" keys are data


def pattern_size(pattern: str) -> tuple[int, int]:
    """``pattern`` (a regular expression) written out with its counted repetitions expanded, as
    (its length in atoms: a character, a class or an escape each one, alternatives added up), and
    the largest count it writes (``{m}``, ``{m,}``, ``{m,n}``). ``([a-z]{1,100}){1,100}`` is
    (10000, 100); ``*``, ``+`` and ``?`` add nothing."""
    groups, last, largest, i = [0], 0, 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            groups[-1], last, i = groups[-1] + 1, 1, i + 2
            continue
        if c == "[":  # a class is one atom: skip to its closing bracket (a first "]" is a member)
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            groups[-1], last, i = groups[-1] + 1, 1, j + 1
            continue
        if c == "{" and (m := _COUNT.match(pattern, i)) and (m.group(1) or m.group(2)):
            low = _count(m.group(1) or "0")
            high = _count(m.group(2)) if m.group(2) else low  # {m,} writes m copies, then a loop
            largest = max(largest, low, high)
            groups[-1] += last * (max(high, 1) - 1)
            last, i = 0, m.end()
            continue
        if c == "(":
            groups.append(0)
            last = 0
        elif c == ")" and len(groups) > 1:
            last = groups.pop()
            groups[-1] += last
        elif c in "|^$*+?":
            last = 0
        else:
            groups[-1], last = groups[-1] + 1, 1
        i += 1
    return sum(groups), largest


def _count(digits: str) -> int:
    return int(digits) if len(digits) <= 9 else 10**9  # (int() refuses over 4,300 digits)


def schema_patterns(schema: object) -> list[str]:
    """The regular expressions of a JSON schema: its ``pattern`` values and ``patternProperties``
    names, at any depth."""
    found = []
    for node in _schemas(schema):
        if isinstance(pattern := node.get("pattern"), str):
            found.append(pattern)
        if isinstance(named := node.get("patternProperties"), dict):
            found.extend(named)
    return found


def patterns_problem(schema: object) -> str | None:
    """Why the schema's patterns are refused (``MAX_COUNTED_REPEAT``, ``MAX_PATTERN_SIZE``), or None."""
    total = 0
    for pattern in schema_patterns(schema):
        size, largest = pattern_size(pattern)
        if largest > MAX_COUNTED_REPEAT:
            return (f"the pattern {pattern[:80]!r} repeats a part {largest} times: a count above "
                    f"{MAX_COUNTED_REPEAT} in a schema's pattern is refused here, as xgrammar 0.2.8, which vLLM 0.32 "
                    "uses, fails to compile it (mlc-ai/xgrammar#863)")
        total += size
    if total > MAX_PATTERN_SIZE:
        return (f"its patterns written out with their counted repetitions are {total} characters long, above "
                f"{MAX_PATTERN_SIZE} (compiling them takes time with that length)")
    return None


# OpenAI's other limit on a Structured Outputs schema that bounds what it costs here: "up to 5000 object
# properties total". Building the grammar of 20,000 properties (575 KB, within the strings' limit) held
# the event loop 0.28 s; 5,000 take about 60 ms.
MAX_SCHEMA_PROPERTIES = 5000


def schema_properties(schema: object) -> int:
    """The object properties a schema declares (``properties``' entries), at any depth."""
    return sum(len(named) for node in _schemas(schema) if isinstance(named := node.get("properties"), dict))


# What the properties' limit leaves unbounded: a schema of alternatives (anyOf, oneOf) or tuple items
# (prefixItems) declares no property, and its cost grows faster than theirs: 100,000 small anyOf
# branches (5.7 MB, within max_body) held the event loop 9.4 s to build, and 20,000 took 20 s to compile
# for tiny-chat (10,000: 3.9 s, as 5,000 properties). Twice the properties' limit, so that 5,000 optional
# properties (pydantic's anyOf of the type and null each) still build.
MAX_SCHEMA_BRANCHES = 2 * MAX_SCHEMA_PROPERTIES
_BRANCHES = ("anyOf", "oneOf", "prefixItems")


def schema_branches(schema: object) -> int:
    """The alternatives (``anyOf``, ``oneOf`` entries) and tuple items (``prefixItems``) a schema
    declares, at any depth."""
    return sum(len(listed) for node in _schemas(schema) for key in _BRANCHES
               if isinstance(listed := node.get(key), list))


def import_compiler() -> None:
    """Import xgrammar (0.1-1 s the first time, with torch already imported), for a server to do on
    a thread as it starts: ``schema_error`` and the engines import it when a request first asks
    for a structured reply, and that import on the event loop held every tier's requests
    (``gateway.loop_watch`` found it)."""
    import xgrammar  # noqa: F401


def schema_error(schema: dict | bool) -> str | None:
    """Why xgrammar cannot compile ``schema`` for a model (or will not here: over
    ``MAX_SCHEMA_STRINGS``, or its patterns past ``patterns_problem``'s limits), or None when it
    can."""
    strings = schema_strings(schema)
    if strings > MAX_SCHEMA_STRINGS:
        return (f"its property names, definition names, enum and const values total {strings} characters, above "
                f"{MAX_SCHEMA_STRINGS} (OpenAI's limit for structured outputs)")
    properties = schema_properties(schema)
    if properties > MAX_SCHEMA_PROPERTIES:
        return (f"it declares {properties} object properties, above {MAX_SCHEMA_PROPERTIES} (OpenAI's limit for "
                "structured outputs)")
    branches = schema_branches(schema)
    if branches > MAX_SCHEMA_BRANCHES:
        return (f"it declares {branches} anyOf, oneOf and prefixItems entries, above {MAX_SCHEMA_BRANCHES} (building "
                "and compiling them takes time with their count)")
    problem = patterns_problem(schema)
    if problem:
        return problem
    for node in _schemas(schema):  # xgrammar compiles an empty choice to "": an empty reply, or `{"a":}`
        for key in ("anyOf", "oneOf"):
            if node.get(key) == []:
                return f"{key} must not be empty: no value matches it"
    try:  # what the engines compile (JsonGrammar's text: the same cache entry). Not compiled here (on a
        # small vocabulary, say): for a large schema that takes 40-250 times as long as building it (1 s
        # for 1,000 properties), and the event loop waits on it
        json_ebnf(json.dumps(schema))
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with its reason
        return xgrammar_reason(exc)
    return None


# xgrammar 0.2's rule for one character of a length-bounded string, and what it should be: a JSON
# string's character (no control character, quote or backslash) or escape. As JSON Schema counts
# characters (code points), a character beyond U+FFFF written as an escaped surrogate pair
# (\ud83d\ude00) is one, and a lone surrogate (no character at all) is refused.
BOUNDED_CHARACTER = r'(([^\"\\\r\n]))'
_HEX = "[A-Fa-f0-9]"
JSON_CHARACTER = (r'(([^\0-\x1f\"\\]) | ("\\" ([\"\\/bfnrt] | ("u" ('
                  rf'([0-9A-Ca-cE-Fe-f] {_HEX} {_HEX} {_HEX}) | ([Dd] [0-7] {_HEX} {_HEX}) | '
                  rf'([Dd] [89ABab] {_HEX} {_HEX} "\\u" [Dd] [C-Fc-f] {_HEX} {_HEX}))))))')
_CHARACTER_RULE = re.compile(r"^(\S+_characters ::= )" + re.escape(BOUNDED_CHARACTER) + "$", re.M)


def grammar_text(grammar: Grammar) -> str:
    """The EBNF text both engines compile for ``grammar``."""
    return grammar.ebnf if isinstance(grammar, EbnfGrammar) else json_ebnf(grammar.schema)


def lru_by_digest(maxsize: int) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """``functools.lru_cache`` keyed by a SHA-256 of the arguments' text, not the text itself: a
    schema's text may be megabytes of descriptions its grammar drops (a body may be 25 MiB), and
    ``lru_cache`` kept each of its keys whole: a 4 MB description grew the server 4 MB a request,
    for good, up to the cache's size. What it keeps is the grammar, bounded by the schema limits."""
    def wrap(build: Callable[..., str]) -> Callable[..., str]:
        kept: OrderedDict[bytes, str] = OrderedDict()
        lock = threading.Lock()  # (the engines build from threads of their own)

        @functools.wraps(build)
        def cached(*args: object) -> str:
            digest = hashlib.sha256()
            for arg in args:
                text = str(arg).encode("utf-8", "surrogatepass")
                digest.update(len(text).to_bytes(8, "little") + text)
            key = digest.digest()
            with lock:
                if key in kept:
                    kept.move_to_end(key)
                    return kept[key]
            value = build(*args)
            with lock:
                kept[key] = value
                while len(kept) > maxsize:
                    kept.popitem(last=False)
            return value

        return cached
    return wrap


@lru_by_digest(maxsize=512)
def json_ebnf(schema: str) -> str:
    """The compact grammar of a JSON schema as EBNF, its length-bounded strings mended (above)."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=SEPARATORS))
    return _CHARACTER_RULE.sub(lambda m: m.group(1) + JSON_CHARACTER, text)


def regex_ebnf(pattern: str) -> str:
    """The grammar of text matching the regular expression ``pattern`` (whole), as EBNF;
    ValueError with xgrammar's reason when it cannot be built. xgrammar turns a regex into
    grammar rules, not a DFA: nested quantifiers (``(a+)+``) cost nothing to build."""
    import xgrammar as xgr

    if "\x00" in pattern:  # vLLM refuses it too: xgrammar's converter reads a C string
        raise ValueError("a regex must not contain a NUL character")
    try:
        text = str(xgr.Grammar.from_regex(pattern))
    except Exception as exc:  # noqa: BLE001 - RuntimeError with the position and reason
        raise ValueError(xgrammar_reason(exc)) from None
    return text



# an EBNF string literal's escapes, as vLLM writes them (``choice_as_grammar``): the quote, the
# backslash, and every C0 control character and DEL
_LITERAL = str.maketrans({**{c: f"\\u{c:04x}" for c in [*range(0x20), 0x7F]}, ord("\\"): r"\\", ord('"'): r'\"',
                          ord("\n"): r"\n", ord("\r"): r"\r", ord("\t"): r"\t"})


def choice_ebnf(choices: list[str]) -> str:
    """The grammar of exactly one of ``choices``, as vLLM writes it (``choice_as_grammar``)."""
    return ebnf_text("root ::= " + " | ".join(f'"{c.translate(_LITERAL)}"' for c in choices))


def ebnf_text(grammar: str) -> str:
    """``grammar`` (xgrammar's EBNF, start rule ``root``, or Lark's syntax, start rule ``start``,
    told apart as vLLM does: EBNF has a ``::=``) as EBNF text both engines compile; ValueError
    with xgrammar's reason when it does not parse."""
    import xgrammar as xgr

    lark = not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.splitlines())
    try:
        text = str(xgr.Grammar.from_lark(grammar) if lark else xgr.Grammar.from_ebnf(grammar))
    except Exception as exc:  # noqa: BLE001 - RuntimeError with the line, column and reason
        raise ValueError(xgrammar_reason(exc)) from None
    return text


def reply_or_calls(reply: Grammar, call: JsonGrammar, begin: str, end: str, several: bool) -> EbnfGrammar:
    """A reply that is either text of the grammar ``reply`` (JSON, a regex's, a choice...), or
    tool calls: blocks of ``begin``, a JSON call valid against ``call``, ``end`` (one block, or
    with ``several`` one or more a newline apart). A newline may open and close a block's JSON,
    as templates differ on it (hermes-style ``<tool_call>{...}</tool_call>`` and Qwen's
    ``<tool_call>\\n{...}\\n</tool_call>``). Built as an xgrammar structural tag and given out as EBNF
    text, which both engines take; cached, as an agent sends the same tools and format every turn
    (~2 ms to build for 8 tools)."""
    return EbnfGrammar(_reply_or_calls(grammar_text(reply), call.schema, begin, end, several))


@lru_by_digest(maxsize=256)  # (the call's schema has the tools' descriptions)
def _reply_or_calls(reply: str, call: str, begin: str, end: str, several: bool) -> str:
    import xgrammar as xgr

    def compact(schema: str) -> dict:
        return {"type": "grammar", "grammar": json_ebnf(schema)}

    newline = {"type": "grammar", "grammar": 'root ::= "" | "\\n"'}
    block = {"type": "tag", "begin": begin, "end": end,
             "content": {"type": "sequence", "elements": [newline, compact(call), newline]}}
    calls = {"type": "tags_with_separator", "tags": [block], "separator": "\n", "at_least_one": True,
             "stop_after_first": not several}
    answer = {"type": "grammar", "grammar": reply}
    tag = {"type": "structural_tag", "format": {"type": "or", "elements": [answer, calls]}}
    return str(xgr.Grammar.from_structural_tag(json.dumps(tag)))


class Vocabulary:
    """One tokenizer's tokens as logprobs show them, remembered per id: the text a token decodes to
    alone (``decode([id])``) and its own bytes. The bytes are xgrammar's decoded vocabulary: a
    byte-level or byte-fallback piece of a multi-byte character is that byte, where its text alone
    is U+FFFD. OpenAI's ``bytes`` field exists so that a client can join such pieces into the
    character; the UTF-8 of U+FFFD cannot be joined. Where xgrammar cannot read the tokenizer,
    ``raw`` is None and ``bytes`` fall back to the text's UTF-8.

    xgrammar reads the whole vocabulary at once (~1 s for 150,000 tokens on this machine's cores),
    so an engine calls :meth:`read` off its engine thread and the event loop before a request that
    asks for logprobs runs, and the table is kept per tokenizer folder (``_BYTES``): a model
    loaded again after an eviction does not read it again."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._raw: list[bytes] | None = None
        self._read = False

    def read(self) -> None:
        """Read the tokens' bytes, once (``raw`` reads them itself otherwise)."""
        if not self._read:
            self._raw, self._read = _decoded_vocab(self._tokenizer), True

    def text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._tokenizer.decode([token])
        return text

    def raw(self, token: int) -> bytes | None:
        self.read()
        return self._raw[token] if self._raw is not None and 0 <= token < len(self._raw) else None

    def text_after(self, token: int, before: Sequence[int]) -> str:
        """``token``'s text as logprobs show it after the tokens ``before`` (those of the reply, or
        of the prompt, up to it), as ``vllm serve`` shows it (vLLM's ``LogprobsProcessor``): a piece
        of a multi-byte character is ``""``, and the piece that completes the character has the
        whole character, so the entries' texts join into the reply's text. Any other token's
        text is ``decode([token])``."""
        text = self.text(token)
        if not text.endswith("\ufffd"):
            return text
        context = list(before[-PIECES:])
        for n in range(1, len(context) + 1):  # the fewest tokens before it that complete a character
            tokens = context[-n:]
            whole = self._tokenizer.decode([*tokens, token])
            if whole.endswith("\ufffd"):
                continue
            clean = len(tokens)  # the pieces before it showed "": their text is this token's
            while clean and self.text(tokens[clean - 1]).endswith("\ufffd"):
                clean -= 1
            prefix = self._tokenizer.decode(tokens[:clean]) if clean else ""
            if not whole.startswith(prefix):  # a tokenizer that normalises: their common start
                prefix = os.path.commonprefix([prefix, whole])
            return whole[len(prefix):]
        return ""

    def entry(self, token: int, logprob: float, top: tuple[TokenLogprob, ...] = (),
              text: str | None = None, rank: int | None = None, before: Sequence[int] | None = None) -> TokenLogprob:
        """``token``'s logprob entry: its text after the tokens ``before`` (``text_after``; None:
        ``decode([token])``, a piece of a character U+FFFD); ``text``: the engine's own text for it
        (vLLM's, made as ``text_after`` makes it); ``rank`` its place by probability, where the
        engine knows it."""
        shown = text if text is not None else self.text(token) if before is None else self.text_after(token, before)
        return TokenLogprob(shown, logprob, top, self.raw(token), token, rank)


PIECES = 4  # the most tokens before a piece of a character looked at to complete it (as vLLM looks)
_BYTES: dict[tuple[str, int], list[bytes] | None] = {}  # by tokenizer folder and size, the last few read
_BYTES_KEPT = 8
_BYTES_LOCK = threading.Lock()  # engines read from threads of their own


def _decoded_vocab(tokenizer) -> list[bytes] | None:
    folder = str(getattr(tokenizer, "name_or_path", "") or "")
    key = (folder, len(tokenizer))
    with _BYTES_LOCK:
        if folder and key in _BYTES:
            return _BYTES[key]
    try:
        import xgrammar as xgr

        raw: list[bytes] | None = list(xgr.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab)
    except Exception:  # noqa: BLE001 - a tokenizer xgrammar does not read: bytes from the text
        raw = None
    if folder:
        with _BYTES_LOCK:
            _BYTES[key] = raw
            while len(_BYTES) > _BYTES_KEPT:
                del _BYTES[next(iter(_BYTES))]
    return raw


def xgrammar_reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


# xgrammar's compiler keeps every grammar it compiled unless told a bound (cache_limit_bytes=-1 by
# default): each distinct schema a request sends stayed in memory while its model was loaded (~80 KB
# each on tiny-chat's 564 tokens, growing with a vocabulary), so a client whose schema differs per
# request (an enum of ids) grew the server without end. vLLM bounds its compiler the same way
# (VLLM_XGRAMMAR_CACHE_MB, 512 by default); past it the least recently used grammars go.
COMPILE_CACHE_BYTES = 512 * 1024 * 1024


class Grammars:
    """xgrammar's view of one model's vocabulary, and compiled grammars cached by schema (at most
    ``COMPILE_CACHE_BYTES`` of them)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=COMPILE_CACHE_BYTES)

    def row(self, grammar: Grammar) -> "RowGrammar":
        """A fresh matcher for one row constrained by ``grammar``."""
        return RowGrammar(self._compiler.compile_grammar(grammar_text(grammar)), self.vocab_size)


class RowGrammar:
    """One row's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, compiled, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits (1-D, in place) of every token the grammar forbids now to -inf: every
        token, once the grammar has ended (its stop token accepted, which ``ignore_eos`` does not
        end the reply at; xgrammar refuses to fill a mask then)."""
        if self._matcher.is_terminated():
            logits.fill_(float("-inf"))
            return
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bitmask = self._bitmask.to(logits.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(logits.unsqueeze(0), bitmask, vocab_size=self._vocab_size)

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"token {token} was sampled outside the grammar")

    @property
    def finished(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self._matcher.is_terminated()
