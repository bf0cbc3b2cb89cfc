"""Text-to-image: a diffusers pipeline loaded from its folder, one denoising step per work step.

The pipeline's modules (UNet, VAE, text encoder) are shared by all calls, but each call gets its
own pipeline object with a fresh scheduler: diffusers schedulers, and the pipeline object itself
(``_guidance_scale``, ``_num_timesteps``, ...), hold per-call state, so two calls on one object
from two threads would corrupt each other.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import DiffusionPipeline

from workers.base import ModelSpec, StepContext


@dataclass
class ImageRequest:
    """One ``/v1/images/generations`` call. ``width``/``height`` None = the model's native size."""

    prompt: str
    n: int = 1
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    negative_prompt: str | None = None
    num_inference_steps: int = 25
    guidance_scale: float = 7.0


class ImageWorker:
    """Runs one diffusers text-to-image pipeline."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.pipe: DiffusionPipeline | None = None

    def load(self, device: torch.device) -> None:
        """Load the pipeline from ``spec.path`` onto ``device`` (fp16 on CUDA, fp32 elsewhere)."""
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        pipe = DiffusionPipeline.from_pretrained(self.spec.path, dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe.to(device)

    def unload(self) -> None:
        self.pipe = None

    def modules(self) -> list[torch.nn.Module]:
        if self.pipe is None:
            return []
        return [c for c in self.pipe.components.values() if isinstance(c, torch.nn.Module)]

    def generate(self, req: ImageRequest, ctx: StepContext) -> list[bytes]:
        """Generate ``req.n`` PNG images; ``ctx.boundary()`` runs after every denoising step.

        Image ``i`` uses the seed ``req.seed + i``, so a seed gives the same images whatever ``n`` is.
        """
        if self.pipe is None:
            raise RuntimeError(f"model {self.spec.name!r} is not loaded")
        if req.n < 1:
            raise ValueError("n must be at least 1")
        for side in (req.width, req.height):
            if side is not None and (side <= 0 or side % 8):
                raise ValueError(f"image sides must be positive multiples of 8, got {side}")
        seed = req.seed if req.seed is not None else int(torch.seed() % 2**31)
        generators = [torch.Generator("cpu").manual_seed(seed + i) for i in range(req.n)]

        def on_step_end(pipe: DiffusionPipeline, step: int, timestep: int, kwargs: dict) -> dict:
            ctx.boundary()
            return kwargs

        with torch.inference_mode():
            out = self._call_pipeline()(
                prompt=[req.prompt] * req.n,
                negative_prompt=[req.negative_prompt] * req.n if req.negative_prompt else None,
                width=req.width,
                height=req.height,
                num_inference_steps=req.num_inference_steps,
                guidance_scale=req.guidance_scale,
                generator=generators,
                callback_on_step_end=on_step_end,
                output_type="pil",
            )
        return [_png(img) for img in out.images]

    def _call_pipeline(self) -> DiffusionPipeline:
        """A pipeline object for one call: the shared modules and a fresh scheduler."""
        pipe = self.pipe
        _, optional = pipe._get_signature_keys(pipe)
        options = {k: pipe.config[k] for k in optional if k in pipe.config}
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        fresh = type(pipe)(**{**pipe.components, "scheduler": scheduler}, **options)
        fresh.set_progress_bar_config(disable=True)
        return fresh


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def build_demo(out_dir: Path, seed: int = 0) -> Path:
    """Save a tiny random-weight StableDiffusionPipeline (native size 64x64) to ``out_dir``."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

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
