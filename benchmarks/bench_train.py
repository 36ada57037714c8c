"""Sharded training step, side by side in one run: overlap.shard vs torch FSDP2 vs overlap off vs ideal.

On ``--world-size`` gloo ranks, an MLP of ``--blocks`` blocks, each sharded, trained with AdamW.
Modes: ``overlap.shard``; ``overlap.shard`` with ``prefetch="auto"`` (the depth chosen from the first
step's measured costs, run behind the link, printed beside the mode); ``overlap.shard`` with each group's AdamW stepped in backward as soon as
its gradients are reduced (``overlap.optimizer_in_backward``); both together (the demo's settings); ``overlap.shard`` under ``overlap.no_overlap`` (every collective completes
before anything else runs); torch FSDP2 ``fully_shard`` with default settings, and with explicit
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

Packing runs the torch path on CPU here (no TRITON_INTERPRET): the Triton kernels are for GPUs.
The modes, the training step and the link calibration are ``overlap.demo.training``'s (shared with
the demo); the MLP is ``_common.mlp``.
"""
from __future__ import annotations

import argparse
from typing import Any

from _common import PAIRED_HEADER, mlp_parser, mlp_step, paired_cells, parse, rank_input  # first: sys.path
from overlap.demo.training import calibrate_link
from overlap.demo.unsharded_peak import UnshardedPeak
from overlap.testing import EmulatedLink, PairedTimes, over_ranks, paired_steps, run_distributed
from report import emit

# Display name -> overlap.demo.training mode.
MODES = {"overlap.shard": "overlap", "overlap.shard, prefetch auto": "overlap",
         "overlap.shard, optimizer in backward": "overlap",
         "overlap.shard, prefetch auto + optimizer in backward": "overlap",
         "overlap.shard, overlap off": "no-overlap",
         "torch FSDP2 (default)": "fsdp2", "torch FSDP2 (explicit prefetch)": "fsdp2-prefetch"}
MEMORY_STEPS = 2
"""Untimed steps per mode, behind the link, over which the peak unsharded bytes are counted (two cover a
step boundary with gathers issued ahead, as in the demo)."""


def _train_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    x = rank_input(args.batch, args.dim, rank)
    gbps = args.link_gbps
    if gbps is None:  # one step's comm ~ this runtime's own compute side
        gbps = calibrate_link(mlp_step("overlap", args.blocks, args.dim, x), args.latency_us)
    out: dict[str, Any] = {"gbps": gbps}
    for name, mode in MODES.items():
        step = mlp_step(mode, args.blocks, args.dim, x, optimizer_in_backward="optimizer in backward" in name,
                        prefetch="auto" if "prefetch auto" in name else 1)
        if "prefetch auto" in name:
            with EmulatedLink(gbps, args.latency_us):
                step()  # the step that measures the costs sees the link, as it would in training
        out[name] = paired_steps(step, args.steps, gbps, args.latency_us, warmup=2)
        with EmulatedLink(gbps, args.latency_us), UnshardedPeak(step.model) as counter:  # type: ignore[attr-defined]
            for _ in range(MEMORY_STEPS):
                step()
        out[f"peak {name}"] = over_ranks(counter.peak)
        if "prefetch auto" in name:
            out[f"depth {name}"] = step.model.prefetch_depth
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse(mlp_parser(__doc__, 8, "timed steps per mode"), argv)

    r = run_distributed(_train_rank, args.world_size, args, timeout=900)[0]
    fsdp2 = r["torch FSDP2 (default)"].linked
    rows = []
    for name in MODES:
        m: PairedTimes = r[name]
        shown = f"{name} (depth {r[f'depth {name}']})" if "prefetch auto" in name else name
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
