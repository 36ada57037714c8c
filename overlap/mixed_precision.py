"""Mixed precision for the sharded runtime: which dtype each stage of a step runs in."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

__all__ = ["MixedPrecision"]


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of a sharded step; ``None`` keeps the parameter's own dtype.

    * ``param_dtype``: the all-gather and the forward/backward compute (unsharded parameters and the
      floating-point forward inputs are cast to it). Sharded parameters (the optimizer's master
      copy) keep their dtype.
    * ``reduce_dtype``: the reduce-scatter of gradients (defaults to ``param_dtype``); the reduced
      shard is cast back to the sharded parameter's dtype on the way out. Where it is wider than
      ``param_dtype``, micro-batches under ``no_sync`` also accumulate their gradients in it, as
      FSDP2's do.
    * ``output_dtype``: floating-point outputs of the root module are cast to it.
    * ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype`` (FSDP2's
      ``MixedPrecisionPolicy.cast_forward_inputs``); off, the module gets its inputs as they are.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecision.cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}")
        for field in dataclasses.fields(self):
            if field.name == "cast_forward_inputs":
                continue
            value = getattr(self, field.name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(
                    f"MixedPrecision.{field.name} must be None or a floating-point torch.dtype "
                    f"(e.g. torch.bfloat16, torch.float16, torch.float32), got {value!r}"
                )

    @property
    def effective_reduce_dtype(self) -> Optional[torch.dtype]:
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype

    def torch_policy(self) -> Any:
        """The same policy as torch's ``MixedPrecisionPolicy`` (what FSDP2's all-gather extension,
        ``fsdp_pre_all_gather``, is passed): ``reduce_dtype`` as the one the reductions use."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.effective_reduce_dtype,
                                    output_dtype=self.output_dtype, cast_forward_inputs=self.cast_forward_inputs)
