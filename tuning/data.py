"""A fine-tuning file's conversations, checked as OpenAI checks a chat fine-tuning file, and the
job's hyperparameters with ``auto`` worked out.

A file is UTF-8 JSON lines, one example per line (blank lines skipped): an object with
``messages`` (a list of chat messages: ``system``/``developer``/``user``/``assistant``/``tool``,
their ``content`` a string or text parts; an assistant's may be empty where it has
``tool_calls``, each shaped as in a chat request) and optionally ``tools`` (function tools, as in a
chat request) and ``parallel_tool_calls``. Each example needs an assistant message to learn from: one without
``"weight": 0`` (``weight`` is 0 or 1, on assistant messages only). Anything else is a
``FileProblem`` naming the line and the field.

A preference file (``method: dpo``) has on each line ``input`` (``messages`` ending with a user
message, optionally ``tools`` and ``parallel_tool_calls``), ``preferred_output`` and
``non_preferred_output``: each a list of one assistant message, the answer to prefer and the one
to prefer less (OpenAI's format).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from batch.lines import jsonl_lines
from gateway.schemas import MAX_DEPTH, InvalidJSON, check_shape

ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_EPOCHS = 3
MAX_BATCH = 8
DEFAULT_BETA = 0.1  # DPO's usual beta (the paper's and TRL's default)


class FileProblem(ValueError):
    """What is wrong with a fine-tuning file, and where (its message names the line)."""


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


@dataclass(frozen=True)
class Preference:
    """A DPO example: a conversation (its assistant turns are context, not learned) and two answers."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    preferred: dict[str, Any]
    non_preferred: dict[str, Any]


def conversations(content: bytes, what: str = "the training file") -> list[Conversation]:
    """The examples of a fine-tuning file; ``FileProblem`` for the first line that is not one."""
    return [_conversation(example, where) for example, where in _lines(content, what)]


def preferences(content: bytes, what: str = "the training file") -> list[Preference]:
    """The examples of a preference (DPO) file; ``FileProblem`` for the first line that is not one."""
    return [_preference(example, where) for example, where in _lines(content, what)]


def _lines(content: bytes, what: str) -> list[tuple[Any, str]]:
    """Each line's JSON value and where it is; ``FileProblem`` for text that is not JSON lines."""
    try:
        text = content.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        raise FileProblem(f"{what} is not UTF-8 text (JSONL expected)") from None
    out = []
    for number, line in enumerate(jsonl_lines(text), 1):  # (not splitlines: a string may hold U+2028)
        if not line.strip():
            continue
        try:
            check_shape(line, "it", MAX_DEPTH + 1)  # a DPO line's input as deep as a request: no RecursionError below
            out.append((json.loads(line), f"{what}, line {number}"))
        except InvalidJSON as exc:
            raise FileProblem(f"{what}, line {number}: not JSON as a request body may be ({exc})") from None
        except json.JSONDecodeError as exc:
            raise FileProblem(f"{what}, line {number}: not JSON ({exc.msg})") from None
    if not out:
        raise FileProblem(f"{what} has no examples")
    return out


def _preference(example: Any, where: str) -> Preference:
    if not isinstance(example, dict):
        raise FileProblem(f"{where}: a preference example is a JSON object with 'input', 'preferred_output' and "
                          "'non_preferred_output'")
    unknown = sorted(set(example) - {"input", "preferred_output", "non_preferred_output"})
    if unknown:
        raise FileProblem(f"{where}: unknown field {unknown[0]!r} (a preference example has 'input', "
                          "'preferred_output', 'non_preferred_output')")
    given = example.get("input")
    if not isinstance(given, dict):
        raise FileProblem(f"{where}: 'input' must be an object with 'messages'")
    context = _conversation({**given, "messages": [*(given.get("messages") or [None]), {"role": "assistant", "content": ""}]}
                            if isinstance(given.get("messages"), list) and given["messages"] else given, f"{where}: input")
    messages = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in context.messages[:-1]]
    if messages[-1]["role"] != "user":
        raise FileProblem(f"{where}: input.messages must end with a user message (the one both outputs answer)")
    answers = []
    for key in ("preferred_output", "non_preferred_output"):
        output = example.get(key)
        if not (isinstance(output, list) and len(output) == 1 and isinstance(output[0], dict)
                and output[0].get("role") == "assistant"):
            raise FileProblem(f"{where}: '{key}' must be a list of one assistant message")
        _check_message(output[0], f"{where}: {key}[0]", "assistant")
        answers.append({k: v for k, v in output[0].items() if k != "weight"})
    return Preference(messages, context.tools, answers[0], answers[1])


def _conversation(example: Any, where: str) -> Conversation:
    if not isinstance(example, dict):
        raise FileProblem(f"{where}: an example is a JSON object with 'messages'")
    unknown = sorted(set(example) - {"messages", "tools", "parallel_tool_calls", "functions"})
    if unknown:
        raise FileProblem(f"{where}: unknown field {unknown[0]!r} (an example has 'messages', 'tools', "
                          "'parallel_tool_calls')")
    messages = example.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FileProblem(f"{where}: 'messages' must be a non-empty list of messages")
    learned = False
    for i, m in enumerate(messages):
        at = f"{where}: messages[{i}]"
        if not isinstance(m, dict):
            raise FileProblem(f"{at} is not an object")
        role = m.get("role")
        if role not in ROLES:
            raise FileProblem(f"{at}.role must be one of {', '.join(ROLES)}")
        _check_message(m, at, role)
        if "weight" in m:
            if role != "assistant" or m["weight"] not in (0, 1) or isinstance(m["weight"], bool):
                raise FileProblem(f"{at}.weight must be 0 or 1, on an assistant message")
        learned |= role == "assistant" and m.get("weight", 1) == 1
    if not learned:
        raise FileProblem(f"{where}: no assistant message to learn from (each example needs one without 'weight': 0)")
    tools = example.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and _is_function(t.get("function")) for t in tools)):
        raise FileProblem(f"{where}: 'tools' must be a list of function tools ({{'type': 'function', 'function': "
                          "{'name': ..., 'parameters': {...}}}})")
    functions = example.get("functions")  # the deprecated form of tools: checked, not trained on
    if functions is not None and not (isinstance(functions, list) and all(map(_is_function, functions))):
        raise FileProblem(f"{where}: 'functions' must be a list of functions ({{'name': ..., 'parameters': {{...}}}})")
    if not isinstance(example.get("parallel_tool_calls", False), bool):
        raise FileProblem(f"{where}: 'parallel_tool_calls' must be true or false")
    return Conversation(messages, tools)


def _is_function(f: Any) -> bool:
    """A function as ``tools`` describe one: a name, and its parameters (if given) a JSON schema object."""
    return isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("parameters", {}), dict)


def _check_message(m: dict, at: str, role: str) -> None:
    """The fields of a message the chat template reads, shaped as in a chat request: a message the
    template cannot render would fail the job later, as a server error."""
    _check_content(m, at, role)
    for key in ("name", "tool_call_id"):
        if key in m and not isinstance(m[key], str):
            raise FileProblem(f"{at}.{key} must be a string")
    if "tool_calls" not in m:
        return
    calls = m["tool_calls"]
    if role != "assistant":
        raise FileProblem(f"{at}.tool_calls is only for assistant messages, not {role}")
    if not isinstance(calls, list):
        raise FileProblem(f"{at}.tool_calls must be a list of tool calls")
    for j, call in enumerate(calls):
        _check_call(call, f"{at}.tool_calls[{j}]")


def _check_call(call: Any, at: str) -> None:
    """One tool call: ``{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}``."""
    if not isinstance(call, dict):
        raise FileProblem(f"{at} must be an object with 'id', 'type' and 'function'")
    if not (isinstance(call.get("id"), str) and call["id"]):
        raise FileProblem(f"{at}.id must be a non-empty string")
    if call.get("type", "function") != "function":
        raise FileProblem(f"{at}.type must be 'function'")
    function = call.get("function")
    if not isinstance(function, dict):
        raise FileProblem(f"{at}.function must be an object with 'name' and 'arguments'")
    if not (isinstance(function.get("name"), str) and function["name"]):
        raise FileProblem(f"{at}.function.name must be a non-empty string")
    if not isinstance(function.get("arguments"), str):
        raise FileProblem(f"{at}.function.arguments must be a string (the arguments as JSON text)")


def _check_content(m: dict, at: str, role: str) -> None:
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise FileProblem(f"{at}.content: only text parts are trained on (no images or audio)")
        m["content"] = "".join(p["text"] for p in content)  # the chat templates read a string
    elif content is None:
        if not (role == "assistant" and m.get("tool_calls")):
            raise FileProblem(f"{at}.content is missing (only an assistant message with tool_calls may have none)")
    elif not isinstance(content, str):
        raise FileProblem(f"{at}.content must be a string or a list of text parts")


@dataclass(frozen=True)
class Hyperparameters:
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    beta: float | None = None  # DPO's: how far the tuned model may move from the base (None: supervised)

    def public(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n_epochs": self.n_epochs, "batch_size": self.batch_size,
                               "learning_rate_multiplier": self.learning_rate_multiplier}
        if self.beta is not None:
            out["beta"] = self.beta
        return out


def resolve(asked: dict[str, Any], examples: int, method: str = "supervised") -> Hyperparameters:
    """The job's hyperparameters, each ``auto`` (or absent) worked out: 3 epochs; a batch of about
    0.2% of the examples, from 1 to 8; a learning rate multiplier of 1; for DPO a beta of 0.1."""
    epochs, batch, multiplier = (asked.get(k, "auto") for k in ("n_epochs", "batch_size", "learning_rate_multiplier"))
    beta = asked.get("beta", "auto")
    return Hyperparameters(
        DEFAULT_EPOCHS if epochs == "auto" else int(epochs),
        max(1, min(MAX_BATCH, math.floor(examples * 0.002))) if batch == "auto" else min(int(batch), examples),
        1.0 if multiplier == "auto" else float(multiplier),
        None if method != "dpo" else DEFAULT_BETA if beta == "auto" else float(beta))
