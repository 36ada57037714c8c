"""Training a client model exact and compressed, side by side from the same weights: shared by
``benchmarks/train_compressed_clients.py`` (300 steps, the loss curves in docs/) and
``test_compressed_training.py`` (a few steps in the default suite, 300 under ``-m slow``).

Each run: the client built from ``models.SEED``, ``overlap.shard`` on each block then on the root,
the tests' AdamW, the client's batches (this rank's slice); the global loss per step, the relative
error of the reduced gradients per step over every rank's shards (compressed runs:
``overlap.measure_gradient_error``, which changes no gradient), and the held-out loss of the final
weights.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

import torch
import torch.distributed as dist

import overlap
from client_zoo import LLAMA3, NANOGPT, Client
from models import SEED, global_mean, local_batch, make_optimizer

__all__ = ["CLIENTS", "EVAL_BATCHES", "MODES", "held_out_loss", "train", "train_clients"]

CLIENTS = {c.name: c for c in (NANOGPT, LLAMA3)}

MODES = {  # name: (compress, mp)
    "exact": (None, None),
    "int8": (overlap.Compression(), None),
    "fp8": (overlap.Compression(gather="fp8"), None),
    "fp8 reduce": (overlap.Compression(gather="int8", reduce="fp8"), None),
    "fp8 both": (overlap.Compression(gather="fp8", reduce="fp8"), None),
    "bf16 reduce": (None, overlap.MixedPrecision(reduce_dtype=torch.bfloat16)),
}
"""``fp8``: e4m3 all-gathers with int8 reductions; ``fp8 reduce``: int8 all-gathers with e4m3
reductions (``int8`` but for the reduction's codes); ``fp8 both``: e4m3 for both (``fp8`` but for the
reduction's codes). ``bf16 reduce`` is the control: exact collectives whose only change is the
gradients' rounding to bfloat16 in the reduce-scatter (a perturbation smaller than int8's: bf16
rounds each element by at most 2^-9 relative): how far any small perturbation moves these short,
noisy runs."""
EVAL_BATCHES = 16
EVAL_SEED = 100_000  # held-out batches: make_batch seeds no training step uses
SEED_STRIDE = 10_000
"""Batch seeds per ``seed``: run ``seed`` trains on ``make_batch`` seeds ``seed * SEED_STRIDE + step``
(below ``EVAL_SEED`` for ``seed`` <= 8 at up to 10,000 steps)."""


def train(client: Client, mode: str, steps: int, rank: int, world: int, seed: int = 0) -> dict[str, Any]:
    """One run of ``client`` in ``mode`` (a key of ``MODES``): ``{"loss": [global loss per step],
    "gradient_error": [relative error per step, compressed runs only], "eval": held-out loss}``.
    ``seed`` 0 is the tests' run; another draws the initial weights from ``SEED + seed`` and the
    training batches from ``SEED_STRIDE * seed + step`` (the held-out batches stay the same)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 8:
        raise ValueError(f"seed must be an int in 0..8, got {seed!r}")
    compress, mp = MODES[mode]
    torch.manual_seed(SEED + seed)
    model = client.build()
    for block in client.blocks(model):
        overlap.shard(block, compress=compress, mp=mp)
    overlap.shard(model, compress=compress, mp=mp)
    opt = make_optimizer(model.parameters())
    losses, errors = [], []
    overlap.take_gradient_errors()
    with overlap.measure_gradient_error(compress is not None):
        for step in range(steps):
            loss = client.loss(model, local_batch(client.batch(SEED_STRIDE * seed + step), rank, world))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(global_mean(loss))
            if compress is not None:
                errors.append(overlap.relative_gradient_error(overlap.take_gradient_errors(), group=dist.group.WORLD))
    return {"loss": losses, "gradient_error": errors, "eval": held_out_loss(client, model)}


def held_out_loss(client: Client, model: torch.nn.Module) -> float:
    """The trained weights (exact: the full state dict) in a plain, unsharded model, mean loss over
    ``EVAL_BATCHES`` held-out global batches: the model's quality without a training batch's noise."""
    state = overlap.full_state_dict(model, rank0_only=False)
    torch.manual_seed(SEED)
    plain = client.build()
    plain.load_state_dict(state)
    with torch.no_grad():
        return statistics.mean(float(client.loss(plain, client.batch(EVAL_SEED + i))) for i in range(EVAL_BATCHES))


def train_clients(rank: int, world: int, clients: Sequence[str], steps: int,
                  modes: Sequence[str] = tuple(MODES), seed: int = 0) -> dict[str, dict[str, Any]]:
    """``{client: {mode: train(...)}}`` on this rank (one thread), for ``run_distributed``."""
    torch.set_num_threads(1)
    return {name: {mode: train(CLIENTS[name], mode, steps, rank, world, seed) for mode in modes} for name in clients}
