"""Sharded training step, side by side in one run: overlap.shard vs torch FSDP2 vs overlap off vs ideal.

Part 1 (``--world-size`` gloo ranks): an MLP of ``--blocks`` blocks, each sharded, trained with
AdamW. Modes: ``overlap.shard``; ``overlap.shard`` under ``overlap.no_overlap`` (every collective
completes before anything else runs); torch FSDP2 ``fully_shard`` with default settings, and with
explicit forward/backward prefetch of one module. Each mode alternates steps without and with the
emulated link's delay: the unlinked step is the mode's *compute side* (math, packing, gloo's real
loopback transfers, runtime bookkeeping: on a 2-core box far more than the math alone), and what a
linked step takes beyond it is *exposed communication*. The link bandwidth is chosen (unless
``--link-gbps``) so that one step's communication (forward and backward all-gathers, gradient
reduce-scatters) takes about as long as this runtime's compute side. Reported: medians of the
slowest rank, the share of hideable comm that was hidden, and the ideal ``max(compute, comm)``.

Part 2 (one process, a 1-rank gloo group): the runtime's own CPU cost, per block per step, of
``--overhead-blocks`` tiny blocks (fwd + bwd) over the same model unsharded; FSDP2 beside it.

    python benchmarks/bench_train.py [--world-size 2] [--steps 8] [--markdown benchmarks/RESULTS.md]

Packing runs the torch path on CPU here (no TRITON_INTERPRET): the Triton kernels are for GPUs.
The modes, the training step and the link calibration are ``overlap.demo.training``'s (shared with the demo).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overlap.testing import PairedTimes, paired_steps, run_distributed  # noqa: E402
from overlap.demo.training import TrainStep, calibrated_gbps, measure_traffic, shard_for_mode  # noqa: E402
from report import emit  # noqa: E402


def _mlp(blocks: int, dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                           for _ in range(blocks)])


def _sharded(mode: str, model: nn.Sequential, bf16: bool = False) -> tuple[nn.Module, Callable[[], Any]]:
    """``model`` sharded block by block for ``mode`` (``overlap.demo.training.MODES``), and its step context."""
    return model, shard_for_mode(mode, model, list(model), bf16=bf16)


def _step_fn(model: nn.Module, context: Callable[[], Any], x: torch.Tensor) -> TrainStep:
    return TrainStep(lambda _: model(x).square().mean(), torch.optim.AdamW(model.parameters(), lr=1e-3), context)


# Display name -> overlap.demo.training mode.
MODES = {"overlap.shard": "overlap", "overlap.shard, overlap off": "no-overlap",
         "torch FSDP2 (default)": "fsdp2", "torch FSDP2 (explicit prefetch)": "fsdp2-prefetch"}


def _train_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))
    gbps = args.link_gbps
    if gbps is None:  # one step's comm ~ this runtime's own compute side
        probe = _step_fn(*_sharded("overlap", _mlp(args.blocks, args.dim)), x)
        compute = paired_steps(probe, 3, 1e9, 0.0, warmup=2).unlinked
        gbps = calibrated_gbps(compute, *measure_traffic(probe), args.latency_us)
    out: dict[str, Any] = {"gbps": gbps}
    for name, mode in MODES.items():
        step = _step_fn(*_sharded(mode, _mlp(args.blocks, args.dim)), x)
        out[name] = paired_steps(step, args.steps, gbps, args.latency_us, warmup=2)
    return out


def _overhead(args: argparse.Namespace) -> dict[str, float]:
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        n = args.overhead_blocks

        def model() -> nn.Sequential:
            torch.manual_seed(0)
            return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8)) for _ in range(n)])

        x = torch.randn(4, 8)

        def per_step(m: nn.Module) -> float:
            def run() -> None:
                m(x).sum().backward()
            for _ in range(5):
                run()
            samples = []
            for _ in range(7):
                start = time.perf_counter()
                for _ in range(10):
                    run()
                samples.append((time.perf_counter() - start) / 10)
            return statistics.median(samples)

        return {
            "unsharded": per_step(model()),
            "overlap.shard (fp32: world-size-1 alias path)": per_step(_sharded("overlap", model())[0]),
            "torch FSDP2 (fp32)": per_step(_sharded("fsdp2", model())[0]),
            "overlap.shard (bf16 params: pack, cast, unpack)": per_step(_sharded("overlap", model(), bf16=True)[0]),
            "torch FSDP2 (bf16 params)": per_step(_sharded("fsdp2", model(), bf16=True)[0]),
            "blocks": n,
        }
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks for part 1 (default 2)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode (default 8)")
    parser.add_argument("--blocks", type=int, default=8, help="sharded MLP blocks (default 8)")
    parser.add_argument("--dim", type=int, default=256, help="MLP width (default 256)")
    parser.add_argument("--batch", type=int, default=256, help="rows per rank (default 256)")
    parser.add_argument("--link-gbps", type=float, default=None, help="link bandwidth (default: comm ~ compute)")
    parser.add_argument("--latency-us", type=float, default=20.0, help="link latency per collective (default 20)")
    parser.add_argument("--overhead-blocks", type=int, default=64, help="tiny blocks for part 2 (default 64)")
    parser.add_argument("--markdown", default=None, help="append the tables to this markdown file")
    args = parser.parse_args(argv)

    r = run_distributed(_train_rank, args.world_size, args, timeout=900)[0]
    fsdp2 = r["torch FSDP2 (default)"].linked
    rows = []
    for name in MODES:
        m: PairedTimes = r[name]
        rows.append([name, f"{1e3 * m.linked:.1f}", f"{1e3 * m.unlinked:.1f}", f"{1e3 * m.comm:.1f}",
                     f"{1e3 * m.exposed:.1f}", f"{100 * m.hidden_share:.0f}%",
                     f"{1e3 * max(m.unlinked, m.comm):.1f}", f"{m.linked / fsdp2:.2f}x"])
    emit(f"Training step, {args.world_size} CPU ranks (gloo), {args.blocks} MLP blocks of width {args.dim}, "
         f"AdamW; emulated link {r['gbps']:.3g} Gbit/s + {args.latency_us:g} µs; medians of {args.steps} "
         "steps alternating without/with the link delay, slowest rank",
         ["mode", "step ms", "compute side ms (no link delay)", "comm ms on the link", "exposed comm ms",
          "hideable comm hidden", "ideal max(compute, comm) ms", "step vs FSDP2 default"],
         rows, args.markdown)

    o = _overhead(args)
    n = o.pop("blocks")
    base = o["unsharded"]
    rows = [[name, f"{1e3 * t:.2f}", f"{1e6 * (t - base) / n:.0f}" if name != "unsharded" else "-"] for name, t in o.items()]
    emit(f"Runtime CPU cost: fwd+bwd of {n} tiny Linear(8, 8) blocks, world size 1 (1-rank gloo)",
         ["mode", "ms per step (median)", "overhead µs per block per step"], rows, args.markdown)


if __name__ == "__main__":
    main()
