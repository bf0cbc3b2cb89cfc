"""Token log probabilities in OpenAI's shapes, from the engines' ``TokenLogprob`` entries.

Chat (``choices[].logprobs.content``): one entry per generated token, ``{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}``, most likely alternative first;
a streamed chunk carries the entries of the tokens behind its text. Transcriptions
(``include[]=logprobs``): ``{"token", "logprob", "bytes"}`` per token of the text. ``bytes`` are the UTF-8 bytes
of the token's text as decoded alone (a token that is part of a multi-byte character decodes to
U+FFFD there).
"""

from __future__ import annotations

from workers.base import TokenLogprob


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


def token_entries(entries: list[TokenLogprob]) -> list[dict]:
    """A transcription's ``logprobs`` (and its done event's): ``{"token", "logprob", "bytes"}`` per
    token, without alternatives."""
    return [_entry(e.token, e.logprob) for e in entries]


def chat_content(entries: list[TokenLogprob]) -> list[dict]:
    """The ``logprobs.content`` list of a chat choice (or chunk) for ``entries``."""
    return [{**_entry(e.token, e.logprob), "top_logprobs": [_entry(t, lp) for t, lp in e.top]} for e in entries]


def chat_logprobs(entries: list[TokenLogprob] | None, asked: bool) -> dict | None:
    """A chat choice's ``logprobs`` object; None when logprobs were not asked for. A reply with
    no tokens to show (the model ended at once) has an empty ``content``, not a null object."""
    if not asked:
        return None
    return {"content": chat_content(entries or []), "refusal": None}
