"""``tiny-image``: a tiny random-weight Stable Diffusion pipeline (native size 64x64), and a diffusers
LoRA for its UNet, built offline from a seed."""

from __future__ import annotations

from pathlib import Path

import torch

from demo.lora import linear_shapes, random_lora


def build_demo(out_dir: Path, seed: int = 0) -> Path:
    """Save a tiny random-weight StableDiffusionPipeline (native size 64x64) to ``out_dir``."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
        norm_num_groups=4,
    )
    vae = AutoencoderKL(  # four blocks: 8x down-sampling like the real model
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=64,
    )
    tokenizer = _clip_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir)
    return out_dir


def _clip_tokenizer():
    """A byte-level CLIP BPE tokenizer: every byte, every byte ending a word, and a few merges."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    merges = [("t", "h"), ("th", "e</w>"), ("a", "t</w>"), ("c", "at</w>")]
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def build_demo_adapter(base_dir: Path, out_dir: Path, seed: int, rank: int = 4) -> Path:
    """A diffusers LoRA (``pytorch_lora_weights.safetensors``, written by diffusers'
    ``save_lora_weights`` with its peft metadata) for ``tiny-image``'s UNet attention projections,
    with random non-zero factors from ``seed``; shapes read from the UNet's checkpoint."""
    from diffusers import StableDiffusionPipeline

    shapes = linear_shapes(sorted((Path(base_dir) / "unet").glob("*.safetensors")), _LORA_TARGETS)
    layers = {}
    for module, (down, up) in random_lora(shapes, rank, seed, b_std=0.3).items():
        layers[f"{module}.lora_A.weight"] = down
        layers[f"{module}.lora_B.weight"] = up
    metadata = {"r": rank, "lora_alpha": rank, "target_modules": list(_LORA_TARGETS)}
    StableDiffusionPipeline.save_lora_weights(str(out_dir), unet_lora_layers=layers,
                                              unet_lora_adapter_metadata=metadata)
    return Path(out_dir)
