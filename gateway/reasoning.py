"""Reasoning models on chat: the reply's thinking split from its answer.

A reasoning model writes its thinking between ``<think>`` and ``</think>`` before the answer.
The model's ``reasoning_parser`` (tiers.yaml, engine block) says where the thinking starts:

* ``qwen3``: the model opens it itself. A reply that begins with ``<think>`` thinks until
  ``</think>``; one that does not (Qwen3 asked with ``enable_thinking: false``) is all answer.
* ``deepseek_r1``: the chat template opens it (its generation prompt ends with ``<think>``, as
  DeepSeek-R1's, QwQ's and Qwen3's thinking-only models' do), so the reply thinks from its first
  token until ``</think>`` (a ``<think>`` the model writes again first is dropped). A reply cut
  before ``</think>`` is all thinking.

:class:`ThinkSplitter` takes the reply's text piece by piece and gives back each piece's
thinking and answer, holding back only the few characters that could be the start of a marker,
so a stream sends thinking as it is written. The answer then goes on to the tool-call parser.
"""

from __future__ import annotations

from typing import Literal

from gateway.tools import partial_suffix

ReasoningParser = Literal["none", "qwen3", "deepseek_r1"]
OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    def __init__(self, parser: ReasoningParser) -> None:
        # start: a leading <think> may still come; thinking: until </think>; answer: the rest
        self.state = "start"
        self.opened = parser == "deepseek_r1"  # the prompt opened the thinking
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
        end = text.find(CLOSE)
        if end >= 0:
            self.state = "answer"
            return text[:end], text[end + len(CLOSE):]
        keep = partial_suffix(text, CLOSE)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the reply."""
        held, self.held = self.held, ""
        if self.state == "thinking" or (self.state == "start" and self.opened):
            return held, ""
        return "", held

