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
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overlap  # noqa: E402
from overlap.testing import emulated_link, run_distributed  # noqa: E402
from report import emit  # noqa: E402


def _sharded_mlp(blocks: int, dim: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                            for _ in range(blocks)])
    for block in model:
        overlap.shard(block)
    return overlap.shard(model)


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    model = _sharded_mlp(args.blocks, args.dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))
    records = []

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

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
    return {"plain": _slowest(statistics.median(t for t, _ in plain)),
            "profiled": _slowest(statistics.median(t for t, _ in prof)),
            "ratio": _slowest(statistics.median(ratios)), "q1": _slowest(q1), "q3": _slowest(q3),
            "cpu_ratio": _slowest(statistics.median(cpu_ratios)), "collectives": records[-1]}


def _hook_costs(n: int) -> dict[str, float]:
    """Seconds per issue+wait of an InflightWork (no underlying work) and per region, off and on."""
    from overlap.inflight_work import InflightWork
    from overlap.regions import region

    def per_call(fn: Callable[[], None]) -> float:
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            samples.append((time.perf_counter() - start) / n)
        return statistics.median(samples)

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=20, help="timed pairs of steps (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed pairs first (default 3)")
    parser.add_argument("--blocks", type=int, default=8, help="sharded MLP blocks (default 8)")
    parser.add_argument("--dim", type=int, default=256, help="MLP width (default 256)")
    parser.add_argument("--batch", type=int, default=256, help="rows per rank (default 256)")
    parser.add_argument("--link-gbps", type=float, default=None, help="emulated link bandwidth (default: none)")
    parser.add_argument("--latency-us", type=float, default=20.0, help="link latency per collective (default 20)")
    parser.add_argument("--hook-calls", type=int, default=20000, help="calls per sample in part 2 (default 20000)")
    parser.add_argument("--markdown", default=None, help="append the tables to this markdown file")
    args = parser.parse_args(argv)

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
