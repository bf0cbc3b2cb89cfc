"""vLLM's ``thinking_token_budget`` on the transformers engine: a reasoning reply's thinking cut
at so many tokens by forcing ``</think>``.

The rule is vLLM 0.32's (``vllm/v1/sample/thinking_budget_state.py``), so that a request is cut
at the same token on both engines. The markers are ``<think>`` and ``</think>`` as the tokenizer
encodes them (one token each in Qwen3's and DeepSeek's vocabularies; a few in a byte-level BPE
that lacks them): a reply thinks after the last ``<think>`` of its prompt and reply that no
``</think>`` follows. Its thinking tokens are counted from there (those the prompt already
holds included); once ``budget`` are written, the next tokens are ``</think>``'s, forced one by
one. A reply that opens ``<think>`` again later starts a new count. A model whose template or
reply never writes ``<think>`` (DeepSeek-R1's older template) is never cut, as on vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass


def last_at(ids: list[int], marker: tuple[int, ...]) -> int:
    """Where ``marker`` last starts in ``ids`` (-1: nowhere). Its first token is looked for from
    the end by ``list.index`` on the reversed ids (a long prompt costs a copy, not a Python loop
    over its tokens: this runs on the event loop)."""
    n, rev, found = len(marker), ids[::-1], 0
    while True:
        try:
            found = rev.index(marker[0], found)
        except ValueError:
            return -1
        at = len(ids) - 1 - found
        if tuple(ids[at:at + n]) == marker:
            return at
        found += 1


@dataclass
class ThinkBudget:
    start: tuple[int, ...]  # ``<think>``'s tokens
    end: tuple[int, ...]  # ``</think>``'s tokens: what is forced
    budget: int  # thinking tokens allowed before ``</think>`` is forced
    thinking: bool = False  # after a <think> that no </think> closed yet
    spent: int = 0  # thinking tokens since that <think>
    forcing: int = -1  # the index in ``end`` of the next forced token (-1: none is forced)

    @classmethod
    def after_prompt(cls, start: tuple[int, ...], end: tuple[int, ...], budget: int,
                     prompt: list[int]) -> ThinkBudget:
        """The budget of a reply to ``prompt``: a prompt whose last marker is an open ``<think>``
        (a template that opens the thinking) has the reply think from its first token, and the
        prompt's tokens after the marker count against the budget."""
        opened, closed = last_at(prompt, start), last_at(prompt, end)
        if opened <= closed:
            return cls(start, end, budget)
        return cls(start, end, budget, thinking=True, spent=len(prompt) - opened - len(start))

    def forced(self) -> int | None:
        """The token the reply must have next (None: any)."""
        if self.forcing < 0 and self.thinking and self.spent >= self.budget:
            self.forcing = 0
        return self.end[self.forcing] if self.forcing >= 0 else None

    def advance(self, ids: list[int]) -> None:
        """After the reply's next token, the last of ``ids`` (prompt and reply)."""
        if self.forcing >= 0:
            self.forcing += 1
            if self.forcing == len(self.end):
                self.forcing, self.thinking, self.spent = -1, False, 0
        elif self.thinking:
            if tuple(ids[-len(self.end):]) == self.end:  # the model closed it itself
                self.thinking, self.spent = False, 0
            else:
                self.spent += 1
        elif tuple(ids[-len(self.start):]) == self.start:
            self.thinking, self.spent = True, 0
