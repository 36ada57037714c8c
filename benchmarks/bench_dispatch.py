"""Per-op cost of a finished collective result: AsyncTensor vs plain tensor vs torch's AsyncCollectiveTensor.

Also the cost of issue + first use (the wait) of one small all-reduce. Runs a one-rank gloo group in
this process (no communication worth measuring: the point is the Python/dispatch cost).

    python benchmarks/bench_dispatch.py [--numel 16] [--iters 20000] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from _common import parse, parser, single_rank_group  # first: sys.path
import overlap
from report import emit
from timing import seconds_per_call


def _us_per_call(fn: Callable[[], object], iters: int, repeats: int = 5) -> float:
    return 1e6 * seconds_per_call(fn, iters, repeats, warmup=max(iters // 10, 10))


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--numel", type=int, default=16, help="elements of the tensor (default 16)")
    p.add_argument("--iters", type=int, default=20000, help="ops per timing sample (default 20000)")
    args = parse(p, argv)
    with single_rank_group():
        _measure(args)


def _measure(args: argparse.Namespace) -> None:
    group = dist.group.WORLD
    x = torch.randn(args.numel)

    plain = x.clone()
    ours = overlap.all_reduce(x)
    overlap.wait(ours)
    theirs = funcol.all_reduce(x, "sum", group)
    theirs + 0  # first use waits; the object stays an AsyncCollectiveTensor
    op = {
        "plain tensor": _us_per_call(lambda: plain + 1, args.iters),
        "AsyncTensor (finished)": _us_per_call(lambda: ours + 1, args.iters),
        "torch AsyncCollectiveTensor (finished)": _us_per_call(lambda: theirs + 1, args.iters // 4),
    }
    issue = {
        "overlap.all_reduce + first use": _us_per_call(lambda: overlap.all_reduce(x) + 1, args.iters // 20),
        "funcol.all_reduce + first use": _us_per_call(lambda: funcol.all_reduce(x, "sum", group) + 1, args.iters // 20),
        "dist.all_reduce (blocking) + use": _us_per_call(lambda: _blocking(x) + 1, args.iters // 20),
    }
    base = op["plain tensor"]
    rows = [[name, f"{us:.2f}", f"{us / base:.2f}x"] for name, us in op.items()]
    base_issue = issue["dist.all_reduce (blocking) + use"]
    rows += [[name, f"{us:.2f}", f"{us / base_issue:.2f}x vs blocking"] for name, us in issue.items()]
    emit(f"Dispatch cost: `x + 1` on a {args.numel}-element CPU tensor; issue + first use of an all-reduce "
         "(1-rank gloo)", ["what", "µs per call (median of 5)", "ratio"], rows, args.markdown)


def _blocking(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y)
    return y


if __name__ == "__main__":
    main()
