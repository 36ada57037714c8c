"""The end-of-step chain, two ways of shortening it, each on / off step by step: deferred optimizer
steps, and the first block's MLP sharded as groups of its own.

The demo model (``overlap.demo.model``: embedding, each block and head sharded, then the root),
``prefetch="auto"``, AdamW stepped in backward (``overlap.optimizer_in_backward``), gather-ahead on:
the runtime's default schedule. ``--compare``:

- ``deferred`` (default): one model; ``--rounds`` rounds alternate ``model.set_deferred_steps(True)``
  and ``(False)`` ([Note: deferred optimizer steps] in ``overlap/sharding.py``), so both see the same
  choices, weights and drifts of a shared machine. Deferring moves when optimizer math runs, never
  what it computes: the losses of the whole run are checked against a second model trained with
  deferral off throughout, bitwise.
- ``split``: two models from the same weights, one sharded with ``shard_units(split_first_block=True)``
  (``blocks.0.up`` and ``blocks.0.down`` groups of their own), one with each block whole; rounds
  alternate between them. Each makes its own schedule choices. The wrappings compute the same
  math: the two runs' losses are checked bitwise equal.

Each model first runs ``overlap.demo.training.schedule_steps()`` untimed steps behind the link (the
costs recorded, the depth, the gather-ahead plan and the deferred steps chosen, the trial of the
choice run). Which setting goes first alternates by round. Per round and setting: a step without the
link's delay and one behind it, each after an untimed step of its kind (the end of backward leaves
the next step's first gathers in flight).

Reported per setting (medians, slowest rank): step behind the link, compute side (the step without
it), comm (the link's busy time per step), step / ideal ``max(compute, comm)``, the share of the
hideable comm hidden, the schedule each model chose; and the median over rounds of the per-round
ratio of the linked steps, first setting / second.

    python benchmarks/bench_deferred_steps.py [--compare deferred|split] [--model small] [--link-gbps B] [--rounds 8] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
from typing import Any, Callable, Optional

import _common  # noqa: F401 (first: sys.path)
import torch
import torch.distributed as dist
from _common import parse, parser
from overlap.demo.model import MODEL_SIZES
from overlap.testing import run_distributed, settled_step
from report import emit

SETTINGS = {"deferred": ("deferred steps on", "deferred steps off"),
            "split": ("blocks.0's MLP split off", "each block whole")}


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from overlap.demo.model import TransformerLM, token_batch
    from overlap.demo.training import TrainStep, calibrate_link, make_optimizer, schedule_steps, shard_for_mode
    from overlap.testing import EmulatedLink, PairedTimes, over_ranks

    size = MODEL_SIZES[args.model]
    names = SETTINGS[args.compare]

    def build(split: bool, deferred: bool) -> tuple[Any, TrainStep]:
        torch.manual_seed(1234)
        model = TransformerLM(size)
        context = shard_for_mode("overlap", model, model.shard_units(split_first_block=split), prefetch="auto")
        model.set_deferred_steps(deferred)  # type: ignore[operator]
        step = TrainStep(lambda i, m=model: m.loss(token_batch(size, i, rank)), make_optimizer(model, 1e-3, True),
                         context)
        return model, step

    # per setting: the model, its step, and what switches to it before each of its steps
    runs: dict[str, tuple[Any, TrainStep, Callable[[], None]]] = {}
    if args.compare == "deferred":
        model, step = build(False, True)
        for name in names:
            runs[name] = (model, step, lambda on=name == names[0], m=model: m.set_deferred_steps(on))
    else:
        for name in names:
            model, step = build(name == names[0], True)
            runs[name] = (model, step, lambda: None)
    models = names[:1] if args.compare == "deferred" else names  # one setting per model
    gbps = args.link_gbps
    if gbps is None:  # as the demo: comm ~ compute, on steps after prefetch="auto" has settled
        calibrated = [calibrate_link(runs[name][1], args.latency_us, warmup=schedule_steps())  # each model alike
                      for name in models]
        gbps = over_ranks(calibrated[0], dist.ReduceOp.MIN)
    links = {name: EmulatedLink(gbps, args.latency_us) for name in names}
    for name in models:
        with links[name]:  # behind the link, as the demo: the schedule settles before any timed step
            for _ in range(schedule_steps()):
                runs[name][1]()
    for link in links.values():
        link.reset_stats()
    linked: dict[str, list[float]] = {name: [] for name in names}
    unlinked: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            _, step, switch = runs[name]
            switch()
            for link, out in ((None, unlinked[name]), (links[name], linked[name])):
                with link if link is not None else contextlib.nullcontext():
                    out.append(settled_step(step, 1))  # from gathers issued behind its own link
    steps = [runs[name][1] for name in models]
    if args.compare == "deferred":
        steps.append(build(False, False)[1])  # the same steps, deferral off throughout
        for _ in range(len(steps[0].losses)):
            steps[1]()
    losses = [torch.stack(step.losses) for step in steps]
    out: dict[str, Any] = {"gbps": gbps, "bitwise": torch.equal(*losses)}
    for name in names:
        model = runs[name][0]
        comm = links[name].stats().emulated_seconds / (2 * args.rounds)
        out[name] = PairedTimes(over_ranks(statistics.median(unlinked[name])),
                                over_ranks(statistics.median(linked[name])), over_ranks(comm))
        deferred = ", ".join(model.deferred_steps or []) or "none"  # the groups chosen (reported when off too)
        if args.compare == "deferred" and name == names[1]:
            deferred = f"off (chosen: {deferred})"
        out[name, "plan"] = (model.prefetch_depth, model.gather_ahead, deferred)
    ratios = [over_ranks(a) / over_ranks(b) for a, b in zip(linked[names[0]], linked[names[1]])]
    out["ratio"] = statistics.median(ratios)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__)
    p.add_argument("--compare", choices=tuple(SETTINGS), default="deferred",
                   help="deferred: deferred steps on / off on one model; split: blocks.0's MLP split off / each block "
                        "whole, two models (default deferred)")
    p.add_argument("--model", choices=tuple(MODEL_SIZES), default="small", help="demo model size (default small)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="emulated link bandwidth in Gbit/s (default: calibrated as the demo does, comm ~ compute)")
    p.add_argument("--latency-us", type=float, default=20.0, help="link latency per collective (default 20)")
    p.add_argument("--rounds", type=int, default=8, help="rounds of both settings, alternating (default 8)")
    args = parse(p, argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    r = run_distributed(_rank, 2, args, timeout=3600)[0]
    names = SETTINGS[args.compare]
    rows = []
    for name in names:
        t = r[name]
        ideal = max(t.unlinked, t.comm)
        depth, ahead, deferred = r[name, "plan"]
        rows.append([name, f"{1e3 * t.linked:.1f}", f"{1e3 * t.unlinked:.1f}", f"{1e3 * t.comm:.1f}",
                     f"{t.linked / ideal:.3f}x", f"{100 * t.hidden_share:.0f}%", str(depth), str(ahead), deferred])
    what = ("Deferred optimizer steps on / off" if args.compare == "deferred"
            else "The first block's MLP sharded as groups of its own / each block whole")
    reference = "deferral off throughout" if args.compare == "deferred" else "each other"
    emit(f"{what}, demo model {args.model}, 2 CPU ranks (gloo), AdamW in backward, prefetch auto; emulated link "
         f"{r['gbps']:.3g} Gbit/s + {args.latency_us:g} µs; medians of {args.rounds} alternating rounds, slowest "
         f"rank; per-round linked step {names[0]} / {names[1]}, median: {r['ratio']:.3f}; losses bitwise equal to "
         f"{reference}: {r['bitwise']}",
         ["setting", "step ms", "compute ms", "comm ms", "step / ideal", "comm hidden", "depth", "gather-ahead",
          "deferred"], rows, args.markdown)

if __name__ == "__main__":
    main()
