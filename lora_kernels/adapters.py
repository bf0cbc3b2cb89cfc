"""LoRA adapter files: peft folders and diffusers LoRA files in, one concatenated peft folder out.

Only plain linear LoRA is accepted (W' = W + scale * B @ A per module). DoRA, other peft LoRA
variants, trained biases, full-module weights (``modules_to_save``) and embedding LoRA are refused
with :class:`AdapterRefused`, naming the adapter and the reason, never merged silently. Factors
that are not finite (NaN or inf: a diverged training run), or not once their scale is folded in,
are an :class:`AdapterFormatError`; a stack whose weights fold them to inf, ``NonFiniteFactors``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from .factors import NonFiniteFactors, folds_finite
from .ops import concat_factors

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"
PEFT_PREFIX = "base_model.model."

# peft LoraConfig fields that turn on a LoRA variant whose merge is not W + s * B @ A (or that peft
# cannot merge at all); peft tags them ``is_lora_variant``.
VARIANT_FIELDS = {
    "use_dora": "DoRA rescales the merged weight by a learned magnitude: not a linear low-rank delta",
    "velora_config": "VeLoRA variant",
    "alora_invocation_tokens": "aLoRA activates only after invocation tokens: cannot be merged",
    "use_qalora": "QALoRA variant (pooled input)",
    "monteclora_config": "MonteCLoRA variant (sampled factors)",
    "use_bdlora": "BD-LoRA variant (block-diagonal factors)",
    "arrow_config": "Arrow routing between adapters: input dependent",
    "kasa_config": "KaSA variant (modifies the base weight's singular values)",
}
OTHER_REFUSALS = {
    "lora_bias": "lora_bias: the adapter carries a trained bias",
    "modules_to_save": "modules_to_save: full module weights, not low-rank deltas",
    "trainable_token_indices": "trainable_token_indices: trained embedding rows, not low-rank deltas",
    "target_parameters": "target_parameters: LoRA on raw parameters (e.g. MoE experts)",
    "layer_replication": "layer_replication changes the model's layers",
}

Stack = Sequence[tuple["LoraAdapter", float]]


class AdapterFormatError(ValueError):
    """An adapter file that cannot be read as LoRA."""


class AdapterRefused(AdapterFormatError):
    """A readable adapter that is not plain linear LoRA (DoRA, other variants, biases...)."""


@dataclass(frozen=True)
class LoraModule:
    """One module's LoRA in peft's tensor layout; the delta is ``scale * up @ down``."""

    down: Tensor  # peft lora_A.weight: [r, in] (Linear, Conv1D) or [r, in, kh, kw] (Conv2d)
    up: Tensor  # peft lora_B.weight: [out, r] or [out, r, 1, 1]
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def factors(self, transposed: bool = False) -> tuple[Tensor, Tensor]:
        """(B, A) with ``B @ A`` in the 2-D layout of the target weight; ``transposed`` for weights
        stored ``[in, out]`` (transformers' Conv1D, peft's fan_in_fan_out)."""
        b, a = self.up.flatten(1), self.down.flatten(1)
        return (a.T, b.T) if transposed else (b, a)


@dataclass
class LoraAdapter:
    """A loaded adapter: LoRA factors per module name (names as in the base model) plus metadata."""

    name: str
    modules: dict[str, LoraModule]
    config: dict = field(default_factory=dict)
    source: str = ""

    @property
    def fan_in_fan_out(self) -> bool:
        return bool(self.config.get("fan_in_fan_out", False))


def _refusals(config: Mapping) -> list[str]:
    reasons = []
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        reasons.append(f"peft_type {peft_type!r} is not LORA")
    for key, why in {**VARIANT_FIELDS, **OTHER_REFUSALS}.items():
        if config.get(key):
            reasons.append(f"{key}={config[key]!r} ({why})")
    if str(config.get("init_lora_weights", "")).lower().startswith("mica"):
        reasons.append("init_lora_weights='mica' (MiCA variant)")
    if config.get("bias", "none") not in ("none", None):
        reasons.append(f"bias={config['bias']!r}: biases are trained")
    return reasons


def _refuse(name: str, source: str, reasons: list[str]) -> None:
    if reasons:
        raise AdapterRefused(f"adapter {name!r} ({source}) refused: " + "; ".join(reasons))


# tensor key suffixes: peft, diffusers-old and kohya-style names for the two factors
_FACTOR_KEY = re.compile(
    r"^(?P<module>.+?)\.(?P<kind>lora_A|lora_B|lora\.down|lora\.up|lora_down|lora_up"
    r"|lora_linear_layer\.down|lora_linear_layer\.up)(?:\.[A-Za-z0-9_-]+)?\.weight$"
)
_OLD_ATTN = re.compile(r"\.(to_q|to_k|to_v|to_out)_lora\.")
_TENSOR_REFUSALS = {
    "lora_magnitude_vector": "DoRA magnitude vector (use_dora)",
    "lora_embedding_A": "embedding LoRA is not supported",
    "lora_embedding_B": "embedding LoRA is not supported",
}


def _normalise_key(key: str) -> str:
    key = key.replace(".processor.", ".")
    return _OLD_ATTN.sub(lambda m: f".{m.group(1)}{'.0' if m.group(1) == 'to_out' else ''}.lora.", key)


def _parse_tensors(
    tensors: Mapping[str, Tensor], name: str, source: str
) -> tuple[dict[str, dict[str, Tensor]], dict[str, float]]:
    """Group tensors into {module: {"down": A, "up": B}} and {module: alpha} (old ``.alpha`` keys)."""
    factors: dict[str, dict[str, Tensor]] = {}
    alphas: dict[str, float] = {}
    for raw_key, tensor in tensors.items():
        key = _normalise_key(raw_key)
        for marker, why in _TENSOR_REFUSALS.items():
            if marker in key:
                raise AdapterRefused(f"adapter {name!r} ({source}) refused: tensor {raw_key!r}: {why}")
        if key.endswith(".alpha"):
            alphas[key[: -len(".alpha")]] = float(tensor)
            continue
        m = _FACTOR_KEY.match(key)
        if m is None:
            if ".lora_B" in key and key.endswith(".bias"):
                raise AdapterRefused(f"adapter {name!r} ({source}) refused: tensor {raw_key!r}: lora_bias")
            raise AdapterFormatError(f"adapter {name!r} ({source}): unrecognised tensor {raw_key!r}")
        side = "down" if m["kind"] in ("lora_A", "lora.down", "lora_down", "lora_linear_layer.down") else "up"
        factors.setdefault(m["module"], {})[side] = tensor
    for module, pair in factors.items():
        if set(pair) != {"down", "up"}:
            raise AdapterFormatError(f"adapter {name!r} ({source}): module {module!r} lacks lora_A or lora_B")
        down, up = pair["down"], pair["up"]
        if up.shape[1] != down.shape[0] or up.dim() not in (2, 4) or up.shape[2:] not in ((), (1, 1)):
            raise AdapterFormatError(
                f"adapter {name!r} ({source}): module {module!r} has mismatched factors "
                f"{tuple(down.shape)} / {tuple(up.shape)}"
            )
    return factors, alphas


def _pattern_value(patterns: Mapping[str, float] | None, module: str, default: float) -> float:
    """peft's ``get_pattern_key``: the first pattern matching ``(.*\\.)?(pattern)$``."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _targeted(config: Mapping, module: str) -> bool:
    """peft's target_modules / exclude_modules matching (a str is a full-match regex)."""

    def matches(spec) -> bool:
        if isinstance(spec, str):
            return spec == "all-linear" or re.fullmatch(spec, module) is not None
        return module in spec or any(module.endswith(f".{t}") for t in spec)

    exclude = config.get("exclude_modules")
    if exclude and matches(exclude):
        return False
    target = config.get("target_modules")
    return target is None or matches(target)


def _build_modules(
    factors: dict[str, dict[str, Tensor]],
    alphas: Mapping[str, float],
    config: Mapping,
    name: str,
    source: str,
    dtype: torch.dtype | None,
) -> dict[str, LoraModule]:
    """Scale per module: from the peft config (r, lora_alpha, rank/alpha_pattern, use_rslora) when there
    is one, else ``alpha / r`` from ``.alpha`` tensors, else 1."""
    modules = {}
    for module, pair in sorted(factors.items()):
        rank = pair["down"].shape[0]
        if "r" in config:
            if not _targeted(config, module):
                raise AdapterFormatError(
                    f"adapter {name!r} ({source}): module {module!r} is not in target_modules "
                    f"{config.get('target_modules')!r}"
                )
            r = int(_pattern_value(config.get("rank_pattern"), module, config["r"]))
            if r != rank:
                raise AdapterFormatError(
                    f"adapter {name!r} ({source}): module {module!r} has rank {rank}, config says {r}"
                )
            alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
        else:
            alpha = alphas.get(module, float(rank))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        down, up = pair["down"], pair["up"]
        if not (torch.isfinite(down).all() and folds_finite(up, scale)):  # a diverged training run's NaN
            raise AdapterFormatError(f"adapter {name!r} ({source}): module {module!r} has factors that are not "
                                     f"finite (NaN or inf, or overflowing with its scale {scale:g})")
        if dtype is not None:
            down, up = down.to(dtype), up.to(dtype)
        modules[module] = LoraModule(down=down, up=up, scale=scale)
    if not modules:
        raise AdapterFormatError(f"adapter {name!r} ({source}): no LoRA tensors found")
    return modules


def load_peft_adapter(folder: str | Path, name: str | None = None, dtype: torch.dtype | None = None) -> LoraAdapter:
    """Load a peft LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    folder = Path(folder)
    name = name or folder.name
    config_path, weights_path = folder / PEFT_CONFIG, folder / PEFT_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterFormatError(f"adapter {name!r} ({folder}): needs {PEFT_CONFIG} and {PEFT_WEIGHTS}")
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterFormatError(f"adapter {name!r} ({folder}): {PEFT_CONFIG} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterFormatError(f"adapter {name!r} ({folder}): {PEFT_CONFIG} is not a JSON object")
    _refuse(name, str(folder), _refusals(config))
    if "r" not in config:
        raise AdapterFormatError(f"adapter {name!r} ({folder}): {PEFT_CONFIG} has no 'r'")
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            tensors = {k.removeprefix(PEFT_PREFIX): f.get_tensor(k) for k in f.keys()}
    except SafetensorError as exc:
        raise AdapterFormatError(f"adapter {name!r} ({folder}): {PEFT_WEIGHTS} is not a readable safetensors file "
                                 f"({exc})") from None
    factors, alphas = _parse_tensors(tensors, name, str(folder))
    return LoraAdapter(name, _build_modules(factors, alphas, config, name, str(folder), dtype), config, str(folder))


def load_diffusers_lora(
    path: str | Path, component: str = "unet", name: str | None = None, dtype: torch.dtype | None = None
) -> LoraAdapter:
    """Load a diffusers LoRA file (``pytorch_lora_weights.safetensors`` as written by
    ``save_lora_weights``, or a folder holding one) for one pipeline component.

    Keys ``<component>.<module>.lora_A.weight`` / ``lora_B.weight``; the older ``lora.down`` /
    ``lora.up`` (+ ``<module>.alpha``) naming is accepted too. The peft config that diffusers stores
    in the file's metadata (``lora_adapter_metadata``) gives alpha, rsLoRA and patterns; without it
    the scale is ``alpha / r`` from ``.alpha`` tensors, or 1.
    """
    path = Path(path)
    file = path / DIFFUSERS_WEIGHTS if path.is_dir() else path
    name = name or (file.parent.name if file.name == DIFFUSERS_WEIGHTS else file.stem)
    if not file.is_file():
        raise AdapterFormatError(f"adapter {name!r}: no file {file}")
    prefix = f"{component}."
    try:
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {}
            keys = list(f.keys())
            if any(k.startswith(prefix) for k in keys):
                keys = [k for k in keys if k.startswith(prefix)]
            tensors = {k.removeprefix(prefix).removeprefix(PEFT_PREFIX): f.get_tensor(k) for k in keys}
    except SafetensorError as exc:
        raise AdapterFormatError(f"adapter {name!r}: {file} is not a readable safetensors file ({exc})") from None
    config = {}
    if DIFFUSERS_METADATA_KEY in metadata:
        packed = json.loads(metadata[DIFFUSERS_METADATA_KEY])
        config = {k.removeprefix(prefix): v for k, v in packed.items() if k.startswith(prefix)}
    _refuse(name, str(file), _refusals(config))
    factors, alphas = _parse_tensors(tensors, name, str(file))
    return LoraAdapter(name, _build_modules(factors, alphas, config, name, str(file), dtype), config, str(file))


def concat_stack(stack: Stack, dtype: torch.dtype = torch.float32) -> dict[str, tuple[Tensor, Tensor]]:
    """Per module: (B_cat [out, K], A_cat [K, in...]) in peft layout (``up``/``down`` shapes) with
    ``w_i * scale_i`` folded into each B block, so ``B_cat @ A_cat = sum_i w_i s_i B_i A_i``;
    ``NonFiniteFactors`` where a folded B is not finite."""
    per_module: dict[str, list[tuple[Tensor, Tensor, float]]] = {}
    for adapter, weight in stack:
        for module, lm in adapter.modules.items():
            per_module.setdefault(module, []).append((lm.up.flatten(1), lm.down, lm.scale * float(weight)))
    out = {}
    for module, fs in per_module.items():
        trailing = fs[0][1].shape[1:]
        if any(a.shape[1:] != trailing for _, a, _ in fs):
            raise ValueError(f"module {module!r}: adapters disagree on the factor shapes")
        b_cat, a_flat = concat_factors([(b, a.flatten(1), s) for b, a, s in fs], dtype)
        if not torch.isfinite(b_cat).all():  # the weights folded in: a stack written so would poison vLLM
            raise NonFiniteFactors(f"module {module!r}: the stack's factors are not finite with its weights "
                                   "folded in")
        up_shape = (b_cat.shape[0], b_cat.shape[1]) + ((1, 1) if len(trailing) == 3 else ())
        out[module] = (b_cat.reshape(up_shape), a_flat.reshape((a_flat.shape[0],) + tuple(trailing)))
    return out


def save_stack_as_peft(
    stack: Stack, folder: str | Path, dtype: torch.dtype = torch.float32, base_model_name_or_path: str | None = None
) -> Path:
    """Write a weighted stack as ONE plain peft LoRA folder whose merge equals the stack's merge.

    Every module gets rank ``K = max_module sum_i r_i`` (modules with fewer rows are zero padded, so
    no rank_pattern is needed) and ``lora_alpha = K`` (scale 1); the weights and scales are folded
    into ``lora_B``.
    """
    if not stack:
        raise ValueError("empty stack")
    cats = concat_stack(stack, dtype)
    k = max(b.shape[1] for b, _ in cats.values())
    tensors = {}
    for module, (b, a) in sorted(cats.items()):
        pad = k - b.shape[1]
        if pad:
            b = torch.cat([b, b.new_zeros((b.shape[0], pad) + tuple(b.shape[2:]))], dim=1)
            a = torch.cat([a, a.new_zeros((pad,) + tuple(a.shape[1:]))], dim=0)
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    config = {
        "peft_type": "LORA",
        "r": k,
        "lora_alpha": k,
        "use_rslora": False,
        "target_modules": sorted(cats),
        "fan_in_fan_out": any(a.fan_in_fan_out for a, _ in stack),
        "bias": "none",
        "use_dora": False,
        "lora_dropout": 0.0,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path,
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / PEFT_WEIGHTS), metadata={"format": "pt"})
    (folder / PEFT_CONFIG).write_text(json.dumps(config, indent=2))
    return folder
