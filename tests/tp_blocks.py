"""Tensor-parallel blocks and their torch TP plans, shared by ``parallel/test_tensor_parallel.py``,
the bad-input matrix and ``benchmarks/bench_tp.py`` (a helper module, not a test file).

Inputs are ``(batch, seq, dim)``; the sequence dim is 1. Plans use torch's own styles, exactly as
they go to ``parallelize_module``:

=================  =========================================================  =======================
block              plan                                                       input / output
=================  =========================================================  =======================
``sp_mlp``         norm ``SequenceParallel``, w1 ``Colwise(Shard(1) in)``,     ``Shard(1)`` / ``Shard(1)``
                   gelu, w2 ``Rowwise(Shard(1) out)``
``attention``      wq, wk, wv ``Colwise``, SDPA on the local heads, wo         replicated / replicated
                   ``Rowwise``
``sp_attention``   norm ``SequenceParallel``, wq/wk/wv ``Colwise(Shard(1)      ``Shard(1)`` / ``Shard(1)``
                   in)``, wo ``Rowwise(Shard(1) out)``
``mlp``            w1 ``Colwise``, gelu, w2 ``Rowwise`` (Megatron MLP)          replicated / replicated
``prepared_attn``  torchtitan's: norm ``SequenceParallel``, attn                ``Shard(1)`` / ``Shard(1)``
                   ``PrepareModuleInput(Shard(1) -> Replicate())`` (one
                   gather), attn.wq/wk/wv ``Colwise`` (a replicated
                   DTensor input), attn.wo ``Rowwise(Shard(1) out)``
=================  =========================================================  =======================

Sizes (defaults): ``dim=16``, ``hidden=32``, ``heads=4`` (head dim 4): hidden, dim and heads divide
by 2 and 4 ranks; on 3 ranks use ``dim=12``, ``hidden=24``, ``heads=3`` (:func:`sizes_for`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

__all__ = ["BLOCKS", "SP_BLOCKS", "Attention", "MLP", "NormAttention", "make_block", "plan_for", "sizes_for"]


class MLP(nn.Module):
    """``[norm] -> w1 -> gelu -> w2``; the norm only in the sequence-parallel variant."""

    def __init__(self, dim: int, hidden: int, bias: bool = True, norm: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim) if norm else nn.Identity()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(self.norm(x))))


class Attention(nn.Module):
    """Causal multi-head attention with separate q, k, v projections; the head count is read off
    the local projection width, so the same code runs unsharded and on local heads."""

    def __init__(self, dim: int, heads: int, bias: bool = True, norm: bool = False) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.norm = nn.LayerNorm(dim) if norm else nn.Identity()
        self.wq = nn.Linear(dim, dim, bias=bias)
        self.wk = nn.Linear(dim, dim, bias=bias)
        self.wv = nn.Linear(dim, dim, bias=bias)
        self.wo = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s, width = q.shape
        h = width // self.head_dim

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, h, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, width))


class NormAttention(nn.Module):
    """``norm -> attn`` with the attention a child module (a plan can prepare its input)."""

    def __init__(self, dim: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.norm(x))


BLOCKS = ("sp_mlp", "attention", "sp_attention", "mlp", "prepared_attn")
SP_BLOCKS = ("sp_mlp", "sp_attention", "prepared_attn")


def sizes_for(world: int) -> dict[str, int]:
    """``dim``, ``hidden``, ``heads`` that divide by ``world`` ranks."""
    if world % 3 == 0:
        return {"dim": 12, "hidden": 24, "heads": 3}
    return {"dim": 16, "hidden": 32, "heads": 4}


def make_block(name: str, bias: bool = True, seed: int = 0, dim: int = 16, hidden: int = 32,
               heads: int = 4) -> nn.Module:
    """A fresh block ``name`` (one of :data:`BLOCKS`) with weights from ``seed``."""
    torch.manual_seed(seed)
    if name in ("sp_mlp", "mlp"):
        return MLP(dim, hidden, bias, norm=name == "sp_mlp")
    if name in ("attention", "sp_attention"):
        return Attention(dim, heads, bias, norm=name == "sp_attention")
    if name == "prepared_attn":
        return NormAttention(dim, heads, bias)
    raise ValueError(f"block must be one of {BLOCKS}, got {name!r}")


def plan_for(name: str) -> dict:
    """The torch TP plan of block ``name`` (fresh style objects each call)."""
    if name == "sp_mlp":
        return {"norm": SequenceParallel(), "w1": ColwiseParallel(input_layouts=Shard(1)),
                "w2": RowwiseParallel(output_layouts=Shard(1))}
    if name == "mlp":
        return {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    if name == "attention":
        return {"w[qkv]": ColwiseParallel(), "wo": RowwiseParallel()}  # fnmatch, as torch matches keys
    if name == "sp_attention":
        plan = {"norm": SequenceParallel()}
        plan.update({f"w{p}": ColwiseParallel(input_layouts=Shard(1)) for p in "qkv"})
        plan["wo"] = RowwiseParallel(output_layouts=Shard(1))
        return plan
    if name == "prepared_attn":
        return {"norm": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attn.w[qkv]": ColwiseParallel(), "attn.wo": RowwiseParallel(output_layouts=Shard(1))}
    raise ValueError(f"block must be one of {BLOCKS}, got {name!r}")
