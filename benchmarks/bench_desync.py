"""Cost of desync detection per collective: debug mode off vs on (``overlap.set_debug``), gloo ranks.

Each rank times issue + wait of one small all-reduce (and all-gather) in blocks that alternate debug
mode off and on, and reports medians; the difference is what the debug check (one 256-byte-per-rank
gather on the side channel) adds to each collective. Also: the cost, with debug mode off, of the
lines ``_issue`` runs for it (the sequence number and one boolean check).

    python benchmarks/bench_desync.py [--world-size 2] [--numel 1024] [--iters 300] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import statistics
import timeit

import torch

from _common import add_world_size, parse, parser  # first: sys.path
import overlap
from overlap import desync
from overlap.testing import run_distributed
from report import emit
from timing import seconds_per_call


def _rank(rank: int, world: int, numel: int, iters: int, blocks: int) -> dict[str, float]:
    torch.set_num_threads(1)
    x = torch.randn(numel)
    calls = {
        "all_reduce": lambda: overlap.wait(overlap.all_reduce(x)),
        "all_gather": lambda: overlap.wait(overlap.all_gather(x)),
    }
    samples: dict[str, list[float]] = {f"{name} {mode}": [] for name in calls for mode in ("off", "on")}
    for block in range(blocks + 1):  # block 0 warms up (and builds the side channel)
        for mode in ("off", "on"):
            overlap.set_debug(mode == "on")
            for name, call in calls.items():
                us = 1e6 * seconds_per_call(call, iters, repeats=1, warmup=0)
                if block:
                    samples[f"{name} {mode}"].append(us)
    overlap.set_debug(None)
    return {k: statistics.median(v) for k, v in samples.items()}


def _issue_prologue() -> None:
    """What ``_issue`` runs for desync detection with debug mode off."""
    seq = desync.next_seq("bench")
    if desync.enabled:
        desync.check("all_reduce", seq, "bench", ())


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    add_world_size(p)  # was --world, which still parses (argparse takes unique prefixes)
    p.add_argument("--numel", type=int, default=1024, help="float32 elements per collective (default 1024)")
    p.add_argument("--iters", type=int, default=300, help="collectives per timing block (default 300)")
    p.add_argument("--blocks", type=int, default=5, help="timed blocks per mode, alternating (default 5)")
    args = parse(p, argv)

    results = run_distributed(_rank, args.world_size, args.numel, args.iters, args.blocks, timeout=600)
    desync.set_debug(False)
    off_path = min(timeit.repeat(_issue_prologue, number=100_000, repeat=5)) / 100_000 * 1e6
    rows = []
    for name in ("all_reduce", "all_gather"):
        off = max(r[f"{name} off"] for r in results)
        on = max(r[f"{name} on"] for r in results)
        rows.append([f"{name} of {args.numel} float32, issue + wait", f"{off:.1f}", f"{on:.1f}", f"{on - off:.1f}",
                     f"{on / off:.2f}x"])
    rows.append(["`_issue`'s desync lines with debug off (seq + check)", f"{off_path:.3f}", "", "", ""])
    emit(f"Desync detection: cost per collective, debug mode off vs on ({args.world_size} gloo ranks; median of "
         f"{args.blocks} alternating blocks of {args.iters}, slowest rank)",
         ["what", "off µs", "on µs", "added µs", "on / off"], rows, args.markdown)


if __name__ == "__main__":
    main()
