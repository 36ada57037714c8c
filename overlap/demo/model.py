"""The demo's model and data: a small GPT-style language model and synthetic token batches.

Used by ``python -m overlap demo``. Everything here is deterministic given its arguments
(``torch.manual_seed`` for the weights, an explicit seed for the tokens), so several runtimes
trained from the same seed on the same batches can be compared loss for loss.

Sizes (:data:`MODEL_SIZES`; parameters counted with the head untied from the token embedding, as
the demo builds it):

========  =====  ===  =====  ======  ===  =====  ===========  ================
size      vocab  dim  heads  layers  seq  batch  parameters   tokens per rank
========  =====  ===  =====  ======  ===  =====  ===========  ================
tiny        128   32      2       2   16      2  ~34 K        32
small      1024  256      4       4  128      4  ~3.7 M       512
medium     4096  512      8       6  256      4  ~23 M        1,024
========  =====  ===  =====  ======  ===  =====  ===========  ================

``batch`` is sequences per rank per step: the global batch grows with the world size.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODEL_SIZES", "ModelSize", "TransformerLM", "token_batch"]


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """Shape of a :class:`TransformerLM` and its per-rank batch (``batch`` sequences of ``seq``)."""

    vocab: int
    dim: int
    heads: int
    layers: int
    seq: int
    batch: int

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one rank trains on per step."""
        return self.batch * self.seq


MODEL_SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(vocab=128, dim=32, heads=2, layers=2, seq=16, batch=2),
    "small": ModelSize(vocab=1024, dim=256, heads=4, layers=4, seq=128, batch=4),
    "medium": ModelSize(vocab=4096, dim=512, heads=8, layers=6, seq=256, batch=4),
}


class _Block(nn.Module):
    """Pre-LayerNorm block: causal self-attention (``scaled_dot_product_attention``), then a 4x MLP.

    ``split_qkv``: separate ``q``, ``k``, ``v`` projections instead of one fused ``qkv``, so a
    column-parallel plan gives each rank whole heads (a fused weight's row shards would mix q, k
    and v). The head count is read off the projection's width (``head_dim`` fixed), so the same
    forward runs on a rank's local heads."""

    def __init__(self, dim: int, heads: int, split_qkv: bool = False) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads ({heads}) must divide dim ({dim})")
        self.head_dim = dim // heads
        self.norm1 = nn.LayerNorm(dim)
        if split_qkv:
            self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        else:
            self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(h).view(b, t, 3, -1, self.head_dim).unbind(2)
        else:
            q, k, v = (proj(h).view(b, t, -1, self.head_dim) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TransformerLM(nn.Module):
    """Token and position embeddings, ``size.layers`` blocks (``self.blocks``), a final LayerNorm and
    an output head, tied to the token embedding with ``tie_head`` (GPT-2's choice) or its own
    parameter (Llama's; then ``tok`` and ``head`` can be sharded as groups of their own, see
    :meth:`shard_units`).

    ``forward(tokens (b, t <= size.seq)) -> logits (b, t, vocab)``; :meth:`loss` takes ``(b, t + 1)``.
    """

    def __init__(self, size: ModelSize, tie_head: bool = False, split_qkv: bool = False) -> None:
        super().__init__()
        self.size = size
        self.tok = nn.Embedding(size.vocab, size.dim)
        self.pos = nn.Embedding(size.seq, size.dim)
        self.blocks = nn.ModuleList(_Block(size.dim, size.heads, split_qkv) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.dim)
        self.head = nn.Linear(size.dim, size.vocab, bias=False)
        if tie_head:
            self.head.weight = self.tok.weight
        else:
            nn.init.normal_(self.head.weight, std=0.02)
        nn.init.normal_(self.tok.weight, std=0.02)  # keeps the first loss near log(vocab)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.size.seq:
            raise ValueError(f"sequence length {t} exceeds the model's {self.size.seq} positions")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def shard_units(self, split_first_block: bool = False) -> list[nn.Module]:
        """The modules to shard one by one before the root, in forward order: each block and, when the
        head is untied, the token embedding first and the head last (as FSDP2 users shard them), so
        the groups gathered at the very start of forward (root, embedding) and reduced at the very
        end of backward are small, and the head's gather and reduction hide behind the blocks.

        ``split_first_block``: the first block's MLP projections (``blocks.0.up``, ``blocks.0.down``)
        become groups of their own, sharded before the block. The first block is the group forward
        needs right after the root and the embedding and backward reduces last, so its
        reduce-scatter, its step and its next-step gather form the end-of-step chain, which only its
        small neighbours can hide (``overlap/sharding.py``, [Note: deferred optimizer steps]).
        Split, that group is the attention third of the block (4 dim^2 of 12 dim^2), and the MLP's
        reduce-scatter goes out while the attention's backward runs. Same math (bitwise, tested).
        Not the default: interleaved with the whole wrapping in one process (small model, 2 ranks,
        calibrated link; ``benchmarks/bench_deferred_steps.py --compare split``) it gained once on a
        loaded box (2026-11-27: 1.03x ideal against 1.18x) and not on a quiet one (2026-12-03:
        split / whole per round 1.049, 1.023, 0.950 in three runs). The block's group stays
        unsharded around its MLP's groups; the prefetch choosers' byte model counts it
        (``scheduler/held_bytes.py``, [Note: the bytes a plan holds])."""
        first = self.blocks[0]
        split = [first.up, first.down] if split_first_block else []
        if self.head.weight is self.tok.weight:
            return [*split, *self.blocks]
        return [self.tok, *split, *self.blocks, self.head]

    def tensor_parallel_plan(self) -> dict:
        """Megatron's plan for the blocks, in torch's styles (for ``overlap.tensor_parallel`` and
        ``parallelize_module``): q, k, v and ``up`` column-parallel, ``out`` and ``down`` row-parallel;
        activations between blocks, embeddings, norms and head stay replicated. Needs ``split_qkv``."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if not hasattr(self.blocks[0], "q"):
            raise ValueError("tensor_parallel_plan: build the model with split_qkv=True (a fused qkv cannot be "
                             "split by heads)")
        return {"blocks.*.[qkv]": ColwiseParallel(), "blocks.*.up": ColwiseParallel(),
                "blocks.*.out": RowwiseParallel(), "blocks.*.down": RowwiseParallel()}

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy over ``tokens`` (b, t + 1), in float32."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def token_batch(size: ModelSize, step: int, rank: int, seed: int = 0) -> torch.Tensor:
    """``(size.batch, size.seq + 1)`` int64 tokens for ``rank`` at ``step``, a function of the arguments
    only: each row is an arithmetic progression mod ``vocab`` (random start, stride 1..4), so the loss
    falls as the model learns the strides."""
    g = torch.Generator().manual_seed(((seed * 1_000_003) + step) * 65_537 + rank)
    start = torch.randint(0, size.vocab, (size.batch, 1), generator=g)
    stride = torch.randint(1, 5, (size.batch, 1), generator=g)
    return (start + stride * torch.arange(size.seq + 1)) % size.vocab
