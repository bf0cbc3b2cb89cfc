"""Structured outputs: a request's ``response_format`` as a grammar for constrained decoding.

``text`` (or none): free text. ``json_object``: any JSON object. ``json_schema``: JSON valid
against the schema. Both engines decode with xgrammar and no free whitespace
(``workers.grammar``); ``strict`` changes nothing (every constrained reply is built as if strict:
objects take only their declared properties). A schema xgrammar cannot compile is a 400 naming
``response_format``, before the request queues.
"""

from __future__ import annotations

import json

from gateway.errors import bad_request
from gateway.schemas import ResponseFormat
from workers.base import JsonGrammar
from workers.grammar import schema_error

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
