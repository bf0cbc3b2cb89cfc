"""Function tools on chat: what a request's ``tools`` / ``tool_choice`` make of its reply, and the
parsers that turn the model's text into OpenAI tool calls, whole or streamed.

Modes (:func:`plan_tools`)
    * ``none`` (``tool_choice: "none"``, or no tools): the tools are not rendered; the reply is text.
    * ``auto`` (the default with tools): the chat template renders the tools and the model may
      answer with calls in its own format; the model's ``tool_parser`` (tiers.yaml, engine
      block; ``hermes`` by default) reads them: ``<tool_call>{"name": ..., "arguments": {...}}
      </tool_call>`` blocks, with any other text as content. A block that does not parse as a
      call of a declared tool stays content.
    * ``allowed_tools`` (``{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}``) is
      ``auto`` or ``required`` over the tools it lists: the others are neither rendered nor callable.
    * ``forced`` (``required``, or a named function): decoding is constrained to a JSON array of
      calls, ``[{"name": "<tool>", "arguments": {...}}, ...]`` (one call for a named function or
      with ``parallel_tool_calls: false``), whose arguments follow each tool's ``parameters``
      schema (``workers.grammar``): every call names a declared tool and its arguments validate.
      Stop strings and stop tokens do not apply to such a reply (``gateway.chat.plan_chat``): they
      could only cut a call short.

Both parsers take the reply's text piece by piece (:meth:`feed`) and give back pieces of
content (``str``) and :class:`CallDelta` in OpenAI's streaming order: a call's index, id and name
first, then fragments of its arguments. Whole responses are built from the same pieces.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from gateway.errors import bad_request
from gateway.schemas import AllowedToolsChoice, NamedToolChoice, Tool
from workers.base import Grammar, JsonGrammar
from workers.grammar import (MAX_SCHEMA_BRANCHES, MAX_SCHEMA_PROPERTIES, MAX_SCHEMA_STRINGS, patterns_problem,
                             reply_or_calls, schema_branches, schema_error, schema_properties, schema_strings)

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DECLARES_KEYS = ("properties", "patternProperties", "additionalProperties")  # how an object says what keys it takes
_DATA = ("enum", "const", "default", "examples")  # a schema's keywords whose values are data, not schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # names to schemas


@dataclass(frozen=True)
class ToolPlan:
    """How the tools shape one request's reply."""

    mode: Literal["none", "auto", "forced"] = "none"
    tools: tuple[Tool, ...] = ()  # declared (and rendered unless mode is none)
    names: tuple[str, ...] = ()  # the tools a call may name
    parser: str = "hermes"  # auto mode's format
    grammar: JsonGrammar | None = None  # forced mode's array of calls
    legacy: bool = False  # asked as the deprecated functions: one call, answered as message.function_call
    single: bool = False  # at most one call (parallel_tool_calls: false, a named function, functions)

    def reply_grammar(self, reply: Grammar | None, param: str = "response_format") -> Grammar | None:
        """What constrains the reply when the request also asks for the format ``reply`` (None:
        free text), named ``param`` in errors. Forced calls keep their grammar (the format shapes
        text, and a forced reply has none); in auto mode the reply is the format's text (JSON, or
        a ``structured_outputs`` regex, choice or grammar) or the model's calls, as it chooses."""
        if self.mode == "forced":
            return self.grammar
        if self.mode == "auto" and reply is not None:
            call = JsonGrammar(json.dumps(call_schema([t for t in self.tools if t.function.name in self.names])))
            try:
                return reply_or_calls(reply, call, OPEN, CLOSE, several=not self.single)
            except Exception as exc:  # noqa: BLE001 - each compiled alone; xgrammar's reason for the pair
                raise bad_request(f"the {param} and the tools' calls cannot be joined in one grammar: {exc}",
                                  param, "invalid_schema") from None
        return reply

    def grammar_param(self, reply_param: str) -> str:
        """The request field an error of ``reply_grammar``'s grammar names (one the engine meets
        compiling it, say): ``tools`` for forced calls, whose array is the whole grammar; else the
        format's ``reply_param``, as its join with the calls' grammar names it."""
        return "tools" if self.mode == "forced" else reply_param

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template takes them (None: render none)."""
        if self.mode == "none":
            return None
        return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in self.tools]

    def parser_for_reply(self) -> "CallParser | None":
        if self.mode == "forced":
            return ForcedCalls(self.names)
        if self.mode == "auto":
            return HermesCalls(self.names, 1 if self.single else None)
        return None


NO_TOOLS = ToolPlan()


def plan_tools(tools: list[Tool] | None, choice: str | NamedToolChoice | AllowedToolsChoice | None,
               parallel: bool | None, parser: str = "hermes") -> ToolPlan:
    """The plan for a request's tool fields; 400 naming the field for a tool schema that does not
    compile, a choice naming a missing tool, or a choice without tools."""
    if not tools and choice is None:
        return NO_TOOLS  # most requests
    tools = list(tools or [])
    for i, tool in enumerate(tools):
        problem = schema_error(tool.function.parameters or EMPTY_PARAMETERS)
        kind = (tool.function.parameters or EMPTY_PARAMETERS).get("type", "object")
        if not problem and kind not in ("object", ["object"]):  # as OpenAI's API and Anthropic's refuse it
            problem = (f"a call's arguments are a JSON object: its schema's type must be 'object', not "
                       f"{json.dumps(kind)}")
        if problem:
            raise bad_request(f"the parameters schema of tool '{tool.function.name}' cannot be used: {problem}",
                              f"tools[{i}].function.parameters", "invalid_schema")
    every = [t.function.parameters for t in tools]  # their calls are one grammar: bounded together as one schema
    problem = patterns_problem(every)
    if problem is None and (properties := schema_properties(every)) > MAX_SCHEMA_PROPERTIES:
        problem = f"they declare {properties} object properties, above {MAX_SCHEMA_PROPERTIES} (OpenAI's limit)"
    if problem is None and (branches := schema_branches(every)) > MAX_SCHEMA_BRANCHES:
        problem = f"they declare {branches} anyOf, oneOf and prefixItems entries, above {MAX_SCHEMA_BRANCHES}"
    if problem:
        raise bad_request(f"the tools' parameters schemas cannot be used together: {problem}", "tools", "invalid_schema")
    counted = sum(schema_strings(t.function.parameters or EMPTY_PARAMETERS) + len(t.function.name) for t in tools)
    if counted > MAX_SCHEMA_STRINGS:  # the calls' grammar joins every tool's: bounded as one schema is
        raise bad_request(f"the tools' names, property names, enum and const values total {counted} characters, above "
                          f"{MAX_SCHEMA_STRINGS} (OpenAI's limit for one structured outputs schema)", "tools",
                          "invalid_schema")
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise bad_request("two tools have the same name", "tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
    if isinstance(choice, AllowedToolsChoice):
        for i, ref in enumerate(choice.allowed_tools.tools):
            if ref.function.name not in names:
                raise bad_request(f"tool_choice.allowed_tools names the function '{ref.function.name}', which is "
                                  f"not among the tools ({', '.join(names)})", f"tool_choice.allowed_tools.tools[{i}]")
        allowed_names = {ref.function.name for ref in choice.allowed_tools.tools}
        tools = [t for t in tools if t.function.name in allowed_names]
        names = [t.function.name for t in tools]
        choice = choice.allowed_tools.mode
    if choice == "none":
        return ToolPlan("none", tuple(tools))
    if choice == "auto":
        return ToolPlan("auto", tuple(tools), tuple(names), parser, single=parallel is False)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the function '{choice.function.name}', which is not among "
                              f"the tools ({', '.join(names)})", "tool_choice")
        allowed = [choice.function.name]
        single = True
    else:  # required
        allowed, single = names, parallel is False
    grammar = JsonGrammar(json.dumps(calls_schema([t for t in tools if t.function.name in allowed], single)))
    return ToolPlan("forced", tuple(tools), tuple(allowed), parser, grammar, single=single)


def arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool's ``parameters`` as its calls' grammar takes them. An object root that declares no
    keys (no ``properties``, ``patternProperties`` or ``additionalProperties``: ``{"type":
    "object"}``, how Anthropic's API and MCP servers declare a tool without arguments) takes none,
    ``{}``: xgrammar would compile it as an open object, and a forced call of random weights writes
    keys until ``max_tokens``. A response format's root and nested objects stay as written (free
    objects, as vLLM takes them)."""
    if not parameters:
        return EMPTY_PARAMETERS
    if parameters.get("type") != "object" or any(key in parameters for key in _DECLARES_KEYS):
        return parameters
    return {**parameters, "properties": {}, "additionalProperties": False}


def call_schema(tools: list[Tool]) -> dict:
    """The JSON schema of one ``{"name", "arguments"}`` call of one of ``tools``. Each tool's
    ``$defs`` move to the root, renamed."""
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        params = _hoist_defs(arguments_schema(tool.function.parameters), f"tool{i}_", defs)
        items.append({"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = items[0] if len(items) == 1 else {"anyOf": items}
    return {**schema, "$defs": defs} if defs else schema


def calls_schema(tools: list[Tool], single: bool) -> dict:
    """The JSON schema of a forced reply: an array of calls of ``tools`` (exactly one when
    ``single``), the calls' ``$defs`` at the root."""
    call = call_schema(tools)
    defs = call.pop("$defs", None)
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _hoist_defs(schema: dict, prefix: str, defs: dict[str, Any]) -> dict:
    """``schema`` with its top-level ``$defs``/``definitions`` moved into ``defs`` under
    ``prefix`` and its local references rewritten: ``#/$defs/X`` and ``#/definitions/X`` to the
    moved definitions, and any other (``#``, a JSON pointer into the schema such as
    ``#/properties/a``, as zod-to-json-schema writes a reused part) into a copy of the whole
    schema among ``defs`` (``<prefix>root``): the calls' grammar nests the schema under
    ``arguments``, where a pointer from the root no longer finds it."""
    schema = copy.deepcopy(schema)
    local = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}

    def rewrite(node: Any) -> Any:
        """A schema (or a list of them) with its references rewritten; data (an enum's values, a
        const: ``{"const": {"$ref": "#/x"}}`` is that object) as written."""
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {key: value if key in _DATA else {name: rewrite(sub) for name, sub in value.items()}
               if key in _SCHEMA_MAPS and isinstance(value, dict) else rewrite(value) for key, value in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str):
            m = re.fullmatch(r"#/(?:\$defs|definitions)/(.+)", ref)
            if m:
                out["$ref"] = f"#/$defs/{prefix}{m.group(1)}"
            elif ref == "#" or ref.startswith("#/"):
                out["$ref"] = f"#/$defs/{prefix}root{ref[1:]}"
        return out

    schema = rewrite(schema)
    for name, sub in local.items():
        defs[prefix + name] = rewrite(sub)
    if f"#/$defs/{prefix}root" in json.dumps(schema) + json.dumps(defs):
        defs[prefix + "root"] = schema
    return schema


# -- parsing the reply ------------------------------------------------------------------------------


@dataclass
class CallDelta:
    """A piece of tool call ``index``: its first piece has ``id`` and ``name``; the others carry
    fragments of its ``arguments`` (JSON text)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict:
        """The ``delta.tool_calls[]`` entry of a stream chunk."""
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        else:
            out["function"] = {"arguments": self.arguments}
        return out


Piece = str | CallDelta


class CallParser(Protocol):
    calls: int  # tool calls started so far

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_CALL_HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class ForcedCalls:
    """Reads the constrained array ``[{"name": ..., "arguments": ...}, ...]`` as it is written
    (the grammar fixes the key order). Arguments stream as they arrive."""

    names: tuple[str, ...]
    calls: int = 0
    _buf: str = ""
    _in_args: bool = False
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf:
            if not self._in_args:
                m = _CALL_HEAD.match(self._buf)
                if m is None:
                    break
                out.append(CallDelta(self.calls, call_id(), m.group(1)))
                self.calls += 1
                self._buf = self._buf[m.end():]
                self._in_args, self._depth, self._in_string, self._escaped = True, 0, False, False
                continue
            end = self._args_end()
            fragment = self._buf if end is None else self._buf[:end]
            if fragment:
                out.append(CallDelta(self.calls - 1, arguments=fragment))
            if end is None:
                self._buf = ""
                break
            self._buf = self._buf[end + 1:]  # past the call's closing brace
            self._in_args = False
        return out

    def _args_end(self) -> int | None:
        """Where the current call's closing brace is in the buffer (None: not yet), scanning the
        arguments' JSON and keeping the scan state across feeds."""
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
            elif ch in "]}":
                if self._depth == 0:
                    return i
                self._depth -= 1
        return None

    def finish(self) -> list[Piece]:
        return []


OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class HermesCalls:
    """Reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks out of free text.
    Text outside blocks is content (a possible start of ``<tool_call>`` is held back); a block is
    given out whole once closed: a call when it parses as one of ``names``, else as content.
    Whitespace beside a call (before it, between calls, after the last) is not content: a reply of
    calls a newline apart has no content, as OpenAI's has none (the openai SDK's ``parse()`` would
    read a ``"\n"`` as the answer's JSON). So a text's trailing whitespace is held back until what
    follows it is known. With ``most`` (``parallel_tool_calls: false``: 1) the calls past it are
    dropped, as ``vllm serve`` drops them (the model was told, not made, to call one tool)."""

    names: tuple[str, ...]
    most: int | None = None
    calls: int = 0
    _buf: str = ""
    _space: str = ""  # whitespace held back: content only if text follows it
    _after_call: bool = False  # the last piece given out was a call

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf:
            start = self._buf.find(OPEN)
            if start < 0:
                keep = partial_suffix(self._buf, OPEN)
                if len(self._buf) > keep:
                    out.extend(self._text(self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                break
            if start:
                out.extend(self._text(self._buf[:start]))
                self._buf = self._buf[start:]
            end = self._buf.find(CLOSE)
            if end < 0:
                break
            block, self._buf = self._buf[: end + len(CLOSE)], self._buf[end + len(CLOSE):]
            pieces = self._block(block)
            if not pieces or isinstance(pieces[0], CallDelta):  # a call (given out, or one past ``most``)
                self._space, self._after_call = "", True
                out.extend(pieces)
            else:
                out.extend(self._text(block))
        return out

    def _text(self, text: str) -> list[Piece]:
        """Content, less its trailing whitespace (held back) and with what was held before it."""
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        out, self._space, self._after_call = self._space + body, text[len(body):], False
        return [out]

    def _block(self, block: str) -> list[Piece]:
        try:
            call = json.loads(block[len(OPEN): -len(CLOSE)])
        except (ValueError, RecursionError):  # past ~1000 levels json.loads raises the latter: no call either
            return [block]
        if not (isinstance(call, dict) and call.get("name") in self.names and isinstance(call.get("arguments", {}), dict)):
            return [block]
        if self.most is not None and self.calls >= self.most:
            return []
        index = self.calls
        self.calls += 1
        return [CallDelta(index, call_id(), call["name"]),
                CallDelta(index, arguments=json.dumps(call.get("arguments", {})))]

    def finish(self) -> list[Piece]:
        rest, self._buf = self._buf, ""
        out = self._text(rest)
        if self._space and not self._after_call:  # a reply's own trailing whitespace stays
            out.append(self._space)
        self._space = ""
        return out


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass
class ToolCalls:
    """Whole tool calls assembled from :class:`CallDelta` pieces (for a non-streamed reply)."""

    calls: list[dict] = field(default_factory=list)

    def add(self, delta: CallDelta) -> None:
        if delta.id is not None:
            self.calls.append({"id": delta.id, "type": "function",
                               "function": {"name": delta.name, "arguments": delta.arguments}})
        else:
            self.calls[delta.index]["function"]["arguments"] += delta.arguments
