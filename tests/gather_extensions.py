"""Weights with FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), for
the tests: a float32 weight, as a tensor subclass, that chooses what its all-gather moves.

* ``mode="bf16"``: the all-gather moves the shard cast to bfloat16 (one input), and the unsharded
  weight is that cast to the compute dtype (torch's own extension tests do the same);
  ``fsdp_pre_all_gather`` of the 5-argument signature.
* ``mode="int8"``: the all-gather moves int8 codes and one float32 scale per row (two inputs of two
  dtypes, as torchao's quantized weights move data and scales), and the unsharded weight is the
  dequantized rows; ``fsdp_pre_all_gather(mesh)``, the older signature. Quantizing per row makes
  the gathered weight independent of how the rows are sharded: ``row_int8`` of the full weight.

Every op but those that keep the subclass (slicing, views, copies, as torchao's weights keep) runs on
the float32 data and returns plain tensors.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

_KEEP = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten.split.Tensor, torch.ops.aten.clone.default,
    torch.ops.aten.narrow.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default,
}


def row_int8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 codes and float32 scales of a 2-D tensor."""
    scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(rows / scale).to(torch.int8), scale


class GatheredWeight(torch.Tensor):
    """A float32 weight whose all-gather moves ``mode``'s format (see the module docstring)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, mode: str) -> "GatheredWeight":
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, mode: str) -> None:
        self._data, self._mode = data, mode

    def __repr__(self) -> str:
        return f"GatheredWeight({self._mode}, {self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], str]:
        return ["_data"], self._mode

    @staticmethod
    def __tensor_unflatten__(inner: dict, mode: str, outer_size: Any, outer_stride: Any) -> "GatheredWeight":
        return _KINDS[mode](inner["_data"], mode)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        mode = next(a._mode for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, GatheredWeight))
        args, kwargs = pytree.tree_map_only(GatheredWeight, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func in _KEEP:
            return pytree.tree_map_only(torch.Tensor, lambda t: _KINDS[mode](t, mode), out)
        return out

    # ------------------------------------------------------------------ FSDP2's all-gather extension
    def _inputs(self) -> tuple[torch.Tensor, ...]:
        if self._mode == "bf16":
            return (self._data.to(torch.bfloat16),)
        return row_int8(self._data)

    def _unsharded(self, outputs: tuple[torch.Tensor, ...], param_dtype: torch.dtype) -> torch.Tensor:
        if self._mode == "bf16":
            return outputs[0].to(param_dtype)
        codes, scale = outputs
        return (codes.to(torch.float32) * scale).to(param_dtype)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: Optional[torch.Tensor] = None) -> Any:
        assert metadata == ("meta", self._mode), metadata
        unsharded = self._unsharded(all_gather_outputs, param_dtype)
        if out is not None:
            if out.data_ptr() != unsharded.data_ptr():  # a bf16 output of bf16 is the all-gather output itself
                # A refill, not a change autograd must see (FSDP2 leaves the counter to the extension).
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(unsharded[: out.shape[0]])  # the outputs hold padded rows where shards are uneven
            return None
        return unsharded, (unsharded,)


class Bf16Gathered(GatheredWeight):
    """``mode="bf16"``, with FSDP2's 5-argument ``fsdp_pre_all_gather``."""

    def fsdp_pre_all_gather(self, mesh: Any, orig_size: torch.Size, contiguous_orig_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        assert isinstance(module, nn.Module) and len(orig_size) == self.dim(), (module, orig_size)
        return self._inputs(), ("meta", self._mode)


class Int8Gathered(GatheredWeight):
    """``mode="int8"``, with the older ``fsdp_pre_all_gather(mesh)``."""

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        return self._inputs(), ("meta", self._mode)


_KINDS = {"bf16": Bf16Gathered, "int8": Int8Gathered}


def gathered_weights(model: nn.Module, mode: str) -> nn.Module:
    """Make every ``nn.Linear``'s weight under ``model`` a ``mode`` weight (biases stay plain)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(_KINDS[mode](m.weight.detach(), mode), requires_grad=m.weight.requires_grad)
    return model
