"""Adapter files and the merge manager against peft's and diffusers' own merges, on tiny random
models built offline.

Stated bound: merged fp32 weights within 1e-6 (absolute) of peft's ``merge_and_unload`` /
diffusers' ``fuse_lora`` (both sides do an fp32 GEMM and one add; only the summation order differs;
weights here are O(0.1)), model outputs within 1e-4. Restore is checked bit for bit.

These hold on any CPU: the bounds hold for any summation order, and every bit-for-bit check
compares a weight with a copy of itself (restore) or with the same merge of the same data.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_kernels import (
    AdapterFormatError,
    AdapterRefused,
    AdapterStack,
    LoraAdapter,
    LoraModule,
    concat_stack,
    load_diffusers_lora,
    load_peft_adapter,
    save_stack_as_peft,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

WEIGHT_ATOL = 1e-6
OUTPUT_ATOL = 1e-4
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _randomise_b(model: torch.nn.Module, seed: int) -> None:
    """peft initialises lora_B to zero (a no-op adapter): make every B random and non-zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def make_peft_adapter(base, folder: Path, seed: int = 0, **config) -> Path:
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**config))
    _randomise_b(model, seed)
    model.save_pretrained(str(folder))
    return folder


def assert_same_weights(expected: torch.nn.Module, actual: torch.nn.Module, atol: float = WEIGHT_ATOL) -> None:
    e, a = expected.state_dict(), actual.state_dict()
    assert set(e) == set(a)
    worst = max((e[k].double() - a[k].double()).abs().max().item() for k in e)
    assert worst <= atol, worst


@pytest.fixture(scope="module")
def llama():
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))


def peft_merged(base, *folders_weights, combine: bool = False):
    """peft's own merge: one adapter, or add_weighted_adapter(combination_type="cat")."""
    folders = [f for f, _ in folders_weights]
    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(folders[0]), adapter_name="a0")
    for i, f in enumerate(folders[1:], 1):
        model.load_adapter(str(f), adapter_name=f"a{i}")
    if combine:
        names = [f"a{i}" for i in range(len(folders))]
        model.add_weighted_adapter(names, [w for _, w in folders_weights], "mix", combination_type="cat")
        model.set_adapter("mix")
        return model.merge_and_unload(adapter_names=["mix"])
    return model.merge_and_unload()


def ours_merged(base, *adapters_weights):
    model = copy.deepcopy(base)
    AdapterStack(model).apply(list(adapters_weights))
    return model


# ---------------------------------------------------------------- peft folders


@pytest.mark.parametrize(
    "config",
    [
        dict(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS),
        dict(r=8, lora_alpha=4, use_rslora=True, target_modules=LLAMA_TARGETS),
        dict(r=4, lora_alpha=6, target_modules=LLAMA_TARGETS, rank_pattern={"v_proj": 2}, alpha_pattern={"q_proj": 3}),
    ],
    ids=["plain", "rslora", "rank_alpha_pattern"],
)
def test_peft_adapter_matches_merge_and_unload(llama, ids, tmp_path, config):
    folder = make_peft_adapter(llama, tmp_path / "a", **config)
    adapter = load_peft_adapter(folder)
    expected = peft_merged(llama, (folder, 1.0))
    ours = ours_merged(llama, (adapter, 1.0))
    assert_same_weights(expected, ours)
    torch.testing.assert_close(ours(ids).logits, expected(ids).logits, rtol=0, atol=OUTPUT_ATOL)
    assert not torch.equal(ours(ids).logits, llama(ids).logits)  # the adapter did something


def test_peft_scales(llama, tmp_path):
    rs = load_peft_adapter(make_peft_adapter(llama, tmp_path / "rs", r=8, lora_alpha=4, use_rslora=True,
                                             target_modules=["q_proj"]))
    assert {m.scale for m in rs.modules.values()} == {4 / 8**0.5}
    pat = load_peft_adapter(make_peft_adapter(llama, tmp_path / "p", r=4, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                                              rank_pattern={"v_proj": 2}, alpha_pattern={"q_proj": 3}))
    q, v = pat.modules["model.layers.0.self_attn.q_proj"], pat.modules["model.layers.0.self_attn.v_proj"]
    assert (q.rank, q.scale, v.rank, v.scale) == (4, 3 / 4, 2, 6 / 2)


def test_target_modules_only_touch_targets(llama, tmp_path):
    folder = make_peft_adapter(llama, tmp_path / "t", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    adapter = load_peft_adapter(folder)
    assert {k.rsplit(".", 1)[1] for k in adapter.modules} == {"q_proj", "v_proj"}
    ours = ours_merged(llama, (adapter, 1.0))
    assert_same_weights(peft_merged(llama, (folder, 1.0)), ours)
    base_sd, ours_sd = llama.state_dict(), ours.state_dict()
    changed = {k for k in base_sd if not torch.equal(base_sd[k], ours_sd[k])}
    assert changed == {f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "v_proj")}
    # a file holding modules its own target_modules does not name is refused
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterFormatError, match="not in target_modules"):
        load_peft_adapter(folder)


def test_gpt2_conv1d_fan_in_fan_out(tmp_path):
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    gpt2 = transformers.GPT2LMHeadModel(cfg).eval()
    folder = make_peft_adapter(gpt2, tmp_path / "g", r=4, lora_alpha=16, fan_in_fan_out=True,
                               target_modules=["c_attn", "c_proj", "c_fc"])
    adapter = load_peft_adapter(folder)
    assert adapter.fan_in_fan_out
    ours = ours_merged(gpt2, (adapter, 1.0))
    expected = peft_merged(gpt2, (folder, 1.0))
    assert_same_weights(expected, ours)
    x = torch.randint(0, 100, (2, 10))
    torch.testing.assert_close(ours(x).logits, expected(x).logits, rtol=0, atol=OUTPUT_ATOL)


def test_weighted_stack_equals_add_weighted_adapter_cat(llama, ids, tmp_path):
    fa = make_peft_adapter(llama, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules=LLAMA_TARGETS)
    fb = make_peft_adapter(llama, tmp_path / "b", seed=2, r=8, lora_alpha=4, target_modules=LLAMA_TARGETS)
    a, b = load_peft_adapter(fa), load_peft_adapter(fb)
    expected = peft_merged(llama, (fa, 0.7), (fb, -0.3), combine=True)
    ours = ours_merged(llama, (a, 0.7), (b, -0.3))
    assert_same_weights(expected, ours)
    torch.testing.assert_close(ours(ids).logits, expected(ids).logits, rtol=0, atol=OUTPUT_ATOL)


def test_save_stack_as_peft_is_one_adapter_of_summed_rank(llama, tmp_path):
    fa = make_peft_adapter(llama, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules=LLAMA_TARGETS)
    fb = make_peft_adapter(llama, tmp_path / "b", seed=2, r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    stack = [(load_peft_adapter(fa), 0.7), (load_peft_adapter(fb), -0.3)]
    out = save_stack_as_peft(stack, tmp_path / "mix")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 12  # q/v: 4 + 8; the others zero padded from 4
    ours = ours_merged(llama, *stack)
    assert_same_weights(peft_merged(llama, (out, 1.0)), ours)  # peft reads it as a plain adapter
    mix = load_peft_adapter(out)
    assert_same_weights(ours_merged(llama, (mix, 1.0)), ours)
    b_cat, a_cat = concat_stack(stack)["model.layers.1.self_attn.q_proj"]
    assert b_cat.shape == (64, 12) and a_cat.shape == (12, 64)


def test_adapter_keys_map_onto_a_differently_wrapped_model(llama, tmp_path):
    adapter = load_peft_adapter(make_peft_adapter(llama, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"]))
    inner = copy.deepcopy(llama.model)  # LlamaModel: names lack the "model." of the adapter keys
    AdapterStack(inner).apply([(adapter, 1.0)])
    ours = ours_merged(llama, (adapter, 1.0))
    assert torch.equal(inner.layers[1].self_attn.q_proj.weight, ours.model.layers[1].self_attn.q_proj.weight)
    stray = LoraAdapter("stray", {"model.layers.9.self_attn.q_proj": adapter.modules["model.layers.0.self_attn.q_proj"]})
    with pytest.raises(KeyError, match="stray"):
        AdapterStack(copy.deepcopy(llama)).apply([(stray, 1.0)])


# ---------------------------------------------------------------- merge manager


@pytest.mark.parametrize("offload", [False, True], ids=["pristine_beside", "pristine_offloaded"])
def test_restore_is_bit_exact_ten_times(llama, tmp_path, offload):
    fa = make_peft_adapter(llama, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules=LLAMA_TARGETS)
    fb = make_peft_adapter(llama, tmp_path / "b", seed=2, r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    a, b = load_peft_adapter(fa), load_peft_adapter(fb)
    model = copy.deepcopy(llama)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    stack = AdapterStack(model, offload=offload)
    for i in range(10):
        stack.apply([(a, 0.5 + i), (b, -1.0)])
        assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, original["model.layers.0.self_attn.q_proj.weight"])
        stack.restore()
        assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())
    assert stack.merged is None


@pytest.mark.parametrize("offload", [False, True], ids=["pristine_beside", "pristine_offloaded"])
def test_switching_stacks_recomputes_from_pristine(llama, tmp_path, offload):
    fa = make_peft_adapter(llama, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules=LLAMA_TARGETS)
    fb = make_peft_adapter(llama, tmp_path / "b", seed=2, r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    a, b = load_peft_adapter(fa), load_peft_adapter(fb)
    model = copy.deepcopy(llama)
    with AdapterStack(model, offload=offload) as stack:
        for _ in range(3):
            stack.apply([(a, 1.0)])
            stack.apply([(b, 0.5)])  # touches fewer modules: the others go back to pristine
        fresh = ours_merged(llama, (b, 0.5))
        assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, llama.state_dict()[k]) for k, v in model.state_dict().items())


def test_same_stack_twice_is_a_no_op(llama, tmp_path):
    adapter = load_peft_adapter(make_peft_adapter(llama, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"]))
    model = copy.deepcopy(llama)
    stack = AdapterStack(model).apply([(adapter, 0.5)])
    weight = model.model.layers[0].self_attn.q_proj.weight
    version, merged = weight._version, weight.clone()
    stack.apply([(adapter, 0.5)])
    assert weight._version == version and torch.equal(weight, merged)  # not even rewritten
    stack.apply([(adapter, 0.25)])
    assert weight._version > version  # a different weight is a different stack


def test_conv2d_and_unsupported_modules():
    conv = torch.nn.Sequential(torch.nn.Conv2d(6, 5, 3), torch.nn.Embedding(10, 4))
    g = torch.Generator().manual_seed(0)
    down, up = torch.randn(2, 6, 3, 3, generator=g), torch.randn(5, 2, 1, 1, generator=g)
    adapter = LoraAdapter("c", {"0": LoraModule(down, up, 0.5)})
    before = conv[0].weight.detach().clone()
    AdapterStack(conv).apply([(adapter, 1.0)])
    expected = before + 0.5 * torch.nn.functional.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3)
    torch.testing.assert_close(conv[0].weight.detach(), expected, rtol=0, atol=WEIGHT_ATOL)
    emb = LoraAdapter("e", {"1": LoraModule(torch.randn(2, 4), torch.randn(10, 2), 1.0)})
    with pytest.raises(TypeError, match="Embedding"):
        AdapterStack(conv).apply([(emb, 1.0)])


# ---------------------------------------------------------------- refusals


def test_dora_refused(llama, tmp_path):
    folder = make_peft_adapter(llama, tmp_path / "my-dora", r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"])
    with pytest.raises(AdapterRefused, match=r"'my-dora'.*DoRA"):
        load_peft_adapter(folder)
    # a DoRA file whose config was stripped is still caught by its magnitude tensors
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["use_dora"] = False
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterRefused, match="lora_magnitude_vector"):
        load_peft_adapter(folder)


@pytest.mark.parametrize(
    "edit, reason",
    [
        ({"peft_type": "LOHA"}, "not LORA"),
        ({"lora_bias": True}, "lora_bias"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"alora_invocation_tokens": [1, 2]}, "aLoRA"),
        ({"kasa_config": {"x": 1}}, "KaSA"),
    ],
)
def test_non_linear_variants_refused(llama, tmp_path, edit, reason):
    folder = make_peft_adapter(llama, tmp_path / "v", r=4, lora_alpha=8, target_modules=["q_proj"])
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(AdapterRefused, match=rf"'v'.*{reason}"):
        load_peft_adapter(folder)


@pytest.mark.parametrize("factor, value", [("lora_A", float("nan")), ("lora_B", float("inf")),
                                           ("lora_B", -float("inf"))])
def test_non_finite_factors_refused(llama, tmp_path, factor, value):
    """Factors holding NaN or inf (a diverged training run) are not an adapter: served, every reply
    of their stack was empty, and on vLLM other keys' base-model replies went wrong after it."""
    folder = make_peft_adapter(llama, tmp_path / "nan", r=4, lora_alpha=8, target_modules=["q_proj"])
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    key = next(k for k in tensors if factor in k)
    tensors[key][0, 0] = value
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterFormatError, match=r"'nan'.*not finite"):
        load_peft_adapter(folder)


def test_a_scale_that_folds_the_factors_to_inf_is_refused(llama, tmp_path):
    """Finite factors with a ``lora_alpha`` that makes ``scale * B`` overflow fp32 (the fold every
    merge, and vLLM, makes) are refused as well."""
    folder = make_peft_adapter(llama, tmp_path / "loud", r=4, lora_alpha=1e40, target_modules=["q_proj"])
    with pytest.raises(AdapterFormatError, match="not finite"):
        load_peft_adapter(folder)


def test_a_stacks_weight_that_folds_its_factors_to_inf_is_refused(llama, tmp_path):
    """A stack whose weight folds an adapter's factors to inf is refused before anything is written
    or merged (a stack LoRA for vLLM, a merge for the transformers engine); the model keeps its
    weights."""
    from lora_kernels import NonFiniteFactors

    adapter = load_peft_adapter(make_peft_adapter(llama, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"]))
    stack = [(adapter, 1e300)]
    with pytest.raises(NonFiniteFactors):
        concat_stack(stack)
    with pytest.raises(NonFiniteFactors):
        save_stack_as_peft(stack, tmp_path / "mix")
    assert not (tmp_path / "mix").exists()
    before = copy.deepcopy(llama.state_dict())
    with pytest.raises(NonFiniteFactors, match="'a' at weight 1e"):
        AdapterStack(llama).switch(stack)
    assert all(torch.equal(before[k], v) for k, v in llama.state_dict().items())


def test_lora_bias_tensor_refused(llama, tmp_path):
    folder = make_peft_adapter(llama, tmp_path / "lb", r=4, lora_alpha=8, target_modules=["q_proj"])
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key.replace(".weight", ".bias")] = torch.zeros(64)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterRefused, match="lora_bias"):
        load_peft_adapter(folder)


# ---------------------------------------------------------------- diffusers


UNET_CONFIG = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
)
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1"]  # Linear, Conv 1x1, Conv 3x3


@pytest.fixture(scope="module")
def unet_lora(tmp_path_factory):
    """A tiny UNet and a LoRA written by diffusers' save_lora_weights (with its peft metadata)."""
    diffusers = pytest.importorskip("diffusers")
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(2)
    unet = diffusers.UNet2DConditionModel(**UNET_CONFIG).eval()
    trained = copy.deepcopy(unet)
    config = peft.LoraConfig(r=4, lora_alpha=6, target_modules=UNET_TARGETS)
    trained.add_adapter(config)
    _randomise_b(trained, 3)
    folder = tmp_path_factory.mktemp("unet_lora")
    diffusers.StableDiffusionPipeline.save_lora_weights(
        str(folder), unet_lora_layers=get_peft_model_state_dict(trained), unet_lora_adapter_metadata=config.to_dict()
    )
    # diffusers' own fused result (note: diffusers reads the alpha metadata only when given the folder
    # and weight_name; given the file path it silently falls back to alpha = r)
    fused = copy.deepcopy(unet)
    fused.load_lora_adapter(str(folder), weight_name="pytorch_lora_weights.safetensors", prefix="unet")
    fused.fuse_lora()
    fused.unload_lora()
    return unet, folder, fused


def _unet_out(unet):
    g = torch.Generator().manual_seed(4)
    x, t, ctx = torch.randn(1, 4, 16, 16, generator=g), torch.tensor([10]), torch.randn(1, 5, 32, generator=g)
    with torch.no_grad():
        return unet(x, t, encoder_hidden_states=ctx).sample


def test_diffusers_lora_matches_fuse_lora(unet_lora):
    unet, folder, fused = unet_lora
    adapter = load_diffusers_lora(folder)
    assert {m.scale for m in adapter.modules.values()} == {6 / 4}
    ours = ours_merged(unet, (adapter, 1.0))
    assert_same_weights(fused, ours)
    torch.testing.assert_close(_unet_out(ours), _unet_out(fused), rtol=0, atol=OUTPUT_ATOL)
    assert not torch.allclose(_unet_out(ours), _unet_out(unet), atol=OUTPUT_ATOL)


def test_diffusers_old_naming_with_alpha(unet_lora, tmp_path):
    """``lora.down`` / ``lora.up`` keys plus ``<module>.alpha`` tensors (no metadata) load the same."""
    unet, folder, fused = unet_lora
    tensors = load_file(str(folder / "pytorch_lora_weights.safetensors"))
    old = {}
    for k, v in tensors.items():
        old[k.replace(".lora_A.weight", ".lora.down.weight").replace(".lora_B.weight", ".lora.up.weight")] = v
        if k.endswith(".lora_A.weight"):
            old[k.replace(".lora_A.weight", ".alpha")] = torch.tensor(6.0)
    save_file(old, str(tmp_path / "old.safetensors"))
    ours = ours_merged(unet, (load_diffusers_lora(tmp_path / "old.safetensors"), 1.0))
    assert_same_weights(fused, ours)


def test_diffusers_dora_refused(unet_lora, tmp_path):
    _, folder, _ = unet_lora
    tensors = load_file(str(folder / "pytorch_lora_weights.safetensors"))
    key = next(k for k in tensors if k.endswith(".lora_A.weight"))
    tensors[key.replace(".lora_A.weight", ".lora_magnitude_vector")] = torch.ones(4)
    save_file(tensors, str(tmp_path / "pytorch_lora_weights.safetensors"))
    with pytest.raises(AdapterRefused, match="DoRA"):
        load_diffusers_lora(tmp_path)
