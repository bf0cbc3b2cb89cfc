"""Token log probabilities in OpenAI's shapes, from the engines' ``TokenLogprob`` entries.

Chat (``choices[].logprobs.content``): one entry per generated token, ``{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}``, most likely alternative first;
a streamed chunk carries the entries of the tokens behind its text. Transcriptions
(``include[]=logprobs``): ``{"token", "logprob", "bytes"}`` per token of the text. ``bytes`` are the UTF-8 bytes
of the token itself, where the engine knows them (``TokenLogprob.raw``): a token that is part of a
multi-byte character has that part's bytes (``[195]``), so joining the entries' bytes gives the
reply's UTF-8, while its ``token`` is ``""``, and the part that completes the character has the
whole character, on both chat engines as ``vllm serve`` gives them
(``workers.grammar.Vocabulary.text_after``); otherwise the UTF-8 of its text.

Every logprob sent is a JSON number (``json_logprob``): an engine's ``-inf`` (an impossible
token) is -9999.0, as vLLM's own server writes it, and so is a NaN (a model whose outputs went
non-finite: no probability is known); ``+inf`` (above any log probability) is 0.0. JSON has no
infinity or NaN: a whole reply with one was a 500, a streamed chunk not JSON at all.
"""

from __future__ import annotations

import math

from gateway.errors import bad_request
from workers.base import PROMPT_LOGPROBS_WITH_LORA, ModelSpec, TokenLogprob


def check_prompt_logprobs(spec: ModelSpec, asked: bool, param: str) -> None:
    """The prompt's logprobs refused before any slot or load, naming ``param`` (``prompt_logprobs``,
    or ``echo`` for a legacy echo with logprobs), on a model whose vLLM engine has LoRA enabled,
    where vLLM 0.32 cannot compute them (``workers.base.PROMPT_LOGPROBS_WITH_LORA``; the
    engine refuses them too)."""
    if asked and spec.engine == "vllm" and spec.options.get("enable_lora"):
        raise bad_request(PROMPT_LOGPROBS_WITH_LORA.format(model=spec.name), param)


IMPOSSIBLE = -9999.0  # vLLM's server's logprob for -inf


def json_logprob(logprob: float) -> float:
    """``logprob`` as a JSON number (the module's doc): -inf and NaN as -9999.0, +inf as 0.0."""
    if math.isfinite(logprob):
        return logprob
    return 0.0 if logprob > 0 else IMPOSSIBLE


def _entry(e: TokenLogprob, as_id: bool = False) -> dict:
    if as_id:
        name = token_name(e, True)
        return {"token": name, "logprob": json_logprob(e.logprob), "bytes": list(name.encode())}
    raw = e.raw if e.raw is not None else e.token.encode("utf-8", "replace")
    return {"token": e.token, "logprob": json_logprob(e.logprob), "bytes": list(raw)}


def token_name(e: TokenLogprob, as_id: bool) -> str:
    """How an entry names its token: its text, or (vLLM's return_tokens_as_token_ids) ``token_id:<id>``,
    which any token, a piece of a character or a special one, can be told apart and read back by."""
    return f"token_id:{e.id}" if as_id and e.id is not None else e.token


def token_entries(entries: list[TokenLogprob]) -> list[dict]:
    """A transcription's ``logprobs`` (and its done event's): ``{"token", "logprob", "bytes"}`` per
    token, without alternatives."""
    return [_entry(e) for e in entries]


def chat_content(entries: list[TokenLogprob], as_ids: bool = False) -> list[dict]:
    """The ``logprobs.content`` list of a chat choice (or chunk) for ``entries``; ``as_ids``: each
    token named by its id (``token_name``), its ``bytes`` that name's, as vLLM answers them."""
    return [{**_entry(e, as_ids), "top_logprobs": [_entry(t, as_ids) for t in e.top]} for e in entries]


def chat_logprobs(entries: list[TokenLogprob] | None, asked: bool, as_ids: bool = False) -> dict | None:
    """A chat choice's ``logprobs`` object; None when logprobs were not asked for. A reply with
    no tokens to show (the model ended at once) has an empty ``content``, not a null object."""
    if not asked:
        return None
    return {"content": chat_content(entries or [], as_ids), "refusal": None}


def prompt_logprob_dicts(entries: list[TokenLogprob | None] | None) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs`` of a chat completion: per prompt token (None for the first), its
    own and the likeliest tokens' ``{"logprob", "rank", "decoded_token"}`` by token id; an
    impossible token's -inf as vLLM writes it, -9999.0."""
    if entries is None:
        return None

    def one(e: TokenLogprob) -> dict:
        return {"logprob": json_logprob(e.logprob), "rank": e.rank, "decoded_token": e.token}

    return [None if e is None else {**{str(t.id): one(t) for t in e.top}, str(e.id): one(e)} for e in entries]
