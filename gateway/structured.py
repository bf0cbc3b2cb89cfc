"""Structured outputs: a request's ``response_format``, or vLLM's ``structured_outputs``, as a
grammar for constrained decoding.

``response_format``: ``text`` (or none): free text. ``json_object``: any JSON object.
``json_schema``: JSON valid against the schema. Both engines decode with xgrammar and no free
whitespace (``workers.grammar``); ``strict`` changes nothing (every constrained reply is built as
if strict: objects take only their declared properties).

``structured_outputs`` (vLLM's extension, on chat, completions and responses): exactly one of
``json`` (a schema, or its JSON text), ``json_object``, ``regex``, ``choice`` or ``grammar``, as
``vllm serve`` takes them; one request sets it or a non-text ``response_format``, not both.

What xgrammar cannot build (a schema, a regex, a grammar) is a 400 naming the field, before the
request queues.
"""

from __future__ import annotations

import json

from gateway.errors import bad_request
from gateway.schemas import ResponseFormat, StructuredOutputs, loads
from workers.base import EbnfGrammar, Grammar, JsonGrammar
from workers.grammar import choice_ebnf, ebnf_text, regex_ebnf, schema_error

ANY_OBJECT = JsonGrammar('{"type": "object"}')


def response_grammar(fmt: ResponseFormat | None, param: str = "response_format") -> JsonGrammar | None:
    """The grammar of ``fmt`` (None for free text); 400 naming ``param`` when it cannot be built."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ANY_OBJECT
    spec = fmt.json_schema
    if spec is None:
        raise bad_request("response_format of type json_schema needs a json_schema object",
                          f"{param}.json_schema", "missing_required_parameter")
    if not isinstance(spec.schema_, dict):
        raise bad_request("json_schema.schema must be a JSON schema object", param, "invalid_schema")
    problem = schema_error(spec.schema_)
    if problem:
        raise bad_request(f"the schema '{spec.name}' cannot be used for constrained decoding: {problem}",
                          param, "invalid_schema")
    return JsonGrammar(json.dumps(spec.schema_))


CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def request_grammar(fmt: ResponseFormat | None, outputs: StructuredOutputs | None, max_chars: int,
                    param: str = "response_format") -> Grammar | None:
    """The grammar a request asks for with ``response_format`` (named ``param``) or
    ``structured_outputs`` (None for free text); 400 naming the field when it cannot be built."""
    if outputs is None:
        return response_grammar(fmt, param)
    if fmt is not None and fmt.type != "text":
        raise bad_request(f"set {param} or structured_outputs, not both", "structured_outputs")
    return outputs_grammar(outputs, max_chars)


def outputs_grammar(so: StructuredOutputs, max_chars: int) -> Grammar:
    """The grammar of vLLM's ``structured_outputs``: exactly one constraint; a regex, grammar or
    choices longer than ``max_chars`` (``limits.grammar_max_chars``) all together is a 400."""
    given = [k for k in CONSTRAINTS if getattr(so, "json_" if k == "json" else k) not in (None, False)]
    if len(given) != 1:
        raise bad_request("structured_outputs takes exactly one of json, json_object, regex, choice and grammar"
                          + (f", not {len(given)}: {', '.join(given)}" if given else ""), "structured_outputs")
    kind, where = given[0], f"structured_outputs.{given[0]}"
    if so.whitespace_pattern is not None:
        raise bad_request("structured_outputs.whitespace_pattern is not supported: JSON is always compact here",
                          "structured_outputs.whitespace_pattern", "unsupported_value")
    if kind == "structural_tag":
        raise bad_request("structured_outputs.structural_tag is not supported; tools and response_format cover "
                          "tool calls and JSON", where, "unsupported_value")
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json":
        schema = so.json_
        if isinstance(schema, str):
            try:
                schema = loads(schema)  # as strict as a body (a schema object's depth is capped there)
            except ValueError:
                raise bad_request("structured_outputs.json is a JSON schema, or its text: this text is not JSON",
                                  where, "invalid_schema") from None
        if not isinstance(schema, (dict, bool)):
            raise bad_request("structured_outputs.json must be a JSON schema object", where, "invalid_schema")
        problem = schema_error(schema)
        if problem:
            raise bad_request(f"the schema cannot be used for constrained decoding: {problem}", where, "invalid_schema")
        return JsonGrammar(json.dumps(schema))
    chars = len(so.regex or "") + len(so.grammar or "") + sum(len(c) + 1 for c in so.choice or ())
    if chars > max_chars:
        raise bad_request(f"{where} is {chars} characters, above this server's limit of {max_chars} "
                          "(limits.grammar_max_chars: compiling it takes time with its length)", where, "too_long")
    try:
        if kind == "regex":
            return EbnfGrammar(regex_ebnf(so.regex or ""))
        if kind == "choice":
            return EbnfGrammar(choice_ebnf(so.choice or []))
        return EbnfGrammar(ebnf_text(so.grammar or ""))
    except ValueError as exc:
        raise bad_request(f"{where} cannot be used for constrained decoding: {exc}", where) from None
