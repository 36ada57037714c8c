"""fp16 gradient reduction: the average over ranks must not overflow where the average fits
(see [Note: fp16 gradients are averaged before they are summed] in ``overlap/param_group.py``).

Each rank's gradient is 40000 in every element (fp16's largest value is 65504): the sum over 2 or
4 ranks overflows, the average does not. Expected: the sharded gradient equals 40000 exactly (the
pre-scaled values 20000 / 10000 are exact in fp16, and so are their sums).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import overlap

GRAD = 40000.0


def _fp16_grad_rank(rank: int, world: int) -> list[float]:
    layer = nn.Linear(4, 8, bias=False)
    overlap.shard(layer, mp=overlap.MixedPrecision(param_dtype=torch.float16))
    x = torch.ones(1, 4)
    (layer(x).float() * GRAD).sum().backward()  # d/dW of sum(GRAD * W x) = GRAD * x = GRAD
    grad = layer.weight.grad
    return [grad.dtype == torch.float32, *grad.to_local().flatten().tolist()]


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp16_reduce_scatter_averages_without_overflow(distributed, world_size: int) -> None:
    for rank, (is_fp32, *values) in enumerate(distributed(_fp16_grad_rank, world_size)):
        assert is_fp32  # reduced in fp16, cast back to the sharded parameter's dtype
        rows = 8 // world_size
        assert values == [GRAD] * (rows * 4), (rank, values)
