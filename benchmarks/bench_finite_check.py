"""Cost of the finite check (``overlap.set_check_finite``) per step: before it existed, off, and on.

The model is ``--blocks`` tiny blocks (``nn.Linear(16, 16)`` + tanh), each sharded, then the root, on a
batch of 8 rows; a step is ``zero_grad``, forward, ``sum()``, backward (no optimizer). Every rank
times each step with ``time.perf_counter`` (host time: on CPU that is all of it) and reports the
median over ``--steps`` steps after ``--warmup``; a run's figure is the slowest rank's median, and a
row shows the minimum over rounds (the least disturbed run: on a shared box other processes only
add time) and the median. Three variants run side by side in each round, in an order rotated from round
to round, each in its own processes:

* ``before``: the tree at ``--before`` (a git revision without the check, extracted with ``git
  archive``; omitted: no such column);
* ``off``: this tree, check off (the default: one flag read per group per reduction);
* ``on``: this tree, check on (one ``vector_norm`` over the packed gradients and one small all-reduce
  per group, epilogues at the end of backward, one host read of the flags per group).

World size 1 (no reduce-scatter: the check is one ``_foreach_norm`` over the gradients moved to the
shards) and ``--world-size`` gloo ranks. A last row times what the runtime runs per group when the
check is off (``finite_check.SWITCH.on``, read in ``issue_reduce`` and in ``finishes_early``) with ``timeit``.

    python benchmarks/bench_finite_check.py --before b01283f [--blocks 16] [--steps 30] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _common import ROOT, add_world_size, parse, parser  # first: sys.path


def _rank(rank: int, world: int, mode: str, blocks: int, steps: int, warmup: int) -> float:
    import torch
    from torch import nn

    import overlap

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(blocks)])
    for block in model:  # a fixed depth: the check's cost is the subject, not the schedule's choice
        overlap.shard(block, prefetch=1)
    overlap.shard(model, prefetch=1)
    if mode != "before":
        overlap.set_check_finite(mode == "on")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def _child(mode: str, world: int, blocks: int, steps: int, warmup: int) -> None:
    from overlap.testing import run_distributed

    us = max(run_distributed(_rank, world, mode, blocks, steps, warmup, timeout=600))
    print(json.dumps({"us": us}))


def _run(tree: str, mode: str, world: int, args: object) -> float:
    script = os.path.join(tree, "benchmarks", os.path.basename(__file__))
    cmd = [sys.executable, script, "--child", mode, "--world-size", str(world), "--blocks", str(args.blocks),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["us"]


def _off_path_us() -> float:
    """µs per group of the lines the runtime runs for the check when it is off."""
    import timeit

    from overlap import finite_check

    finite_check.set_check_finite(False)

    def off_path() -> bool:  # issue_reduce and finishes_early each read the switch
        return finite_check.SWITCH.on or finite_check.SWITCH.on

    return min(timeit.repeat(off_path, number=100_000, repeat=5)) / 100_000 * 1e6


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    add_world_size(p)
    p.add_argument("--before", default=None, help="git revision without the check (the 'before' column); "
                   "omitted: no 'before' column")
    p.add_argument("--blocks", type=int, default=16, help="sharded blocks (default 16)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the variants side by side (default 5)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parse(p, argv)
    if args.child:
        _child(args.child, args.world_size, args.blocks, args.steps, args.warmup)
        return

    from report import emit

    trees = {"off": ROOT, "on": ROOT}
    scratch = None
    if args.before:
        scratch = tempfile.mkdtemp(prefix="bench_finite_before_")
        archive = subprocess.run(["git", "-C", ROOT, "archive", args.before], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", scratch], input=archive, check=True)
        shutil.copy(__file__, os.path.join(scratch, "benchmarks"))
        trees = {"before": scratch, **trees}
    try:
        rows = []
        for world in (1, args.world_size):
            samples: dict[str, list[float]] = {mode: [] for mode in trees}
            order = list(trees)
            for round_ in range(args.rounds):
                for mode in order[round_ % len(order):] + order[:round_ % len(order)]:  # rotated: no order bias
                    samples[mode].append(_run(trees[mode], mode, world, args))
            low = {mode: min(v) for mode, v in samples.items()}
            med = {mode: statistics.median(v) for mode, v in samples.items()}
            cells = [f"{low[m]:.0f} ({med[m]:.0f})" for m in trees]
            ratios = [f"{low['off'] / low['before']:.3f}x"] if "before" in low else []
            rows.append([str(world), *cells, *ratios, f"{low['on'] / low['off']:.2f}x",
                         f"{(low['on'] - low['off']) / args.blocks:.0f}"])
        off_lines = _off_path_us()
        rows.append(["off, per group (timeit)", *(f"{off_lines:.3f}" if m == "off" else "" for m in trees),
                     *([""] if args.before else []), "", ""])
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    header = ["ranks", *(f"{m} µs/step, min (median)" for m in trees), *(["off / before"] if args.before else []),
              "on / off", "on - off µs per group"]
    emit(f"Finite check: host time per step, {args.blocks} groups (blocks of Linear(16, 16) + tanh), forward + backward; median of {args.steps} steps, slowest rank, median of {args.rounds} "
         f"rounds" + (f"; before = {args.before}" if args.before else ""), header, rows, args.markdown)


if __name__ == "__main__":
    main()
