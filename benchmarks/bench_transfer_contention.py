"""What a collective's transfer costs the compute beside it on this host (gloo, CPU), in interleaved rounds.

The step model of ``prefetch="auto"`` (``scheduler/replayed_step.py``) puts a collective on the
link only: the compute beside it runs at the speed recorded with nothing in flight. On CPU, gloo
moves the bytes with the host's cores, which on a small host are the compute's cores too
([Note: the host work between the groups] in ``scheduler/prefetch_depth.py`` names this as left
out of the model). This measures it without the emulated link, per round on every rank:

  alone    a block's forward and backward (``--repeat`` times), nothing in flight
  beside   the same compute with ``--gathers`` all-gathers of ``--mb`` MB issued just before it
           and waited after it
  gathers  the same all-gathers issued and waited with no compute

The rounds interleave the three (alone, beside, gathers, alone, ...); the table gives each one's
least and median over the rounds, slowest rank, and ``beside - alone``: the compute's seconds the
transfers took. The box is usually shared: report ``uptime`` with the figures.

  python benchmarks/bench_transfer_contention.py --rounds 15
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Optional, Sequence

import _common  # noqa: F401  (this checkout first on sys.path)
import torch
import torch.distributed as dist
from torch import nn

from overlap.testing import run_distributed

KINDS = ("alone", "beside", "gathers")


def _rank(rank: int, world_size: int, rounds: int, mb: float, gathers: int, repeat: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    x = torch.randn(512, 256, requires_grad=True)
    numel = max(world_size, int(mb * 2**20 / 4) // world_size * world_size)
    shard, out = torch.randn(numel // world_size), torch.empty(numel)

    def compute() -> None:
        for _ in range(repeat):
            block(x).sum().backward()

    def issue() -> list[dist.Work]:
        return [dist.all_gather_into_tensor(out, shard, async_op=True) for _ in range(gathers)]

    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(rounds + 1):  # the first round warms up
        for kind in KINDS:
            dist.barrier()
            start = time.perf_counter()
            works = issue() if kind != "alone" else []
            if kind != "gathers":
                compute()
            for w in works:
                w.wait()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
            times[kind].append(float(elapsed))
    return {k: v[1:] for k, v in times.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _common.parser(__doc__)
    _common.add_world_size(p)
    p.add_argument("--rounds", type=int, default=15, help="timed rounds of each kind (default 15)")
    p.add_argument("--mb", type=float, default=3.0, help="MB per all-gather's output (default 3.0: a demo block's)")
    p.add_argument("--gathers", type=int, default=3, help="all-gathers in flight beside the compute (default 3)")
    p.add_argument("--repeat", type=int, default=4, help="forward + backward passes per compute (default 4)")
    args = _common.parse(p, argv)
    for name in ("world_size", "rounds", "gathers", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.world_size < 2:
        p.error(f"--world-size must be >= 2 (a collective needs peers), got {args.world_size}")
    if not args.mb > 0:
        p.error(f"--mb must be > 0, got {args.mb}")
    times = run_distributed(_rank, args.world_size, args.rounds, args.mb, args.gathers, args.repeat,
                            timeout=3600)[0]
    print(f"{args.world_size} gloo ranks, {args.gathers} all-gathers of {args.mb:g} MB, {args.rounds} rounds, "
          f"torch {torch.__version__}")
    rows = ["| kind | least ms | median ms |", "|---|---|---|"]
    for kind in KINDS:
        rows.append(f"| {kind} | {1e3 * min(times[kind]):.2f} | {1e3 * statistics.median(times[kind]):.2f} |")
    per_round = [b - a for a, b in zip(times["alone"], times["beside"])]
    rows.append(f"| beside - alone (per round) | {1e3 * min(per_round):.2f} | {1e3 * statistics.median(per_round):.2f} |")
    text = "\n".join(rows)
    print(text)
    if args.markdown:
        with open(args.markdown, "a", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
