"""Request bodies of the OpenAI API as pydantic models, and their parsing into 400 errors that
name the offending field (``param``)."""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request

from gateway.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


MAX_STACK = 8  # adapters in one request's stack


class AdapterChoice(_Body):
    """One entry of the ``adapters`` extension field: a configured adapter and its weight."""

    name: str = Field(min_length=1)
    weight: float = Field(default=1.0, allow_inf_nan=False)


class ChatCompletionRequest(_Body):
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
    n: Literal[1] = 1
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    adapters: list[AdapterChoice] | None = Field(default=None, max_length=MAX_STACK)  # extension: LoRA stack

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def messages_as_dicts(self) -> list[dict[str, str]]:
        role = {"developer": "system"}
        return [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages]


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 past ``max_bytes``, 400 if it is not JSON."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body is larger than {max_bytes} bytes", "request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise APIError(413, f"request body is larger than {max_bytes} bytes", "request_too_large")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise bad_request("the request body is not valid JSON", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    return data


def parse(model: type[M], data: dict[str, Any]) -> M:
    """Validate ``data`` as ``model``; the first problem becomes a 400 naming its field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param(err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unrecognized request argument: {param}", param, "unknown_parameter") from None
        if err["type"] == "missing":
            raise bad_request(f"missing required parameter: {param}", param, "missing_required_parameter") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise bad_request(f"invalid value for {param}: {msg}", param, "invalid_value") from None


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[TextPart]", "literal['text']") or "[" in str(part):
            continue  # pydantic's union-branch labels are not fields
        else:
            out += f".{part}" if out else str(part)
    return out
