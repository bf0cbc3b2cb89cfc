"""The image endpoints on the pipeline families people serve, each built tiny offline from configs as
diffusers' own tests build them: Flux (a transformer on packed latents, CLIP and T5 encoders, flow
matching), Stable Diffusion XL (two CLIP encoders, a UNet with time conditioning) and Stable
Diffusion 3 (a joint transformer, three encoders). Generations, streamed previews (Flux's latents
unpacked before the VAE), edits with and without a mask and variations on each, and a Flux
transformer LoRA (merged as diffusers fuses it), through the openai SDK."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from tests.helpers import start_server, write_config


def _clip(tokenizer, with_projection: bool = False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def _t5(tokenizer):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4))


def _vae(latent_channels: int, flow: bool):
    """An 8x VAE; a flow-matching pipeline's (Flux, SD3) has their shift and scale and no quant convs."""
    from diffusers import AutoencoderKL

    flow_only = dict(use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 8, 8, 8),
                         down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4, sample_size=64,
                         **(flow_only if flow else {}))


def build_tiny_flux(out: Path) -> Path:
    """FluxPipeline: 1+1 transformer blocks on 4 latent channels (16 packed). Every tokenizer is the
    demo's byte-level CLIP one (a T5 encoder needs only ids)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from demo.image import _clip_tokenizer

    torch.manual_seed(0)
    tok = _clip_tokenizer()
    FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae(4, flow=True), text_encoder=_clip(tok), tokenizer=tok,
        text_encoder_2=_t5(tok), tokenizer_2=_clip_tokenizer(),
        transformer=FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                           pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]),
    ).save_pretrained(out)
    return out


def build_tiny_sdxl(out: Path) -> Path:
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    from demo.image import _clip_tokenizer

    torch.manual_seed(0)
    tok = _clip_tokenizer()
    unet = UNet2DConditionModel(block_out_channels=(16, 32), layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
                                use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                                transformer_layers_per_block=(1, 1), projection_class_embeddings_input_dim=80,
                                cross_attention_dim=64, norm_num_groups=4)
    StableDiffusionXLPipeline(
        vae=_vae(4, flow=False), text_encoder=_clip(tok), text_encoder_2=_clip(tok, with_projection=True),
        tokenizer=tok, tokenizer_2=_clip_tokenizer(), unet=unet,
        scheduler=EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                         steps_offset=1),
    ).save_pretrained(out)
    return out


def build_tiny_sd3(out: Path) -> Path:
    """StableDiffusion3Pipeline on 16 latent channels (as SD3's own: its inpainting needs them)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    from demo.image import _clip_tokenizer

    torch.manual_seed(0)
    tok = _clip_tokenizer()
    StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_vae(16, flow=True),
        text_encoder=_clip(tok, with_projection=True), tokenizer=tok,
        text_encoder_2=_clip(tok, with_projection=True), tokenizer_2=_clip_tokenizer(),
        text_encoder_3=_t5(tok), tokenizer_3=_clip_tokenizer(),
        transformer=SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=16, out_channels=16, num_layers=1,
                                          attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                                          joint_attention_dim=32, pooled_projection_dim=64),
    ).save_pretrained(out)
    return out


PIPELINES = {"tiny-flux": build_tiny_flux, "tiny-sdxl": build_tiny_sdxl, "tiny-sd3": build_tiny_sd3}


# Linear layers of both kinds of Flux block: the joint blocks' image and text attention, the single
# blocks' MLP and output projection
FLUX_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "proj_mlp", "proj_out"]


def save_flux_lora(flux: Path, folder: Path, seed: int = 3) -> Path:
    """A transformer LoRA written by diffusers' FluxPipeline.save_lora_weights (its peft metadata
    too), with random non-zero B factors."""
    import peft
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from peft.utils import get_peft_model_state_dict

    trained = FluxTransformer2DModel.from_pretrained(flux / "transformer")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=FLUX_TARGETS)
    trained.add_adapter(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    FluxPipeline.save_lora_weights(str(folder), transformer_lora_layers=get_peft_model_state_dict(trained),
                                   transformer_lora_adapter_metadata=config.to_dict())
    return folder


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pipelines")
    return {name: build(folder / name) for name, build in PIPELINES.items()}


@pytest.fixture(scope="module")
def flux(pipelines) -> Path:
    return pipelines["tiny-flux"]


@pytest.fixture(scope="module")
def flux_lora(flux, tmp_path_factory) -> Path:
    return save_flux_lora(flux, tmp_path_factory.mktemp("flux-lora"))


@pytest.fixture(scope="module")
def server(pipelines, flux_lora, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipelines-server")
    adapters = f"adapters:\n  - {{name: flux-style, model: tiny-flux, path: {flux_lora}}}\n"
    s = start_server(write_config(folder, {name: ("image", path) for name, path in pipelines.items()}, adapters))
    yield s
    s.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=120)


def png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


STEPS = {"num_inference_steps": 4, "seed": 7}


@pytest.mark.parametrize("model", list(PIPELINES))
def test_generations_streamed_with_previews_end_in_the_unstreamed_image(server, model):
    c = client(server)
    whole = c.images.generate(model=model, prompt="a cat", size="64x32", response_format="b64_json",
                              extra_body=STEPS)
    assert png(whole.data[0].b64_json).size == (64, 32)
    events = list(c.images.generate(model=model, prompt="a cat", size="64x32", stream=True, partial_images=2,
                                    extra_body=STEPS))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    previews = [png(e.b64_json) for e in events[:2]]
    assert all(p.size == (64, 32) for p in previews)
    assert not np.array_equal(np.asarray(previews[0]), np.asarray(previews[1]))  # two steps apart
    assert events[-1].b64_json == whole.data[0].b64_json  # the same seed: the same bytes


def test_unpacking_is_the_inverse_of_the_pipeline_s_packing():
    """``_unpacked`` gives back the image-shaped latents the pipeline packed, for a wide image
    (width and height not swapped), and None for latents packed for another size."""
    from diffusers import FluxPipeline

    from workers.image import _unpacked

    class Pipe:  # what _unpacked reads of a Flux pipeline
        vae_scale_factor = 8
        default_sample_size = 4
        _unpack_latents = staticmethod(FluxPipeline._unpack_latents)

    latents = torch.randn(2, 4, 4, 8)  # a 64x32 image's (width 64: 8 latent columns)
    packed = FluxPipeline._pack_latents(latents, 2, 4, 4, 8)
    assert torch.equal(_unpacked(Pipe, packed, (64, 32)), latents)
    assert _unpacked(Pipe, packed, (64, 64)) is None
    square = FluxPipeline._pack_latents(torch.randn(1, 4, 4, 4), 1, 4, 4, 4)
    assert _unpacked(Pipe, square, None).shape == (1, 4, 4, 4)  # the default size: 4 x 8 pixels a side


@pytest.mark.parametrize("model", list(PIPELINES))
def test_an_edit_keeps_what_the_mask_keeps_and_variations_keep_the_size(server, model):
    c = client(server)
    source = Image.new("RGB", (64, 64), (200, 30, 30))
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 32, 32))  # repaint the top-left quarter
    files = {}
    for name, image in (("image", source), ("mask", mask)):
        buf = io.BytesIO()
        image.save(buf, "PNG")
        files[name] = (f"{name}.png", buf.getvalue(), "image/png")
    edited = c.images.edit(model=model, prompt="a dog", response_format="b64_json", extra_body=STEPS, **files)
    pixels = np.asarray(png(edited.data[0].b64_json).convert("RGB"))
    assert (pixels[32:, :] == (200, 30, 30)).all() and (pixels[:, 32:] == (200, 30, 30)).all()
    assert not (pixels[:32, :32] == (200, 30, 30)).all()  # repainted
    streamed = list(c.images.edit(model=model, prompt="a dog", stream=True, partial_images=1,
                                  extra_body=STEPS, **files))
    assert [e.type for e in streamed] == ["image_edit.partial_image", "image_edit.completed"]
    assert streamed[-1].b64_json == edited.data[0].b64_json
    varied = c.images.create_variation(model=model, image=files["image"], response_format="b64_json",
                                       extra_body=STEPS)
    assert png(varied.data[0].b64_json).size == (64, 64)


def test_a_flux_lora_merges_as_diffusers_fuses_it(flux, flux_lora):
    """tiergate's merge of a transformer LoRA (lora_kernels, as the image worker merges it) gives the
    weights diffusers' own load_lora_adapter + fuse_lora gives, within fp32 rounding (1e-6), on every
    targeted layer of both block kinds."""
    from diffusers import FluxTransformer2DModel

    from lora_kernels import AdapterStack, load_diffusers_lora

    adapter = load_diffusers_lora(flux_lora, component="transformer")
    assert {m.scale for m in adapter.modules.values()} == {8 / 4}
    assert {name.rsplit(".", 1)[-1] for name in adapter.modules} >= {"to_q", "add_q_proj", "proj_mlp", "proj_out"}
    ours = FluxTransformer2DModel.from_pretrained(flux / "transformer")
    base = {k: v.clone() for k, v in ours.state_dict().items()}
    AdapterStack(ours).apply([(adapter, 1.0)])
    fused = FluxTransformer2DModel.from_pretrained(flux / "transformer")
    fused.load_lora_adapter(str(flux_lora), weight_name="pytorch_lora_weights.safetensors", prefix="transformer")
    fused.fuse_lora()
    fused.unload_lora()
    expected, got = fused.state_dict(), ours.state_dict()
    assert set(expected) == set(got)
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) <= 1e-6
    changed = [k for k in got if not torch.equal(got[k], base[k])]
    assert len(changed) == len(adapter.modules)  # each targeted layer's weight, and nothing else


def test_a_flux_lora_by_name_changes_the_image_and_the_base_comes_back(server):
    c = client(server)
    ask = dict(model="tiny-flux", prompt="a cat", size="32x32", response_format="b64_json")
    base = c.images.generate(**ask, extra_body=STEPS).data[0].b64_json
    styled = c.images.generate(**ask, extra_body={**STEPS, "adapters": [{"name": "flux-style"}]}).data[0].b64_json
    assert styled != base
    assert c.images.generate(**ask, extra_body=STEPS).data[0].b64_json == base
