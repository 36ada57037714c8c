"""Parameters sharded on dim 1 (FSDP2's ``shard_placement_fn`` returning ``Shard(1)``) vs dim 0: step time under overlap.fully_shard and FSDP2.

What is measured. ``bench_train.py``'s MLP (2 gloo ranks, blocks of Linear dim -> 2 dim -> dim, AdamW,
float32), each block and the root sharded by ``overlap.fully_shard`` and by torch's ``fully_shard``,
with the default placement (dim 0) and with every matrix on dim 1 (``Shard(1)``; the biases stay on
dim 0). Sharding on dim 1 costs two copies per matrix and step in both runtimes: the gathered chunks
concatenated along dim 1 into the unsharded weight, and the gradient's chunks concatenated into the
reduce-scatter's rows ([Note: sharding on another dim] in ``overlap/dim_sharding.py``). Behind the
emulated link (calibrated so that the dim-0 step's comm takes about as long as its compute, or
``--link-gbps``); every mode steps in turn, round by round, in one run; medians of the slowest rank.
Each runtime's losses with one placement are checked bitwise equal to the other runtime's.

    python benchmarks/bench_shard_placement.py [--steps 8] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from _common import (interleaved_rounds, mlp, mlp_parser, parse, rank_input, same_losses,  # first: sys.path
                     slowest_rank_medians)
from overlap.demo.training import calibrate_link, make_optimizer
from overlap.testing import emulated_link, run_distributed
from report import emit

MODES = [(runtime, dim) for dim in (0, 1) for runtime in ("overlap", "fsdp2")]


def _label(runtime: str, dim: int) -> str:
    return f"{'overlap.fully_shard' if runtime == 'overlap' else 'torch FSDP2'}, matrices on dim {dim}"


def _step(runtime: str, dim: int, args: argparse.Namespace, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Shard

    import overlap

    model = mlp(args.blocks, args.dim)
    shard = overlap.fully_shard if runtime == "overlap" else torch_fully_shard
    placement = (lambda p: Shard(1) if p.dim() == 2 else None) if dim else None
    for block in model:
        shard(block, shard_placement_fn=placement)
    shard(model, shard_placement_fn=placement)
    optimizer = make_optimizer(model, 1e-3)

    def step() -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    x = rank_input(args.batch, args.dim, rank)
    gbps = args.link_gbps or calibrate_link(_step("overlap", 0, args, x), args.latency_us)
    steps = {_label(*m): _step(*m, args, x) for m in MODES}
    with emulated_link(gbps, args.latency_us):
        out: dict[str, Any] = interleaved_rounds(steps, args.warmup, args.steps)
    out["gbps"] = gbps
    return out


def main(argv: list[str] | None = None) -> None:
    p = mlp_parser(__doc__, 8, "timed rounds", 2, "untimed rounds")
    args = parse(p, argv)
    results = run_distributed(_rank, args.world_size, args, timeout=1800)
    labels = [_label(*m) for m in MODES]
    median = slowest_rank_medians(results, labels, args.steps)
    rows = []
    for (runtime, dim), label in zip(MODES, labels):
        same = same_losses(results, label, _label("fsdp2" if runtime == "overlap" else "overlap", dim))
        rows.append([label, f"{median[label] * 1e3:.1f}", f"{median[label] / median[_label(runtime, 0)]:.2f}x",
                     f"{median[label] / median[_label('fsdp2', dim)]:.2f}x", "yes" if same else "NO"])
    emit(f"Sharding on dim 1, {args.world_size} CPU ranks (gloo), {args.blocks} MLP blocks of width {args.dim}, AdamW, "
         f"float32; emulated link {results[0]['gbps']:.2f} Gbit/s + {args.latency_us:g} µs; medians of {args.steps} "
         f"interleaved rounds, slowest rank",
         ["mode", "step ms", "vs the same runtime on dim 0", "vs FSDP2 on the same dim",
          "losses bitwise the other runtime's"], rows, args.markdown)


if __name__ == "__main__":
    main()
