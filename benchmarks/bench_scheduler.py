"""What the scheduler buys in step time, side by side in one run, behind the emulated link.

Sections (``--sections``, default all; one function per section, each prints its own table):

``eager``
    Steady-state cost per block of a forward whose blocks each multiply by a weight all-gathered one
    block ahead (1-rank gloo, so the figure is the runtime's own cost): first-use waits alone
    (AsyncTensor), the same under ``scheduler.Scheduler`` replay, torch's functional collectives
    (AsyncCollectiveTensor), and a recording step; against the same forward with local weights.

``compiled``
    A compiled FSDP-style training step (``ShardedMLP`` of ``tests/compiled_step.py``: ``--blocks``
    residual MLP blocks, each block's parameters one flat shard that the forward all-gathers and
    whose gradient the backward reduce-scatters) on ``--world-size`` gloo ranks, compiled by
    Inductor three times: without the hook, with Inductor's own comm passes (``INDUCTOR_COMM_PASSES``:
    ``reorder_for_compute_comm_overlap`` with the pass list torch's config recommends, and FX
    bucketing of all-gathers and reduce-scatters), and with ``scheduler.inductor_overlap()``. The
    copies start from the same weights and take the same steps; each iteration times, in turn, a
    step of each without the link's delay (the *compute side*) and a step of each behind the link,
    the copies taking turns going first. The link bandwidth is chosen (unless ``--link-gbps``) so
    that one step's communication takes about as long as the compute side. Reported: medians of
    the slowest rank, each copy's speed-up over the one without the hook (ratio of medians, and the
    median of the per-iteration ratios), the hook's over Inductor's passes, the ideal
    ``max(compute, comm)``, how many collectives have compute between their issue and their wait in
    the generated code, and whether the copies' losses are identical, bit for bit.

    python benchmarks/bench_scheduler.py [--sections compiled] [--steps 10] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from _common import (INDUCTOR_COMM_PASSES, add_link, add_mlp, add_steps, add_world_size, over_ranks,  # first: sys.path
                     parse, parser, rank_input)
import scheduler
from scheduler.torch_versions import funcol_all_gather
from compiled_step import ShardedMLP, captured_code, collective_gaps, compiled_step
from overlap.demo.training import calibrated_gbps
from overlap.testing import EmulatedLink, run_distributed
from report import emit
from timing import seconds_per_call


def _timed(step: Callable[[], torch.Tensor], losses: list[torch.Tensor]) -> float:
    dist.barrier()
    start = time.perf_counter()
    losses.append(step())
    return time.perf_counter() - start


def _overlapped(codes: list[str]) -> str:
    """'k/n': collectives with compute between issue and wait, of all collectives in ``codes``."""
    gaps = [g for code in codes for g in collective_gaps(code)]
    return f"{sum(g.compute_before_wait > 0 for g in gaps)}/{len(gaps)}"


BASELINE, INDUCTOR, HOOK = "without hook", "Inductor's comm passes", "with hook"
VARIANTS = (BASELINE, INDUCTOR, HOOK)


def _compile_context(name: str) -> contextlib.AbstractContextManager[Any]:
    """The context a variant's step compiles in (the hook also needs it when the step is built)."""
    import torch._inductor.config as inductor_config

    if name == HOOK:
        return scheduler.inductor_overlap()
    if name == INDUCTOR:
        return inductor_config.patch(INDUCTOR_COMM_PASSES)
    return contextlib.nullcontext()


def _compiled_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    x = rank_input(args.batch, args.dim, rank)
    models = [ShardedMLP(args.blocks, args.dim, args.hidden, rank, world) for _ in VARIANTS]
    steps = []
    for name, model in zip(VARIANTS, models):
        with _compile_context(name) if name == HOOK else contextlib.nullcontext():
            steps.append(compiled_step(model, x))  # the hook stays with this step, recompiles included
    losses: dict[str, list[torch.Tensor]] = {n: [] for n in VARIANTS}
    out: dict[str, Any] = {}
    # Caches off: every graph is compiled here, under the config of its variant, and its code seen.
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        for name, step in zip(VARIANTS, steps):
            start = time.perf_counter()
            with _compile_context(name), captured_code() as codes:
                losses[name].append(step())
            out["compile s " + name] = time.perf_counter() - start
            out["overlapped " + name] = _overlapped(codes)

    for _ in range(args.warmup):
        for name, step in zip(VARIANTS, steps):
            _timed(step, losses[name])
    # Calibration: the compute side, median over every copy (the same number of steps on each).
    compute = over_ranks(statistics.median(
        _timed(step, losses[name]) for _ in range(args.calibration_steps) for name, step in zip(VARIANTS, steps)))
    rows = models[0][0].rows
    wire = 2 * args.blocks * (world - 1) * rows * 4  # per step: an all-gather and a reduce-scatter per block
    collectives = 2 * args.blocks
    gbps = args.link_gbps or calibrated_gbps(compute, collectives, wire, args.latency_us)
    link = EmulatedLink(gbps, args.latency_us, functional=True)

    unlinked: dict[str, list[float]] = {n: [] for n in VARIANTS}
    linked: dict[str, list[float]] = {n: [] for n in VARIANTS}
    link.reset_stats()
    for i in range(args.steps):
        shift = i % len(VARIANTS)  # the copies take turns going first
        order = list(zip(VARIANTS, steps))[shift:] + list(zip(VARIANTS, steps))[:shift]
        for name, step in order:
            unlinked[name].append(_timed(step, losses[name]))
        for name, step in order:
            with link:
                linked[name].append(_timed(step, losses[name]))
    stats = link.stats()
    out.update(gbps=gbps, comm=over_ranks(stats.emulated_seconds / (len(VARIANTS) * args.steps)),
               by_op=dict(stats.by_op))
    for name in VARIANTS:
        out["unlinked " + name] = over_ranks(statistics.median(unlinked[name]))
        out["linked " + name] = over_ranks(statistics.median(linked[name]))
        pair_ratios = [a / b for a, b in zip(linked[BASELINE], linked[name])]
        out["pair ratio " + name] = over_ranks(statistics.median(pair_ratios), dist.ReduceOp.MIN)  # least favourable rank
    hook_vs_inductor = [a / b for a, b in zip(linked[INDUCTOR], linked[HOOK])]
    out["hook vs inductor"] = over_ranks(statistics.median(hook_vs_inductor), dist.ReduceOp.MIN)
    reference = torch.stack(losses[BASELINE])
    out["losses"] = {name: (len(reference), torch.equal(reference, torch.stack(losses[name])),
                            float((reference - torch.stack(losses[name])).abs().max())) for name in VARIANTS[1:]}
    out["shards equal"] = {name: all(torch.equal(p, q) for p, q in zip(models[0].parameters(), m.parameters()))
                           for name, m in zip(VARIANTS[1:], models[1:])}
    return out


def compiled(args: argparse.Namespace) -> None:
    """The ``compiled`` section: a compiled training step without the hook, with Inductor's own comm
    passes, and with the Inductor hook."""
    results = run_distributed(_compiled_rank, args.world_size, args, timeout=1800)
    r = results[0]
    notes = []
    for name in VARIANTS[1:]:
        n_losses = r["losses"][name][0]
        if all(res["losses"][name][1] and res["shards equal"][name] for res in results):
            notes.append(f"{name}: identical, bit for bit ({n_losses} steps x {args.world_size} ranks, and final shards)")
        else:
            notes.append(f"{name}: DIFFER (max abs diff {max(res['losses'][name][2] for res in results):.3g})")
    base = r["linked " + BASELINE]
    rows = []
    for name in VARIANTS:
        step, compute = r["linked " + name], r["unlinked " + name]
        rows.append([name, f"{1e3 * step:.1f}", f"{1e3 * compute:.1f}", f"{1e3 * r['comm']:.1f}",
                     f"{1e3 * max(0.0, step - compute):.1f}", f"{1e3 * max(compute, r['comm']):.1f}",
                     r["overlapped " + name], f"{base / step:.2f}x",
                     f"{r['pair ratio ' + name]:.2f}x" if name != BASELINE else "-"])
    emit(f"Compiled training step (torch.compile, Inductor), {args.world_size} CPU ranks (gloo), "
         f"{args.blocks} sharded MLP blocks {args.dim}->{args.hidden}->{args.dim}, batch {args.batch} "
         f"per rank, SGD; emulated link {r['gbps']:.3g} Gbit/s + {args.latency_us:g} µs; without the hook, with "
         f"Inductor's own comm passes, with scheduler.inductor_overlap(); medians of {args.steps} iterations, "
         f"slowest rank; losses vs without the hook: {'; '.join(notes)}",
         ["variant", "step ms", "compute side ms (no link delay)", "comm ms on the link", "exposed comm ms",
          "ideal max(compute, comm) ms", "collectives with compute before their wait",
          "speed-up vs without hook (ratio of medians)", "speed-up vs without hook (median of paired ratios)"],
         rows, args.markdown)
    print(f"hook vs Inductor's comm passes (median of paired ratios, least favourable rank): "
          f"{r['hook vs inductor']:.2f}x")
    print("compile seconds (rank 0): " + ", ".join(f"{n} {r['compile s ' + n]:.1f}" for n in VARIANTS)
          + f"; link ops over the timed linked steps: {r['by_op']}")


def eager(args: argparse.Namespace) -> None:
    """The ``eager`` section: per-block cost of where waits come from, steady state, forward only, on a
    1-rank gloo group: recorded-schedule replay vs first-use waits alone vs torch's AsyncCollectiveTensor."""
    run_distributed(_eager_rank, 1, args, timeout=600)


def _eager_rank(rank: int, world: int, args: argparse.Namespace) -> None:
    import overlap
    from scheduler import Scheduler

    width, blocks = args.eager_width, args.eager_blocks
    torch.manual_seed(0)
    model = _GatheringStack(blocks, width)
    x = torch.randn(4, width)

    def gather_ours(w: torch.Tensor) -> torch.Tensor:
        return overlap.all_gather(w)

    def gather_torch(w: torch.Tensor) -> torch.Tensor:
        return funcol_all_gather(w, 0, dist.group.WORLD)

    sched = Scheduler(model)

    def replayed() -> None:
        with sched.step():
            model(x, gather_ours)

    variants: dict[str, Callable[[], object]] = {
        "weights local (no collective)": lambda: model(x, None),
        "overlap: first-use waits": lambda: model(x, gather_ours),
        "overlap: Scheduler replay": replayed,
        "torch funcol (AsyncCollectiveTensor)": lambda: model(x, gather_torch),
    }
    with torch.no_grad():
        replayed()  # the recording step
        assert sched.schedule is not None
        times = {name: seconds_per_call(fn, args.eager_iters) for name, fn in variants.items()}
        recording = seconds_per_call(lambda: _record_once(model, x, gather_ours), max(args.eager_iters // 5, 3))
    assert sched.steps_fallen_back == 0, sched.last_fallback_reason
    base = times["weights local (no collective)"]
    ours = times["overlap: first-use waits"]
    rows = [[name, f"{1e3 * t:.2f}", f"{1e6 * (t - base) / blocks:.1f}",
             f"{(t - base) / (ours - base):.2f}x" if ours > base and t > base else "-"] for name, t in times.items()]
    rows.append(["overlap: Scheduler recording step", f"{1e3 * recording:.2f}",
                 f"{1e6 * (recording - base) / blocks:.1f}",
                 f"{(recording - base) / (ours - base):.2f}x" if ours > base else "-"])
    emit(f"Scheduler, eager: one forward of {blocks} blocks (Linear {width}x{width} + matmul by a gathered "
         f"weight), 1-rank gloo, no_grad; overhead = step minus 'weights local', per block",
         ["variant", "step ms (median)", "overhead µs / block", "overhead vs first-use waits"], rows,
         args.markdown)


class _GatheringStack(nn.Module):
    """``blocks`` Linear layers; each multiplies by its own weight, gathered one block ahead."""

    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.weights = [torch.randn(width, width) / width for _ in range(blocks)]

    def forward(self, x: torch.Tensor, gather: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
        if gather is None:
            for block, w in zip(self.blocks, self.weights):
                x = block(x) @ w
            return x
        pending = gather(self.weights[0])
        for i, block in enumerate(self.blocks):
            following = gather(self.weights[i + 1]) if i + 1 < len(self.blocks) else None
            x = block(x) @ pending  # first use of the gathered weight
            pending = following
        return x


def _record_once(model: nn.Module, x: torch.Tensor, gather: Callable) -> None:
    from scheduler import Scheduler

    sched = Scheduler(model)
    with sched.step():
        model(x, gather)
    sched.close()



SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {"compiled": compiled, "eager": eager}


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--sections", nargs="+", choices=sorted(SECTIONS), default=sorted(SECTIONS),
                   help="sections to run (default: all)")
    add_world_size(p)
    add_steps(p, 10, "timed iterations", 2, "untimed steps per variant after compiling")
    p.add_argument("--calibration-steps", type=int, default=4,
                   help="unlinked steps per variant that calibrate the link (default 4)")
    add_mlp(p, blocks=4, dim=256, batch=1024)
    p.add_argument("--hidden", type=int, default=1024, help="block hidden width (default 1024)")
    add_link(p)
    p.add_argument("--eager-blocks", type=int, default=32, help="eager section: blocks (default 32)")
    p.add_argument("--eager-width", type=int, default=16, help="eager section: block width (default 16)")
    p.add_argument("--eager-iters", type=int, default=50, help="eager section: forwards per sample (default 50)")
    args = parse(p, argv)
    for name in args.sections:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
