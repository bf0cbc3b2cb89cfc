"""Merging many LoRA adapters into base weights: a fused Triton kernel (one launch per weight
group), the equivalent fused torch path, plain reference paths, exact restore, and adapter I/O."""

from .adapters import (
    AdapterFormatError,
    AdapterRefused,
    LoraAdapter,
    LoraModule,
    concat_stack,
    load_diffusers_lora,
    load_peft_adapter,
    save_stack_as_peft,
)
from .factors import NonFiniteFactors
from .ops import LoraFactor, Mode, concat_factors, merge_into, merge_loop, merge_reference
from .stack import AdapterStack

__all__ = [
    "AdapterFormatError",
    "AdapterRefused",
    "AdapterStack",
    "LoraAdapter",
    "LoraFactor",
    "LoraModule",
    "Mode",
    "NonFiniteFactors",
    "concat_factors",
    "concat_stack",
    "load_diffusers_lora",
    "load_peft_adapter",
    "merge_into",
    "merge_loop",
    "merge_reference",
    "save_stack_as_peft",
]
