"""The tool-call parsers and tool plans (gateway/tools.py), fed the reply in every possible split."""

from __future__ import annotations

import json

import pytest

from gateway.errors import APIError
from gateway.schemas import NamedToolChoice, Tool
from gateway.tools import CallDelta, ForcedCalls, HermesCalls, ToolCalls, calls_schema, plan_tools


def feed_split(parser, text: str, cut: int) -> list:
    return parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()


def assemble(pieces: list) -> tuple[str, list[dict]]:
    calls = ToolCalls()
    content = ""
    for p in pieces:
        if isinstance(p, CallDelta):
            calls.add(p)
        else:
            content += p
    return content, calls.calls


FORCED = '[{"name": "get_weather", "arguments": {"city": "Paris", "tags": ["a}", "\\"b]"]}}, {"name": "noop", "arguments": {}}]'


@pytest.mark.parametrize("cut", range(len(FORCED) + 1))
def test_forced_calls_in_any_split(cut):
    parser = ForcedCalls(("get_weather", "noop"))
    pieces = feed_split(parser, FORCED, cut)
    content, calls = assemble(pieces)
    assert content == ""
    assert [c["function"]["name"] for c in calls] == ["get_weather", "noop"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "tags": ["a}", '"b]']}
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    # OpenAI's streaming order: index, id and name first, then argument fragments only
    firsts = [p for p in pieces if p.id is not None]
    assert [p.index for p in firsts] == [0, 1] and all(p.arguments == "" for p in firsts)


HERMES = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> <tool_call>not json</tool_call> done <tool'


@pytest.mark.parametrize("cut", range(len(HERMES) + 1))
def test_hermes_calls_in_any_split(cut):
    pieces = feed_split(HermesCalls(("get_weather",)), HERMES, cut)
    content, calls = assemble(pieces)
    assert content == "Let me check. <tool_call>not json</tool_call> done <tool"  # the space beside the call is not content
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


SEVERAL = '\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>\n'


@pytest.mark.parametrize("cut", range(len(SEVERAL) + 1))
def test_whitespace_beside_calls_is_not_content_in_any_split(cut):
    """Calls a newline apart (what the combined grammar writes) are a reply with no content; a
    reply's own whitespace stays where no call is beside it."""
    content, calls = assemble(feed_split(HermesCalls(("a", "b")), SEVERAL, cut))
    assert content == "" and [c["function"]["name"] for c in calls] == ["a", "b"]
    text = "Checking.\n" + SEVERAL.strip() + "\nDone.\n\n"
    content, calls = assemble(feed_split(HermesCalls(("a", "b")), text, min(cut, len(text))))
    assert content == "Checking.\nDone.\n\n" and len(calls) == 2


@pytest.mark.parametrize("cut", range(len(SEVERAL) + 1))
def test_auto_calls_past_the_first_are_dropped_without_parallel_tool_calls(cut):
    """``parallel_tool_calls: false`` in auto mode (no format beside, whose grammar stops after
    one call): a model that writes several calls is answered with the first, as vLLM's
    ``maybe_filter_parallel_tool_calls`` answers it, whole and streamed."""
    parser = plan_tools([tool("a"), tool("b")], "auto", False).parser_for_reply()
    content, calls = assemble(feed_split(parser, SEVERAL, cut))
    assert content == "" and [c["function"]["name"] for c in calls] == ["a"]
    text = "Checking.\n" + SEVERAL.strip() + "\nDone."
    content, calls = assemble(feed_split(plan_tools([tool("a"), tool("b")], "auto", False).parser_for_reply(),
                                         text, min(cut, len(text))))
    assert content == "Checking.\nDone." and len(calls) == 1
    assert len(assemble(feed_split(plan_tools([tool("a"), tool("b")], "auto", None).parser_for_reply(),
                                   SEVERAL, cut))[1]) == 2


def test_hermes_call_of_an_undeclared_tool_is_content():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert assemble(HermesCalls(("get_weather",)).feed(text)) == (text, [])


def test_a_hermes_block_nested_past_the_json_parser_is_content():
    """A model may write any text: a block nested past json.loads' ~1000 levels (RecursionError,
    a 500) is content, as any block that is not a call."""
    text = "<tool_call>" + "[" * 2000 + "]" * 2000 + "</tool_call>"
    assert assemble(HermesCalls(("get_weather",)).feed(text)) == (text, [])


def tool(name: str, parameters: dict | None = None) -> Tool:
    return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})


def test_forced_schema_moves_each_tools_defs_to_the_root():
    person = {"type": "object", "properties": {"pet": {"$ref": "#/$defs/Pet"}}, "required": ["pet"],
              "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}}}}
    schema = calls_schema([tool("a", person), tool("b", person)], single=False)
    assert set(schema["$defs"]) == {"tool0_Pet", "tool1_Pet"}
    items = schema["items"]["anyOf"]
    assert items[1]["properties"]["arguments"]["properties"]["pet"] == {"$ref": "#/$defs/tool1_Pet"}
    assert items[0]["properties"]["name"] == {"const": "a"}


def test_a_tools_json_pointer_references_resolve_under_its_calls_arguments():
    """A reference other than to a definition (``#/properties/a``, as zod-to-json-schema writes a
    reused part; a pointer into a nested ``$defs``) compiles alone and so passes the gateway's
    check: the calls' grammar, which nests the parameters under ``arguments``, resolves it too."""
    reused = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"$ref": "#/properties/a"},
                                               "c": {"$defs": {"N": {"type": "boolean"}},
                                                     "$ref": "#/properties/c/$defs/N"}},
              "required": ["a", "b", "c"]}
    person = {"$defs": {"P": {"type": "integer"}}, "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
              "required": ["p"]}
    for tools in ([tool("f", reused)], [tool("g", person), tool("f", reused)]):
        forced = plan_tools(tools, "required", None).grammar
        assert matches(forced, '[{"name":"f","arguments":{"a":"x","b":"y","c":true}}]')
        assert not matches(forced, '[{"name":"f","arguments":{"a":"x","b":1,"c":true}}]')
        assert not matches(forced, '[{"name":"f","arguments":{"a":"x","b":"y","c":"z"}}]')
    from workers.base import JsonGrammar

    beside = plan_tools([tool("f", reused)], "auto", None).reply_grammar(JsonGrammar(json.dumps(REPLY)))
    assert matches(beside, '<tool_call>{"name":"f","arguments":{"a":"y","b":"x","c":false}}</tool_call>')

    # a const's or an enum's value that looks like a reference is data, kept as written; a property
    # named as a keyword is a schema
    data = {"type": "object", "properties": {"k": {"const": {"$ref": "#/$defs/A"}}, "enum": {"$ref": "#/$defs/A"}},
            "required": ["k", "enum"], "$defs": {"A": {"type": "integer"}}}
    forced = plan_tools([tool("d", data)], "required", None).grammar
    assert matches(forced, '[{"name":"d","arguments":{"k":{"$ref":"#/$defs/A"},"enum":7}}]')


def test_plans():
    tools = [tool("a"), tool("b")]
    assert plan_tools(None, None, None).mode == "none"
    assert plan_tools(tools, None, None).mode == "auto"
    assert plan_tools(tools, "none", None).template_tools() is None
    forced = plan_tools(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "b"}}), None)
    assert forced.mode == "forced" and forced.names == ("b",)
    assert json.loads(forced.grammar.schema)["maxItems"] == 1
    assert "maxItems" not in json.loads(plan_tools(tools, "required", None).grammar.schema)
    assert json.loads(plan_tools(tools, "required", False).grammar.schema)["maxItems"] == 1
    # an error of the reply's grammar (the engine's compile) names where it came from: forced calls' tools
    assert forced.grammar_param("response_format") == "tools"
    assert plan_tools(tools, "auto", None).grammar_param("structured_outputs") == "structured_outputs"
    assert plan_tools(None, None, None).grammar_param("response_format") == "response_format"


@pytest.mark.parametrize("tools,choice,param", [
    ([tool("a", {"type": "string", "pattern": "("})], "auto", "tools[0].function.parameters"),
    # a call's arguments are an object (a string's was answered as text on the Messages API, its tool_use lost)
    ([tool("a"), tool("b", {"type": "string"})], "required", "tools[1].function.parameters"),
    ([tool("a", {"type": ["array", "null"], "items": {"type": "integer"}})], "auto", "tools[0].function.parameters"),
    ([tool("a")], NamedToolChoice.model_validate({"type": "function", "function": {"name": "zz"}}), "tool_choice"),
    (None, "required", "tool_choice"),
    ([tool("a"), tool("a")], "auto", "tools"),
])
def test_bad_plans_are_400_naming_the_field(tools, choice, param):
    with pytest.raises(APIError) as err:
        plan_tools(tools, choice, None)
    assert err.value.status == 400 and err.value.param == param


# -- auto tools beside a response format: the JSON or the model's calls ------------------------------------------------

def matches(grammar, text: str) -> bool:
    """Whether ``grammar`` (a JsonGrammar or an EbnfGrammar) takes ``text`` whole and may end
    there: fed character by character to xgrammar over a one-character vocabulary, as the engines
    feed it tokens."""
    import xgrammar as xgr

    from workers.grammar import Grammars

    class OneCharacter:  # the part of a Hugging Face tokenizer that xgrammar reads
        vocab = [chr(i) for i in range(128)] + ["</s>"]

    info = xgr.TokenizerInfo(OneCharacter.vocab, stop_token_ids=[128])
    grammars = Grammars.__new__(Grammars)
    grammars.vocab_size, grammars._compiler = len(info.decoded_vocab), xgr.GrammarCompiler(info)
    row = grammars.row(grammar)
    try:
        for ch in text:
            row.accept(ord(ch))
        row.accept(128)
    except RuntimeError:
        return False
    return row.finished


REPLY = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
HOUR = {"type": "object", "properties": {"hour": {"type": "integer"}}, "required": ["hour"]}


def test_a_response_format_beside_auto_tools_takes_the_json_or_calls_of_the_tools():
    from workers.base import JsonGrammar

    reply = JsonGrammar(json.dumps(REPLY))
    several = plan_tools([tool("alarm", HOUR), tool("noop")], "auto", None).reply_grammar(reply)
    call, other = '{"name":"alarm","arguments":{"hour":7}}', '{"name":"noop","arguments":{}}'
    for text in ['{"ok":true}', f"<tool_call>{call}</tool_call>", f"<tool_call>\n{call}\n</tool_call>",
                 f"<tool_call>{call}</tool_call>\n<tool_call>\n{other}</tool_call>"]:
        assert matches(several, text), text
    for text in ['{"ok":1}', '{"ok":true,"x":1}', "ok", f"{call}", '<tool_call>{"name":"rm","arguments":{}}</tool_call>',
                 '<tool_call>{"name":"alarm","arguments":{"hour":"7"}}</tool_call>', f"<tool_call>{call}</tool_call> done",
                 f'<tool_call>{call}</tool_call>{{"ok":true}}']:
        assert not matches(several, text), text
    single = plan_tools([tool("alarm", HOUR), tool("noop")], "auto", False).reply_grammar(reply)
    assert matches(single, f"<tool_call>{call}</tool_call>")
    assert not matches(single, f"<tool_call>{call}</tool_call>\n<tool_call>{other}</tool_call>")
    # the reply's grammar alone without tools; a forced plan keeps its array of calls
    assert plan_tools(None, None, None).reply_grammar(reply) is reply
    assert plan_tools([tool("a")], "none", None).reply_grammar(reply) is reply
    forced = plan_tools([tool("alarm", HOUR)], "required", None)
    assert forced.reply_grammar(reply) is forced.grammar and matches(forced.grammar, f"[{call}]")
    assert plan_tools([tool("alarm", HOUR)], "auto", None).reply_grammar(None) is None


def test_a_tool_whose_parameters_declare_no_properties_takes_no_arguments():
    """``{"type": "object"}`` with no ``properties`` (how Anthropic's API and MCP servers declare a
    tool without arguments) is called with ``{}`` only, forced or beside a format, as a tool
    without ``parameters`` is; an object that declares its keys another way keeps them, and a
    response format's bare object (and a nested one) stays a free object, as vLLM takes it."""
    from workers.base import JsonGrammar

    bare = {"type": "object", "description": "no arguments"}
    for parameters in (bare, None):
        forced = plan_tools([tool("now", parameters)], "required", None).grammar
        assert matches(forced, '[{"name":"now","arguments":{}}]')
        assert not matches(forced, '[{"name":"now","arguments":{"a":1}}]')
        beside = plan_tools([tool("now", parameters)], "auto", None).reply_grammar(JsonGrammar(json.dumps(REPLY)))
        assert not matches(beside, '<tool_call>{"name":"now","arguments":{"a":1}}</tool_call>')
    free = {"type": "object", "additionalProperties": {"type": "integer"}}
    tally = plan_tools([tool("tally", free)], "required", None).grammar
    assert matches(tally, '[{"name":"tally","arguments":{"a":1}}]')
    nested = {"type": "object", "properties": {"extra": {"type": "object"}}, "required": ["extra"]}
    assert matches(plan_tools([tool("f", nested)], "required", None).grammar,
                   '[{"name":"f","arguments":{"extra":{"a":1}}}]')
    from gateway.schemas import ResponseFormat
    from gateway.structured import response_grammar

    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x", "schema": bare}})
    assert matches(response_grammar(fmt), '{"a":1}')  # a response format's root: a free object


def test_a_format_that_cannot_be_joined_with_the_calls_is_a_400(monkeypatch):
    import gateway.tools
    from workers.base import JsonGrammar

    def refuse(*args, **kwargs):
        raise RuntimeError("rule conflict")

    monkeypatch.setattr(gateway.tools, "reply_or_calls", refuse)
    with pytest.raises(APIError) as err:
        plan_tools([tool("a")], "auto", None).reply_grammar(JsonGrammar(json.dumps(REPLY)))
    assert err.value.status == 400 and err.value.param == "response_format" and "rule conflict" in err.value.message


def test_a_length_bounded_string_is_a_json_string():
    """xgrammar 0.2 draws a string with minLength/maxLength as any characters but quote, backslash,
    CR and LF: raw control characters in, escapes out. Mended (``workers.grammar.json_ebnf``): each
    character is a JSON string's character or one escape, and the bounds count them so: an escaped
    surrogate pair is one character, a lone surrogate none."""
    from workers.base import JsonGrammar
    from workers.grammar import BOUNDED_CHARACTER, JSON_CHARACTER, json_ebnf

    schema = json.dumps({"type": "object", "properties": {"title": {"type": "string", "minLength": 2, "maxLength": 5}},
                         "required": ["title"], "additionalProperties": False})
    assert JSON_CHARACTER in json_ebnf(schema) and BOUNDED_CHARACTER not in json_ebnf(schema)
    title = JsonGrammar(schema)
    pair = "\\ud83d\\ude00"  # one character (U+1F600) as JSON escapes it: two escapes, one of JSON Schema's characters
    for text in ['{"title":"ab"}', '{"title":"a\\"b"}', '{"title":"\\\\\\n\\t"}', '{"title":"abcd\\u00e9"}',
                 f'{{"title":"a{pair}"}}', f'{{"title":"abcd{pair}"}}', '{"title":"a\\ud7ff"}']:
        assert matches(title, text), text
        assert 2 <= len(json.loads(text)["title"]) <= 5  # strict JSON, its length in code points within the bounds
    for text in ['{"title":"a\tb"}', '{"title":"a\x1cb"}', '{"title":"a"}', '{"title":"abcdef"}', '{"title":"abcde\\n"}',
                 '{"title":"a\\qb"}', f'{{"title":"{pair}"}}', f'{{"title":"abcde{pair}"}}', '{"title":"a\\ud83db"}',
                 '{"title":"a\\ude00b"}', '{"title":"\\ude00\\ud83d"}']:
        assert not matches(title, text), repr(text)


def test_a_schema_is_refused_past_openais_limit_on_its_names_enums_and_consts():
    """OpenAI's count (property and definition names, enum values and consts, at any depth; a value
    that is not a string as its compact JSON; descriptions and other strings not counted): at
    120,000 characters a schema compiles, one more is refused with the count."""
    from workers.grammar import MAX_SCHEMA_STRINGS, schema_error, schema_strings

    schema = {"type": "object", "description": "d" * 10_000, "$defs": {"ab": {"enum": ["xyz", 31, "q"]}},
              "properties": {"p": {"anyOf": [{"const": "cc"}, {"type": "string", "pattern": "z" * 50}]}}}
    assert schema_strings(schema) == 2 + 3 + 2 + 1 + 1 + 2
    # a literal that is not a string costs as much to compile: a 1 MB object const took 215 s
    assert schema_strings({"const": {"a": ["x" * 10, None]}}) == len('{"a":["xxxxxxxxxx",null]}')
    assert "total 488890 characters" in schema_error({"enum": list(range(100_000))})
    assert "total 120008 characters" in schema_error({"enum": [{"k": "v" * 120_000}]})
    room = MAX_SCHEMA_STRINGS - schema_strings(schema)
    at_limit = {**schema, "$defs": {**schema["$defs"], "e" * room: {}}}
    assert schema_strings(at_limit) == MAX_SCHEMA_STRINGS and schema_error(at_limit) is None
    over = {**schema, "$defs": {**schema["$defs"], "e" * (room + 1): {}}}
    assert f"total {MAX_SCHEMA_STRINGS + 1} characters" in schema_error(over)


@pytest.mark.parametrize("pattern, size, largest", [
    ("([a-z]{1,100}){1,100}", 10_000, 100), ("[a-z]{1,200}", 200, 200), (r"^\d{3}-\d{4}$", 8, 4),
    ("(ab|cd){1,1000}", 4000, 1000), ("[]a]{3}", 3, 3), ("[^]a]{3}", 3, 3), (r"[\]]{200}", 200, 200),
    (r"\{5}", 3, 0), ("a{,5}", 5, 5), ("a{5,}", 5, 5), ("{abc}", 5, 0), ("ab*c+d?", 4, 0), ("((a)", 1, 0),
    ("a{" + "9" * 5000 + "}", 10**9, 10**9),  # (int() refuses 5,000 digits: capped, not a 500)
])
def test_a_patterns_size_written_out_and_its_largest_count(pattern, size, largest):
    from workers.grammar import pattern_size

    assert pattern_size(pattern) == (size, largest)


@pytest.mark.parametrize("where", ["pattern", "patternProperties", "propertyNames"])
def test_a_count_above_128_in_a_schemas_pattern_is_refused_as_xgrammar_fails_on_it(where):
    """xgrammar 0.2.8 (vLLM 0.32's) compiles a pattern's count of 128 and fails on 129 with its
    grammar cache on, as the engines' compilers have it (mlc-ai/xgrammar#863): the gateway refuses
    the 129 before xgrammar sees it, naming the count, and takes the 128."""
    import xgrammar as xgr

    from workers.base import JsonGrammar
    from workers.grammar import MAX_COUNTED_REPEAT, json_ebnf, schema_error

    def schema(n: int) -> dict:
        regex = f"^[a-z]{{1,{n}}}$"
        return {"pattern": {"type": "string", "pattern": regex},
                "patternProperties": {"type": "object", "patternProperties": {regex: {"type": "integer"}}},
                "propertyNames": {"type": "object", "propertyNames": {"pattern": regex},
                                  "additionalProperties": {"type": "integer"}}}[where]

    vocab = [chr(c) for c in range(32, 127)] + ["</s>"]
    cached = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1]), cache_enabled=True)
    at, over = schema(MAX_COUNTED_REPEAT), schema(MAX_COUNTED_REPEAT + 1)
    cached.compile_grammar(json_ebnf(json.dumps(at)))
    with pytest.raises(RuntimeError, match="per_rule_fsm_hashes"):
        cached.compile_grammar(json_ebnf(json.dumps(over)))
    assert schema_error(at) is None
    assert "repeats a part 129 times" in schema_error(over)
    if where == "pattern":
        assert matches(JsonGrammar(json.dumps(at)), json.dumps("a" * 128))
        assert not matches(JsonGrammar(json.dumps(at)), json.dumps("a" * 129))


def test_a_schemas_patterns_written_out_are_bounded_together():
    """Building a pattern's grammar takes time with its counted repetitions written out (10,000
    characters' worth took 0.1 s, on the event loop): a schema's patterns may be 4,096 together, at
    any depth, in a tool's parameters or across a request's tools; a "pattern" that is an enum's
    value (data) or a property's name does not count."""
    from workers.grammar import MAX_PATTERN_SIZE, schema_error

    fill = {"type": "string", "pattern": "[a-z]{1,128}"}  # 128 each
    def props(n: int, extra: dict | None = None) -> dict:
        return {"type": "object", "properties": {**{f"p{i}": fill for i in range(n)}, **(extra or {})}}

    assert MAX_PATTERN_SIZE == 32 * 128
    assert schema_error(props(32)) is None
    assert schema_error(props(32, {"pattern": {"enum": [{"pattern": "a{99}"}]}})) is None
    assert "are 4097 characters long, above 4096" in schema_error(props(32, {"x": {"type": "string", "pattern": "b"}}))
    assert "above 4096" in schema_error({"type": "array", "items": {"anyOf": [props(20), props(20)]}})
    plan_tools([tool("a", props(16))], "auto", None)
    with pytest.raises(APIError) as refused:
        plan_tools([tool("a", props(16)), tool("b", props(17))], "auto", None)
    assert refused.value.param == "tools" and "above 4096" in refused.value.message


def test_a_schema_is_refused_past_openais_limit_of_5000_object_properties():
    """Building 20,000 properties' grammar held the event loop 0.28 s: at OpenAI's 5,000 (at any
    depth, a property named "properties" counted once, an enum's data not at all) a schema builds,
    one more is refused with the count, and a request's tools are counted together."""
    from workers.grammar import MAX_SCHEMA_PROPERTIES, schema_error, schema_properties

    def props(n: int, start: int = 0) -> dict:
        return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(start, start + n)}}

    nested = {"type": "object", "properties": {"properties": props(2), "e": {"enum": [{"properties": {"x": 1}}]}}}
    assert schema_properties(nested) == 4
    at = {"anyOf": [props(MAX_SCHEMA_PROPERTIES - 4), nested]}
    assert schema_properties(at) == MAX_SCHEMA_PROPERTIES and schema_error(at) is None
    assert "declares 5001 object properties, above 5000" in schema_error({"anyOf": [at, props(1)]})
    plan_tools([tool("a", props(2500)), tool("b", props(2500))], "auto", None)
    with pytest.raises(APIError) as refused:
        plan_tools([tool("a", props(2500)), tool("b", props(2501))], "auto", None)
    assert refused.value.param == "tools" and "5001 object properties" in refused.value.message


def test_the_engines_compiled_grammars_are_bounded_in_memory(monkeypatch):
    """Every distinct schema compiled stayed cached for as long as the model was loaded (xgrammar's
    default has no bound): the transformers engine's compiler keeps at most COMPILE_CACHE_BYTES."""
    import xgrammar as xgr

    from workers import grammar
    from workers.base import JsonGrammar

    vocab = [chr(i) for i in range(128)] + ["</s>"]
    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface",
                        staticmethod(lambda *a, **k: xgr.TokenizerInfo(vocab, stop_token_ids=[128])))
    monkeypatch.setattr(grammar, "COMPILE_CACHE_BYTES", 100_000)
    grammars = grammar.Grammars(None, len(vocab), [128])
    for i in range(40):
        grammars.row(JsonGrammar(json.dumps({"type": "object", "properties": {f"k{i}_{j}": {"enum": ["a", "b"]}
                                                                              for j in range(10)}})))
    assert 0 < grammars._compiler.get_cache_size_bytes() <= 100_000


@pytest.mark.parametrize("schema", [{"anyOf": []}, {"type": "object", "properties": {"a": {"oneOf": []}}}])
def test_an_empty_anyof_or_oneof_is_refused_not_compiled_to_an_empty_reply(schema):
    """No value matches an empty ``anyOf``/``oneOf`` (JSON Schema's meta-schema wants one entry or
    more): xgrammar compiled it to the empty string, and the reply was ``""`` or ``{"a":}`` with
    finish_reason stop. It is a 400, as an empty ``enum`` is."""
    from workers.grammar import schema_error

    assert "must not be empty" in schema_error(schema)
    with pytest.raises(APIError) as refused:
        plan_tools([tool("a", {"type": "object", "properties": {"x": schema}})], "auto", None)
    assert refused.value.param == "tools[0].function.parameters"


def test_the_grammar_caches_do_not_keep_a_schemas_text():
    """The built grammars are cached by a digest of the schema's text: ``lru_cache`` kept each
    text whole, megabytes of descriptions (which the grammar drops) kept for good, request by
    request (a 4 MB description grew the server 4 MB each)."""
    import sys

    from workers.base import JsonGrammar
    from workers.grammar import json_ebnf, reply_or_calls

    schema = json.dumps({"type": "object", "description": "d" * 100_000, "properties": {"ok": {"type": "boolean"}}})
    call = JsonGrammar(json.dumps({"type": "object", "description": "e" * 100_000}))
    held = sys.getrefcount(schema), sys.getrefcount(call.schema)
    first = json_ebnf(schema)
    assert json_ebnf(schema) is first  # cached
    reply_or_calls(JsonGrammar(schema), call, "<tool_call>", "</tool_call>", True)
    assert (sys.getrefcount(schema), sys.getrefcount(call.schema)) == held
    assert json_ebnf(schema[:-1] + " }") == first and json_ebnf(schema[:-1] + " }") is not first


def test_a_schema_is_refused_past_10000_anyof_oneof_and_prefixitems_entries():
    """Alternatives and tuple items declare no property, and cost more than properties: 100,000
    small anyOf branches held the event loop 9.4 s to build, 20,000 took 20 s to compile. At
    10,000 (at any depth, a request's tools together) a schema builds; one more is refused."""
    from workers.grammar import MAX_SCHEMA_BRANCHES, schema_branches, schema_error

    def either(n: int) -> dict:
        return {"anyOf": [{"type": "boolean"}] * (n - 2) + [{"oneOf": [{"type": "null"}]}]}

    tuple_ = {"type": "array", "prefixItems": [{"type": "integer"}]}
    at = {"type": "array", "items": either(MAX_SCHEMA_BRANCHES - 2), "prefixItems": [tuple_]}
    assert schema_branches(at) == MAX_SCHEMA_BRANCHES and schema_error(at) is None
    assert "10001 anyOf, oneOf and prefixItems entries, above 10000" in schema_error({"anyOf": [at]})
    half = {"type": "object", "properties": {"x": either(5000)}}
    plan_tools([tool("a", half), tool("b", half)], "auto", None)
    with pytest.raises(APIError) as refused:
        plan_tools([tool("a", half), tool("b", {"type": "object", "properties": {"x": either(5001)}})], "auto", None)
    assert refused.value.param == "tools" and "10001 anyOf" in refused.value.message
