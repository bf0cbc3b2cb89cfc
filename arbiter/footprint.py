"""How much device memory a model takes, and how much the device has.

Used by the arbiter's owner loop; the decisions themselves live in ``arbiter.policy``.

Sizes are parsed and written by ``arbiter.units`` (torch-free).

Budget
    ``device_budget(device, vram_budget, reserve)``: on CUDA, ``vram_budget`` if set, else the
    device's free memory (``torch.cuda.mem_get_info``) less ``reserve``. On CPU ``vram_budget`` is
    a simulated budget and must be set. ``device=None`` picks CUDA when it exists. Call it once,
    before any model is loaded: the policy treats the result as the total its models may occupy.

Footprint before loading
    ``estimate_footprint(path, kind, dtype_bytes=None, declared=None)``: a declared ``vram`` wins;
    otherwise ``checkpoint_bytes(path, dtype_bytes)`` plus the runtime margin of the kind
    (``RUNTIME_MARGIN``: chat +20% for KV cache and activations, image +30% for UNet/VAE
    activations, tts/stt +15%, embed and moderation +25% for a padded batch's activations). ``checkpoint_bytes``
    reads only safetensors *headers* (8-byte little-endian length + JSON), summing numel * element
    size over every ``*.safetensors`` under ``path`` (recursively, so diffusers pipelines with
    unet/, vae/, text_encoder/... count fully;
    dot-directories such as .cache/ are skipped). Where a folder holds both plain and variant files
    (``x.safetensors`` and ``x.fp16.safetensors``) only the plain ones count, as diffusers loads
    them by default. ``dtype_bytes`` (e.g. 2 for fp16) rescales floating-point tensors to the dtype
    they will be loaded in; integer and bool tensors keep their size. Without any safetensors the
    sizes of ``*.bin``/``*.pt``/``*.pth`` files are summed, unscaled (their dtype is unknown without
    unpickling them).

Footprint after loading
    ``measure_modules(modules)``: parameter + buffer bytes of one or more ``torch.nn.Module``,
    counting each storage once (tied weights are not double-counted). On CUDA measure instead the
    delta of ``cuda_allocated(device)`` around the load. Either way
    ``footprint_from_measurement(measured, kind)`` adds the same runtime margin as the estimate.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

# --- the budget --------------------------------------------------------------------------------


def default_device() -> torch.device:
    """CUDA device 0 where CUDA exists, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def configured_device(setting: str) -> torch.device:
    """The device ``gpu.device`` names (``auto``: CUDA where it exists, else the CPU); RuntimeError
    for ``cuda`` where torch sees none."""
    if setting == "auto":
        return default_device()
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("gpu.device is 'cuda' but torch sees no CUDA device")
    return torch.device(setting)


def device_budget(device: str | torch.device | None, vram_budget: int | None, reserve: int) -> int:
    """Bytes the arbiter may fill with models on ``device`` (see the module docstring)."""
    dev = default_device() if device is None else torch.device(device)
    if dev.type == "cuda":
        if vram_budget is not None:
            return vram_budget
        free, _total = torch.cuda.mem_get_info(dev)
        return max(0, free - reserve)
    if vram_budget is None:
        raise ValueError(
            f"no CUDA device ({dev}): set gpu.vram_budget to the simulated budget, e.g. '16GiB'"
        )
    return vram_budget


def cuda_allocated(device: str | torch.device) -> int:
    """Bytes torch has allocated on a CUDA device; measure it before and after a load."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"cuda_allocated needs a CUDA device, got {dev}; use measure_modules")
    return torch.cuda.memory_allocated(dev)


# --- footprint before loading ------------------------------------------------------------------

RUNTIME_MARGIN: dict[str, float] = {"chat": 0.20, "image": 0.30, "tts": 0.15, "stt": 0.15, "embed": 0.25,
                                   "moderation": 0.25, "rerank": 0.25, "train": 0.0}  # train: its spec's training_bytes instead

# Bits per element of each safetensors dtype; sub-byte types are packed.
_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64,
    "I64": 64, "U64": 64, "F64": 64,
}  # fmt: skip
_FLOAT_DTYPES = {"F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "F16", "BF16",
                 "F32", "F64"}  # fmt: skip
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit
_VARIANT_RE = re.compile(r"^.+?\.(fp16|fp32|bf16|fp8|int8)(-\d+-of-\d+)?$")  # x.fp16[-1-of-2]
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def runtime_margin(kind: str) -> float:
    """The fraction added to a model's weight bytes for its runtime state."""
    try:
        return RUNTIME_MARGIN[kind]
    except KeyError:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {sorted(RUNTIME_MARGIN)}")


def read_safetensors_header(path: str | Path) -> dict:
    """The JSON header of a safetensors file, reading only the header's bytes."""
    path = Path(path)
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER or length > path.stat().st_size - 8:
            raise ValueError(f"{path}: header length {length} is not plausible")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: unreadable safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    return header


def safetensors_bytes(path: str | Path, dtype_bytes: int | None = None) -> int:
    """Bytes of the tensors in one safetensors file, from its header; see ``checkpoint_bytes``."""
    total = 0
    for name, info in read_safetensors_header(path).items():
        if name == "__metadata__":
            continue
        dtype, shape = info["dtype"], info["shape"]
        numel = math.prod(shape)
        if dtype_bytes is not None and dtype in _FLOAT_DTYPES:
            total += numel * dtype_bytes
        elif dtype in _DTYPE_BITS:
            total += (numel * _DTYPE_BITS[dtype] + 7) // 8
        else:  # a dtype newer than this table: trust the stored byte range
            begin, end = info["data_offsets"]
            total += end - begin
    return total


def _is_variant(path: Path) -> bool:
    return _VARIANT_RE.match(path.name.rsplit(".", 1)[0]) is not None


def _weight_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files under ``root`` with one of ``suffixes``, skipping dot-directories and, per folder,
    variant files (``x.fp16.safetensors``) when plain ones exist beside them."""
    if root.is_file():
        return [root] if root.name.endswith(suffixes) else []
    files = [
        p
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and p.name.endswith(suffixes)
        and not any(part.startswith(".") for part in p.relative_to(root).parts[:-1])
    ]
    by_folder: dict[Path, list[Path]] = {}
    for p in files:
        by_folder.setdefault(p.parent, []).append(p)
    chosen: list[Path] = []
    for folder_files in by_folder.values():
        plain = [p for p in folder_files if not _is_variant(p)]
        chosen += plain or folder_files
    return chosen


def checkpoint_bytes(path: str | Path, dtype_bytes: int | None = None) -> int:
    """Weight bytes of the checkpoint at ``path`` (a file or folder), without loading it."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"no checkpoint at {root}")
    tensors = _weight_files(root, (".safetensors",))
    if tensors:
        return sum(safetensors_bytes(p, dtype_bytes) for p in tensors)
    pickles = _weight_files(root, _PICKLE_SUFFIXES)
    if pickles:
        return sum(p.stat().st_size for p in pickles)
    raise ValueError(f"no weights (*.safetensors, *.bin, *.pt, *.pth) under {root}")


def estimate_footprint(
    path: str | Path, kind: str, dtype_bytes: int | None = None, declared: int | None = None
) -> int:
    """The declared footprint if given, else the checkpoint's weights plus the kind's margin."""
    if declared is not None:
        return declared
    margin = runtime_margin(kind)
    return math.ceil(checkpoint_bytes(path, dtype_bytes) * (1 + margin))


# --- footprint after loading -------------------------------------------------------------------


def measure_modules(modules: torch.nn.Module | Iterable[torch.nn.Module]) -> int:
    """Parameter + buffer bytes of the modules, each underlying storage counted once."""
    if isinstance(modules, torch.nn.Module):
        modules = [modules]
    seen: dict[tuple[str, int], int] = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            seen[key] = max(seen.get(key, 0), storage.nbytes())
    return sum(seen.values())


def footprint_from_measurement(measured: int, kind: str) -> int:
    """A measured weight size (``measure_modules`` or CUDA allocated delta) plus the margin."""
    return math.ceil(measured * (1 + runtime_margin(kind)))
