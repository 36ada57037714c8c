"""torchao's float8 all-gather (FSDP2's all-gather extension) under overlap.shard and FSDP2: bytes on the link and step time.

What is measured. ``bench_train.py``'s MLP (2 gloo ranks, blocks of Linear dim -> 2 dim -> dim, AdamW,
float32 parameters) converted with torchao's ``convert_to_float8_training``, each linear computing
in float8, two ways: ``enable_fsdp_float8_all_gather=False`` (the weights travel as their float32
values and each rank casts after the gather) and ``True`` (each weight's ``fsdp_pre_all_gather``
casts its shard to float8 with a scale agreed over the ranks, the all-gather moves float8 bytes,
``fsdp_post_all_gather`` wraps them; ``precompute_float8_dynamic_scale_for_fsdp`` after each
optimizer step makes that one all-reduce for all weights). Each under ``overlap.shard`` and torch
FSDP2, behind the emulated link (calibrated so that the float32 step's comm takes about as long as
its compute, or ``--link-gbps``). Every mode steps in turn, round by round, in one run; medians
of the slowest rank. Bytes per step and rank, counted at torch's calls: each all-gather's output
(every rank's input) and each reduce-scatter's input (on gloo overlap.shard moves those bytes with
an all-to-all: its input). The losses of
overlap.shard and FSDP2 are checked bitwise equal per way.

    python benchmarks/bench_gather_extension.py [--steps 8] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

from _common import mlp, mlp_parser, parse, rank_input, same_losses, slowest_rank_medians  # first: sys.path
from overlap.demo.training import calibrate_link, make_optimizer, shard_for_mode
from overlap.testing import emulated_link, run_distributed
from report import emit

MODES = [(runtime, float8_gather) for float8_gather in (False, True) for runtime in ("overlap", "fsdp2")]


def _label(runtime: str, float8_gather: bool) -> str:
    return f"{'overlap.shard' if runtime == 'overlap' else 'torch FSDP2'}, " + (
        "float8 all-gather" if float8_gather else "float32 all-gather")


def _step(runtime: str, float8_gather: bool, args: argparse.Namespace, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    from torchao import float8

    torch.manual_seed(0)
    model = float8.convert_to_float8_training(
        mlp(args.blocks, args.dim), config=float8.Float8LinearConfig(enable_fsdp_float8_all_gather=float8_gather))
    shard_for_mode(runtime, model, list(model))
    optimizer = make_optimizer(model, 1e-3)

    def step() -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if float8_gather:
            float8.precompute_float8_dynamic_scale_for_fsdp(model)
        return loss.detach()

    return step


def _counting(counts: dict[str, int]) -> Callable[[], None]:
    """Count into ``counts`` the bytes of torch's all-gathers (their output) and of the gradient
    reductions (a reduce-scatter's or all-to-all's input); returns the function that restores them."""
    import torch.distributed as dist

    from scheduler.torch_versions import DIST_ALL_GATHER, DIST_REDUCE_SCATTER

    saved = {name: getattr(dist, name) for name in (DIST_ALL_GATHER, DIST_REDUCE_SCATTER, "all_to_all_single")}

    def wrap(name: str, key: str, which: int) -> Callable[..., Any]:
        inner = saved[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[which] if len(args) > which else kwargs["output_tensor" if which == 0 else "input"]
            counts[key] += tensor.numel() * tensor.element_size()
            return inner(*args, **kwargs)

        return counted

    setattr(dist, DIST_ALL_GATHER, wrap(DIST_ALL_GATHER, "all_gather", 0))  # its output: every rank's input
    setattr(dist, DIST_REDUCE_SCATTER, wrap(DIST_REDUCE_SCATTER, "reduce_scatter", 1))  # its input: every rank's share
    # overlap.shard moves a reduce-scatter's bytes on gloo by an all-to-all ([Note: gloo's
    # reduce-scatter cannot say it is done] in overlap/collectives.py): its input, likewise
    setattr(dist, "all_to_all_single", wrap("all_to_all_single", "reduce_scatter", 1))

    def restore() -> None:
        for name, fn in saved.items():
            setattr(dist, name, fn)

    return restore


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    x = rank_input(args.batch, args.dim, rank)
    # calibrated on a model of its own: the timed ones all take the same steps
    gbps = args.link_gbps or calibrate_link(_step("overlap", False, args, x), args.latency_us)
    steps = {_label(*m): _step(*m, args, x) for m in MODES}
    out: dict[str, Any] = {label: {"step": [], "losses": [], "bytes": []} for label in steps}
    counts = {"all_gather": 0, "reduce_scatter": 0}
    with emulated_link(gbps, args.latency_us):
        restore = _counting(counts)  # over the link's own patches of the same functions
        try:
            for i in range(args.warmup + args.steps):
                for label, step in steps.items():
                    counts.update(all_gather=0, reduce_scatter=0)
                    start = time.perf_counter()
                    loss = step()
                    elapsed = time.perf_counter() - start
                    out[label]["losses"].append(loss)
                    out[label]["bytes"].append((counts["all_gather"], counts["reduce_scatter"]))
                    if i >= args.warmup:
                        out[label]["step"].append(elapsed)
        finally:
            restore()
    out["gbps"] = gbps
    return out


def main(argv: list[str] | None = None) -> None:
    p = mlp_parser(__doc__, 8, "timed rounds", 2, "untimed rounds")
    args = parse(p, argv)
    results = run_distributed(_rank, args.world_size, args, timeout=1800)
    labels = [_label(*m) for m in MODES]
    median = slowest_rank_medians(results, labels, args.steps)
    base = median[_label("overlap", False)]
    rows = []
    for (runtime, float8_gather), label in zip(MODES, labels):
        gathered, reduced = results[0][label]["bytes"][-1]
        other = _label("fsdp2" if runtime == "overlap" else "overlap", float8_gather)
        same = same_losses(results, label, other)
        rows.append([label, f"{median[label] * 1e3:.1f}", f"{median[label] / base:.2f}x",
                     f"{gathered / 2 ** 20:.2f}", f"{reduced / 2 ** 20:.2f}", "yes" if same else "NO"])
    emit(f"torchao float8 training, {args.world_size} CPU ranks (gloo), {args.blocks} MLP blocks of width {args.dim}, "
         f"AdamW, float32 parameters; emulated link {results[0]['gbps']:.2f} Gbit/s + {args.latency_us:g} µs; medians "
         f"of {args.steps} interleaved rounds, slowest rank; MiB per step per rank (rank 0's last step)",
         ["mode", "step ms", "vs overlap.shard float32 all-gather", "all-gather MiB", "reduce-scatter MiB",
          "losses bitwise the other runtime's"], rows, args.markdown)


if __name__ == "__main__":
    main()
