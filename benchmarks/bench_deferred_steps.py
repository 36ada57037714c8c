"""The deferred optimizer steps on and off, step by step in one model: the demo's end-of-step chain.

One demo model (``overlap.demo.model``, embedding, each block and head sharded, then the root),
``prefetch="auto"``, AdamW stepped in backward (``overlap.optimizer_in_backward``), gather-ahead on:
the runtime's default schedule. The first ``overlap.demo.training.schedule_steps()`` steps (behind
the link, untimed) record the costs, choose the depth, the gather-ahead plan and the deferred steps
([Note: deferred optimizer steps] in ``overlap/sharding.py``) and run the trial of the choice; then
``--rounds`` rounds alternate ``model.set_deferred_steps(True)`` and ``(False)`` on the same model
(which goes first alternates too), so both see the same choices, weights and drifts of a shared
machine. Per round and setting: a step without the link's delay and one behind it, each after an
untimed step of its kind (the end of backward leaves the next step's first gathers in flight).
Deferring moves when optimizer math runs, never what it computes: the losses of the whole run are
checked against a second model trained with deferral off throughout, bitwise.

Reported per setting (medians, slowest rank): step behind the link, compute side (the step without
it), comm (the link's busy time per step), step / ideal ``max(compute, comm)``, the share of the
hideable comm hidden; and the median over rounds of the per-round ratio on / off of the linked step.

    python benchmarks/bench_deferred_steps.py [--model small] [--link-gbps B] [--rounds 8] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
from typing import Any, Optional

import _common  # noqa: F401 (first: sys.path)
import torch
import torch.distributed as dist
from _common import parse, parser
from overlap.demo.model import MODEL_SIZES
from overlap.testing import run_distributed, settled_step
from report import emit

SETTINGS = ("deferred steps on", "deferred steps off")


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from overlap.demo.model import TransformerLM, token_batch
    from overlap.demo.training import TrainStep, calibrate_link, make_optimizer, schedule_steps, shard_for_mode
    from overlap.testing import EmulatedLink, PairedTimes, over_ranks

    size = MODEL_SIZES[args.model]

    def build(deferred: bool) -> tuple[Any, TrainStep]:
        torch.manual_seed(1234)
        model = TransformerLM(size)
        context = shard_for_mode("overlap", model, model.shard_units(), prefetch="auto")
        model.set_deferred_steps(deferred)  # type: ignore[operator]
        step = TrainStep(lambda i, m=model: m.loss(token_batch(size, i, rank)), make_optimizer(model, 1e-3, True),
                         context)
        return model, step

    model, step = build(True)
    gbps = args.link_gbps
    if gbps is None:  # as the demo: comm ~ compute (its warm-up steps run without the link's delay)
        gbps = over_ranks(calibrate_link(step, args.latency_us), dist.ReduceOp.MIN)
    links = {name: EmulatedLink(gbps, args.latency_us) for name in SETTINGS}
    with links[SETTINGS[0]]:  # behind the link, as the demo: the schedule settles before any timed step
        for _ in range(schedule_steps()):
            step()
    for link in links.values():
        link.reset_stats()
    linked: dict[str, list[float]] = {name: [] for name in SETTINGS}
    unlinked: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
            model.set_deferred_steps(name == SETTINGS[0])  # type: ignore[operator]
            for link, out in ((None, unlinked[name]), (links[name], linked[name])):
                with link if link is not None else contextlib.nullcontext():
                    out.append(settled_step(step, 1))  # from gathers issued behind its own link
    reference_model, reference = build(False)  # the same steps, deferral off throughout
    for _ in range(len(step.losses)):
        reference()
    out: dict[str, Any] = {"gbps": gbps, "depth": model.prefetch_depth, "ahead": model.gather_ahead,
                           "deferred": model.deferred_steps,
                           "bitwise": torch.equal(torch.stack(step.losses), torch.stack(reference.losses))}
    for name in SETTINGS:
        comm = links[name].stats().emulated_seconds / (2 * args.rounds)
        out[name] = PairedTimes(over_ranks(statistics.median(unlinked[name])),
                                over_ranks(statistics.median(linked[name])), over_ranks(comm))
    ratios = [over_ranks(a) / over_ranks(b) for a, b in zip(linked[SETTINGS[0]], linked[SETTINGS[1]])]
    out["ratio"] = statistics.median(ratios)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__)
    p.add_argument("--model", choices=tuple(MODEL_SIZES), default="small", help="demo model size (default small)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="emulated link bandwidth in Gbit/s (default: calibrated as the demo does, comm ~ compute)")
    p.add_argument("--latency-us", type=float, default=20.0, help="link latency per collective (default 20)")
    p.add_argument("--rounds", type=int, default=8, help="rounds of both settings, alternating (default 8)")
    args = parse(p, argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    r = run_distributed(_rank, 2, args, timeout=3600)[0]
    rows = []
    for name in SETTINGS:
        t = r[name]
        ideal = max(t.unlinked, t.comm)
        rows.append([name, f"{1e3 * t.linked:.1f}", f"{1e3 * t.unlinked:.1f}", f"{1e3 * t.comm:.1f}",
                     f"{t.linked / ideal:.3f}x", f"{100 * t.hidden_share:.0f}%"])
    emit(f"Deferred optimizer steps on / off, demo model {args.model}, 2 CPU ranks (gloo), AdamW in backward, "
         f"prefetch auto (depth {r['depth']}, gather-ahead {r['ahead']}, deferred: {', '.join(r['deferred'] or []) or 'none'}); "
         f"emulated link {r['gbps']:.3g} Gbit/s + {args.latency_us:g} µs; medians of {args.rounds} alternating rounds, "
         f"slowest rank; per-round linked step on / off, median: {r['ratio']:.3f}; losses bitwise equal to deferral "
         f"off throughout: {r['bitwise']}",
         ["setting", "step ms", "compute ms", "comm ms", "step / ideal", "comm hidden"], rows, args.markdown)


if __name__ == "__main__":
    main()
