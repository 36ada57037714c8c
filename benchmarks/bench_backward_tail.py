"""The end-of-backward tail of ``overlap.shard``, with the reduce-scatter epilogues run as soon as
their collectives complete (the runtime's behaviour) vs all of them at the end of backward.

Same model, link calibration and training step as ``bench_train.py`` part 1 (2 gloo ranks, MLP
blocks, AdamW, emulated link with comm ~ compute). The tail is the time spent in the final autograd
callback (flush the last reduce-scatters, wait for every one, run the epilogues left, reshard),
measured around ``_Root._end_backward``; "epilogues at the end" replaces the runtime's early
epilogue (``_Root._finish_completed_reduces``) with nothing, which is how the runtime behaved before.
Both variants alternate step by step in one run; medians of the slowest rank.

    python benchmarks/bench_backward_tail.py [--steps 12] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import _mlp, _sharded, _step_fn  # noqa: E402
from overlap.testing import emulated_link, paired_steps, run_distributed  # noqa: E402
from overlap.demo.training import calibrated_gbps, measure_traffic  # noqa: E402
from report import emit  # noqa: E402

VARIANTS = ("epilogue as soon as complete", "epilogues at the end")


def _tail_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from overlap.sharding import _Root

    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))
    probe = _step_fn(*_sharded("overlap", _mlp(args.blocks, args.dim)), x)
    compute = paired_steps(probe, 3, 1e9, 0.0, warmup=2).unlinked
    gbps = calibrated_gbps(compute, *measure_traffic(probe), args.latency_us)

    tails: list[float] = []
    end_backward, early = _Root._end_backward, _Root._finish_completed_reduces

    def timed_end_backward(self: _Root) -> None:
        start = time.perf_counter()
        end_backward(self)
        tails.append(time.perf_counter() - start)

    steps = {v: _step_fn(*_sharded("overlap", _mlp(args.blocks, args.dim)), x) for v in VARIANTS}
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per variant (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (default 2)")
    parser.add_argument("--blocks", type=int, default=8, help="MLP blocks (default 8)")
    parser.add_argument("--dim", type=int, default=256, help="MLP width (default 256)")
    parser.add_argument("--batch", type=int, default=256, help="rows per rank (default 256)")
    parser.add_argument("--latency-us", type=float, default=20.0, help="link latency per collective (default 20)")
    parser.add_argument("--markdown", help="append the table to this markdown file")
    args = parser.parse_args(argv)
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
