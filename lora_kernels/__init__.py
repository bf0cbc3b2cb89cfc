"""Merging many LoRA adapters into base weights: a fused Triton kernel (one launch per weight
group), the equivalent fused torch path, plain reference paths, exact restore, and adapter I/O."""
