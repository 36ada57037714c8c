"""Sharded training step, side by side in one run: overlap.shard vs torch FSDP2 vs overlap off vs ideal.

On ``--world-size`` gloo ranks, an MLP of ``--blocks`` blocks, each sharded, trained with AdamW.
Modes: ``overlap.shard`` with ``prefetch=1`` (FSDP2's schedule); with ``prefetch="auto"``, its default
(the depth chosen from the first steps' measured costs, run behind the link, printed beside the
mode); with ``prefetch=1`` and each group's AdamW stepped in backward as soon as its gradients are
reduced (``overlap.optimizer_in_backward``); both together (the demo's settings); ``overlap.shard``
under ``overlap.no_overlap`` (every collective completes before anything else runs, at depth 1); torch FSDP2 ``fully_shard`` with default settings, and with explicit
forward/backward prefetch of one module. Each mode alternates steps without and with the emulated
link's delay: the unlinked step is the mode's *compute side* (math, packing, gloo's real loopback
transfers, runtime bookkeeping: on a 2-core box far more than the math alone), and what a linked
step takes beyond it is *exposed communication*. The link bandwidth is chosen (unless
``--link-gbps``) so that one step's communication (forward and backward all-gathers, gradient
reduce-scatters) takes about as long as this runtime's compute side. Reported: medians of the
slowest rank, the share of hideable comm that was hidden, and the ideal ``max(compute, comm)``.

After each mode's timed steps, ``MEMORY_STEPS`` untimed steps behind the link run under
``overlap.demo.unsharded_peak.UnshardedPeak``: the *peak unsharded MB* column is the most bytes of
unsharded parameters a rank held at once (the demo's count, the same for FSDP2: what prefetch depth
and gathering ahead cost in memory; gradients, activations and optimizer state not included).

The runtime's own CPU cost per block (world size 1, against the same model unsharded, FSDP2
beside it) is ``bench_runtime_cost.py``'s.

    python benchmarks/bench_train.py [--world-size 2] [--steps 8] [--markdown benchmarks/RESULTS.md]
    python benchmarks/bench_train.py --grid [--steps 6] [--markdown benchmarks/RESULTS.md]
    python benchmarks/bench_train.py --default-vs-depth-1 [--steps 12] [--markdown benchmarks/RESULTS.md]

``prefetch="auto"`` modes first run ``overlap.demo.training.schedule_steps()`` untimed steps behind
the link: the steps that record its costs and the trial that verifies its choice against the simple
schedule (the decision is printed beside the mode).

``--grid`` (issue 29's grid): the demo's settings (``prefetch="auto"``, AdamW stepped in backward)
beside torch FSDP2 (default settings), on 2 and 4 ranks, at 0.5x, 1x and 2x the calibrated link
bandwidth (calibrated per world size, as above; 0.5x: comm ~ 2x compute). Per cell: the hidden
share, step / ideal ``max(compute, comm)``, step vs FSDP2's, the link's idle time while compute ran
(``overlap.profile()`` over :data:`PROFILED_STEPS` linked steps after a warm-up one it does not report,
mean per step and rank), the peak
unsharded MB against FSDP2's, the depth and schedule decision (model's choice kept by the
trial, or the simple plan), and the steady step the chooser's model gave the chosen and the simple
plan from the recorded costs (agreed over the ranks): beside the measured step it says how much of
what is left the model itself expects from the recorded costs, and how much is the execution's.
``--world-size`` is ignored there.

``--default-vs-depth-1``: ``overlap.shard``'s default (``prefetch="auto"``) against a fixed
``prefetch=1`` (FSDP2's schedule), the user's plain loop (AdamW after backward), at the grid's cells:
two models from the same weights, their linked steps interleaved round by round (the first of each
pair alternating), after the auto model's settling steps behind the link; medians of the slowest
rank, their ratio, the decision, and each one's peak unsharded MB. ``--world-size`` is ignored there.

Packing runs the torch path on CPU here (no TRITON_INTERPRET): the Triton kernels are for GPUs.
The modes, the training step and the link calibration are ``overlap.demo.training``'s (shared with
the demo); the MLP is ``_common.mlp``.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

from _common import PAIRED_HEADER, mlp_parser, mlp_step, paired_cells, parse, rank_input  # first: sys.path
from overlap.demo.training import calibrate_link, schedule_steps
from overlap.demo.unsharded_peak import UnshardedPeak
from overlap.testing import (EmulatedLink, PairedTimes, over_ranks, paired_steps, profiled_steps, run_distributed,
                             settled_step)
from scheduler.schedule_trial import describe
from report import emit

# Display name -> overlap.demo.training mode.
MODES = {"overlap.shard, prefetch=1": "overlap", "overlap.shard, prefetch auto (the default)": "overlap",
         "overlap.shard, prefetch=1, optimizer in backward": "overlap",
         "overlap.shard, prefetch auto + optimizer in backward": "overlap",
         "overlap.shard, overlap off": "no-overlap",
         "torch FSDP2 (default)": "fsdp2", "torch FSDP2 (explicit prefetch)": "fsdp2-prefetch"}
MEMORY_STEPS = 2
"""Untimed steps per mode, behind the link, over which the peak unsharded bytes are counted (two cover a
step boundary with gathers issued ahead, as in the demo)."""


def _calibrated_gbps(args: argparse.Namespace, x: Any) -> float:
    """``--link-gbps``, or the bandwidth at which one step's comm ~ this runtime's own compute side."""
    if args.link_gbps is not None:
        return args.link_gbps
    return calibrate_link(mlp_step("overlap", args.blocks, args.dim, x), args.latency_us)


def _unsharded_peak(step: Any, link: EmulatedLink) -> tuple[int, int]:
    """The most unsharded bytes a rank held over ``MEMORY_STEPS`` untimed steps of ``step`` behind
    ``link`` (the largest over ranks), and this rank's largest group's bytes."""
    with link, UnshardedPeak(step.model) as counter:
        for _ in range(MEMORY_STEPS):
            step()
    return over_ranks(counter.peak), counter.largest_group


def _train_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    x = rank_input(args.batch, args.dim, rank)
    gbps = _calibrated_gbps(args, x)
    out: dict[str, Any] = {"gbps": gbps}
    for name, mode in MODES.items():
        step = mlp_step(mode, args.blocks, args.dim, x, optimizer_in_backward="optimizer in backward" in name,
                        prefetch="auto" if "prefetch auto" in name else 1)
        if "prefetch auto" in name:
            with EmulatedLink(gbps, args.latency_us):  # the recorded steps and the trial see the link, as in training
                for _ in range(schedule_steps()):
                    step()
        # with prefetch="auto" and the optimizer in backward the next step's first gathers are in flight
        # at the step boundary: each timed step follows an untimed one of its kind (as in the grid)
        settle = 1 if "prefetch auto" in name and "optimizer in backward" in name else 0
        out[name] = paired_steps(step, args.steps, gbps, args.latency_us, warmup=2, settle=settle)
        out[f"peak {name}"] = _unsharded_peak(step, EmulatedLink(gbps, args.latency_us))[0]
        if "prefetch auto" in name:
            out[f"depth {name}"] = step.model.prefetch_depth
            out[f"decision {name}"] = str(step.model.schedule_decision)
    return out


GRID_FACTORS = (0.5, 1.0, 2.0)
"""Link bandwidths of the grid, as multiples of the calibrated one (comm ~ compute at 1x)."""
GRID_WORLDS = (2, 4)
PROFILED_STEPS = 2
"""Linked steps per grid cell under ``overlap.profile()`` for the link-idle time."""


def _grid_rank(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    x = rank_input(args.batch, args.dim, rank)
    calibrated = _calibrated_gbps(args, x)
    cells = []
    for factor in GRID_FACTORS:
        gbps = calibrated * factor
        link = EmulatedLink(gbps, args.latency_us)
        ours = mlp_step("overlap", args.blocks, args.dim, x, optimizer_in_backward=True, prefetch="auto")
        with link:
            for _ in range(schedule_steps()):
                ours()
        # gathers issued at the end of backward land in the next step: each timed step follows one of its kind
        times = paired_steps(ours, args.steps, gbps, args.latency_us, warmup=0, settle=1)
        peak, largest = _unsharded_peak(ours, link)
        with link:  # a warm-up step first, recorded but not reported: its gathers ahead
            prof = profiled_steps(ours, PROFILED_STEPS)
        merged = prof.gather(dst=0)
        fsdp2 = mlp_step("fsdp2", args.blocks, args.dim, x)
        fsdp2_times = paired_steps(fsdp2, args.steps, gbps, args.latency_us, warmup=2)
        cells.append({"factor": factor, "gbps": gbps, "times": times, "fsdp2": fsdp2_times,
                      "peak": peak, "fsdp2 peak": _unsharded_peak(fsdp2, link)[0],
                      "largest": largest, "profile": merged,
                      "depth": ours.model.prefetch_depth,  # type: ignore[attr-defined]
                      "decision": ours.model.schedule_decision,  # type: ignore[attr-defined]
                      "floor": ours.model.step_floor})  # type: ignore[attr-defined]
    return cells


def _versus_rank(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    x = rank_input(args.batch, args.dim, rank)
    calibrated = _calibrated_gbps(args, x)
    cells = []
    for factor in GRID_FACTORS:
        link = EmulatedLink(calibrated * factor, args.latency_us)
        steps = {"fixed": mlp_step("overlap", args.blocks, args.dim, x, prefetch=1),
                 "default": mlp_step("overlap", args.blocks, args.dim, x, prefetch="auto")}
        with link:  # the default's recorded steps and trial (each step timed alone), as many for depth 1
            for step in steps.values():
                for _ in range(schedule_steps()):
                    step()
        times: dict[str, list[float]] = {name: [] for name in steps}
        for r in range(args.steps):
            for name in ("fixed", "default") if r % 2 == 0 else ("default", "fixed"):
                with link:
                    times[name].append(settled_step(steps[name]))
        default = steps["default"].model  # type: ignore[attr-defined]
        cells.append({"factor": factor, "gbps": calibrated * factor,
                      **{name: over_ranks(statistics.median(t)) for name, t in times.items()},
                      **{f"peak {name}": _unsharded_peak(step, link)[0] for name, step in steps.items()},
                      "depth": default.prefetch_depth, "decision": default.schedule_decision})
    return cells


def _versus(args: argparse.Namespace) -> None:
    rows = []
    for world in GRID_WORLDS:
        for c in run_distributed(_versus_rank, world, args, timeout=1800)[0]:
            rows.append([str(world), f"{c['factor']:g}x ({c['gbps']:.3g} Gbit/s)", f"{1e3 * c['fixed']:.1f}",
                         f"{1e3 * c['default']:.1f}", f"{c['default'] / c['fixed']:.2f}x", str(c["depth"]),
                         str(c["decision"]), f"{c['peak fixed'] / 2**20:.3g} / {c['peak default'] / 2**20:.3g}"])
    emit(f"overlap.shard's default (prefetch=\"auto\") vs prefetch=1, {args.blocks} MLP blocks of width {args.dim}, "
         f"AdamW after backward, CPU ranks (gloo), link bandwidth x the calibrated one (comm ~ compute at 1x, "
         f"calibrated per world size) + {args.latency_us:g} µs; medians of {args.steps} interleaved linked steps "
         "each, slowest rank",
         ["ranks", "link", "prefetch=1 step ms", "default step ms", "default / prefetch=1", "depth",
          "schedule decision", "peak unsharded MB, prefetch=1 / default"], rows, args.markdown)


GRID_HEADER = ["ranks", "link", "step ms", "compute ms", "comm ms", "hidden", "step / ideal", "step vs FSDP2",
               "link idle ms per step (share)", "peak unsharded MB ours / FSDP2 (extra, in groups)", "depth",
               "schedule decision (trial: least timed step, chosen vs simple)",
               "modelled step ms, chosen / simple plan", "floor ms (x ideal): no exact schedule goes below"]


def _grid_row(world: int, link: str, m: PairedTimes, fsdp2: PairedTimes, profile: Any, peak: int, fsdp2_peak: int,
              largest: int, depth: Any, decision: Any, floor: Any) -> list[str]:
    """One cell of the grid as a row of :data:`GRID_HEADER` (``floor``: the model's ``step_floor``, from
    the recorded costs: [Note: the end-of-step chain's floor])."""
    steps = profile.summary().steps if profile is not None else []
    idle_ms = sum(s.link_idle_ms for s in steps) / max(1, len(steps))
    idle_share = sum(s.link_idle_share for s in steps) / max(1, len(steps))
    extra = (peak - fsdp2_peak) / largest if largest else float("nan")
    if decision is None or decision.verdict is None:
        told = "undecided" if decision is None else f"{describe(decision.plan)} ({decision.reason})"
    else:
        v = decision.verdict
        told = (f"{describe(decision.plan)}: {'kept' if v.keep else 'fell back'}, "
                f"{1e3 * v.chosen_s:.1f} vs {1e3 * v.simple_s:.1f} ms")
    modelled = "-" if decision is None else f"{1e3 * decision.modelled_s:.1f} / {1e3 * decision.modelled_simple_s:.1f}"
    return [str(world), link, f"{1e3 * m.linked:.1f}", f"{1e3 * m.unlinked:.1f}", f"{1e3 * m.comm:.1f}",
            f"{100 * m.hidden_share:.0f}%", f"{m.linked / max(m.unlinked, m.comm):.2f}x",
            f"{m.linked / fsdp2.linked:.2f}x", f"{idle_ms:.1f} ({100 * idle_share:.0f}%)",
            f"{peak / 2**20:.3g} / {fsdp2_peak / 2**20:.3g} ({extra:+.2f} groups)", str(depth), told, modelled,
            "-" if floor is None else f"{1e3 * floor.seconds:.1f} ({floor.ratio():.2f}x)"]


def _demo_grid(args: argparse.Namespace) -> list[list[str]]:
    """The demo (``overlap.demo.run``, ``--compare fsdp2``) at each cell: the 1x run calibrates, the
    others run at a multiple of its bandwidth."""
    from overlap.demo.run import DemoConfig, run_demo

    rows = []
    for world in GRID_WORLDS:
        calibrated = None
        for factor in sorted(GRID_FACTORS, key=lambda f: f != 1.0):  # 1x first: it calibrates
            cfg = DemoConfig(world_size=world, steps=args.steps, model=args.grid_demo_model, compare=("fsdp2",),
                             link_gbps=None if calibrated is None else calibrated * factor,
                             profile_steps=PROFILED_STEPS, progress=False)
            r = run_demo(cfg)
            calibrated = calibrated or r.link_gbps
            ours, fsdp2 = r.modes["overlap"], r.modes["fsdp2"]
            rows.append((world, factor, _grid_row(
                world, f"{factor:g}x ({r.link_gbps:.3g} Gbit/s)", ours.times, fsdp2.times, ours.profile,
                ours.unsharded_peak, fsdp2.unsharded_peak, ours.largest_group, ours.depth, ours.schedule,
                ours.step_floor)))
    return [row for _, _, row in sorted(rows, key=lambda x: x[:2])]


def _grid(args: argparse.Namespace) -> None:
    rows = []
    for world in GRID_WORLDS:
        for c in run_distributed(_grid_rank, world, args, timeout=1800)[0]:
            rows.append(_grid_row(world, f"{c['factor']:g}x ({c['gbps']:.3g} Gbit/s)", c["times"], c["fsdp2"],
                                  c["profile"], c["peak"], c["fsdp2 peak"], c["largest"], c["depth"], c["decision"],
                                  c["floor"]))
    common = (f"CPU ranks (gloo), link bandwidth x the calibrated one (comm ~ compute at 1x, calibrated per world "
              f"size) + {args.latency_us:g} µs; medians of {args.steps} paired steps, slowest rank; link idle over "
              f"{PROFILED_STEPS} profiled steps")
    emit(f"Grid (issue 29), bench_train: overlap.shard with prefetch=\"auto\" and AdamW stepped in backward (the "
         f"demo's settings), {args.blocks} MLP blocks of width {args.dim}, {common}", GRID_HEADER, rows, args.markdown)
    if args.grid_demo_model != "none":
        emit(f"Grid (issue 29), the demo: model {args.grid_demo_model} (python -m overlap demo --compare fsdp2 "
             f"--steps {args.steps}), {common}", GRID_HEADER, _demo_grid(args), args.markdown)


def main(argv: list[str] | None = None) -> None:
    p = mlp_parser(__doc__, 8, "timed steps per mode")
    p.add_argument("--grid", action="store_true", help="run issue 29's grid (2 and 4 ranks x 0.5, 1, 2 x the "
                   "calibrated link), for this MLP and for the demo, instead of the modes side by side")
    p.add_argument("--grid-demo-model", default="small", help="the demo's model size in the grid (tiny, small, "
                   "medium; none: leave the demo out; default small)")
    p.add_argument("--default-vs-depth-1", action="store_true", help="overlap.shard's default (prefetch='auto') "
                   "against prefetch=1, interleaved, at the grid's cells, instead of the modes side by side")
    args = parse(p, argv)
    if args.grid:
        _grid(args)
        return
    if args.default_vs_depth_1:
        _versus(args)
        return
    r = run_distributed(_train_rank, args.world_size, args, timeout=900)[0]
    fsdp2 = r["torch FSDP2 (default)"].linked
    rows = []
    for name in MODES:
        m: PairedTimes = r[name]
        shown = f"{name} ({r[f'decision {name}']})" if "prefetch auto" in name else name  # what runs, and why
        rows.append([shown, *paired_cells(m), f"{100 * m.hidden_share:.0f}%",
                     f"{1e3 * max(m.unlinked, m.comm):.1f}", f"{m.linked / fsdp2:.2f}x",
                     f"{r[f'peak {name}'] / 2**20:.3g}"])
    emit(f"Training step, {args.world_size} CPU ranks (gloo), {args.blocks} MLP blocks of width {args.dim}, "
         f"AdamW; emulated link {r['gbps']:.3g} Gbit/s + {args.latency_us:g} µs; medians of {args.steps} "
         "steps alternating without/with the link delay, slowest rank",
         ["mode", *PAIRED_HEADER, "hideable comm hidden", "ideal max(compute, comm) ms", "step vs FSDP2 default",
          "peak unsharded MB"],
         rows, args.markdown)


if __name__ == "__main__":
    main()
