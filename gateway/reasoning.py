"""Reasoning models on chat: the reply's thinking split from its answer.

A reasoning model writes its thinking between ``<think>`` and ``</think>`` before the answer.
Where the thinking starts is read from the rendered prompt (the chat engine notes its last
marker, ``StepContext.prompt_thinking``) and from the reply, as the model's ``reasoning_parser``
(tiers.yaml, engine block) says:

* ``qwen3``: a reply thinks when it begins with ``<think>`` (Qwen3 opens it itself) or when the
  prompt ends inside a ``<think>`` the template opened (Qwen3's thinking-only models); a reply to
  a prompt that closed it (``enable_thinking: false`` writes an empty block) is all answer.
* ``deepseek_r1``: the reply thinks from its first token unless the prompt closed the thinking
  (DeepSeek-V3.1's template writes ``</think>`` for no thinking), as R1 sometimes leaves out the
  ``<think>`` its template did not write.

Either way the thinking runs until ``</think>`` (a ``<think>`` the model writes first is dropped),
and a reply cut before it is all thinking.

:class:`ThinkSplitter` takes the reply's text piece by piece and gives back each piece's
thinking and answer, holding back only the few characters that could be the start of a marker,
so a stream sends thinking as it is written. The answer then goes on to the tool-call parser.
The reply's reasoning tokens (``usage``'s ``reasoning_tokens``) are those the engine generated
through the first ``</think>`` (``ChatRequest.reasoning``), counted on the reply's ids.
"""

from __future__ import annotations

from typing import Literal

from gateway.tools import partial_suffix
from workers.base import ChatFinished

ReasoningParser = Literal["none", "qwen3", "deepseek_r1"]
OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    def __init__(self, parser: ReasoningParser, prompt_thinking: str = "none") -> None:
        # start: a leading <think> may still come; thinking: until </think>; answer: the rest
        self.state = "start"
        self.thought = False  # the reply thought (its reasoning tokens are counted)
        # the reply starts inside the thinking (``prompt_thinking``: the prompt's last marker)
        self.opened = prompt_thinking == "open" or (parser == "deepseek_r1" and prompt_thinking != "closed")
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) of ``text``, the reply's next piece."""
        text = self.held + text
        self.held = ""
        if self.state == "start":
            stripped = text.lstrip()
            if OPEN.startswith(stripped):  # "", "<", "<thi": wait for more
                self.held = text
                return "", ""
            if stripped.startswith(OPEN):
                text = stripped[len(OPEN):]
                self.state = "thinking"
            elif self.opened:
                self.state = "thinking"
            else:
                self.state = "answer"
        if self.state == "answer":
            return "", text
        self.thought = True
        end = text.find(CLOSE)
        if end >= 0:
            self.state = "answer"
            return text[:end], text[end + len(CLOSE):]
        keep = partial_suffix(text, CLOSE)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], ""

    def reasoning_tokens(self, finished: ChatFinished) -> int:
        """The completion tokens the reply spent thinking: through its ``</think>`` (the engine's
        ``think_tokens``), all of them when it was cut before it, none when it did not think."""
        if not self.thought:
            return 0
        if finished.think_tokens is None:
            return finished.completion_tokens
        return min(finished.think_tokens, finished.completion_tokens)

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the reply."""
        held, self.held = self.held, ""
        if self.state == "thinking" or (self.state == "start" and self.opened):
            self.thought = True
            return held, ""
        return "", held

