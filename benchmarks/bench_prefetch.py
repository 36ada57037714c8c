"""``overlap.shard``'s prefetch depths side by side, step by step in one run: a fixed ``prefetch=1``
against ``prefetch="auto"`` without gather-ahead, without the deferred optimizer steps, and with
both (the default; ``ahead (count, lag)``: the plan chosen, see ``scheduler/gather_ahead.py``;
``deferred``: the groups whose step runs in the end-of-step chain, ``scheduler/deferred_steps.py``), on the demo's transformer (``overlap.demo.model``, embedding, each
block and head sharded, then the root), AdamW stepped in backward (``overlap.optimizer_in_backward``),
behind one emulated link.

Each depth is a fresh model from the same weights; the first ``overlap.demo.training.schedule_steps()``
steps of each run behind the link (``prefetch="auto"`` records its costs in the first ones, then
runs the trial that verifies its choice against the simple schedule; every run takes as many, so the
losses compare step by step). Then ``--rounds`` rounds of one linked step
per depth, interleaved, each after an untimed linked step of the same run (gather-ahead leaves the
next step's first gathers in flight: the timed step must start from its own run's), so a shared machine's slow drifts fall on both alike; medians of the
slowest rank. After the timed rounds, two profiled steps per depth (after a warm-up step the profile
records but does not report) give the link-idle share
(``overlap.profile()``: the part of each step with nothing of the rank on the link while it
computed). Losses are checked bitwise between all runs.

    python benchmarks/bench_prefetch.py [--model small] [--link-gbps 0.1] [--rounds 8] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

import _common  # noqa: F401 (first: sys.path)
import torch
from _common import parse
from overlap.demo.model import MODEL_SIZES
from overlap.testing import profiled_steps, run_distributed, settled_step
from report import emit

DEPTHS: dict[str, Any] = {"prefetch=1": (1, True, True), 'prefetch="auto", no gather-ahead': ("auto", False, True),
                          'prefetch="auto", no deferred steps': ("auto", True, False),
                          'prefetch="auto"': ("auto", True, True)}
"""Runs: (prefetch, gather-ahead on, deferred steps on). Gather-ahead applies to ``"auto"`` only
(``set_gather_ahead``), and the deferred optimizer steps with it (``set_deferred_steps``)."""


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from overlap.demo.model import TransformerLM, token_batch
    from overlap.demo.training import TrainStep, make_optimizer, schedule_steps, shard_for_mode
    from overlap.testing import EmulatedLink, over_ranks

    size = MODEL_SIZES[args.model]
    runs = {}
    for name, (prefetch, ahead, deferred) in DEPTHS.items():
        torch.manual_seed(1234)
        model = TransformerLM(size)
        context = shard_for_mode("overlap", model, model.shard_units(), prefetch=prefetch)
        model.set_gather_ahead(ahead)  # type: ignore[operator]
        model.set_deferred_steps(deferred)  # type: ignore[operator]
        step = TrainStep(lambda i, m=model: m.loss(token_batch(size, i, rank)), make_optimizer(model, 1e-3, True),
                         context)
        link = EmulatedLink(args.link_gbps, args.latency_us)
        with link:
            for _ in range(schedule_steps()):
                step()
        link.reset_stats()
        runs[name] = (model, step, link, [])
    for _ in range(args.rounds):
        for model, step, link, times in runs.values():
            with link:  # the timed step must start from gathers its own run issued behind its link
                times.append(settled_step(step, 1))
    out: dict[str, Any] = {}
    for name, (model, step, link, times) in runs.items():
        comm = over_ranks(link.stats().emulated_seconds / (2 * args.rounds))
        with link:  # a warm-up step first, recorded but not reported: its gathers ahead
            prof = profiled_steps(step, 2)
        merged = prof.gather(dst=0)
        out[name] = {"step": over_ranks(statistics.median(times)), "comm": comm, "depth": model.prefetch_depth,
                     "decision": model.schedule_decision,
                     "ahead": model.gather_ahead if DEPTHS[name][1] else None,
                     # deferral runs with a gather-ahead plan only: with gather-ahead off, nothing was deferred
                     "deferred": model.deferred_steps if DEPTHS[name][1] and DEPTHS[name][2] else None,
                     "idle": [s.link_idle_share for s in merged.summary().steps] if merged is not None else [],
                     "losses": torch.stack(step.losses)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(MODEL_SIZES), default="small", help="demo model size (default small)")
    p.add_argument("--link-gbps", type=float, default=0.1, help="emulated link bandwidth in Gbit/s (default 0.1)")
    p.add_argument("--latency-us", type=float, default=20.0, help="link latency per collective (default 20)")
    p.add_argument("--rounds", type=int, default=8, help="interleaved timed rounds (default 8)")
    args = parse(p, argv)
    per_rank = run_distributed(_rank, 2, args, timeout=1800)
    r = per_rank[0]
    base = r["prefetch=1"]["step"]
    bitwise = all(torch.equal(x["prefetch=1"]["losses"], v["losses"]) for x in per_rank for v in x.values())
    rows = [[f"{name} (depth {v['depth']}" + (f", ahead {v['ahead']}" if v["ahead"] else "")
             + (f"; {v['decision'].reason}" if v["decision"] is not None else "")
             + (f", deferred {'+'.join(v['deferred'])}" if v["deferred"] else "") + ")",
             f"{1e3 * v['step']:.1f}", f"{1e3 * v['comm']:.1f}",
             f"{v['step'] / v['comm']:.2f}x", ", ".join(f"{100 * x:.0f}%" for x in v["idle"]),
             f"{v['step'] / base:.2f}x"] for name, v in r.items()]
    emit(f"Prefetch depth, demo model {args.model}, 2 CPU ranks (gloo), AdamW in backward; emulated link "
         f"{args.link_gbps:g} Gbit/s + {args.latency_us:g} µs; medians of {args.rounds} interleaved linked steps, "
         f"slowest rank; losses bitwise equal across depths: {bitwise}",
         ["depth", "step ms", "comm ms on the link", "step / comm", "link idle (2 profiled steps x 2 ranks)",
          "step vs prefetch=1"], rows, args.markdown)


if __name__ == "__main__":
    main()
