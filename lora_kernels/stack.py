"""Merge a weighted stack of adapters into a model's weights, and restore them bit for bit.

The first merge of a weight keeps a pristine copy of it; every later merge is computed from that
copy straight into the weight (``W = W0 + delta``, never ``W -= old_delta``), and :meth:`restore`
copies it back, so merge -> restore round trips are exact however often they repeat. With
``offload=True`` the copy lives in host memory and each merge first copies it back, then merges in
place. :meth:`AdapterStack.switch` is what a server calls between requests: it either merges the
whole stack or leaves the pristine weights, never a half-merged model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .adapters import LoraAdapter, LoraModule
from .factors import NonFiniteFactors, folds_finite
from .ops import Backend, LoraFactor, Mode, merge_into


def resolve_module(modules: dict[str, nn.Module], key: str, adapter: str = "") -> str:
    """The model module an adapter key names: exact name, else the unique module whose name and the
    key agree on a whole-component suffix (handles ``model.`` wrappers on either side)."""
    if key in modules:
        return key
    parts = key.split(".")
    for i in range(1, len(parts)):  # key carries an extra prefix (longest remaining suffix first)
        if ".".join(parts[i:]) in modules:
            return ".".join(parts[i:])
    found = [n for n in modules if n.endswith("." + key)]  # model carries an extra prefix
    if len(found) == 1:
        return found[0]
    why = "no module" if not found else f"{len(found)} modules ({', '.join(found[:3])}...)"
    raise KeyError(f"adapter {adapter!r}: {why} of the model matches {key!r}")


def _as_2d(t: Tensor) -> Tensor:
    """A 2-D view sharing memory (merges write through it); never a copy."""
    if t.dim() == 2:
        return t
    if not t.is_contiguous():
        raise ValueError(f"a {tuple(t.shape)} weight that is not contiguous (channels_last?) cannot be merged in place")
    return t.view(t.shape[0], -1)


def is_transposed(module: nn.Module, lm: LoraModule, name: str) -> bool:
    """Whether the factors must be transposed to fit the module's 2-D weight (transformers' Conv1D
    stores ``[in, out]``: peft's fan_in_fan_out, which peft too decides by module type); checks fit."""
    w = getattr(module, "weight", None)
    kind = type(module).__name__
    if isinstance(module, nn.Linear) or (isinstance(module, nn.Conv2d) and module.groups == 1):
        transposed = False
    elif kind == "Conv1D" and isinstance(w, Tensor):
        transposed = True
    else:
        raise TypeError(f"module {name!r} ({kind}) is not a Linear, Conv1D or Conv2d: cannot merge LoRA into it")
    b, a = lm.factors(transposed)
    if (b.shape[0], a.shape[1]) != tuple(_as_2d(w).shape):
        raise ValueError(f"module {name!r}: LoRA delta {b.shape[0]}x{a.shape[1]} does not fit weight {tuple(w.shape)}")
    return transposed


class AdapterStack:
    """Merges weighted adapter stacks into one model and restores its pristine weights.

    ``apply([(a, 1.0), (b, 0.5)])`` sets every targeted weight to ``W0 + sum_i w_i s_i B_i A_i`` (one
    grouped merge); applying the same stack again is a no-op; applying another stack recomputes from
    the pristine copies; ``restore()`` (or leaving the ``with`` block) puts the exact originals back.
    """

    def __init__(self, model: nn.Module, *, mode: Mode = "exact", backend: Backend = "auto", offload: bool = False):
        """``offload=True`` keeps the pristine copies in host memory (pinned for CUDA weights) instead of
        beside the weights: no extra device memory, at the price of a host-to-device copy per switch."""
        self.model = model
        self.mode: Mode = mode
        self.backend: Backend = backend
        self.offload = offload
        self._modules = dict(model.named_modules())
        self._pristine: dict[str, Tensor] = {}
        self._merged: tuple[tuple[LoraAdapter, float], ...] | None = None

    @property
    def merged(self) -> tuple[tuple[LoraAdapter, float], ...] | None:
        """The stack currently merged (None when the model is pristine)."""
        return self._merged

    def _is_merged(self, stack: tuple[tuple[LoraAdapter, float], ...]) -> bool:
        cur = self._merged
        return cur is not None and len(cur) == len(stack) and all(
            a is b and wa == wb for (a, wa), (b, wb) in zip(cur, stack)
        )

    def apply(self, stack: Sequence[tuple[LoraAdapter, float]]) -> AdapterStack:
        """Merge ``sum_i w_i * adapter_i`` into the model (from the pristine weights)."""
        stack = tuple((adapter, float(w)) for adapter, w in stack)
        if self._is_merged(stack):
            return self
        targets: dict[str, list[LoraFactor]] = {}
        for adapter, w in stack:  # resolve and check everything before touching a weight
            for key, lm in adapter.modules.items():
                name = resolve_module(self._modules, key, adapter.name)
                b, a = lm.factors(is_transposed(self._modules[name], lm, name))
                if not folds_finite(b, lm.scale * w):
                    raise NonFiniteFactors(f"adapter {adapter.name!r} at weight {w:g}: module {key!r}'s factors "
                                           "are not finite with the weight folded in")
                targets.setdefault(name, []).append((b, a, lm.scale * w))
        with torch.no_grad():
            for name in [n for n in self._pristine if n not in targets]:
                self._modules[name].weight.copy_(self._pristine.pop(name))
            srcs, dsts = [], []
            for name in targets:
                weight = self._modules[name].weight.detach()
                if name not in self._pristine:
                    self._pristine[name] = self._keep(weight)
                elif self.offload:
                    weight.copy_(self._pristine[name], non_blocking=True)
                srcs.append(_as_2d(weight if self.offload else self._pristine[name]))
                dsts.append(_as_2d(weight))
            self._merged = None  # in case the merge fails half way
            merge_into(srcs, list(targets.values()), out=dsts, mode=self.mode, backend=self.backend)
        self._merged = stack
        return self

    def switch(self, stack: Sequence[tuple[LoraAdapter, float]]) -> AdapterStack:
        """Make the weights serve ``stack``: merge it (from the pristine weights), or restore them
        for the empty stack. A merge that fails, even half way through the weights (out of memory
        in a later group, a bad factor), restores the pristine weights bit for bit, then re-raises."""
        if not stack:
            self.restore()
            return self
        try:
            return self.apply(stack)
        except BaseException:
            self.restore()
            raise

    def _keep(self, weight: Tensor) -> Tensor:
        if not self.offload:
            return weight.clone()
        return weight.to("cpu", copy=True).pin_memory() if weight.is_cuda else weight.clone()

    def restore(self) -> None:
        """Copy the pristine weights back (bit for bit) and forget them."""
        with torch.no_grad():
            for name, pristine in self._pristine.items():
                self._modules[name].weight.copy_(pristine)
        self._pristine.clear()
        self._merged = None

    def __enter__(self) -> AdapterStack:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
