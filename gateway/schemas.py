"""Request bodies of the OpenAI API as pydantic models, and their parsing into 400 errors that
name the offending field (``param``).

Bodies are read as strictly as OpenAI reads them: UTF-8 JSON only; no ``NaN``/``Infinity``, no
number that overflows, no duplicate key, no lone surrogate; a bounded shape (nesting depth and
count of values), checked before parsing so a small body cannot expand into a large parse; and
strict types: a string is not a boolean or a number (an integer is still a fine float).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Annotated, Any, Callable, ClassVar, Literal, TypeVar, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag,
                      ValidationError, field_validator, model_validator)
from starlette.requests import Request

from gateway.errors import APIError, bad_request
from workers.base import PromptEnd

M = TypeVar("M", bound=BaseModel)

MAX_DEPTH = 32  # nested arrays and objects in one body
MAX_VALUES = 100_000  # arrays, objects and comma-separated items in one body
MAX_INT_DIGITS = 100  # an integer literal longer than this is refused before it is converted
INT64 = (-(2**63), 2**63 - 1)  # every integer field of the API fits in 64 bits


class _Body(BaseModel):
    """A JSON request body: unknown fields refused, types strict, numbers finite and 64-bit."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    # fields OpenAI's API declares nullable whose null is their default here, as if left out (the
    # openai SDK sends ``temperature=None`` as null; OpenAI and vllm serve take it); null
    # elsewhere stays a 400 where the field's type has no None
    null_is_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _nulls_left_out(cls, data: Any) -> Any:
        if cls.null_is_default and isinstance(data, dict) and any(
                data.get(k, 0) is None for k in cls.null_is_default):
            return {k: v for k, v in data.items() if not (v is None and k in cls.null_is_default)}
        return data

    @field_validator("*")
    @classmethod
    def _int64(cls, v: Any) -> Any:
        if type(v) is int and not INT64[0] <= v <= INT64[1]:
            raise ValueError("integer out of range (a signed 64-bit integer is expected)")
        return v


class _Form(BaseModel):
    """Multipart text fields: every value arrives as a string, so types convert as usual."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _checked_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's limits on ``metadata``: 16 pairs, keys of 64 characters and values of 512 at most."""
    if v is not None and len(v) > 16:
        raise ValueError(f"at most 16 pairs, not {len(v)}")
    for key, value in (v or {}).items():
        if len(key) > 64:
            raise ValueError(f"the key '{key[:20]}...' is longer than 64 characters")
        if len(value) > 512:
            raise ValueError(f"the value of '{key}' is longer than 512 characters")
    return v


Metadata = Annotated[dict[str, str] | None, AfterValidator(_checked_metadata)]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str  # a data: URL (data:image/png;base64,...), or http(s) where the server fetches them
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sets the resolution


class ImagePart(_Body):
    """An image in a user message, for a model that reads images (``gateway.vision``)."""

    type: Literal["image_url"]
    image_url: ImageURL


class RefusalPart(_Body):
    """An assistant message's refusal, sent back as history: accepted, not rendered."""

    type: Literal["refusal"]
    refusal: str


class FunctionCall(_Body):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Body):
    """A call an assistant message made (echoed back in later turns)."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


def tagged(*forms: tuple[str, Any], by: Callable[[Any], str]) -> Any:
    """A union whose branch ``by(value)`` picks (a tag of ``forms``), so a bad value's error is
    that branch's own, not the first branch's "Input should be a valid string". Tags are
    capitalized: error places leave them out (``_param``)."""
    return Annotated[Union[tuple(Annotated[form, Tag(tag)] for tag, form in forms)], Discriminator(by)]


def part_type(parts: dict[str, str], default: str) -> Callable[[Any], str]:
    """A content part's tag from its ``type`` (``default`` for an unknown or missing one)."""
    return lambda value: parts.get(value.get("type"), default) if isinstance(value, dict) else default


def text_or_parts(value: Any) -> str:
    return "Parts" if isinstance(value, list) else "Text"


ChatPart = tagged(("TextPart", TextPart), ("RefusalPart", RefusalPart), ("ImagePart", ImagePart),
                  by=part_type({"refusal": "RefusalPart", "image_url": "ImagePart"}, "TextPart"))
Content = tagged(("Text", str), ("Parts", list[ChatPart]), by=text_or_parts)


class Message(_Body):
    """One chat message. Which fields a role needs (content, tool_calls, tool_call_id) is checked
    by :meth:`ChatCompletionRequest.message_problem`, so the error names the field."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: the old functions API's
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    function_call: FunctionCall | None = None  # assistant, the old functions API's one call
    tool_call_id: str | None = None  # tool
    refusal: str | None = None  # assistant: accepted, not rendered
    # assistant: a reply's citations (OpenAI's url_citation), in the SDK's message dumped whole (model_dump(),
    # null): accepted as history, not rendered
    annotations: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None  # assistant, a reasoning model's thinking (both names), handed to the
    reasoning: str | None = None  # template as reasoning_content (Qwen3's renders it within a tool-calling turn)

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts_only(cls, value: Any) -> Any:
        """An audio or file part is named as such, not as "not a valid string"."""
        for part in value if isinstance(value, list) else ():
            kind = part.get("type", "text") if isinstance(part, dict) else "text"
            if kind not in ("text", "refusal", "image_url"):
                raise ValueError(f"content parts of type {str(kind)[:40]!r} are not supported: the chat models "
                                 "here take parts of type 'text', 'file' (a document, read as its text), where "
                                 "the model reads images 'image_url', and where tiers.yaml names a model to "
                                 "hear it (engine.audio_input) 'input_audio'")
        return value

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def image_parts(self) -> list[tuple[int, ImagePart]]:
        """The message's image parts, with their places in ``content``."""
        if not isinstance(self.content, list):
            return []
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, ImagePart)]


TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
# apply_chat_template's own arguments, which chat_template_kwargs may not set
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                                "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                                "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
MAX_TOOLS = 128
MAX_DOCUMENTS = 1024
# vLLM takes any positive penalty; a seen token's logit is divided by it (or multiplied), so past ~2 it is all but
# barred, and a tiny one would make its logit infinite: 0.01..100 here
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_STOP_TOKEN_IDS = 64
MAX_ALLOWED_TOKEN_IDS = 262_144  # more than any vocabulary has
MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS (it counts them after tokenizing: workers.chat.bad_words_ids)
# vLLM's request_id: the answer's id after its prefix (chatcmpl-, cmpl-); printable ASCII, no spaces
RequestId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[!-~]+$")]
CacheSalt = Annotated[str, Field(min_length=1, max_length=256)]
BadWord = Annotated[str, Field(min_length=1, max_length=256)]


class FunctionDef(_Body):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


def served_tool_types(*served: str) -> BeforeValidator:
    """A tool's ``type`` that names what is served here when it is another (a built-in tool such
    as ``web_search``, or chat's ``custom`` tools), rather than pydantic's "Input should be ..."."""

    def check(value: Any) -> Any:
        if isinstance(value, str) and value not in served:
            raise ValueError(f"tools of type '{value}' are not served here; this server serves "
                             + " and ".join(f"'{t}'" for t in served) + " tools")
        return value

    return BeforeValidator(check)


class Tool(_Body):
    type: Annotated[Literal["function"], served_tool_types("function")]
    function: FunctionDef


class FunctionName(_Body):
    name: str = Field(min_length=1)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(_Body):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(_Body):
    """``tool_choice: {"type": "allowed_tools", ...}``: only these tools may be called (``mode``
    ``auto``: or none; ``required``: one or more)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class JsonSchemaFormat(_Body):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # required with type json_schema


MAX_CHOICE = 1024  # the strings of structured_outputs.choice


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` (``extra_body`` in the SDK): the reply constrained to one of
    ``json`` (a JSON schema, or its text), ``json_object``, ``regex``, ``choice`` (one of these
    strings) or ``grammar`` (EBNF with a ``root`` rule, or Lark with ``start``); see
    ``gateway.structured``. ``disable_any_whitespace`` and ``disable_additional_properties`` are
    accepted and change nothing: JSON is always compact, and objects take only their declared
    properties. ``structural_tag`` and ``whitespace_pattern`` are refused."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICE)
    grammar: str | None = Field(default=None, min_length=1)
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; no padding field is added to the chunks


class Prediction(_Body):
    """``prediction``: Predicted Outputs, text the reply is expected to repeat (a file being
    edited): an engine that checks it writes what matches it in one pass. The reply is the same
    with it or without it."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class SpokenReply(_Body):
    """``audio``: how a reply asked for with ``modalities: ["text", "audio"]`` is said
    (gateway/output_audio.py)."""

    voice: str = Field(min_length=1)  # an OpenAI voice name or one of the speech model's own
    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]


MAX_STACK = 8  # adapters in one request's stack
# |weight| of an adapter in a stack: far beyond any blend or extrapolation in use (weights of a
# few units), and low enough that no factor folds to infinity: a weight of 1e300 made inf of a
# stack's factors, and vLLM's later base-model rows of other keys came out wrong.
MAX_ADAPTER_WEIGHT = 100.0


class AdapterChoice(_Body):
    """One entry of the ``adapters`` extension field: a configured adapter and its weight."""

    name: str = Field(min_length=1)
    weight: float = Field(default=1.0, allow_inf_nan=False, ge=-MAX_ADAPTER_WEIGHT, le=MAX_ADAPTER_WEIGHT)


def is_count(text: str) -> bool:
    """Whether ``text`` is a non-negative integer in ASCII digits. ``str.isdigit`` alone also
    accepts "²" and other digits that ``int`` refuses (a 500 where a 400 was meant)."""
    return text.isascii() and text.isdigit()


MAX_STOPS = 4  # OpenAI's limit, on chat and completions alike


def checked_stops(v: str | list[str] | None) -> list[str]:
    """``stop`` as chat and completions take it: one string or up to four, none of them empty."""
    stops = [v] if isinstance(v, str) else list(v or [])
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences")
    if any(not s for s in stops):
        raise ValueError("stop sequences must not be empty")
    return stops


def checked_logit_bias(v: dict[str, float] | None) -> dict[str, float] | None:
    """``logit_bias`` as chat and completions take it: token-id keys, biases within -100..100."""
    for token, bias in (v or {}).items():
        if not is_count(token):
            raise ValueError(f"keys are token ids, not {token[:20]!r}")
        if not -100 <= bias <= 100:
            raise ValueError(f"the bias of token {token} is {bias:g}, outside -100..100")
    return v


class EndUser(_Body):
    """OpenAI's fields that name the caller's end user and its prompt cache. Accepted, not acted
    on: ``user`` and ``safety_identifier`` are logged as a hash scoped to the key, never raw
    (``end_user``); the engines cache prompt prefixes by their tokens, whatever the key asks
    (vLLM's prefix cache, for as long as its blocks stay)."""

    user: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=64)
    prompt_cache_key: str | None = None
    # "in_memory" as the openai SDK types it, "in-memory" as OpenAI's API reference spells it
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None

    def end_user(self, key_id: str) -> str | None:
        """Who the caller says it serves, as logged: a hash scoped to the key (the raw value may
        be an e-mail address; two keys' identical strings are different users); None when unsaid."""
        named = self.safety_identifier or self.user
        return None if named is None else hashlib.sha256(f"{key_id}:{named}".encode()).hexdigest()[:16]


class ChatCompletionRequest(EndUser):
    null_is_default: ClassVar[frozenset[str]] = frozenset(
        {"temperature", "top_p", "n", "stream", "logprobs", "presence_penalty", "frequency_penalty"})
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)  # capped by limits.max_n
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in -100..100
    # vLLM's sampling extensions (workers.base.ChatParams): 0 or -1 top_k and 0 min_p are off, 1 no penalty
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    # vLLM's ends of a reply and detokenizing options (``reply_options``)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[BadWord] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    thinking_token_budget: int | None = Field(default=None, ge=-1)  # vLLM's: the thinking cut at so many tokens
    request_id: RequestId | None = None  # vLLM's: the answer's id is chatcmpl-<request_id> (not with store)
    cache_salt: CacheSalt | None = None  # vLLM's: the prompt's cached blocks shared only among requests of this salt
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens (BOS) added to the template's prompt
    # vLLM's scheduling and beam-search fields, at the values vllm serve takes by default (``check_vllm_defaults``)
    priority: int = 0
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search's: without it vLLM reads no value of it, and nor does this server
    # vLLM's: the rendered prompt cut to this many tokens (-1: the context less one), its start kept
    # (truncation_side right) or its end (left; unset: the tokenizer's own side)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: each prompt token's log probability, rank and the k likeliest there (0..20; not streamed)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's token ids in the answer
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name each token "token_id:<id>"
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)  # deprecated: tools
    function_call: Literal["none", "auto"] | FunctionName | None = None  # deprecated: tool_choice
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension: a regex, choice, grammar or schema
    service_tier: str | None = None  # auto | default | flex | priority, or a tier's name
    metadata: Metadata = None
    store: bool | None = None  # true: kept for the stored-completions API (gateway/stored_chat.py)
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; the model decides
    modalities: list[str] | None = None  # ["text"], or ["text", "audio"]: a spoken reply (gateway/output_audio.py)
    audio: SpokenReply | None = None  # the spoken reply's voice and format
    prediction: Prediction | None = None  # Predicted Outputs
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # to the template
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: documents for a template that renders them (RAG templates: Command-R's, Granite's), each a dict of
    # strings ("title", "text", ...); a template that does not use them ignores them, as vLLM's does
    documents: list[dict[str, str]] | None = Field(default=None, max_length=MAX_DOCUMENTS)  # vLLM's extension: the chat template's own variables
    include_reasoning: bool = True  # vLLM's extension: false leaves a reasoning model's thinking out
    # vLLM's: where the prompt ends (``prompt_end``); continue_final_message prefills the reply with the last message
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the reply prepended with the last message's text (``echoed``)
    adapters: list[AdapterChoice] | None = Field(default=None, max_length=MAX_STACK)  # extension: LoRA stack

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        return checked_stops(v)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return checked_logit_bias(v)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or ()) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"{taken[0]!r} is set by the server, not by chat_template_kwargs")
        return v

    def echoed(self) -> str:
        """vLLM's ``echo``: the last message's text, which the reply is prepended with where that
        message has the reply's role (the assistant's; with ``add_generation_prompt`` false any
        role, as vLLM's reply takes the last message's role then: a continued message comes whole);
        empty otherwise. 400 with a spoken reply, whose text is its transcript."""
        last = self.messages[-1] if self.messages else None
        if not self.echo or last is None or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        if self.spoken:
            raise bad_request("echo is not supported with a spoken reply (modalities audio)", "echo")
        return last.text() or ""

    def prompt_end(self) -> PromptEnd:
        """Where the prompt ends: the assistant's turn opened (``add_generation_prompt``, the
        default), the last message left open for the reply to continue (``continue_final_message``
        with ``add_generation_prompt`` false, vLLM's rule), or closed after it (both false)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message leaves the last message open: set add_generation_prompt to "
                              "false with it", "continue_final_message")
        return "open" if self.continue_final_message else "generation" if self.add_generation_prompt else "closed"

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables: ``chat_template_kwargs``, ``documents``, and
        ``reasoning_effort`` as vLLM passes it (itself, and ``enable_thinking`` false for ``none``,
        true otherwise, unless ``chat_template_kwargs`` sets it); None when none is given."""
        given = {**(self.chat_template_kwargs or {}), **({"documents": self.documents} if self.documents else {})}
        if self.reasoning_effort is None:
            return given or None
        return {"reasoning_effort": self.reasoning_effort, "enable_thinking": self.reasoning_effort != "none", **given}

    @field_validator("modalities")
    @classmethod
    def _text_or_spoken(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (sorted(v) not in (["text"], ["audio", "text"])):
            raise ValueError('modalities is ["text"], or ["text", "audio"] for a reply that is also spoken')
        return v

    @property
    def spoken(self) -> bool:
        """Whether the reply is to be said as well as written (``modalities`` has ``audio``)."""
        return "audio" in (self.modalities or ())

    def message_problem(self) -> tuple[str, str] | None:
        """(message, param) for the first message whose role lacks (or must not have) a field."""
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if m.role == "tool" and m.tool_call_id is None:
                return "a tool message needs tool_call_id", f"{where}.tool_call_id"
            if m.role != "tool" and m.tool_call_id is not None:
                return f"tool_call_id is only for tool messages, not {m.role}", f"{where}.tool_call_id"
            if m.role != "assistant" and m.tool_calls is not None:
                return f"tool_calls is only for assistant messages, not {m.role}", f"{where}.tool_calls"
            if m.role != "assistant" and isinstance(m.content, list) and any(isinstance(p, RefusalPart) for p in m.content):
                return f"content parts of type 'refusal' are only for assistant messages, not {m.role}", f"{where}.content"
            if m.role != "user" and m.image_parts():
                j = m.image_parts()[0][0]
                return f"content parts of type 'image_url' are only for user messages, not {m.role}", f"{where}.content[{j}].type"
            if m.role != "assistant" and m.annotations is not None:
                return f"annotations are only for assistant messages, not {m.role}", f"{where}.annotations"
            if m.role != "assistant" and m.function_call is not None:
                return f"function_call is only for assistant messages, not {m.role}", f"{where}.function_call"
            if m.tool_calls and m.function_call is not None:
                return "an assistant message has tool_calls or function_call, not both", f"{where}.function_call"
            if m.role == "function" and not m.name:
                return f"missing required parameter: {where}.name (the function's)", f"{where}.name"
            if m.content is None and not (m.role == "assistant" and (m.tool_calls or m.function_call or m.reasoning_content
                                                                      or m.reasoning)):
                return f"missing required parameter: {where}.content", f"{where}.content"
        if self.functions is not None and (self.tools is not None or self.tool_choice is not None):
            return "functions is the deprecated form of tools: send one or the other", "functions"
        if self.function_call is not None and self.functions is None:
            return "function_call is only allowed when functions are given", "function_call"
        return None

    def tool_fields(self) -> tuple[list[Tool] | None, Any, bool | None]:
        """``tools``, ``tool_choice`` and ``parallel_tool_calls``, or what the deprecated
        ``functions`` / ``function_call`` mean in their terms (one call at most)."""
        if self.functions is None:
            return self.tools, self.tool_choice, self.parallel_tool_calls
        tools = [Tool(type="function", function=f) for f in self.functions]
        choice = self.function_call
        if isinstance(choice, FunctionName):
            choice = NamedToolChoice(type="function", function=choice)
        return tools, choice, False

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (developer becomes system)."""
        role = {"developer": "system", "function": "tool"}
        out = []
        legacy_call = ""  # the id given to the last assistant function_call, which a function message answers
        for i, m in enumerate(self.messages):
            d: dict[str, Any] = {"role": role.get(m.role, m.role), "content": m.text()}
            if isinstance(m.content, list) and m.image_parts():  # the template's parts, in order: text as
                # given, each image as {"type": "image"}
                d["content"] = [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                                for p in m.content if isinstance(p, (ImagePart, TextPart))]
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.function_call is not None:  # the old functions API: the same call, as the template takes calls
                legacy_call = f"call_fn_{i}"
                d["tool_calls"] = [{"id": legacy_call, "type": "function", "function": m.function_call.model_dump()}]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.role == "function":
                d.update(tool_call_id=legacy_call or f"call_fn_{i}", name=m.name)
            if m.reasoning_content is not None or m.reasoning is not None:
                d["reasoning_content"] = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if d["content"] is None and "tool_calls" not in d:  # a reply that only thought: templates take a string
                d["content"] = ""
            out.append(d)
        return out


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 past ``max_bytes``, 400 if it is not strict JSON."""
    return json_object(await read_body(request, max_bytes))


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body's bytes; 413 past ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared and is_count(declared) and int(declared) > max_bytes:
        raise APIError(413, f"request body is larger than {max_bytes} bytes", "request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise APIError(413, f"request body is larger than {max_bytes} bytes", "request_too_large")
    return bytes(body)


def json_object(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object; 400 if it is not strict JSON or not an object."""
    try:
        data = loads(body)
    except InvalidJSON as exc:
        raise _invalid(str(exc)) from None
    if not isinstance(data, dict):
        raise _invalid("the request body must be a JSON object")
    return data


class InvalidJSON(ValueError):
    """Why a body is not strict JSON (a ``ValueError``, so it can replace ``json.loads``)."""


def loads(raw: bytes | str) -> Any:
    """Strict JSON: UTF-8, bounded shape, finite numbers, unique keys, valid Unicode strings.
    Raises :class:`InvalidJSON`; as a 400 through :func:`read_json`."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidJSON(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    check_shape(raw)
    try:
        data = _DECODER.decode(raw)
    except InvalidJSON:
        raise
    except RecursionError:  # not reached past check_shape; kept so no body can make a 500
        raise InvalidJSON("the request body nests too deeply") from None
    except ValueError as exc:
        raise InvalidJSON(f"the request body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):
        _check_unicode(data)
    return data


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_NOT_STRUCTURE = re.compile(r"[^\[\]{},]")


def check_shape(text: str, what: str = "the request body", max_depth: int = MAX_DEPTH) -> None:
    """Depth (at most ``max_depth``) and value count, counted on the text outside strings, before
    anything is built (``what`` names the text in the :class:`InvalidJSON`). Any JSON text, parsed
    by any decoder: a realtime client event is checked too, and a Batch API or fine-tuning file's
    line, so no depth can raise ``RecursionError``."""
    opening = text.count("[") + text.count("{")
    marks = opening + text.count("]") + text.count("}") + text.count(",")
    if opening <= max_depth and marks <= 2 * MAX_VALUES and text.count('"') <= 4 * MAX_VALUES:
        return  # within the limits even counting inside strings (an audio append's base64 has none of these)
    plain = text.replace("\\\\", "").replace('\\"', "")  # no escaped quote is left: a string is "..."
    if plain.count('"') > 4 * MAX_VALUES:  # a key or a string value per value, two quotes each
        raise InvalidJSON(f"{what} has more than {MAX_VALUES} JSON values")
    structure = _NOT_STRUCTURE.sub("", "".join(plain.split('"')[::2]))  # brackets and commas outside strings
    if len(structure) > 2 * MAX_VALUES:  # every value adds at most a comma or an opening and a closing bracket
        raise InvalidJSON(f"{what} has more than {MAX_VALUES} JSON values")
    depth = 0
    for ch in structure:
        if ch == ",":
            continue
        depth += 1 if ch in "[{" else -1
        if depth > max_depth:
            raise InvalidJSON(f"{what} nests arrays and objects deeper than {max_depth} levels")


def _constant(name: str) -> float:
    raise InvalidJSON(f"{name} is not a JSON number")


def _int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise InvalidJSON(f"an integer in the request body has more than {MAX_INT_DIGITS} digits")
    return int(literal)


def _float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise InvalidJSON(f"the number {literal[:40]} is out of range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InvalidJSON(f"duplicate key {json.dumps(key)} in a JSON object")
        out[key] = value
    return out


# made once (json.loads with options makes a decoder per call)
_DECODER = json.JSONDecoder(parse_constant=_constant, parse_int=_int, parse_float=_float, object_pairs_hook=_unique_keys)


def _check_unicode(data: Any) -> None:
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidJSON("a string in the request body has a lone UTF-16 surrogate (\\ud800-\\udfff)") from None


def _invalid(message: str) -> APIError:
    return bad_request(message, None, "invalid_json")


def parse(model: type[M], data: dict[str, Any]) -> M:
    """Validate ``data`` as ``model``; the first problem becomes a 400 naming its field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param(err["loc"], err["type"])
        if err["type"] == "extra_forbidden":  # the last place is the unknown key itself, whatever it looks like
            param = ".".join(p for p in (_param(err["loc"][:-1]), str(err["loc"][-1])) if p)
            raise bad_request(f"unrecognized request argument: {param}", param, "unknown_parameter") from None
        if err["type"] == "missing":
            raise bad_request(f"missing required parameter: {param}", param, "missing_required_parameter") from None
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"].endswith("_type"):  # bool_type, int_type, string_type...: a string for a bool
            raise bad_request(f"invalid type for {param}: {msg}", param, "invalid_type") from None
        raise bad_request(f"invalid value for {param}: {msg}", param, "invalid_value") from None


# pydantic's labels of a union's scalar branches (``int | Literal["auto"]``), and the prefix of their errors' types
_SCALAR_BRANCHES = {"str": "string_", "int": "int_", "float": "float_", "bool": "bool_", "bytes": "bytes_"}


def _param(loc: tuple[Any, ...], error: str = "") -> str:
    """The request's place of an error at ``loc``, of type ``error``, without pydantic's union-branch
    labels: types (``list[TextPart]``, ``literal['auto']``), model classes and tags (capitalized), and
    a scalar's (``int``) as the last place of an error about that scalar (nothing is inside a scalar;
    a key named so, as in ``metadata.int``, stays)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in str(part) or str(part)[:1].isupper():
            continue
        elif i == len(loc) - 1 and error.startswith(_SCALAR_BRANCHES.get(str(part), "-")):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def sampling(body: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """``ChatParams``' sampling fields of a chat or completion request: each as the request sets
    it, else the model's default (``Services.sampling_defaults``: its generation_config.json, as
    vllm serve reads it), else OpenAI's; vLLM's extensions ``top_k`` (0 or -1: every token),
    ``min_p`` and ``repetition_penalty`` (1: none) off."""
    given = body.model_fields_set

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(body, name) if name in given else None
        return value if value is not None else defaults.get(name, fallback)

    return {"temperature": pick("temperature", 1.0), "top_p": pick("top_p", 1.0),
            "presence_penalty": pick("presence_penalty", 0.0), "frequency_penalty": pick("frequency_penalty", 0.0),
            "top_k": max(pick("top_k", 0), 0), "min_p": pick("min_p", 0.0),
            "repetition_penalty": pick("repetition_penalty", 1.0)}


def check_vllm_defaults(body: Any) -> None:
    """vLLM's ``priority`` and ``use_beam_search`` of a chat or completion request, at the values
    ``vllm serve`` takes by default (clients send them as they are): a 400 naming each otherwise,
    as vllm serve's own without ``--scheduling-policy priority``."""
    if body.priority != 0:
        raise bad_request("priority orders requests on vLLM's priority scheduler; this server orders them by the "
                          "key's tier (and service_tier): leave priority at 0", "priority")
    if body.use_beam_search:
        raise bad_request("beam search is not served here: sample several with n (or best_of on /v1/completions)",
                          "use_beam_search")


def reply_options(body: Any, max_tokens: int, reasoning: str = "none") -> dict[str, Any]:
    """``ChatParams``' fields for vLLM's ends of a reply, of a chat or completion request:
    ``stop_token_ids`` (tokens that end it besides the model's end of text; out of the vocabulary:
    a 400 from the engine), ``min_tokens`` (at most ``max_tokens``: a 400 naming it otherwise),
    ``ignore_eos``, ``include_stop_str_in_output`` (the stop string or token that ended it kept in
    its text); its detokenizing options ``skip_special_tokens`` and
    ``spaces_between_special_tokens``; its token constraints ``allowed_token_ids`` (the only
    tokens it may have) and ``bad_words`` (words it may not write); and ``thinking_token_budget``
    (-1: none), for a model whose ``reasoning`` parser is set (a 400 naming it otherwise, as vLLM's
    without a reasoning config)."""
    if body.min_tokens > max_tokens:
        raise bad_request(f"min_tokens is {body.min_tokens}, above max_tokens ({max_tokens})", "min_tokens")
    budget = None if body.thinking_token_budget == -1 else body.thinking_token_budget
    if budget is not None and reasoning == "none":
        raise bad_request(f"thinking_token_budget needs a reasoning model: '{body.model}' has no reasoning_parser "
                          "(tiers.yaml, its engine block)", "thinking_token_budget")
    return {"thinking_budget": budget,"stop_token_ids": tuple(body.stop_token_ids or ()), "min_tokens": body.min_tokens,
            "ignore_eos": body.ignore_eos, "include_stop_str": body.include_stop_str_in_output,
            "skip_special_tokens": body.skip_special_tokens,
            "spaces_between_special_tokens": body.spaces_between_special_tokens,
            "allowed_token_ids": tuple(body.allowed_token_ids or ()), "bad_words": tuple(body.bad_words or ())}
