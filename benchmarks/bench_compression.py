"""Compressed collectives (int8 gather and reduce) vs exact overlap.shard vs FSDP2 at a comm-bound link.

On ``--world-size`` gloo ranks, the sharded MLP of ``_common.mlp`` (``--blocks`` blocks of width
``--dim``, each sharded, then the root), AdamW. Modes: ``overlap.shard`` exact; ``overlap.shard`` with
``compress=overlap.Compression()`` (int8 all-gathers and int8 all-to-all reductions summed in fp32,
block 256: [Note: compressed collectives] in ``overlap/compression.py``); torch FSDP2 ``fully_shard``.
The link is first calibrated so that one exact step's communication takes about as long as the exact
runtime's compute side, then slowed to ``--link-scale`` of that bandwidth (default 0.25: comm-bound,
the issue's setting). Rounds interleave the modes (rotating which goes first), each mode one step
without the link delay (its compute side) and one with it; medians over rounds of the slowest rank.
Bytes are what the emulated link counted for one linked step (received per rank).

    python benchmarks/bench_compression.py [--world-size 2] [--steps 6] [--markdown benchmarks/RESULTS.md]

Packing runs the torch path on CPU here (no TRITON_INTERPRET): bitwise the Triton kernels' result.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _common import mlp, mlp_parser, over_ranks, parse, rank_input  # first: sys.path
import torch.distributed as dist

import overlap
from overlap.demo.training import TrainStep, calibrate_link, make_optimizer, shard_for_mode
from overlap.testing import EmulatedLink, run_distributed
from report import emit

MODES = ("overlap.shard, exact", "overlap.shard, int8 gather + reduce", "torch FSDP2 (default)")


def _step(mode: str, args: argparse.Namespace, rank: int) -> TrainStep:
    model = mlp(args.blocks, args.dim)
    if mode.startswith("torch FSDP2"):
        context = shard_for_mode("fsdp2", model, list(model))
    else:
        compress = overlap.Compression() if "int8" in mode else None
        for block in model:  # FSDP2's depth, as in this table's earlier rows: the bytes are the subject
            overlap.shard(block, compress=compress, prefetch=1)
        overlap.shard(model, compress=compress, prefetch=1)
        context = None
    x = rank_input(args.batch, args.dim, rank)
    step = TrainStep(lambda _: model(x).square().mean(), make_optimizer(model, 1e-3),
                     **({"context": context} if context is not None else {}))
    return step


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    steps = {mode: _step(mode, args, rank) for mode in MODES}
    calibrated = calibrate_link(steps[MODES[0]], args.latency_us)
    gbps = args.link_gbps if args.link_gbps is not None else calibrated * args.link_scale
    link = EmulatedLink(gbps, args.latency_us)
    for step in steps.values():  # warm-up: two steps without the link, one with
        step(), step()
        with link:
            step()
    times: dict[str, dict[str, list[float]]] = {m: {"compute": [], "linked": [], "bytes": [], "comm": []} for m in MODES}
    for round_ in range(args.steps):
        order = MODES[round_ % len(MODES):] + MODES[: round_ % len(MODES)]
        for mode in order:
            for linked in (False, True):
                dist.barrier()
                link.reset_stats()
                start = time.perf_counter()
                if linked:
                    with link:
                        steps[mode]()
                else:
                    steps[mode]()
                elapsed = time.perf_counter() - start
                times[mode]["linked" if linked else "compute"].append(elapsed)
                if linked:
                    stats = link.stats()
                    times[mode]["bytes"].append(stats.wire_bytes)
                    times[mode]["comm"].append(stats.emulated_seconds)
    out: dict[str, Any] = {"gbps": gbps, "calibrated": calibrated}
    for mode in MODES:
        t = times[mode]
        out[mode] = {"compute": over_ranks(statistics.median(t["compute"])),
                     "linked": over_ranks(statistics.median(t["linked"])),
                     "comm": over_ranks(statistics.median(t["comm"])),
                     "bytes": statistics.median(t["bytes"])}
    return out


def main(argv: list[str] | None = None) -> None:
    p = mlp_parser(__doc__, 6, "rounds (each: every mode, one step without and one with the link)")
    p.add_argument("--link-scale", type=float, default=0.25,
                   help="the link's bandwidth as a share of the calibrated one (default 0.25; ignored with --link-gbps)")
    args = parse(p, argv)
    r = run_distributed(_rank, args.world_size, args, timeout=1800)[0]
    exact, fsdp2 = r[MODES[0]], r[MODES[2]]
    rows = []
    for mode in MODES:
        m = r[mode]
        rows.append([mode, f"{1e3 * m['linked']:.1f}", f"{1e3 * m['compute']:.1f}", f"{1e3 * m['comm']:.1f}",
                     f"{m['bytes'] / 1e6:.2f}", f"{m['bytes'] / exact['bytes']:.3f}x",
                     f"{m['linked'] / exact['linked']:.2f}x", f"{m['linked'] / fsdp2['linked']:.2f}x"])
    emit(f"Compressed collectives, {args.world_size} CPU ranks (gloo), {args.blocks} MLP blocks of width "
         f"{args.dim}, batch {args.batch}, AdamW, fp32; emulated link {r['gbps']:.3g} Gbit/s "
         f"({args.link_scale:g}x the calibrated {r['calibrated']:.3g}) + {args.latency_us:g} µs; medians of "
         f"{args.steps} interleaved rounds, slowest rank",
         ["mode", "step ms (link)", "compute side ms", "comm ms on the link", "MB on the link per step",
          "bytes vs exact", "step vs exact", "step vs FSDP2"],
         rows, args.markdown)


if __name__ == "__main__":
    main()
