"""Random LoRA factors for the demo adapters, shaped after a checkpoint's linear weights."""

from __future__ import annotations

from pathlib import Path

import torch


def random_lora(shapes: dict[str, tuple[int, int]], rank: int, seed: int,
                b_std: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per module (sorted by name): (A [rank, in] ~ N(0, 1/in), B [out, rank] ~ N(0, b_std^2)) from
    ``seed``. B is not zero (peft's initialisation), so the adapter does something."""
    g = torch.Generator().manual_seed(seed)
    factors = {}
    for module, (d_out, d_in) in sorted(shapes.items()):
        down = torch.randn(rank, d_in, generator=g) / d_in**0.5
        up = torch.randn(d_out, rank, generator=g) * b_std
        factors[module] = (down.contiguous(), up.contiguous())
    return factors


def linear_shapes(files: list[Path], targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Shapes of the 2-D weights in ``files`` (safetensors) whose module name ends with a target."""
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                module = key.removesuffix(".weight")
                shape = f.get_slice(key).get_shape()
                if key.endswith(".weight") and len(shape) == 2 and any(module.endswith("." + t) for t in targets):
                    shapes[module] = (shape[0], shape[1])
    return shapes
