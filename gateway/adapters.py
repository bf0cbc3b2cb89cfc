"""LoRA adapters a request can ask for: read from tiers.yaml ``adapters:`` at start-up, and resolved
per request into the base model plus an adapter stack.

A request selects adapters in two ways (as vLLM does for the first):

* ``model: "<adapter>"``: that adapter at weight 1.0 on its base model;
* ``model: "<base>"`` plus ``adapters: [{"name": ..., "weight": ...}, ...]``: a weighted stack
  (after the model's own adapter, if ``model`` names one).

Adapter names map to folders only through the config, so no request reaches a path of its choosing.
An adapter is read, checked against its format's rules (DoRA and other variants are refused) and
against the base model's checkpoint (every targeted module exists with a fitting shape) before the
server starts; any problem is a one-line :class:`ConfigError` naming the adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from safetensors import safe_open

from gateway.config import AdapterConfig, Config, ConfigError
from gateway.errors import bad_request, not_found
from gateway.schemas import MAX_STACK, AdapterChoice
from lora_kernels import AdapterFormatError, LoraAdapter, load_diffusers_lora, load_peft_adapter
from lora_kernels.adapters import DIFFUSERS_WEIGHTS, PEFT_CONFIG
from lora_kernels.stack import resolve_module
from workers.base import AdapterStackSpec, ModelSpec

if TYPE_CHECKING:
    from gateway.service import Services

DENOISERS = ("unet", "transformer")  # the pipeline component a diffusers LoRA may target


@dataclass(frozen=True)
class ServedAdapter:
    """One configured adapter, loaded (factors in host memory)."""

    name: str
    model: str  # the base model
    kind: str  # the base model's kind: chat or image
    format: str  # peft or diffusers
    path: Path
    adapter: LoraAdapter

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.adapter.modules.values())

    def row(self) -> dict[str, Any]:
        """Its /v1/models entry."""
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "tiergate", "kind": "adapter",
                "parent": self.model, "root": self.model, "base_kind": self.kind, "format": self.format,
                "rank": self.rank, "modules": len(self.adapter.modules)}


class AdapterRegistry:
    """The configured adapters by name."""

    def __init__(self, adapters: Iterable[ServedAdapter] = ()) -> None:
        self.adapters = {a.name: a for a in adapters}

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def rows(self) -> list[dict[str, Any]]:
        return [a.row() for a in self.adapters.values()]

    def base_model(self, model: str) -> str:
        """The model a request runs on: the adapter's base when ``model`` names an adapter."""
        served = self.adapters.get(model)
        return served.model if served is not None else model

    def stack(self, model: str, choices: Sequence[AdapterChoice] | None, kind: str) -> AdapterStackSpec:
        """The adapter stack of a request for ``model`` (a base model or an adapter) plus ``choices``:
        404 for an unknown adapter, 400 for one of another base model or kind, or a repeated one."""
        base = self.base_model(model)
        stack: list[tuple[LoraAdapter, float]] = []
        own = self.adapters.get(model)
        if own is not None:
            if own.kind != kind:
                raise bad_request(f"'{model}' is an adapter of the {own.kind} model '{base}', not of a {kind} model",
                                  "model", "model_not_supported")
            stack.append((own.adapter, 1.0))
        for choice in choices or ():
            served = self.adapters.get(choice.name)
            if served is None:
                raise not_found(f"the adapter '{choice.name}' does not exist", "adapters", "adapter_not_found")
            if served.model != base:
                raise bad_request(f"the adapter '{choice.name}' is for the model '{served.model}', not '{base}'",
                                  "adapters", "adapter_model_mismatch")
            stack.append((served.adapter, choice.weight))
        names = [a.name for a, _ in stack]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise bad_request(f"the adapter '{repeated[0]}' is selected more than once", "adapters")
        if len(stack) > MAX_STACK:
            raise bad_request(f"{len(stack)} adapters in one stack, above this server's limit of {MAX_STACK}",
                              "adapters")
        return tuple(stack)


def resolve_request(svc: "Services", model: str, choices: Sequence[AdapterChoice] | None,
                    kind: str) -> tuple[ModelSpec, AdapterStackSpec]:
    """The base model's spec and the adapter stack of one request (errors as the API's 4xx; an
    unknown model is a 404 before anything is said about its adapters)."""
    adapters = svc.adapters
    model = svc.model_name(model)
    if model not in adapters:
        svc.spec(model, kind)
    stack = adapters.stack(model, choices, kind)
    return svc.spec(adapters.base_model(model), kind), stack


# -- start-up: reading and checking the configured adapters -----------------------------------------


def load_adapters(config: Config) -> AdapterRegistry:
    """Read every adapter of ``config`` and check it against its base model's checkpoint."""
    models = {m.name: m for m in config.models}
    served = []
    for i, entry in enumerate(config.adapters):
        base = models[entry.model]
        try:
            served.append(load_adapter(entry, base.kind, base.path))
        except (AdapterFormatError, OSError, ValueError, KeyError) as exc:
            message = " ".join(str(exc).strip("'\"").split())
            raise ConfigError(f"{config.source}: adapters[{i}] ({entry.name}): {message}") from None
    return AdapterRegistry(served)


def load_adapter(entry: AdapterConfig, kind: str, model_path: Path) -> ServedAdapter:
    fmt = entry.format or detect_format(entry.path)
    if fmt == "peft":
        adapter = load_peft_adapter(entry.path, name=entry.name)
    else:
        adapter = load_diffusers_lora(entry.path, component=_denoiser(entry.path), name=entry.name)
    check_fits(adapter, checkpoint_shapes(model_path, kind), entry.model)
    return ServedAdapter(entry.name, entry.model, kind, fmt, entry.path, adapter)


def detect_format(path: Path) -> str:
    if path.is_dir() and (path / PEFT_CONFIG).is_file():
        return "peft"
    if (path.is_dir() and (path / DIFFUSERS_WEIGHTS).is_file()) or (path.is_file() and path.suffix == ".safetensors"):
        return "diffusers"
    raise AdapterFormatError(f"{path} is neither a peft LoRA folder ({PEFT_CONFIG}) nor a diffusers LoRA "
                             f"({DIFFUSERS_WEIGHTS})")


def _denoiser(path: Path) -> str:
    """The component a diffusers LoRA file targets; LoRA on other components (text encoders) is
    refused rather than silently left out."""
    file = path / DIFFUSERS_WEIGHTS if path.is_dir() else path
    with safe_open(str(file), framework="pt") as f:
        prefixes = {k.split(".", 1)[0] for k in f.keys()}
    named = {p for p in prefixes if p in DENOISERS or p.startswith("text_encoder")}
    others = sorted(p for p in named if p not in DENOISERS)
    if others:
        raise AdapterFormatError(f"LoRA for {', '.join(others)} is not supported (only the unet or transformer)")
    return next(iter(named), "unet")


def checkpoint_shapes(model_path: Path, kind: str) -> dict[str, tuple[int, ...]]:
    """Weight shapes by module name, read from the safetensors headers of the model (chat) or of its
    denoiser (image), without loading a tensor. Empty when the checkpoint is not safetensors."""
    folders = [model_path] if kind == "chat" else [model_path / d for d in DENOISERS]
    shapes: dict[str, tuple[int, ...]] = {}
    for folder in folders:
        for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key.endswith(".weight"):
                        shapes[key.removesuffix(".weight")] = tuple(f.get_slice(key).get_shape())
    return shapes


def check_fits(adapter: LoraAdapter, shapes: dict[str, tuple[int, ...]], model: str) -> None:
    """Every module the adapter targets exists in ``model`` with a shape its delta fits (as the
    merge maps them: exact name, else a unique whole-component suffix)."""
    if not shapes:
        return
    for key, lm in adapter.modules.items():
        try:
            name = resolve_module(shapes, key, adapter.name)  # type: ignore[arg-type]
        except KeyError as exc:
            raise AdapterFormatError(f"does not fit model '{model}': {exc.args[0]}") from None
        shape = shapes[name]
        rows, cols = lm.up.shape[0], math.prod(lm.down.shape[1:])
        flat = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else None
        if flat not in ((rows, cols), (cols, rows)):
            raise AdapterFormatError(f"does not fit model '{model}': module {name!r} is {list(shape)}, "
                                     f"the adapter's delta {rows}x{cols}")
