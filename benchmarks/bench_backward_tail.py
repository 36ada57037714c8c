"""The end-of-backward tail of ``overlap.shard``, with the reduce-scatter epilogues run as soon as
their collectives complete (the runtime's behaviour) vs all of them at the end of backward.

Same model, link calibration and training step as ``bench_train.py`` (2 gloo ranks, MLP blocks,
AdamW, emulated link with comm ~ compute). The tail is the time spent in the final autograd
callback (flush the last reduce-scatters, wait for every one, run the epilogues left, reshard),
measured around ``_Root._end_backward``; "epilogues at the end" replaces the runtime's early
epilogue (``_Root._finish_completed_reduces``) with nothing, which is how the runtime behaved before.
Both variants alternate step by step in one run; medians of the slowest rank.

    python benchmarks/bench_backward_tail.py [--steps 12] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _common import mlp_parser, mlp_step, parse, rank_input  # first: sys.path
from overlap.demo.training import calibrate_link
from overlap.testing import emulated_link, run_distributed
from report import emit

VARIANTS = ("epilogue as soon as complete", "epilogues at the end")


def _tail_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from overlap.sharding import _Root

    x = rank_input(args.batch, args.dim, rank)
    gbps = calibrate_link(mlp_step("overlap", args.blocks, args.dim, x), args.latency_us)

    tails: list[float] = []
    end_backward, early = _Root._end_backward, _Root._finish_completed_reduces

    def timed_end_backward(self: _Root) -> None:
        start = time.perf_counter()
        end_backward(self)
        tails.append(time.perf_counter() - start)

    steps = {v: mlp_step("overlap", args.blocks, args.dim, x) for v in VARIANTS}
    out: dict[str, Any] = {v: {"step": [], "tail": []} for v in VARIANTS}
    _Root._end_backward = timed_end_backward  # type: ignore[method-assign]
    try:
        with emulated_link(gbps, args.latency_us):
            for i in range(args.warmup + args.steps):
                for variant in VARIANTS:
                    _Root._finish_completed_reduces = early if variant == VARIANTS[0] else (lambda self: None)
                    tails.clear()
                    start = time.perf_counter()
                    steps[variant]()
                    elapsed = time.perf_counter() - start
                    if i >= args.warmup:
                        out[variant]["step"].append(elapsed)
                        out[variant]["tail"].append(sum(tails))
    finally:
        _Root._end_backward, _Root._finish_completed_reduces = end_backward, early  # type: ignore[method-assign]
    out["gbps"] = gbps
    return out


def main(argv: list[str] | None = None) -> None:
    # No --link-gbps: always calibrated (the title says comm ~ compute).
    p = mlp_parser(__doc__, 12, "timed steps per variant", 2, "untimed steps per variant", gbps_default=None)
    args = parse(p, argv)
    results = run_distributed(_tail_rank, args.world_size, args, timeout=600)
    rows = []
    base_tail = None
    for variant in VARIANTS:
        step = statistics.median(max(r[variant]["step"][i] for r in results) for i in range(args.steps))
        tail = statistics.median(max(r[variant]["tail"][i] for r in results) for i in range(args.steps))
        base_tail = tail if base_tail is None else base_tail
        rows.append([variant, f"{step * 1e3:.1f}", f"{tail * 1e3:.2f}", f"{tail / base_tail:.2f}x"])
    emit(f"End-of-backward tail of overlap.shard, {args.world_size} CPU ranks (gloo), {args.blocks} MLP blocks "
         f"of width {args.dim}, AdamW; emulated link {results[0]['gbps']:.2f} Gbit/s + {args.latency_us:g} µs "
         f"(comm ~ compute); medians of {args.steps} alternating steps, slowest rank",
         ["variant", "step ms", "tail ms (final backward callback)", "tail vs runtime"], rows, args.markdown)


if __name__ == "__main__":
    main()
