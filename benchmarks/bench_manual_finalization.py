"""What manual backward finalization hides: the end of backward's reductions behind host work done before the optimizer step.

What is measured. A training step that does host work between backward and the optimizer step
(``--host-ms`` of it: a wait that leaves the CPU idle, as a data loader's or a logger's I/O does),
for ``overlap.shard`` and torch FSDP2, each two ways:

* automatic: ``backward()`` waits for every reduction before it returns, then the host work, then
  ``optimizer.step()``;
* manual (``set_manual_backward_finalization(True)`` on the root): ``backward()`` returns with the
  last reductions in flight, the host work runs while they finish, then ``finalize_backward()`` and
  ``optimizer.step()``. FSDP2's manual mode runs where its torch has it (2.15).

Same model and link as ``bench_train.py``: 2 gloo ranks, MLP blocks, AdamW, the emulated link
calibrated so communication takes about as long as compute. Every mode steps in turn, round by
round, in one run; medians of the slowest rank. The manual step's saving is at most the shorter of
the host work and the reductions' tail after backward's compute; the losses of the two ways are
checked bitwise equal per runtime.

    python benchmarks/bench_manual_finalization.py [--host-ms 10] [--steps 12] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

from _common import (interleaved_rounds, mlp, mlp_parser, mlp_step, parse, rank_input,  # first: sys.path
                     same_losses, slowest_rank_medians)
from overlap.demo.training import calibrate_link, make_optimizer, shard_for_mode
from overlap.testing import emulated_link, run_distributed
from report import emit


def _modes() -> list[tuple[str, str, bool]]:
    """(label, runtime mode, manual) for every mode this torch can run."""
    from torch.distributed.fsdp import FSDPModule

    modes = [("overlap.shard, automatic", "overlap", False), ("overlap.shard, manual", "overlap", True),
             ("torch FSDP2, automatic", "fsdp2", False)]
    if hasattr(FSDPModule, "set_manual_backward_finalization"):
        modes.append(("torch FSDP2, manual", "fsdp2", True))
    return modes


def _step(runtime: str, manual: bool, args: argparse.Namespace, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    torch.manual_seed(0)
    model = mlp(args.blocks, args.dim)
    shard_for_mode(runtime, model, list(model))
    if manual:
        model.set_manual_backward_finalization(True)
    optimizer = make_optimizer(model, 1e-3)
    host_s = args.host_ms / 1e3

    def step() -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        time.sleep(host_s)  # the host work before the optimizer step
        if manual:
            model.finalize_backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    x = rank_input(args.batch, args.dim, rank)
    gbps = args.link_gbps or calibrate_link(mlp_step("overlap", args.blocks, args.dim, x), args.latency_us)
    modes = _modes()
    steps = {label: _step(runtime, manual, args, x) for label, runtime, manual in modes}
    with emulated_link(gbps, args.latency_us):
        out: dict[str, Any] = interleaved_rounds(steps, args.warmup, args.steps)
    out["gbps"] = gbps
    out["modes"] = [label for label, _, _ in modes]
    return out


def main(argv: list[str] | None = None) -> None:
    p = mlp_parser(__doc__, 12, "timed rounds", 2, "untimed rounds")
    p.add_argument("--host-ms", type=float, default=10.0,
                   help="host work between backward and the optimizer step, ms (default 10)")
    args = parse(p, argv)
    results = run_distributed(_rank, args.world_size, args, timeout=900)
    modes = results[0]["modes"]
    median = slowest_rank_medians(results, modes, args.steps)
    rows = []
    for label in modes:
        runtime = label.split(",")[0]
        automatic = f"{runtime}, automatic"
        same = same_losses(results, label, automatic)
        rows.append([label, f"{median[label] * 1e3:.1f}", f"{median[label] / median[automatic]:.2f}x",
                     f"{median[label] / median['torch FSDP2, automatic']:.2f}x", "yes" if same else "NO"])
    emit(f"Host work between backward and the optimizer step ({args.host_ms:g} ms), {args.world_size} CPU ranks "
         f"(gloo), {args.blocks} MLP blocks of width {args.dim}, AdamW; emulated link {results[0]['gbps']:.2f} Gbit/s "
         f"+ {args.latency_us:g} µs; medians of {args.steps} interleaved rounds, slowest rank",
         ["mode", "step ms", "vs its automatic step", "vs FSDP2 automatic", "losses bitwise its automatic"],
         rows, args.markdown)


if __name__ == "__main__":
    main()
