"""The transformers engine's sampling (workers/chat.py ``_probs``, ``_process``) against plain
references: transformers' own logits processors, applied in vLLM's order (penalties; then the
temperature, min_p, top_k, top_p), so that a request reads the same on either engine. Tolerance:
1e-6 absolute on probabilities, fp32 logits (the engine samples from fp32 copies of any dtype)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from workers.base import ChatParams
from workers.chat import _probs, _process, _sample


def reference_probs(logits: torch.Tensor, p: ChatParams) -> torch.Tensor:
    scores = logits[None].clone()
    ids = torch.zeros((1, 1), dtype=torch.long)  # the warpers below do not read the ids
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return torch.softmax(scores[0], dim=-1)


@pytest.mark.parametrize("vocab", [7, 1000, 32000])
@pytest.mark.parametrize("temperature,top_k,min_p,top_p", [
    (1.0, 0, 0.0, 1.0), (0.7, 0, 0.0, 0.9), (1.0, 1, 0.0, 1.0), (1.0, 5, 0.0, 1.0), (1.3, 40, 0.0, 0.8),
    (1.0, 0, 0.05, 1.0), (0.5, 0, 0.5, 1.0), (1.0, 20, 0.1, 0.95), (2.0, 3, 0.01, 0.5), (1.0, 0, 1.0, 1.0),
])
def test_probs_are_transformers_warpers_in_vllms_order(vocab, temperature, top_k, min_p, top_p):
    gen = torch.Generator().manual_seed(vocab + top_k)
    logits = torch.randn(vocab, generator=gen) * 3
    p = ChatParams(temperature=temperature, top_k=top_k, min_p=min_p, top_p=top_p)
    got = _probs(logits, p)
    want = reference_probs(logits, p)
    assert torch.allclose(got / got.sum(), want, atol=1e-6, rtol=0)
    if top_k:
        assert int((got > 0).sum()) <= top_k
    if top_k == 1 or min_p == 1.0:  # only the likeliest token is left: a draw is the greedy choice
        assert _sample(logits, p, gen) == int(logits.argmax())


def test_top_p_judges_what_top_k_left_as_vllm_does():
    """min_p keeps the tokens at least min_p as likely as the likeliest; top_p counts the
    probabilities of what top_k left, renormalized: three tokens of probabilities 0.5, 0.3, 0.2
    (and a tail)."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2, 1e-4, 1e-4]))
    left = _probs(logits, ChatParams(temperature=1.0, min_p=0.5, top_k=0))  # 0.2 < 0.5 x 0.5: out
    assert (left > 0).tolist() == [True, True, False, False, False]
    left = _probs(logits, ChatParams(temperature=1.0, top_k=2, top_p=0.6))  # of 0.5/0.8 and 0.3/0.8, 0.625 >= 0.6
    assert (left > 0).tolist() == [True, False, False, False, False]
    left = _probs(logits, ChatParams(temperature=1.0, top_k=3, top_p=0.6))  # 0.5 alone is under 0.6
    assert (left > 0).tolist() == [True, True, False, False, False]


@pytest.mark.parametrize("penalty", [1.0, 1.2, 2.0, 0.8])
def test_the_repetition_penalty_is_transformers_on_the_prompt_and_the_reply(penalty):
    """Every token of the prompt and of the reply so far, repeats or not: positive logits divided by
    the penalty, negative ones multiplied (transformers' and vLLM's definition); the rest as they were."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, generator=gen) * 4
    ids = [3, 7, 7, 11, 3, 42, 0]
    seq = SimpleNamespace(params=ChatParams(repetition_penalty=penalty), ids=ids, generated=ids[4:], grammar=None,
                          thinking=False)
    got = _process(logits.clone(), seq)
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[None].clone())[0]
    assert torch.allclose(got, want, atol=0, rtol=0)
    untouched = [i for i in range(50) if i not in ids]
    assert torch.equal(got[untouched], logits[untouched])
