"""What ``overlap.profile()`` costs: a sharded training step with and without the profiler, paired.

Part 1 (``--world-size`` gloo ranks): an MLP of ``--blocks`` blocks of width ``--dim``, each sharded
with ``overlap.shard``, trained with AdamW (the demo-sized workload of ``bench_train.py``). Steps
alternate: one plain, one inside ``with overlap.profile() as prof: ...; prof.step()`` (entering and
leaving the profiler counted too), ``--steps`` pairs after warm-up, every step behind a barrier.
Reported: medians of the slowest rank, the median over pairs of profiled / plain step time (with
its quartiles: on a shared 2-core box the spread is wide, read the median), and the same ratio of
process CPU time (all threads), which other machine load disturbs less.
No link delay by default (the worst case: nothing dilutes the profiler's host cost); ``--link-gbps``
adds the emulated link.

Part 2 (one process, no process group): the hooks' cost per collective, off and on: issuing and
waiting an ``InflightWork`` with no underlying work, and entering a runtime region.

    python benchmarks/bench_profiler.py [--world-size 2] [--steps 20] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any, Callable

import torch.distributed as dist

from _common import mlp_parser, mlp_step, over_ranks, parse, rank_input  # first: sys.path
import overlap
from overlap.testing import emulated_link, run_distributed
from report import emit
from timing import seconds_per_call


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    step = mlp_step("overlap", args.blocks, args.dim, rank_input(args.batch, args.dim, rank))
    records = []

    def profiled() -> None:
        with overlap.profile() as prof:
            step()
            prof.step()
        records.append(len(prof.collectives))

    def timed(fn: Callable[[], None]) -> tuple[float, float]:
        """Wall seconds and this process's CPU seconds (all threads: gloo's, the profiler's) of ``fn``."""
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - start, time.process_time() - cpu

    link = emulated_link(args.link_gbps, args.latency_us) if args.link_gbps else contextlib.nullcontext()
    with link:
        for _ in range(args.warmup):
            timed(step)
            timed(profiled)
        plain, prof = [], []
        for i in range(args.steps):
            order = (step, profiled) if i % 2 == 0 else (profiled, step)  # alternate which goes first
            times = {fn: timed(fn) for fn in order}
            plain.append(times[step])
            prof.append(times[profiled])
    ratios = [p[0] / q[0] for p, q in zip(prof, plain)]
    cpu_ratios = [p[1] / q[1] for p, q in zip(prof, plain)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {"plain": over_ranks(statistics.median(t for t, _ in plain)),
            "profiled": over_ranks(statistics.median(t for t, _ in prof)),
            "ratio": over_ranks(statistics.median(ratios)), "q1": over_ranks(q1), "q3": over_ranks(q3),
            "cpu_ratio": over_ranks(statistics.median(cpu_ratios)), "collectives": records[-1]}


def _hook_costs(n: int) -> dict[str, float]:
    """Seconds per issue+wait of an InflightWork (no underlying work) and per region, off and on."""
    from overlap.inflight_work import InflightWork
    from overlap.regions import region

    def per_call(fn: Callable[[], None]) -> float:
        return seconds_per_call(fn, n, repeats=5, warmup=0)

    def collective() -> None:
        InflightWork("all_gather", 64, (), group="g").wait()

    def labelled() -> None:
        with region("overlap::pre_forward"):
            pass

    out = {"collective off": per_call(collective), "region off": per_call(labelled)}
    with overlap.profile():
        out["collective on"] = per_call(collective)
        out["region on"] = per_call(labelled)
    return out


def main(argv: list[str] | None = None) -> None:
    p = mlp_parser(__doc__, 20, "timed pairs of steps", 3, "untimed pairs first", gbps_default="none")
    p.add_argument("--hook-calls", type=int, default=20000, help="calls per sample in part 2 (default 20000)")
    args = parse(p, argv)

    r = run_distributed(_rank, args.world_size, args, timeout=900)[0]
    link = f"emulated link {args.link_gbps:g} Gbit/s + {args.latency_us:g} µs" if args.link_gbps else "no link delay"
    emit(f"Profiler overhead: sharded step, {args.world_size} CPU ranks (gloo), {args.blocks} MLP blocks of width "
         f"{args.dim}, batch {args.batch}, AdamW, {link}; {args.steps} pairs (plain / profiled, alternating), "
         "medians of the slowest rank",
         ["step ms, plain", "step ms, profiled", "profiled / plain (median of pairs)", "ratio, quartiles of pairs",
          "CPU time profiled / plain (median of pairs)", "collectives recorded per step"],
         [[f"{1e3 * r['plain']:.1f}", f"{1e3 * r['profiled']:.1f}", f"{r['ratio']:.3f}",
           f"{r['q1']:.3f} - {r['q3']:.3f}", f"{r['cpu_ratio']:.3f}", r["collectives"]]],
         args.markdown)

    c = _hook_costs(args.hook_calls)
    emit("Profiler hooks, one process: µs per call, no profiler active (off) and recording (on)",
         ["call", "off µs", "on µs"],
         [["InflightWork issue + wait (no underlying work)", f"{1e6 * c['collective off']:.2f}",
           f"{1e6 * c['collective on']:.2f}"],
          ["runtime region (overlap::...)", f"{1e6 * c['region off']:.2f}", f"{1e6 * c['region on']:.2f}"]],
         args.markdown)


if __name__ == "__main__":
    main()
