"""``tiny-vlm``: a LLaVA (a 2-layer CLIP vision tower on 32-pixel images, patch 8, projected into
tiny-chat's Llama) with tiny-chat's tokenizer plus an ``<image>`` token, saved with its
``LlavaProcessor``, built offline from a seed. Its chat template is tiny-chat's (tools included),
and renders a message's content parts: text as itself, an image part as ``<image>``, which the
processor expands to the vision tower's 16 patch tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from demo.chat import _CHAT_TEMPLATE, build_tokenizer, text_config

IMAGE_TOKEN = "<image>"
IMAGE_SIDE = 32  # pixels: the vision tower's input, after resizing and a centre crop
PATCH = 8  # so 16 image tokens per image (the CLS token is left out: vision_feature_select_strategy "default")

_PARTS = ("{%- macro parts(c) %}{% if c is string %}{{ c }}{% else %}{% for p in c %}"
          "{% if p['type'] == 'image' %}" + IMAGE_TOKEN + "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
          "{% endfor %}{% endif %}{% endmacro %}")
CHAT_TEMPLATE = _PARTS + (_CHAT_TEMPLATE.replace("{{ messages[0]['content'] }}", "{{ parts(messages[0]['content']) }}")
                          .replace("{{ m['content'] or '' }}", "{{ parts(m['content'] or '') }}")
                          .replace("{{ m['content'] }}", "{{ parts(m['content']) }}"))


def build_demo(out_dir: Path, seed: int = 0) -> Path:
    import transformers
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    # the PIL backend by name where transformers has one (torchvision does not load beside CPU torch); the
    # saved config names CLIPImageProcessor either way
    CLIPImageProcessorPil = getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(CHAT_TEMPLATE)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIDE, patch_size=PATCH, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text_config(tokenizer),
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_layer=-1, vision_feature_select_strategy="default")
    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIDE},
                                   crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                               vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                               num_additional_image_tokens=1)
    processor.save_pretrained(out_dir)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir)
    return out_dir
