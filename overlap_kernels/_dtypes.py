"""The dtypes the packing ops take, and the precision they compute in.

Contract: ``TRITON_DTYPES`` is the supported set (torch dtype -> the Triton dtype the kernels use);
one call mixes at most ``MAX_DTYPE_GROUPS`` of them on its parameter side. Scaling and accumulation
happen in ``compute_dtype`` of every tensor involved, with the scale rounded by ``as_float32``: the
kernels, the torch fallback and the references all follow these rules, which is what makes them
bitwise interchangeable.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton.language as tl

TRITON_DTYPES: dict[torch.dtype, tl.dtype] = {
    torch.float64: tl.float64,
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.int64: tl.int64,
    torch.int32: tl.int32,
    torch.int16: tl.int16,
    torch.int8: tl.int8,
    torch.uint8: tl.uint8,
}
SUPPORTED = ", ".join(str(d).removeprefix("torch.") for d in TRITON_DTYPES)
MAX_DTYPE_GROUPS = 4
"""Dtypes one call may mix on its parameter side (one branch each in the kernels' ``load_as`` and
``store_as``, ``overlap_kernels._jit``)."""


def compute_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """Precision of scaling and accumulation: float64 if any tensor is float64, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def as_float32(value: float) -> float:
    """A scale as the kernels apply it: rounded to float32 (a Triton float argument)."""
    return float(np.float32(value))
