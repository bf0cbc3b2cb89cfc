"""The transformers chat engine on the decoder families people serve besides the demo's Llama: each
built tiny offline from its config (random weights, the demo's tokenizer and chat template), its
greedy chat answer through the openai SDK, whole and streamed, checked against transformers' own
``generate`` on the same model: the same text, and each token's log probability within 1e-4."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import start_server, write_config

# Each family's own attention and norm code: Qwen2 (q/k/v biases), Qwen3 (q/k norms), Mistral,
# Gemma 2 (logit soft-capping, alternating sliding-window layers), Gemma 3, Phi-3 (fused qkv and
# gate_up projections)
CONFIGS = {
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32}),
    "mistral": (transformers.MistralConfig, {"head_dim": 32}),
    "gemma2": (transformers.Gemma2Config, {"head_dim": 32}),
    "gemma3": (transformers.Gemma3TextConfig, {"head_dim": 32}),
    "phi3": (transformers.Phi3Config, {}),
}
MESSAGES = [{"role": "user", "content": "Hello there"}]
TOKENS = 8


def build(family: str, tiny_chat: Path, out: Path) -> Path:
    tok = AutoTokenizer.from_pretrained(tiny_chat)
    tok.save_pretrained(out)
    config_class, extra = CONFIGS[family]
    config = config_class(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def families(tiny_chat, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("families")
    return {family: build(family, tiny_chat, folder / family) for family in CONFIGS}


@pytest.fixture(scope="module")
def server(families, tmp_path_factory):
    s = start_server(write_config(tmp_path_factory.mktemp("families-server"),
                                  {name: ("chat", path) for name, path in families.items()}))
    yield s
    s.stop()


LOGPROB_ATOL = 1e-4  # fp32 on both sides; the engine's batched step and generate's differ in summation order


def reference(path: Path) -> tuple[str, list[float]]:
    """transformers' greedy answer (its text, without a last character cut in half, which the
    engine holds back at a length stop as vLLM's detokenizer does) and each token's log probability."""
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    ids = out.sequences[0][prompt["input_ids"].shape[1]:]
    logprobs = [torch.log_softmax(step[0].float(), -1)[i].item() for step, i in zip(out.logits, ids)]
    return tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd"), logprobs


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_chat_matches_transformers_generate(server, families, family):
    c = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=120)
    whole = c.chat.completions.create(model=family, messages=MESSAGES, max_tokens=TOKENS, temperature=0, logprobs=True)
    streamed = c.chat.completions.create(model=family, messages=MESSAGES, max_tokens=TOKENS, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    expected, logprobs = reference(families[family])
    assert whole.choices[0].message.content == text == expected
    assert whole.usage.completion_tokens == len(logprobs)
    got = [entry.logprob for entry in whole.choices[0].logprobs.content]
    assert got == pytest.approx(logprobs, abs=LOGPROB_ATOL)
