"""Generated bad input, every JSON endpoint: whatever the body, the answer is a success or a 4xx
(429/503 allowed) in OpenAI's error shape, never a 500, a traceback or a dropped connection; a
stream that starts is valid SSE to its end; and the server still serves a normal chat afterwards.

Bodies are a valid request with some fields replaced by near-misses (edge numbers, wrong types,
odd schemas, tool calls without ids, token ids outside the vocabulary ...) or by any JSON value,
fields dropped, and unknown ones added (hypothesis). The two upload endpoints get real audio files
(libsndfile) at odd rates, channel counts, lengths and sample values, cut short or replaced by
noise, JSONL files of generated lines, odd form fields, and raw bodies that are not well-formed
multipart; no error message may show Python internals (a repr, a traceback). In the suite the examples are fixed
(``derandomize``) so that a failure repeats, 25 per endpoint (40 until 2026-12-03: cut for the
suite's 15 minutes after a random search of 300 per endpoint found nothing);
``TIERGATE_FUZZ_EXAMPLES=2000 TIERGATE_FUZZ_RANDOM=1`` runs a longer, random search by hand, and
``TIERGATE_FUZZ_ENGINE=vllm`` puts chat on the vLLM engine.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import engine_options, start_server, write_config

MAX_UPLOAD = 96 * 1024  # both upload endpoints' caps in this server: a few generated files go past them
ENGINE = os.environ.get("TIERGATE_FUZZ_ENGINE", "transformers")  # the chat engine behind the server; vllm by hand
EXAMPLES = int(os.environ.get("TIERGATE_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("TIERGATE_FUZZ_RANDOM"),
                database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(tiny_chat, tiny_embed, tiny_image, tiny_tts, tiny_stt, tiny_moderation, tiny_rerank, tiny_vlm,
           tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    models = {"tiny-chat": ("chat", tiny_chat), "tiny-embed": ("embed", tiny_embed),
              "tiny-image": ("image", tiny_image), "tiny-tts": ("tts", tiny_tts), "tiny-stt": ("stt", tiny_stt),
              "tiny-moderation": ("moderation", tiny_moderation), "tiny-rerank": ("rerank", tiny_rerank)}
    extra = ("limits:\n  max_chat_tokens: 6\n  max_n: 2\n  image_max_side: 64\n  image_max_steps: 2\n"
             "  image_max_n: 1\n  speech_max_chars: 80\n  embed_max_inputs: 4\n  prompt_max_chars: 200\n"
             "  rerank_max_documents: 4\n  rerank_max_tokens: 2000\n"
             f"  transcription_max_bytes: {MAX_UPLOAD}\n  transcription_max_seconds: 3\n"
             f"  image_edit_max_bytes: {MAX_UPLOAD}\n"
             f"batch:\n  store: sqlite\n  max_file_bytes: {MAX_UPLOAD}\n  max_lines: 8\n"
             "accounts:\n  limits:\n    free: {requests_per_min: 100000}\n"
             f"adapter_dirs:\n  - {{model: tiny-chat, path: {folder / 'adapters'}}}\n"
             "fine_tuning:\n  models: [tiny-chat]\n")  # jobs made by the fuzz name no file that exists: none runs
    (folder / "adapters").mkdir()
    if ENGINE == "transformers":  # suffix on a model with FIM tokens (its chat roles, named in tiers.yaml)
        models["tiny-chat-fim"] = ("chat", tiny_chat)
        models["tiny-vlm"] = ("chat", tiny_vlm)  # images in chat: the transformers engine only
    config = write_config(folder, models, extra, engine=ENGINE)
    entry = f"  - name: tiny-chat-fim\n    kind: chat\n    path: {tiny_chat}\n"
    config.write_text(config.read_text().replace(
        entry, entry + '    fim: {prefix: "<|user|>", suffix: "<|system|>", middle: "<|assistant|>"}\n'))
    if ENGINE == "vllm":  # a small engine, as tests/test_vllm_gateway.py starts it
        config.write_text(config.read_text().replace("    engine: vllm", "    engine: {name: vllm, kv_cache: 128MiB, max_num_seqs: 4}"))
    engine_options(config, "tiny-chat", tiny_chat, audio_output="tiny-tts")  # spoken replies: modalities text, audio
    running = start_server(config)
    r = httpx.post(f"{running.base_url}/chat/completions", timeout=300,  # the chat engine loads (a vLLM start: ~30 s)
                   json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                   headers={"Authorization": f"Bearer {running.keys['paid']}"})
    assert r.status_code == 200, r.text
    yield running
    running.stop()


# -- values ---------------------------------------------------------------------------------------

EDGE_INTS = st.sampled_from([0, -1, 1, 2, 7, 255, 2**31, 2**53 + 1, 2**63, 2**64 + 1, -(2**63) - 1, 10**30])
EDGE_FLOATS = st.sampled_from([0.0, -0.0, 1e-320, 0.5, 1.0, 2.0, 2.0000001, -2.0, 100.0, 1e308, -1e308])
TEXT = st.text(max_size=12) | st.sampled_from(["", " ", "\x00", "\ud7ff", "💥" * 3, "{", "</s>", "<|im_end|>", "a" * 300])
SCALARS = st.none() | st.booleans() | EDGE_INTS | st.integers() | EDGE_FLOATS | st.floats(allow_nan=False) | TEXT
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                        max_leaves=6)

SCHEMA_KEYS = ["type", "properties", "items", "enum", "required", "minimum", "maximum", "maxLength", "minItems",
               "pattern", "anyOf", "oneOf", "allOf", "$ref", "$defs", "additionalProperties", "const", "format"]
SCHEMA_TYPES = st.sampled_from(["object", "string", "integer", "number", "boolean", "array", "null", "nope"])
JSON_SCHEMA = st.recursive(
    st.fixed_dictionaries({"type": SCHEMA_TYPES}) | st.booleans() | st.just({}),
    lambda inner: st.dictionaries(st.sampled_from(SCHEMA_KEYS),
                                  inner | SCHEMA_TYPES | st.lists(inner | TEXT, max_size=3)
                                  | st.dictionaries(TEXT, inner, max_size=3) | EDGE_INTS | TEXT, max_size=4),
    max_leaves=8)
TOOL_NAME = st.sampled_from(["get_weather", "f", "", "a b", "x" * 80]) | TEXT
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "code"]) | ANY_JSON,
                              "function": st.fixed_dictionaries(
                                  {"name": TOOL_NAME},
                                  optional={"parameters": JSON_SCHEMA | ANY_JSON, "strict": st.booleans() | ANY_JSON,
                                            "description": TEXT})})
TOOL_CALL = st.fixed_dictionaries({}, optional={
    "id": TEXT, "type": st.just("function") | ANY_JSON,
    "function": st.fixed_dictionaries({}, optional={"name": TOOL_NAME, "arguments": TEXT | st.just('{"a": 1}') | ANY_JSON})})
def _png_url() -> str:
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (5, 3), (200, 10, 10)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


IMAGE_URL = st.fixed_dictionaries({"url": st.sampled_from([_png_url(), _png_url()[:-8], "data:image/png;base64,",
                                                           "https://example.com/a.png", "data:,x"]) | TEXT | ANY_JSON},
                                  optional={"detail": st.sampled_from(["auto", "low", "high", "max"]) | ANY_JSON})
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "refusal"]) | ANY_JSON},
                             optional={"text": TEXT | ANY_JSON, "image_url": IMAGE_URL | ANY_JSON})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "robot"])},
    optional={"content": TEXT | st.lists(PART, max_size=3) | st.none() | ANY_JSON, "name": TEXT | ANY_JSON,
              "tool_calls": st.lists(TOOL_CALL, max_size=2) | ANY_JSON, "tool_call_id": TEXT | ANY_JSON,
              "function_call": st.fixed_dictionaries({"name": TOOL_NAME, "arguments": TEXT}) | ANY_JSON,
              "refusal": TEXT, "reasoning_content": TEXT | ANY_JSON,
              "audio": st.fixed_dictionaries({"id": TEXT | st.just("audio_0") | ANY_JSON}) | st.none() | ANY_JSON})
TOKEN_IDS = st.lists(EDGE_INTS | st.integers(-5, 300), max_size=4)
FORMAT = st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"]) | ANY_JSON},
                               optional={"json_schema": st.fixed_dictionaries(
                                   {"name": TOOL_NAME}, optional={"schema": JSON_SCHEMA | ANY_JSON,
                                                                  "strict": st.booleans()}) | ANY_JSON})
TOOL_CHOICE = (st.sampled_from(["none", "auto", "required", "any"])
               | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": TOOL_NAME})})
               | st.fixed_dictionaries({"type": st.just("allowed_tools"), "allowed_tools": st.fixed_dictionaries(
                   {"mode": st.sampled_from(["auto", "required", "none"]),
                    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                        {"name": TOOL_NAME})}), max_size=2)})})
               | st.fixed_dictionaries({"type": st.just("allowed_tools"), "mode": st.sampled_from(["auto", "required"]),
                                        "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"),
                                                                                 "name": TOOL_NAME}), max_size=2)})
               | ANY_JSON)
FILTER = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["eq", "ne", "gt", "gte", "lt", "lte", "in", "nin", "like"]) | ANY_JSON},
                          optional={"key": TEXT | ANY_JSON, "value": TEXT | EDGE_INTS | EDGE_FLOATS | st.booleans()
                                    | st.lists(TEXT | EDGE_INTS, max_size=3) | ANY_JSON}),
    lambda inner: st.fixed_dictionaries({"type": st.sampled_from(["and", "or", "xor"])},
                                        optional={"filters": st.lists(inner, max_size=3) | ANY_JSON}), max_leaves=6)
CHUNKING = st.fixed_dictionaries({"type": st.sampled_from(["auto", "static", "other"]) | ANY_JSON}, optional={
    "static": st.fixed_dictionaries({}, optional={"max_chunk_size_tokens": EDGE_INTS | st.sampled_from([100, 126, 127]),
                                                  "chunk_overlap_tokens": EDGE_INTS | st.sampled_from([0, 50, 51])})
    | ANY_JSON})
HYBRID = st.fixed_dictionaries({}, optional={"embedding_weight": EDGE_FLOATS | st.sampled_from([0, 1]),
                                             "text_weight": EDGE_FLOATS | st.sampled_from([0, 1])}) | ANY_JSON
ATTRIBUTES = st.dictionaries(TEXT, TEXT | EDGE_INTS | EDGE_FLOATS | st.booleans() | ANY_JSON, max_size=18)
ADAPTERS = st.lists(st.fixed_dictionaries({"name": TEXT}, optional={"weight": EDGE_FLOATS | ANY_JSON}), max_size=3)
REGEX = st.sampled_from(["[0-9]+", "(a", "a{2,1}", "\\", "a\x00", "(?P<x>a)", "\\p{L}", ".*", "[z-a]", "a**", "(?=a)"]) | TEXT
GRAMMAR = st.sampled_from(['root ::= "a"', 'start: "a"', "root ::= ", "start: (", 'x ::= "a"', 'root ::= root',
                           'start: start', '%import common.WORD\nstart: WORD']) | TEXT
STRUCTURED = st.fixed_dictionaries({}, optional={
    "json": JSON_SCHEMA | TEXT | ANY_JSON, "json_object": st.booleans() | ANY_JSON, "regex": REGEX | ANY_JSON,
    "choice": st.lists(TEXT, max_size=3) | ANY_JSON, "grammar": GRAMMAR | ANY_JSON, "structural_tag": TEXT,
    "disable_any_whitespace": st.booleans(), "whitespace_pattern": TEXT}) | ANY_JSON
SAMPLING = {"temperature": EDGE_FLOATS, "top_p": EDGE_FLOATS, "seed": EDGE_INTS, "n": EDGE_INTS,
            "presence_penalty": EDGE_FLOATS, "frequency_penalty": EDGE_FLOATS,
            "top_k": EDGE_INTS | EDGE_FLOATS, "min_p": EDGE_FLOATS, "repetition_penalty": EDGE_FLOATS,
            "stop_token_ids": TOKEN_IDS | ANY_JSON, "min_tokens": EDGE_INTS, "ignore_eos": st.booleans() | ANY_JSON,
            "include_stop_str_in_output": st.booleans() | ANY_JSON, "return_token_ids": st.booleans() | ANY_JSON,
            "return_tokens_as_token_ids": st.booleans() | ANY_JSON, "echo": st.booleans() | ANY_JSON,
            "allowed_token_ids": TOKEN_IDS | ANY_JSON, "bad_words": st.lists(TEXT, max_size=3) | ANY_JSON,
            "truncate_prompt_tokens": EDGE_INTS | st.sampled_from([-1, 1, 3]),
            "thinking_token_budget": EDGE_INTS | st.sampled_from([-1, 0, 3]),
            "request_id": TEXT, "cache_salt": TEXT, "add_special_tokens": st.booleans() | ANY_JSON,
            "priority": EDGE_INTS, "use_beam_search": st.booleans() | ANY_JSON, "length_penalty": EDGE_FLOATS,
            "truncation_side": st.sampled_from(["left", "right", "middle"]), "prompt_logprobs": EDGE_INTS,
            "skip_special_tokens": st.booleans() | ANY_JSON, "spaces_between_special_tokens": st.booleans() | ANY_JSON,
            "structured_outputs": STRUCTURED, "stop": TEXT | st.lists(TEXT, max_size=5), "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | ANY_JSON}),
            "logit_bias": st.dictionaries(st.sampled_from(["0", "1", "-1", "99999999", "abc", "1.5", " 2", "²"]),
                                          EDGE_FLOATS | ANY_JSON, max_size=3),
            "service_tier": st.sampled_from(["auto", "default", "flex", "priority", "paid", "batch", "free", "gold"]),
            "user": TEXT, "metadata": st.dictionaries(TEXT, TEXT | ANY_JSON, max_size=3)}

END_USER = {"safety_identifier": TEXT, "prompt_cache_key": TEXT, "prompt_cache_retention": st.sampled_from(["in-memory", "in_memory", "24h", "1h"])}

# Anthropic's content blocks, near misses among them
BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("image"), "source": st.fixed_dictionaries(
        {"type": st.sampled_from(["base64", "url", "file"])},
        optional={"media_type": st.sampled_from(["image/png", "text/plain"]), "data": TEXT, "url": TEXT})}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT, "name": TEXT, "input": ANY_JSON}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": TEXT},
                          optional={"content": TEXT | ANY_JSON, "is_error": st.booleans()}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "document", "x"]), "thinking": TEXT}))

# each endpoint: a valid body, and a near-miss strategy per field (any field may also get ANY_JSON)
ENDPOINTS = {
    "/v1/chat/completions": (
        {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {**SAMPLING, "messages": st.lists(MESSAGE, max_size=4), "max_tokens": EDGE_INTS,
         "max_completion_tokens": EDGE_INTS, "logprobs": st.booleans(), "top_logprobs": EDGE_INTS,
         "tools": st.lists(TOOL, max_size=3), "tool_choice": TOOL_CHOICE, "parallel_tool_calls": st.booleans(),
         "functions": st.lists(TOOL.map(lambda t: t.get("function")), max_size=3),
         "reasoning_effort": st.sampled_from(["none", "low", "high", "extreme"]), "include_reasoning": st.booleans(),
         "add_generation_prompt": st.booleans() | ANY_JSON, "continue_final_message": st.booleans() | ANY_JSON,
         "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "tools", "x", "tokenize"]),
                                                 ANY_JSON, max_size=2),
         "documents": st.lists(st.dictionaries(st.sampled_from(["title", "text", "x"]), TEXT | ANY_JSON, max_size=2),
                               max_size=3) | ANY_JSON,
         "function_call": st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries({"name": TOOL_NAME}),
         "response_format": FORMAT, "adapters": ADAPTERS, "store": st.booleans(), **END_USER,
         "verbosity": st.sampled_from(["low", "high", "max"]), "modalities": st.lists(st.sampled_from(["text", "audio"]), max_size=2),
         "prediction": st.fixed_dictionaries({"type": st.sampled_from(["content", "text"]) | ANY_JSON},
                                             optional={"content": TEXT | st.lists(PART, max_size=2) | ANY_JSON}),
         "audio": st.fixed_dictionaries({}, optional={"voice": st.sampled_from(["alloy", "amy", "nobody", ""]) | ANY_JSON,
                                                      "format": st.sampled_from(["wav", "pcm16", "mp3", "ogg"]) | ANY_JSON}),
         "model": st.sampled_from(["tiny-chat", "tiny-vlm", "tiny-embed", "tiny-image", "nope", ""])}),
    "/v1/completions": (
        {"model": "tiny-chat", "prompt": "hi", "max_tokens": 2},
        {**SAMPLING, "prompt": TEXT | st.lists(TEXT, max_size=3) | TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3),
         "max_tokens": EDGE_INTS, "logprobs": EDGE_INTS, "echo": st.booleans(), "best_of": EDGE_INTS,
         "response_format": FORMAT,
         "suffix": TEXT, "model": st.sampled_from(["tiny-chat", "tiny-tts", "nope"] +
                                                  (["tiny-chat-fim"] * 2 if ENGINE == "transformers" else []))}),
    "/v1/responses": (
        {"model": "tiny-chat", "input": "hi", "max_output_tokens": 2},
        {"input": TEXT | st.lists(MESSAGE | st.fixed_dictionaries(
            {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "nope"])},
            optional={"role": TEXT, "content": TEXT | st.lists(PART, max_size=2) | ANY_JSON, "call_id": TEXT,
                      "name": TOOL_NAME, "arguments": TEXT, "output": TEXT | ANY_JSON,
                      "summary": st.lists(PART, max_size=2) | ANY_JSON, "encrypted_content": TEXT}), max_size=4),
         "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["none", "low", "max"]) | ANY_JSON,
                                                          "summary": st.sampled_from(["auto", "detailed"]) | st.none()}),
         "instructions": TEXT, "max_output_tokens": EDGE_INTS, "temperature": EDGE_FLOATS, "top_p": EDGE_FLOATS,
         "top_k": SAMPLING["top_k"], "min_p": EDGE_FLOATS, "repetition_penalty": EDGE_FLOATS,
         "structured_outputs": STRUCTURED, "top_logprobs": EDGE_INTS, "stream": st.booleans(), "store": st.booleans(), "background": st.booleans(),
         **END_USER, "max_tool_calls": EDGE_INTS,
         "stream_options": st.fixed_dictionaries({}, optional={"include_obfuscation": st.booleans() | ANY_JSON}),
         "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": TOOL_NAME},
                                                 optional={"parameters": JSON_SCHEMA, "strict": st.booleans()})
                           | st.fixed_dictionaries({"type": st.just("file_search")}, optional={
                               "vector_store_ids": st.lists(TEXT | st.just("vs_0"), max_size=3) | ANY_JSON,
                               "max_num_results": EDGE_INTS, "filters": FILTER,
                               "ranking_options": st.fixed_dictionaries({}, optional={
                                   "score_threshold": EDGE_FLOATS, "hybrid_search": HYBRID})}),
                           max_size=2),
         "tool_choice": TOOL_CHOICE, "previous_response_id": TEXT | st.just("resp_0"),
         "conversation": TEXT | st.just("conv_0") | st.fixed_dictionaries({"id": TEXT}) | ANY_JSON,
         "text": st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries(
             {"type": st.sampled_from(["text", "json_object", "json_schema"])},
             optional={"name": TOOL_NAME, "schema": JSON_SCHEMA | ANY_JSON, "strict": st.booleans()})}),
         "truncation": st.sampled_from(["disabled", "auto"]),
         "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"]) | TEXT,
                             max_size=2)}),
    "/v1/embeddings": (
        {"model": "tiny-embed", "input": "hi"},
        {"input": TEXT | st.lists(TEXT, max_size=6) | TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3) | st.just([[]]),
         "encoding_format": st.sampled_from(["float", "base64", "int8"]), "dimensions": EDGE_INTS,
         "truncate_prompt_tokens": EDGE_INTS | st.sampled_from([-1, 1, 2, 127, 128, 129]),
         "truncation_side": st.sampled_from(["left", "right", "middle"]),
         "model": st.sampled_from(["tiny-embed", "tiny-chat", "nope"])}),
    "/v2/embed": (
        {"model": "tiny-embed", "texts": ["hi"], "input_type": "search_query"},
        {"texts": st.lists(TEXT, max_size=6) | ANY_JSON,
         "input_type": st.sampled_from(["search_query", "image", "x"]) | TEXT,
         "embedding_types": st.lists(st.sampled_from(["float", "base64", "binary", "ubinary", "int8"]), max_size=3),
         "truncate": st.sampled_from(["NONE", "START", "END", "end"]), "max_tokens": EDGE_INTS,
         "output_dimension": EDGE_INTS, "images": st.lists(TEXT, max_size=2), "priority": EDGE_INTS,
         "model": st.sampled_from(["tiny-embed", "tiny-chat", "nope"])}),
    "/v1/moderations": (
        {"model": "tiny-moderation", "input": "hi"},
        {"input": TEXT | st.lists(TEXT, max_size=6) | st.lists(PART, max_size=3) | TOKEN_IDS,
         "model": st.sampled_from(["tiny-moderation", "tiny-embed", "nope"])}),
    "/v1/rerank": (
        {"model": "tiny-rerank", "query": "q", "documents": ["a", "b"]},
        {"query": TEXT, "documents": TEXT | st.lists(TEXT | st.fixed_dictionaries({"text": TEXT}), max_size=6),
         "top_n": EDGE_INTS, "return_documents": st.booleans(), "max_tokens_per_doc": EDGE_INTS,
         "use_activation": st.booleans() | st.none(), "model": st.sampled_from(["tiny-rerank", "tiny-embed", "tiny-chat", "nope"])}),
    "/v1/score": (
        {"model": "tiny-rerank", "text_1": "q", "text_2": ["a", "b"]},
        {**{k: TEXT | st.lists(TEXT, max_size=5) for k in ("text_1", "text_2", "queries", "documents", "items", "data_1",
                                                            "data_2")},
         "max_tokens_per_doc": EDGE_INTS, "use_activation": st.booleans(),
         "model": st.sampled_from(["tiny-rerank", "tiny-embed", "tiny-moderation", "nope"])}),
    "/v1/messages": (
        {"model": "tiny-chat", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                     "content": TEXT | st.lists(BLOCK, max_size=3)}), max_size=3),
         "max_tokens": EDGE_INTS, "system": TEXT | st.lists(BLOCK, max_size=2), "stop_sequences": st.lists(TEXT, max_size=5),
         "stream": st.booleans(), "temperature": EDGE_FLOATS, "top_p": EDGE_FLOATS, "top_k": EDGE_INTS,
         "tools": st.lists(st.fixed_dictionaries({"name": TOOL_NAME, "input_schema": JSON_SCHEMA | ANY_JSON},
                                                 optional={"description": TEXT}), max_size=2),
         "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                              optional={"name": TOOL_NAME, "disable_parallel_tool_use": st.booleans()}),
         "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive", "on"])},
                                           optional={"budget_tokens": EDGE_INTS}),
         "metadata": st.fixed_dictionaries({}, optional={"user_id": TEXT}),
         "model": st.sampled_from(["tiny-chat", "tiny-vlm", "tiny-embed", "nope"])}),
    "/v1/messages/count_tokens": (
        {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]},
        {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                                     "content": TEXT | st.lists(BLOCK, max_size=3)}), max_size=3),
         "system": TEXT, "model": st.sampled_from(["tiny-chat", "tiny-embed", "nope"])}),
    "/v1/classify": (
        {"model": "tiny-moderation", "input": "hi"},
        {"input": TEXT | st.lists(TEXT, max_size=6) | TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3) | st.just([[]]),
         "truncate_prompt_tokens": EDGE_INTS | st.sampled_from([-1, 1, 2, 127, 128, 129]),
         "truncation_side": st.sampled_from(["left", "right", "middle"]), "use_activation": st.booleans() | st.none(),
         "model": st.sampled_from(["tiny-moderation", "tiny-rerank", "tiny-embed", "nope"])}),
    "/v1/images/generations": (
        {"model": "tiny-image", "prompt": "a cat", "size": "32x32", "num_inference_steps": 1},
        {"prompt": TEXT, "n": EDGE_INTS, "seed": EDGE_INTS, "num_inference_steps": EDGE_INTS,
         "guidance_scale": EDGE_FLOATS, "negative_prompt": TEXT,
         "size": st.sampled_from(["auto", "32x32", "0x0", "8x8", "7x9", "64x65", "99999x1", "x", "32X32", " 32x32",
                                  "-32x32", "3.5x4"]) | TEXT,
         "response_format": st.sampled_from(["b64_json", "url", "jpeg"]), "adapters": ADAPTERS,
         "quality": st.sampled_from(["low", "medium", "high", "hd", "auto", "standard"]) | TEXT,
         "output_format": st.sampled_from(["png", "jpeg", "webp", "gif"]) | TEXT,
         "output_compression": EDGE_INTS | st.sampled_from([0, 50, 100]),
         "background": st.sampled_from(["auto", "opaque", "transparent"]) | TEXT,
         "stream": st.booleans(), "partial_images": EDGE_INTS | st.sampled_from([0, 1, 3]),
         "model": st.sampled_from(["tiny-image", "tiny-chat"])}),
    "/v1/audio/speech": (
        {"model": "tiny-tts", "input": "hello", "voice": "alloy"},
        {"input": TEXT, "voice": TEXT | st.sampled_from(["alloy", "nova"]), "speed": EDGE_FLOATS,
         "response_format": st.sampled_from(["mp3", "wav", "flac", "opus", "aac", "pcm", "ogg", ""]) | TEXT,
         "stream_format": st.sampled_from(["audio", "sse"]), "model": st.sampled_from(["tiny-tts", "tiny-chat"])}),
    "/v1/batches": (
        {"input_file_id": "file-none", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        {"input_file_id": TEXT, "endpoint": st.sampled_from(["/v1/chat/completions", "/v1/embeddings", "/v1/moderations", "/v1/x"]),
         "completion_window": st.sampled_from(["24h", "1h"]), "metadata": st.dictionaries(TEXT, TEXT | ANY_JSON),
         "output_expires_after": ANY_JSON}),
    "/v1/fine_tuning/jobs": (
        {"model": "tiny-chat", "training_file": "file-none"},
        {"model": st.sampled_from(["tiny-chat", "tiny-embed", "tiny-chat~train"]) | TEXT, "training_file": TEXT,
         "validation_file": TEXT | ANY_JSON, "suffix": TEXT | ANY_JSON, "seed": EDGE_INTS | ANY_JSON,
         "hyperparameters": st.fixed_dictionaries({}, optional={
             "n_epochs": EDGE_INTS | st.just("auto") | ANY_JSON, "batch_size": EDGE_INTS | st.just("auto"),
             "learning_rate_multiplier": EDGE_FLOATS | st.just("auto") | ANY_JSON}) | ANY_JSON,
         "method": st.fixed_dictionaries({"type": st.sampled_from(["supervised", "dpo", ""]) | TEXT}, optional={
             "dpo": st.fixed_dictionaries({}, optional={"hyperparameters": st.fixed_dictionaries({}, optional={
                 "beta": EDGE_FLOATS | st.just("auto") | ANY_JSON, "n_epochs": EDGE_INTS})}) | ANY_JSON,
             "supervised": ANY_JSON}) | ANY_JSON,
         "metadata": st.dictionaries(TEXT, TEXT | ANY_JSON), "integrations": ANY_JSON}),
    "/v1/conversations": (
        {"items": [{"type": "message", "role": "user", "content": "hi"}], "metadata": {"a": "b"}},
        {"items": st.lists(MESSAGE | st.fixed_dictionaries(
            {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "nope"])},
            optional={"role": TEXT, "content": TEXT | st.lists(PART, max_size=2) | ANY_JSON, "call_id": TEXT,
                      "id": TEXT, "name": TOOL_NAME, "arguments": TEXT, "output": TEXT | ANY_JSON}), max_size=22),
         "metadata": st.dictionaries(TEXT, TEXT | ANY_JSON, max_size=18)}),
    "/v1/vector_stores": (
        {"name": "fuzz"},
        {"name": TEXT, "description": TEXT, "file_ids": st.lists(TEXT | st.just("file-0"), max_size=3) | ANY_JSON,
         "metadata": st.dictionaries(TEXT, TEXT | ANY_JSON, max_size=18),
         "expires_after": st.fixed_dictionaries({"anchor": st.sampled_from(["last_active_at", "created_at"]),
                                                 "days": EDGE_INTS}) | ANY_JSON,
         "chunking_strategy": CHUNKING, "model": st.sampled_from(["tiny-embed", "tiny-chat", "nope"]) | TEXT}),
    "/v1/uploads": (
        {"bytes": 10, "filename": "x.jsonl", "mime_type": "application/jsonl", "purpose": "batch"},
        {"bytes": EDGE_INTS, "filename": TEXT, "mime_type": st.sampled_from(["text/plain", "image/png", ""]) | TEXT,
         "purpose": st.sampled_from(["batch", "fine-tune", ""]), "expires_after": ANY_JSON}),
    "/admin/keys": (
        {"name": "fuzz", "tier": "free"},
        {"name": TEXT, "tier": st.sampled_from(["paid", "free", "batch", "gold", ""]),
         "models": st.lists(TEXT, max_size=3), "adapters": st.lists(TEXT, max_size=3) | ANY_JSON,
         "limits": st.dictionaries(st.sampled_from(["requests_per_min", "tokens_per_min", "gpu_seconds_per_day",
                                                    "max_inflight", "nope"]), EDGE_INTS | EDGE_FLOATS | ANY_JSON,
                                   max_size=3)}),
    "/v1/load_lora_adapter": (
        {"lora_name": "fuzz", "lora_path": "/nonexistent"},
        {"lora_name": TEXT, "lora_path": TEXT | st.sampled_from(["/", "/etc/passwd", "", ".", "/proc/self", "\x00",
                                                                        "/" + "a" * 5000]),
         "load_inplace": st.booleans() | ANY_JSON, "is_3d_lora_weight": st.booleans(),
         "base_model": st.sampled_from(["tiny-chat", "tiny-embed", "nope"]) | TEXT}),
    "/v1/unload_lora_adapter": ({"lora_name": "fuzz"}, {"lora_name": TEXT, "lora_int_id": EDGE_INTS | ANY_JSON}),
}
ADMIN_ONLY = ("/admin", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


ENDPOINTS["/v1/responses/input_tokens"] = ENDPOINTS["/v1/responses"]  # what a response would be made from
ENDPOINTS["/tokenize"] = (  # vLLM's: a text, or a chat as chat's messages and tools
    {"model": "tiny-chat", "prompt": "hi"},
    {"model": st.sampled_from(["tiny-chat", "tiny-embed", "tiny-tts", "nope"]) | TEXT, "prompt": TEXT | ANY_JSON,
     "messages": ENDPOINTS["/v1/chat/completions"][1]["messages"], "tools": ENDPOINTS["/v1/chat/completions"][1]["tools"],
     "chat_template_kwargs": ENDPOINTS["/v1/chat/completions"][1]["chat_template_kwargs"],
     "add_generation_prompt": st.booleans() | ANY_JSON, "continue_final_message": st.booleans(),
     "add_special_tokens": st.booleans(), "return_token_strs": st.booleans() | st.none()})
ENDPOINTS["/detokenize"] = ({"model": "tiny-chat", "tokens": [1, 2]},
                            {"model": st.sampled_from(["tiny-chat", "tiny-embed", "tiny-tts"]) | TEXT,
                             "tokens": TOKEN_IDS | ANY_JSON})
ENDPOINTS["/v1/responses/compact"] = (  # a window compacted: a response's input, and a compaction item's content
    {"model": "tiny-chat", "input": "hi"},
    {**{k: v for k, v in ENDPOINTS["/v1/responses"][1].items()
        if k in ("input", "instructions", "previous_response_id", "service_tier", "model")},
     "input": ENDPOINTS["/v1/responses"][1]["input"] | st.lists(st.fixed_dictionaries(
         {"type": st.just("compaction")}, optional={"encrypted_content": TEXT | ANY_JSON, "id": TEXT}), max_size=2),
     "prompt_cache_options": ANY_JSON})

# the updates of stored objects: their paths name a real one, made when the test starts
METADATA = st.dictionaries(TEXT, TEXT | ANY_JSON, max_size=18) | st.none()
ON_STORED = {
    "/v1/chat/completions/{completion}": ({"metadata": {"a": "b"}}, {"metadata": METADATA}),
    "/v1/conversations/{conversation}": ({"metadata": {"a": "b"}}, {"metadata": METADATA}),
    "/v1/conversations/{conversation}/items": ({"items": [{"type": "message", "role": "user", "content": "hi"}]},
                                               {"items": ENDPOINTS["/v1/conversations"][1]["items"]}),
    "/v1/vector_stores/{vector_store}": ({"name": "renamed"}, {"name": TEXT, "metadata": METADATA,
                                                                "expires_after": ANY_JSON}),
    "/v1/vector_stores/{vector_store}/search": (
        {"query": "hi"},
        {"query": TEXT | st.lists(TEXT, max_size=12), "filters": FILTER, "max_num_results": EDGE_INTS,
         "ranking_options": st.fixed_dictionaries({}, optional={"ranker": st.sampled_from(["auto", "none", "best"]),
                                                                "score_threshold": EDGE_FLOATS, "hybrid_search": HYBRID}),
         "rewrite_query": st.booleans()}),
    "/v1/vector_stores/{vector_store}/files": (
        {"file_id": "file-0"}, {"file_id": TEXT, "attributes": ATTRIBUTES, "chunking_strategy": CHUNKING}),
    "/v1/vector_stores/{vector_store}/file_batches": (
        {"file_ids": ["file-0"]},
        {"file_ids": st.lists(TEXT, max_size=3) | ANY_JSON, "attributes": ATTRIBUTES, "chunking_strategy": CHUNKING,
         "files": st.lists(st.fixed_dictionaries({"file_id": TEXT}, optional={"attributes": ATTRIBUTES,
                                                                             "chunking_strategy": CHUNKING}),
                           max_size=3) | ANY_JSON}),
    "/v1/uploads/{upload}/complete": ({"part_ids": []}, {"part_ids": st.lists(TEXT, max_size=3) | ANY_JSON, "md5": TEXT | ANY_JSON}),
}


@st.composite
def bodies(draw, path: str):
    if draw(st.integers(0, 19)) == 0:  # now and then, not an object at all
        return draw(ANY_JSON)
    base, fields = ENDPOINTS.get(path) or ON_STORED[path]
    body = dict(base)
    names = sorted(set(base) | set(fields))
    for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
        choice = draw(st.integers(0, 5))
        if choice == 0:
            body.pop(name, None)
        else:
            body[name] = draw(ANY_JSON if choice == 1 or name not in fields else fields[name])
    if draw(st.integers(0, 9)) == 0:
        body[draw(TEXT)] = draw(ANY_JSON)
    if body.get("stream") is True and path == "/v1/chat/completions":
        body["max_tokens"] = 2  # a streamed reply is read to its end
    return body


# -- checks ---------------------------------------------------------------------------------------

def check_error(status: int, content: bytes, body) -> None:
    try:
        err = json.loads(content)["error"]
    except (ValueError, KeyError, TypeError):
        pytest.fail(f"{status} without OpenAI's error shape: {content[:300]!r} for {body!r}")
    assert set(err) == {"message", "type", "param", "code"}, (err, body)
    assert isinstance(err["code"], str) and isinstance(err["message"], str) and err["message"], (err, body)
    assert err["param"] is None or isinstance(err["param"], str), (err, body)
    assert err["code"] != "http_error", (err, body)  # the catch-all code: every refusal here has its own
    assert " object at 0x" not in err["message"] and "Traceback" not in err["message"], (err, body)  # no internals


def check_stream(lines, body) -> None:
    done = False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        assert not done, f"data after [DONE] for {body!r}"
        event = json.loads(data)  # every event is JSON; an error mid-stream is one too
        if "error" in event and set(event) <= {"error", "type", "sequence_number"}:
            err = event["error"]
            assert isinstance(err.get("message"), str) and err.get("message"), (event, body)


def post(server, path: str, body) -> None:
    headers = {"Authorization": f"Bearer {server.keys['admin' if path.startswith(ADMIN_ONLY) else 'paid']}"}
    with httpx.stream("POST", f"{server.url}{path}", content=json.dumps(body).encode(), timeout=30,
                      headers={**headers, "Content-Type": "application/json"}) as r:
        assert r.status_code < 500 or r.status_code == 503, (r.status_code, r.read()[:500], body)
        if r.status_code >= 400:
            check_error(r.status_code, r.read(), body)
        elif r.headers.get("content-type", "").startswith("text/event-stream"):
            check_stream(r.iter_lines(), body)
        else:
            r.read()


@pytest.mark.parametrize("path", list(ON_STORED))
def test_generated_updates_of_stored_objects_get_a_success_or_a_clean_4xx(server, path):
    """The bodies that change a stored completion's or a conversation's metadata, or add items."""
    c = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=60)
    ids = {"completion": c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=1, store=True).id,
           "conversation": c.conversations.create().id,
           "vector_store": c.vector_stores.create(name="fuzz").id,
           "upload": c.uploads.create(bytes=3, filename="x.jsonl", mime_type="text/plain", purpose="batch").id}
    target = path.format(**ids)

    @FUZZ
    @given(body=bodies(path))
    def run(body):
        post(server, target, body)

    run()
    assert c.chat.completions.retrieve(ids["completion"]).id == ids["completion"]  # still there, still readable
    assert c.conversations.items.list(ids["conversation"]).object == "list"
    assert c.vector_stores.retrieve(ids["vector_store"]).object == "vector_store"
    assert c.uploads.cancel(ids["upload"]).status in ("cancelled", "completed")  # (completed: a generated body made it)


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_generated_bodies_get_a_success_or_a_clean_4xx(server, path):
    @FUZZ
    @given(body=bodies(path))
    def run(body):
        post(server, path, body)

    run()
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                   json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                   headers={"Authorization": f"Bearer {server.keys['paid']}"})
    assert r.status_code == 200, r.text


# -- reads: odd ids in the path, odd query strings --------------------------------------------------

READS = ["/v1/batches", "/v1/files", "/v1/usage", "/admin/usage", "/admin/keys", "/admin/events", "/admin/state", "/v1/models/{}",
         "/v1/files/{}", "/v1/files/{}/content", "/v1/batches/{}", "/v1/responses/{}", "/v1/responses/{}/input_items", "/v1/responses/{}/cancel", "/admin/keys/{}",
         "/v1/chat/completions", "/v1/chat/completions/{}", "/v1/chat/completions/{}/messages",
         "/v1/conversations/{}", "/v1/conversations/{}/items", "/v1/conversations/conv_0/items/{}",
         "/v1/images/files/{}.png", "/v1/uploads/{}/cancel", "/v1/uploads/{}/parts",
         "/v1/vector_stores", "/v1/vector_stores/{}", "/v1/vector_stores/{}/files", "/v1/vector_stores/vs_0/files/{}",
         "/v1/vector_stores/vs_0/files/{}/content", "/v1/vector_stores/vs_0/file_batches/{}",
         "/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/{}", "/v1/fine_tuning/jobs/{}/events",
         "/v1/fine_tuning/jobs/{}/checkpoints", "/v1/fine_tuning/jobs/{}/cancel", "/v1/fine_tuning/jobs/{}/pause",
         "/v1/fine_tuning/jobs/{}/resume",
         "/v1/vector_stores/vs_0/file_batches/{}/files", "/v1/vector_stores/{}/file_batches/x/cancel"]
QUERY = st.dictionaries(
    st.sampled_from(["limit", "after", "key", "model", "start_date", "end_date", "group_by", "format", "stream",
                     "starting_after", "include[]", "since", "order", "purpose", "before", "nope", "metadata[g]",
                     "metadata", "filter"]),
    st.sampled_from(["", "0", "-1", "20", "101", "1e3", "abc", "2026-01-01", "2026-13-45", "0000-00-00", "csv", "json",
                     "day", "key", "tier", "true", "asc", "batch_output", "\x00", "../etc/passwd", "²"]) | TEXT, max_size=4)
ID = st.sampled_from(["x", "file-0", "batch_0", "resp_0", "key_0", "chatcmpl-0", "tiny-chat", "..", "%2e%2e", "a/b"]) | TEXT


@FUZZ
@given(path=st.sampled_from(READS), ident=ID, query=QUERY, method=st.sampled_from(["GET", "GET", "DELETE", "POST"]),
       admin=st.booleans())
def _read(server, path, ident, query, method, admin):
    from urllib.parse import quote

    url = f"{server.url}{path.format(quote(ident, safe='') or 'x')}"
    key = server.keys["admin" if admin else "paid"]
    with httpx.stream(method, url, params=query, headers={"Authorization": f"Bearer {key}"}, timeout=60) as r:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert r.status_code == 200
            return  # a live event stream (/admin/events) does not end: its head is the answer here
        r.read()
    assert r.status_code < 500 or r.status_code == 503, (r.status_code, r.text[:500], method, url, query)
    if r.status_code >= 400:
        check_error(r.status_code, r.content, (method, url, query))


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/batches?limit=²", None),
    ("GET", "/v1/files?limit=²", None),
    ("POST", "/v1/chat/completions", {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": 1, "logit_bias": {"²": 1}}),
])
def test_a_number_in_non_ascii_digits_is_a_400(server, method, path, body):
    """"²" is a digit to ``str.isdigit`` and not to ``int``: these were 500s."""
    r = httpx.request(method, f"{server.url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {server.keys['paid']}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("limit", "logit_bias")


def test_generated_reads_get_a_success_or_a_clean_4xx(server):
    _read(server)


# -- multipart uploads: transcriptions, translations and batch files --------------------------------

def sound_file(rate: int, channels: int, frames: int, fmt: str, subtype: str, special: str) -> bytes:
    """A real audio file from libsndfile (the server decodes with the same library)."""
    import io

    import numpy as np
    import soundfile as sf

    x = np.random.default_rng(frames).uniform(-1, 1, (frames, channels)).astype(np.float32)
    if special != "plain" and frames:
        x[::3] = {"nan": np.nan, "inf": np.inf, "loud": 1e30, "silent": 0.0}[special]
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


# (the first values are the ones a derandomized run draws most: a file the model can transcribe)
AUDIO = st.builds(sound_file, rate=st.sampled_from([16000, 8000, 22050, 1, 7, 44101, 48000, 192000]),
                  channels=st.sampled_from([1, 2, 3]), frames=st.sampled_from([4000, 400, 20000, 0, 1, 2]),
                  fmt=st.just("WAV"), subtype=st.sampled_from(["PCM_16", "PCM_U8", "FLOAT", "DOUBLE"]),
                  special=st.sampled_from(["plain", "plain", "nan", "inf", "loud", "silent"]))
FILE_BYTES = st.one_of(AUDIO, AUDIO, AUDIO, AUDIO.map(lambda b: b[:len(b) // 2]), AUDIO.map(lambda b: b[:44]),
                       st.binary(max_size=200), st.just(b""), st.just(b"RIFF" + b"\xff" * 40),
                       st.just(b"x" * (MAX_UPLOAD + 1)))
FORM_TEXT = TEXT | st.sampled_from(["0", "-1", "0.5", "1", "2", "nan", "1e309", "true", "[]", "{}"])
TRANSCRIPTION_FIELDS = {
    "model": st.sampled_from(["tiny-stt", "tiny-chat", "nope", ""]) | TEXT,
    "language": st.sampled_from(["en", "fr", "english", "xx", "", "EN"]) | TEXT,
    "prompt": TEXT, "temperature": FORM_TEXT,
    "response_format": st.sampled_from(["json", "text", "srt", "vtt", "verbose_json", "xml"]) | TEXT,
    "timestamp_granularities[]": st.sampled_from(["segment", "word", ""]), "stream": FORM_TEXT,
    "include[]": st.sampled_from(["logprobs", "segments", ""]) | TEXT,
    "chunking_strategy": st.sampled_from(["auto", "server_vad", ""]) | TEXT,
    "chunking_strategy[type]": st.sampled_from(["server_vad", "auto"]) | TEXT,
}
JSONL_LINE = (st.builds(lambda i, body: json.dumps({"custom_id": i, "method": "POST", "url": "/v1/chat/completions",
                                                    "body": body}),
                        st.sampled_from(["a", "b", "a", ""]) | ANY_JSON, bodies("/v1/chat/completions"))
              | ANY_JSON.map(json.dumps) | TEXT)
JSONL = (st.lists(JSONL_LINE, max_size=10).map(lambda ls: "\n".join(ls).encode())
         | st.binary(max_size=100) | st.just(b"\xff\xfe{}"))
FILE_FIELDS = {"purpose": st.sampled_from(["batch", "fine-tune", "", "BATCH"]) | TEXT}


def image_file(mode: str, width: int, height: int, fmt: str, alpha: str) -> bytes:
    """A real image file from Pillow (the server decodes with the same library): noise pixels, and
    for modes with alpha none, some or all of them fully transparent."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(width * 1000 + height)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if alpha != "random":
        img.putalpha({"opaque": 255, "clear": 0, "half": 128}[alpha])
    buf = io.BytesIO()
    try:
        img.convert(mode).save(buf, format=fmt)
    except (OSError, ValueError):  # a mode the format cannot hold: the same pixels as a PNG
        buf = io.BytesIO()
        img.save(buf, format="PNG")
    return buf.getvalue()


# (the first values are the ones a derandomized run draws most: an image the model can edit)
IMAGE = st.builds(image_file, mode=st.sampled_from(["RGBA", "RGB", "L", "LA", "P", "1", "I;16", "CMYK"]),
                  width=st.sampled_from([16, 33, 64, 8, 7, 1, 65, 300]), height=st.sampled_from([16, 24, 64, 8, 1, 200]),
                  fmt=st.sampled_from(["PNG", "PNG", "JPEG", "WEBP", "GIF", "BMP"]),
                  alpha=st.sampled_from(["random", "opaque", "clear", "half"]))
IMAGE_BYTES = st.one_of(IMAGE, IMAGE, IMAGE, IMAGE.map(lambda b: b[:len(b) // 2]), st.binary(max_size=200),
                        st.just(b""), st.just(b"\x89PNG\r\n\x1a\n" + b"\xff" * 40), st.just(b"x" * (MAX_UPLOAD + 1)))
EDIT_FIELDS = {
    "model": st.sampled_from(["tiny-image", "tiny-chat", "nope", ""]) | TEXT, "prompt": TEXT,
    "n": FORM_TEXT, "size": st.sampled_from(["16x16", "64x64", "8x8", "auto", "72x64", "16x15", ""]) | TEXT,
    "strength": FORM_TEXT, "num_inference_steps": FORM_TEXT, "seed": FORM_TEXT, "guidance_scale": FORM_TEXT,
    "response_format": st.sampled_from(["b64_json", "url", "png"]) | TEXT, "negative_prompt": TEXT,
    "adapters": st.sampled_from(["[]", "[{\"name\": \"x\"}]", "{}", "null", "[1]"]) | TEXT,
    "stream": FORM_TEXT, "partial_images": FORM_TEXT, "user": TEXT,
    "output_format": st.sampled_from(["png", "jpeg", "webp", "bmp"]) | TEXT, "output_compression": FORM_TEXT,
    "background": st.sampled_from(["auto", "opaque", "transparent"]) | TEXT,
}


@st.composite
def image_edits(draw, variation: bool):
    """(files, fields) for an image edit or variation: an image part (or none, two, or a text
    field), maybe a mask (an image of its own, often the same size with transparent pixels), and
    form fields."""
    data = {"model": "tiny-image", "num_inference_steps": "2", **({} if variation else {"prompt": "a cat"})}  # 2 x 0.8
    for name in draw(st.lists(st.sampled_from(sorted(EDIT_FIELDS)), max_size=3, unique=True)):
        if draw(st.integers(0, 4)) == 0:
            data.pop(name, None)
        else:
            data[name] = draw(EDIT_FIELDS[name])
    image = draw(IMAGE_BYTES)
    how = draw(st.sampled_from(["image"] * 6 + ["image[]", "none", "text", "two"]))
    if how == "none":
        return None, data
    if how == "text":
        return None, {**data, "image": image.decode("latin-1")}
    files = [("image" if how != "image[]" else "image[]", ("a.png", image, "image/png"))]
    if how == "two":
        files.append(("image", ("b.png", image, "image/png")))
    if draw(st.booleans()):
        mask = image_file("RGBA", 16, 16, "PNG", draw(st.sampled_from(["random", "clear", "opaque"]))) \
            if draw(st.booleans()) else draw(IMAGE_BYTES)
        files.append(("mask", ("m.png", mask, "image/png")))
    return files, data


@st.composite
def uploads(draw, path: str):
    """(files, fields) for httpx: a file part (or a text 'file', or none) and form fields."""
    if path.startswith("/v1/images/"):
        return draw(image_edits(path.endswith("/variations")))
    transcription = path.startswith("/v1/audio/")  # transcriptions and translations: the same fields but one
    if transcription and draw(st.integers(0, 3)) == 0:  # a plain good file with one field changed: most
        # generated ones are refused (a rate of 1 Hz makes even 20 samples too long), so the success path needs this
        name = draw(st.sampled_from(sorted(TRANSCRIPTION_FIELDS)))
        good = sound_file(draw(st.sampled_from([8000, 16000, 44100])), draw(st.sampled_from([1, 2])), 4000, "WAV",
                          "PCM_16", "plain")
        return [("file", ("a.wav", good, "audio/wav"))], {"model": "tiny-stt", name: draw(TRANSCRIPTION_FIELDS[name])}
    names = TRANSCRIPTION_FIELDS if transcription else FILE_FIELDS
    data = {"model": "tiny-stt"} if transcription else {"purpose": "batch"}
    for name in draw(st.lists(st.sampled_from(sorted(names)), max_size=3, unique=True)):
        if draw(st.integers(0, 4)) == 0:
            data.pop(name, None)
        else:
            data[name] = draw(names[name])
    if draw(st.integers(0, 9)) == 0:
        data[draw(TEXT) or "x"] = draw(FORM_TEXT)
    content = draw(FILE_BYTES if transcription else JSONL)
    how = draw(st.sampled_from(["file"] * 7 + ["none", "text", "two"]))
    if how == "none":
        return None, data  # no file part
    if how == "text":
        return None, {**data, "file": content.decode("latin-1")}  # a text field named file
    name = draw(st.sampled_from(["a.wav", "a.jsonl", "", "../../x", "é.wav", "a\"b"]))
    files = [("file", (name, content, draw(st.sampled_from(["audio/wav", "application/octet-stream", "text/plain"]))))]
    if how == "two":
        files.append(("file", ("b.wav", content, "audio/wav")))
    return files, data


RAW_BODIES = st.sampled_from([
    b"", b"--", b"--x\r\n", b"--x--\r\n", b"--x\r\nContent-Disposition: form-data\r\n\r\nv\r\n--x--\r\n",
    b"--x\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF",
    b"--x\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ntiny-stt\r\n--x",
    b"not multipart at all", b"--y\r\n\r\n--y--",
]) | st.binary(max_size=120)
CONTENT_TYPES = st.sampled_from(["multipart/form-data; boundary=x", "multipart/form-data", "multipart/form-data; boundary=",
                                 "multipart/form-data; boundary=\"x\"", "multipart/mixed; boundary=x", "application/json",
                                 "text/plain", "multipart/form-data; boundary=" + "x" * 300])


def check_answer(r: httpx.Response, what) -> None:
    assert r.status_code < 500 or r.status_code == 503, (r.status_code, r.text[:500], what)
    if r.status_code >= 400:
        check_error(r.status_code, r.content, what)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):  # a streamed transcription
        check_stream(r.text.splitlines(), what)


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations", "/v1/files", "/v1/images/edits",
                                  "/v1/images/variations"])
def test_generated_uploads_get_a_success_or_a_clean_4xx(server, path):
    """Real audio files at odd rates, channel counts, lengths and sample values (NaN, inf, 1e30),
    cut short or replaced by noise; JSONL files of generated lines; real images in every pixel
    mode and format, with masks (edits and variations); odd fields; then raw bodies that are not well-formed multipart at
    all. An uploaded batch file is then used for a batch."""
    headers = {"Authorization": f"Bearer {server.keys['paid']}"}

    @FUZZ
    @given(upload=uploads(path))
    def run(upload):
        files, data = upload
        r = httpx.post(f"{server.url}{path}", files=files, data=data, headers=headers, timeout=60)
        check_answer(r, (data, files and [(n, f[0], len(f[1])) for n, f in files]))
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if path == "/v1/files" and r.status_code == 200:
            made = httpx.post(f"{server.url}/v1/batches", headers=headers, timeout=30,
                              json={"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions",
                                    "completion_window": "24h"})
            check_answer(made, "batch on an uploaded file")
            if made.status_code == 200:
                batches[made.json()["id"]] = files[0][1][1]

    @FUZZ
    @given(body=RAW_BODIES, content_type=CONTENT_TYPES)
    def raw(body, content_type):
        r = httpx.post(f"{server.url}{path}", content=body, headers={**headers, "Content-Type": content_type},
                       timeout=30)
        check_answer(r, (content_type, body))
        assert r.status_code != 200 or path == "/v1/files", (content_type, body)

    batches: dict[str, bytes] = {}  # the batches made on generated files: id -> the file
    statuses: dict[int, int] = {}
    run()
    if EXAMPLES >= 25 and not os.environ.get("TIERGATE_FUZZ_RANDOM"):  # the suite's fixed examples reach the
        assert statuses.get(200, 0) >= 1, statuses  # model (or the store) too, not only the refusals
    raw()
    deadline = time.monotonic() + 120  # each batch's validation ends: never stuck, whatever its lines
    for batch_id, content in batches.items():
        while (status := httpx.get(f"{server.url}/v1/batches/{batch_id}", headers=headers, timeout=30).json()["status"]) \
                == "validating" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status != "validating", (batch_id, content)
    if path.startswith("/v1/audio/"):  # the server still transcribes / stores a good upload afterwards
        files, data = {"file": ("a.wav", sound_file(16000, 1, 1600, "WAV", "PCM_16", "silent"), "audio/wav")}, {"model": "tiny-stt"}
    elif path.startswith("/v1/images/"):
        files = {"image": ("a.png", image_file("RGBA", 16, 16, "PNG", "random"), "image/png")}
        data = {"model": "tiny-image", "num_inference_steps": "2", **({"prompt": "a cat"} if "edits" in path else {})}
    else:
        files, data = {"file": ("a.jsonl", b"{}", "text/plain")}, {"purpose": "batch"}
    r = httpx.post(f"{server.url}{path}", files=files, data=data, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
