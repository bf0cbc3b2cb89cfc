"""``tiny-chat``: a 2-layer Llama with a byte-level BPE tokenizer and a chat template, and peft LoRA
adapters for it, built offline from a seed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from demo.lora import linear_shapes, random_lora

# Hermes/Qwen style: tools listed in the system turn, calls as <tool_call>{"name": ..., "arguments":
# ...}</tool_call> (the format tiers.yaml's default tool_parser, hermes, reads), results in a
# <tool_response> turn. Without tools a conversation renders as <|role|>content</s> per message.
_CHAT_TEMPLATE = (
    "{%- set first_system = messages and messages[0]['role'] == 'system' %}"
    "{%- if tools %}<|system|>{% if first_system %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "<tools>{% for t in tools %}{{ '\\n' }}{{ t['function'] | tojson }}{% endfor %}{{ '\\n' }}</tools></s>"
    "{%- elif first_system %}<|system|>{{ messages[0]['content'] }}</s>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first %}"
    "{%- elif m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}</tool_response></s>"
    "{%- elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] or '' }}"
    "{%- for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": {{ c['function']['name'] | tojson }}, "
    "\"arguments\": {% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}}</tool_call>{% endfor %}</s>"
    "{%- else %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # added, not special: decoded text keeps them

_CORPUS = [
    "tiergate serves chat, images, speech and transcription on one shared GPU.",
    "Paid requests come first, then subscribers, then free traffic; batch work waits for idle time.",
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today?",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "A small model with random weights says random things, and that is fine for a demo.",
    # JSON schemas and tool calls, so that tools and structured outputs take few tokens
    '{"type": "object", "properties": {"name": {"title": "Name", "type": "string"}}, "required": ["name"]}',
    '{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}, {"enum": ["a", "b"], "type": "array"}',
    '{"name": "get_weather", "description": "A function.", "parameters": {"additionalProperties": false}}',
    '<tool_call>{"name": "f", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>',
] * 20


# The output layer at 8x the init's 0.02 std. At 0.02 the final norm's unit-scale state can reach a
# logit of at most ~1.3 (|h| = 8 times a row's norm 0.16), so no LoRA (which leaves lm_head alone, as
# peft's "all-linear" does) could take the loss below ~5.1 of uniform's 6.34: a fine-tuned reply was
# the argmax of a near-flat distribution, and one seed in ten stuttered "Arrr, matey!". At 8x a
# LoRA takes the demo's answer to a loss under 0.2 in 50 steps (README, "Fine-tuning").
LM_HEAD_SCALE = 8.0


def build_demo(out_dir: Path, seed: int = 0) -> Path:
    """Build ``tiny-chat``: a 2-layer Llama with a byte-level BPE tokenizer, offline, from a seed.
    head_dim is 32 because vLLM's CPU attention has no kernel for smaller heads."""
    from transformers import LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast = build_tokenizer()
    fast.save_pretrained(out_dir)

    torch.manual_seed(seed)
    model = LlamaForCausalLM(text_config(fast))
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.save_pretrained(out_dir)
    return out_dir


def build_tokenizer(chat_template: str = _CHAT_TEMPLATE):
    """tiny-chat's tokenizer: byte-level BPE trained on a small corpus, with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=specials[3:],
    )
    fast.add_tokens(_TOOL_TOKENS)
    fast.chat_template = chat_template
    return fast


def text_config(tokenizer):
    """tiny-chat's Llama configuration for ``tokenizer``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )



_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_demo_adapter(base_dir: Path, out_dir: Path, seed: int, rank: int = 4) -> Path:
    """A peft LoRA folder for ``tiny-chat`` (every attention and MLP projection, ``lora_alpha = r``)
    with random non-zero factors from ``seed``; shapes read from the model's checkpoint."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    shapes = linear_shapes(sorted(Path(base_dir).glob("*.safetensors")), _LORA_TARGETS)
    tensors = {}
    for module, (down, up) in random_lora(shapes, rank, seed, b_std=0.1).items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = down
        tensors[f"base_model.model.{module}.lora_B.weight"] = up
    out_dir = Path(out_dir)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(_LORA_TARGETS), task_type="CAUSAL_LM",
                        base_model_name_or_path=Path(base_dir).name)
    config.save_pretrained(str(out_dir))
    _sort_target_modules(out_dir / "adapter_config.json")  # peft writes a set: order varies per process
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _sort_target_modules(config_file: Path) -> None:
    config = json.loads(config_file.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_sure_turn_judge(base_dir: Path, out_dir: Path) -> Path:
    """``tiny-chat`` (at ``base_dir``) with weights set so that it is sure every user message has
    ended: a judge for checking and timing ``semantic_vad``'s shortest wait (gateway.turn_end;
    tests/test_realtime.py, scripts/bench_turns.py), not a model to chat with. The layers add
    nothing to the residual stream, every token's embedding has a positive first dimension, the
    final norm keeps only that dimension, and the LM head maps it to ``</s>`` (the end of a
    message in tiny-chat's template) alone. Saved with ``save_pretrained``, the tokenizer beside it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    end = tok.convert_tokens_to_ids("</s>")
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 4.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[end, 0] = 50.0
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
