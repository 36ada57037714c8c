"""The schedule model with each reduce-scatter at its own bytes, against the model that took it as long
as the group's all-gather ([Note: a reduce-scatter's seconds] in ``overlap/sharding.py``).

Mixed precision with bfloat16 parameters and float32 gradient reductions (torchtitan's default)
moves twice the gather's bytes in every reduce-scatter. The runtime's choosers (prefetch depth,
gather-ahead, deferred steps) and the floor of an exact step replay the step on the link from the
recorded costs; this benchmark shows what that model predicts, what runs, and what the choices
made with each model measure.

The MLP of ``bench_train`` (``--blocks`` x Linear(d, 2d) + GELU + Linear(2d, d), ``--batch`` rows
per rank), each block then the root sharded with ``MixedPrecision(param_dtype=bfloat16,
reduce_dtype=float32)`` (``--reduce-dtype bfloat16``: both directions the same bytes, the control),
``prefetch="auto"``, AdamW stepped in backward: the runtime's default schedule, floor included. Per
grid cell (``--worlds`` ranks x the link at ``--factors`` times the calibrated bandwidth, where one
step's comm ~ its compute at 1x), two models from the same weights make their own choices behind the
link (``schedule_steps()`` untimed steps each): "own bytes" (the runtime) and "as the gather" (the
model before 2026-12-06, patched in while that model records and chooses). Then ``--rounds``
rounds alternate them, one linked step each after an untimed one (the end of backward leaves the
next step's first gathers in flight).

Reported per cell and model (slowest rank): the plan that runs, the modelled seconds per step of
that plan, the floor, the measured step (median over rounds), measured / modelled, and the median
per-round ratio of the measured steps, own bytes / as the gather.

    python benchmarks/bench_reduce_seconds.py [--worlds 2 4] [--factors 0.5 1 2] [--rounds 8]
                                              [--reduce-dtype float32] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
from typing import Any, Optional

from _common import add_link, add_mlp, mlp, parse, parser, rank_input  # first: sys.path
import torch

from overlap.testing import run_distributed
from report import emit

MODELS = ("own bytes", "as the gather")


def _as_the_gather(group: Any, gather_seconds: float) -> float:
    """The model before 2026-12-06: every reduce-scatter as long as its group's all-gather."""
    return 0.0 if group is None else gather_seconds


def _rank(rank: int, world: int, args: argparse.Namespace, factor: float) -> dict[str, Any]:
    import overlap
    from overlap import sharding
    from overlap.demo.training import TrainStep, calibrate_link, make_optimizer, schedule_steps
    from overlap.testing import EmulatedLink, over_ranks, settled_step

    torch.set_num_threads(1)
    x = rank_input(args.batch, args.dim, rank)
    mp = overlap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, args.reduce_dtype))

    def build(prefetch: Any) -> TrainStep:
        model = mlp(args.blocks, args.dim)
        for block in model:
            overlap.shard(block, mp=mp, prefetch=prefetch)
        overlap.shard(model, mp=mp, prefetch=prefetch)
        step = TrainStep(lambda _, m=model: m(x).float().square().mean(), make_optimizer(model, 1e-3, True),
                         contextlib.nullcontext)
        step.model = model  # type: ignore[attr-defined]
        return step

    gbps = factor * calibrate_link(build(1), args.latency_us)
    link = EmulatedLink(gbps, args.latency_us)
    own = sharding._reduce_seconds
    steps = {}
    for name in MODELS:
        sharding._reduce_seconds = own if name == MODELS[0] else _as_the_gather
        try:
            steps[name] = build("auto")
            with link:  # costs recorded, plan chosen and its trial run, all with this model
                for _ in range(schedule_steps()):
                    steps[name]()
        finally:
            sharding._reduce_seconds = own
    times: dict[str, list[float]] = {name: [] for name in MODELS}
    for r in range(args.rounds):
        for name in MODELS if r % 2 == 0 else MODELS[::-1]:
            with link:
                times[name].append(over_ranks(settled_step(steps[name], 1)))
    out: dict[str, Any] = {"gbps": gbps,
                           "ratio": statistics.median(a / b for a, b in zip(*(times[n] for n in MODELS)))}
    for name in MODELS:
        model = steps[name].model  # type: ignore[attr-defined]
        out[name] = (model.prefetch_depth, model.gather_ahead, model.modelled_step, model.step_floor,
                     statistics.median(times[name]))
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__)
    add_mlp(p)
    add_link(p, gbps_default=None)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per cell (default 2 4)")
    p.add_argument("--factors", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                   help="link bandwidths, times the calibrated one (default 0.5 1 2)")
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds per cell (default 8)")
    p.add_argument("--reduce-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="MixedPrecision.reduce_dtype over bfloat16 parameters (default float32)")
    args = parse(p, argv)
    if args.rounds < 1 or min(args.worlds) < 2 or min(args.factors) <= 0:
        p.error("--rounds must be >= 1, --worlds >= 2 and --factors > 0")
    rows = []
    for world in args.worlds:
        for factor in args.factors:
            r = run_distributed(_rank, world, args, factor, timeout=3600)[0]
            for name in MODELS:
                depth, ahead, modelled, floor, measured = r[name]
                rows.append([world, f"{factor:g}x ({r['gbps']:.3g} Gbit/s)", name, str(depth), str(ahead),
                             f"{1e3 * modelled:.1f}", "-" if floor is None else f"{1e3 * floor.seconds:.1f}",
                             f"{1e3 * measured:.1f}", f"{measured / modelled:.2f}",
                             f"{r['ratio']:.3f}" if name == MODELS[0] else ""])
    emit(f"The schedule model with each reduce-scatter at its own bytes vs as long as its gather: MLP {args.blocks} x "
         f"d={args.dim}, {args.batch} rows per rank, MixedPrecision(bfloat16, reduce {args.reduce_dtype}), AdamW in "
         f"backward, prefetch auto; emulated link + {args.latency_us:g} µs; measured: medians of {args.rounds} "
         f"alternating linked steps, slowest rank",
         ["ranks", "link", "model", "depth", "gather-ahead", "modelled ms", "floor ms", "measured ms",
          "measured / modelled", "measured own / as the gather (per round, median)"], rows, args.markdown)


if __name__ == "__main__":
    main()
