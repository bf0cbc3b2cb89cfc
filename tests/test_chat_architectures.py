"""The transformers chat engine on the decoder families people serve besides the demo's Llama: each
built tiny offline from its config (random weights, the demo's tokenizer and chat template), its
greedy chat answer through the openai SDK, whole and streamed, checked against transformers' own
``generate`` on the same model: the same text, and each token's log probability within 1e-4; and
with a peft LoRA on every linear layer, against peft's merged model."""

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


def save_adapter(base: Path, out: Path) -> Path:
    """A peft LoRA on every linear layer of ``base`` (Phi-3's fused qkv and gate_up among them),
    its B factors random so that it changes the answer."""
    import peft

    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(families, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("family-adapters")
    return {family: save_adapter(path, folder / family) for family, path in families.items()}


@pytest.fixture(scope="module")
def server(families, adapters, tmp_path_factory):
    listed = "adapters:\n" + "".join(f"  - {{name: {f}-lora, model: {f}, path: {path}}}\n" for f, path in adapters.items())
    s = start_server(write_config(tmp_path_factory.mktemp("families-server"),
                                  {name: ("chat", path) for name, path in families.items()}, listed))
    yield s
    s.stop()


LOGPROB_ATOL = 1e-4  # fp32 on both sides; the engine's batched step and generate's differ in summation order


def reference_ids(path: Path, tokens: int) -> list[int]:
    """transformers' greedy answer as token ids."""
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return model.generate(**prompt, max_new_tokens=tokens, do_sample=False)[0][prompt["input_ids"].shape[1]:].tolist()


def reference(path: Path, adapter: Path | None = None, tokens: int = TOKENS,
              messages: list[dict] = MESSAGES) -> tuple[str, list[float]]:
    """transformers' greedy answer (its text, without a last character cut in half, which the
    engine holds back at a length stop as vLLM's detokenizer does) and each token's log probability;
    with ``adapter``, of the model peft merged it into."""
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=tokens, do_sample=False, output_logits=True,
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


TOGETHER = ["Hello there", "Tell me about the sea and its ships", "Hi"]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_prompts_prefilled_in_one_pass_answer_as_generate_answers_each(server, families, family):
    """Three prompts of different lengths admitted together are prefilled in one forward pass,
    left-padded to the longest, on each family's attention and cache (Gemma's sliding-window
    layers among them): each answer and its log probabilities are generate's for that prompt alone."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_chat_worker import AdmittedTogether

    c = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=120)
    c.chat.completions.create(model=family, messages=MESSAGES, max_tokens=1)  # loaded: its engine to hold
    worker = server.services.arbiter.workers[family]

    def ask(text: str):
        return c.chat.completions.create(model=family, messages=[{"role": "user", "content": text}],
                                         max_tokens=TOKENS, temperature=0, logprobs=True)

    with AdmittedTogether(worker, len(TOGETHER)) as passes, ThreadPoolExecutor(len(TOGETHER)) as pool:
        answers = list(pool.map(ask, TOGETHER))
    assert sorted(passes[0][1]) == sorted(TOGETHER) and passes[0][0] == "together"
    for text, got in zip(TOGETHER, answers):
        expected, logprobs = reference(families[family], messages=[{"role": "user", "content": text}])
        assert got.choices[0].message.content == expected
        assert [e.logprob for e in got.choices[0].logprobs.content] == pytest.approx(logprobs, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_lora_on_every_linear_layer_matches_peft_merged(server, families, adapters, family):
    c = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=120)
    styled = c.chat.completions.create(model=family, messages=MESSAGES, max_tokens=TOKENS, temperature=0, logprobs=True,
                                       extra_body={"adapters": [{"name": f"{family}-lora"}]})
    expected, logprobs = reference(families[family], adapters[family])
    assert styled.choices[0].message.content == expected
    assert [e.logprob for e in styled.choices[0].logprobs.content] == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    assert reference(families[family])[1] != pytest.approx(logprobs, abs=LOGPROB_ATOL)  # the adapter changes it


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_prediction_checked_in_the_prefill_leaves_the_answer_as_generate_gives_it(server, families, family):
    """Predicted Outputs on each family's cache (Gemma's sliding-window layers among them): the
    prediction, the reference answer with its second half changed, is checked in the prefill's one
    pass and cut back where the answer leaves it; the answer and its log probabilities stay
    generate's."""
    c = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=120)
    expected, logprobs = reference(families[family])
    prediction = expected[: len(expected) // 2] + "#~#~#~"
    got = c.chat.completions.create(model=family, messages=MESSAGES, max_tokens=TOKENS, temperature=0, logprobs=True,
                                    prediction={"type": "content", "content": prediction})
    assert got.choices[0].message.content == expected
    assert [e.logprob for e in got.choices[0].logprobs.content] == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    details = got.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0


RESYNC_TOKENS = 24


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_prediction_picked_up_again_after_an_edit_leaves_the_answer_as_generate_gives_it(server, families, family):
    """The re-sync on each family's cache: the prediction is generate's own tokens with one token
    changed in the middle (set as tokens on the engine, since these random models write words in
    other pieces than their tokenizers make of the text). The prefill's check keeps the tokens
    before the change; three tokens after it, the reply is a run of the prediction again and the
    rest is checked in one pass of the row's own (its cache taken out of the batch, cut, merged
    back). The answer and its log probabilities stay generate's."""
    c = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=120)
    expected, logprobs = reference(families[family], tokens=RESYNC_TOKENS)
    ids = reference_ids(families[family], RESYNC_TOKENS)
    c.chat.completions.create(model=family, messages=MESSAGES, max_tokens=1)  # loaded: its engine to set
    worker = server.services.arbiter.workers[family]
    edit = len(ids) // 3
    other = next(t for t in range(100, 10_000) if t not in ids)
    draft = [*ids[:edit], other, *ids[edit + 1:]][: RESYNC_TOKENS - 1]
    checks = worker.checks
    worker._draft = lambda req, prompt_len: list(draft)
    try:
        got = c.chat.completions.create(model=family, messages=MESSAGES, max_tokens=RESYNC_TOKENS, temperature=0,
                                        logprobs=True, prediction={"type": "content", "content": "(set on the engine)"})
    finally:
        del worker._draft
    assert got.choices[0].message.content == expected
    assert [e.logprob for e in got.choices[0].logprobs.content] == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    details = got.usage.completion_tokens_details
    assert worker.checks > checks  # a re-sync pass ran
    assert details.accepted_prediction_tokens > edit  # more than the prefill's check kept
