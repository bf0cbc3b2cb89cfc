"""Footprint accounting: header-only checkpoint estimates, measurement after loading, sizes."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from safetensors.torch import save_file

from arbiter.footprint import (
    RUNTIME_MARGIN,
    checkpoint_bytes,
    cuda_allocated,
    device_budget,
    estimate_footprint,
    footprint_from_measurement,
    measure_modules,
    read_safetensors_header,
    runtime_margin,
    safetensors_bytes,
)
from arbiter.units import format_size, parse_size

GiB = 1024**3


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def save(path, tensors):
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return nbytes(tensors)


MIXED = {
    "w": torch.zeros(64, 32, dtype=torch.float32),
    "h": torch.zeros(7, 3, dtype=torch.float16),
    "b": torch.zeros(5, dtype=torch.bfloat16),
    "ids": torch.zeros(11, dtype=torch.int64),
    "mask": torch.zeros(9, dtype=torch.bool),
    "q": torch.zeros(4, 4, dtype=torch.int8),
}


# --- header-only estimate ------------------------------------------------------------------


def test_one_file_equals_exact_tensor_bytes(tmp_path):
    exact = save(tmp_path / "model.safetensors", MIXED)
    assert safetensors_bytes(tmp_path / "model.safetensors") == exact
    assert checkpoint_bytes(tmp_path) == exact
    assert checkpoint_bytes(tmp_path / "model.safetensors") == exact


def test_only_the_header_is_read(tmp_path):
    """A file whose data section is truncated still gives the estimate: only the header is read."""
    path = tmp_path / "model.safetensors"
    exact = save(path, {"w": torch.zeros(1000, 1000)})
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    path.write_bytes(path.read_bytes()[: 8 + length] + b"x")  # keep the header, drop the data
    assert checkpoint_bytes(tmp_path) == exact


def test_sharded_and_extra_files(tmp_path):
    exact = save(tmp_path / "model-00001-of-00002.safetensors", {"a": torch.zeros(100, 10)})
    exact += save(tmp_path / "model-00002-of-00002.safetensors", {"b": torch.zeros(30)})
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}" * 5000)
    (tmp_path / "training_args.bin").write_bytes(b"\0" * 4096)  # ignored: safetensors exist
    assert checkpoint_bytes(tmp_path) == exact


def test_nested_diffusers_layout(tmp_path):
    exact = save(tmp_path / "unet/diffusion_pytorch_model.safetensors", {"c": torch.zeros(32, 32)})
    exact += save(tmp_path / "vae/diffusion_pytorch_model.safetensors", {"d": torch.zeros(8, 8)})
    exact += save(
        tmp_path / "text_encoder/model.safetensors",
        {"e": torch.zeros(10, dtype=torch.float16), "pos": torch.zeros(77, dtype=torch.int64)},
    )
    (tmp_path / "model_index.json").write_text("{}")
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler/scheduler_config.json").write_text("{}")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer/vocab.json").write_text("{}")
    # a variant beside a plain file is not counted (diffusers loads the plain one by default)
    variant = {"c": torch.zeros(32, 32).half()}
    save(tmp_path / "unet/diffusion_pytorch_model.fp16.safetensors", variant)
    # nor is anything under a dot-directory (e.g. huggingface's .cache/)
    save(tmp_path / ".cache/stale.safetensors", {"z": torch.zeros(1000)})

    assert checkpoint_bytes(tmp_path) == exact
    expected = math.ceil(exact * (1 + RUNTIME_MARGIN["image"]))
    assert estimate_footprint(tmp_path, "image") == expected


def test_variant_only_folder_counts_the_variant(tmp_path):
    path = tmp_path / "unet/diffusion_pytorch_model.fp16.safetensors"
    exact = save(path, {"c": torch.zeros(6).half()})
    assert checkpoint_bytes(tmp_path) == exact


def test_dtype_rescales_floating_tensors_only(tmp_path):
    save(tmp_path / "model.safetensors", MIXED)
    floats = 64 * 32 + 7 * 3 + 5
    ints = 11 * 8 + 9 * 1 + 16 * 1
    assert checkpoint_bytes(tmp_path, dtype_bytes=2) == floats * 2 + ints
    assert checkpoint_bytes(tmp_path, dtype_bytes=4) == floats * 4 + ints


@pytest.mark.parametrize("kind", ["chat", "image", "tts", "stt"])
def test_estimate_adds_the_kinds_margin(tmp_path, kind):
    exact = save(tmp_path / "model.safetensors", {"w": torch.zeros(1000, 10)})
    assert estimate_footprint(tmp_path, kind) == math.ceil(exact * (1 + runtime_margin(kind)))
    assert estimate_footprint(tmp_path, kind, dtype_bytes=2) == math.ceil(
        exact // 2 * (1 + runtime_margin(kind))
    )


def test_declared_vram_wins(tmp_path):
    save(tmp_path / "model.safetensors", {"w": torch.zeros(10)})
    assert estimate_footprint(tmp_path, "chat", declared=6 * GiB) == 6 * GiB
    # and needs no checkpoint at all
    assert estimate_footprint(tmp_path / "missing", "chat", declared=123) == 123


def test_pickle_fallback_uses_file_sizes(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/extra.pt").write_bytes(b"\0" * 24)
    (tmp_path / "config.json").write_text("{}" * 100)
    assert checkpoint_bytes(tmp_path) == 1024


def test_no_weights_and_missing_path(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weights"):
        checkpoint_bytes(tmp_path)
    with pytest.raises(FileNotFoundError):
        checkpoint_bytes(tmp_path / "nope")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x01\x02",
        struct.pack("<Q", 10**12) + b"{}",
        struct.pack("<Q", 5) + b"notjs",
        struct.pack("<Q", 2) + b"[]",
    ],
)
def test_corrupt_headers_raise_value_error(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError):
        read_safetensors_header(path)


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown model kind"):
        runtime_margin("video")


# --- measurement after loading -------------------------------------------------------------


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)
        self.head = torch.nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.norm = torch.nn.LayerNorm(16)
        self.register_buffer("pos", torch.zeros(8, dtype=torch.int64))


def test_measure_counts_tied_weights_once():
    m = Tied()
    expected = 100 * 16 * 4 + 2 * 16 * 4 + 8 * 8
    assert measure_modules(m) == expected


def test_measure_several_modules_sharing_a_storage():
    a = torch.nn.Linear(4, 4)
    b = torch.nn.Linear(4, 4)
    b.weight = a.weight
    assert measure_modules([a, b]) == (16 + 4 + 4) * 4
    assert measure_modules([a, a]) == measure_modules(a)


def test_measure_views_count_their_whole_storage():
    m = torch.nn.Module()
    big = torch.zeros(100)
    m.register_buffer("first", big[:10])
    m.register_buffer("second", big[10:20])
    assert measure_modules(m) == 100 * 4


def test_measure_skips_meta_tensors():
    with torch.device("meta"):
        m = torch.nn.Linear(1000, 1000)
    assert measure_modules(m) == 0


def test_footprint_from_measurement():
    assert footprint_from_measurement(1000, "chat") == 1200
    assert footprint_from_measurement(1000, "image") == 1300


# --- the budget ----------------------------------------------------------------------------


def test_cpu_budget_is_the_simulated_one():
    assert device_budget("cpu", 10 * GiB, reserve=GiB) == 10 * GiB
    with pytest.raises(ValueError, match="vram_budget"):
        device_budget("cpu", None, reserve=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_auto_device_is_cpu_without_cuda():
    assert device_budget(None, 3 * GiB, reserve=0) == 3 * GiB
    with pytest.raises(ValueError):
        cuda_allocated("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_budget_and_allocated_delta():
    free, _ = torch.cuda.mem_get_info(0)
    budget = device_budget(None, None, reserve=GiB)
    assert 0 <= budget <= free - GiB + 64 * 1024**2
    assert device_budget("cuda", 5 * GiB, reserve=GiB) == 5 * GiB
    before = cuda_allocated("cuda")
    m = torch.nn.Linear(1024, 1024).cuda()
    assert cuda_allocated("cuda") - before >= measure_modules(m)


# --- sizes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("6GiB", 6 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("512MiB", 512 * 1024**2),
        ("4KiB", 4096),
        ("2TiB", 2 * 1024**4),
        ("6GB", 6 * 10**9),
        ("1.5 GB", 1_500_000_000),
        ("10MB", 10**7),
        ("3KB", 3000),
        ("1TB", 10**12),
        ("100B", 100),
        ("1024", 1024),
        ("0", 0),
        (" 6 gib ", 6 * GiB),
        (".5KiB", 512),
        ("1.1KiB", 1126),  # floored to whole bytes
        (4096, 4096),
    ],
)
def test_parse_size_good(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "GiB", "6 GiBs", "6XB", "-1GiB", "1,000", "1e9", "inf", "nan", "6G", "6Gi", "1.", "1_000",
     -5, True, 1.5, None],  # fmt: skip
)
def test_parse_size_bad(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(
    "n, text",
    [(0, "0B"), (1023, "1023B"), (1024, "1KiB"), (1536, "1.5KiB"), (6 * GiB, "6GiB"),
     (3 * GiB // 2, "1.5GiB"), (5 * 1024**4, "5TiB"), (-GiB, "-1GiB")],
)  # fmt: skip
def test_format_size(n, text):
    assert format_size(n) == text
    assert parse_size(text.lstrip("-")) == abs(n)
