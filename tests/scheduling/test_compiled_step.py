"""A compiled FSDP-style training step, without and with ``scheduler.inductor_overlap()``.

On 2 gloo ranks, two copies of ``ShardedMLP`` (``tests/compiled_step.py``; 3 blocks, each block
all-gathers its flat shard in forward and reduce-scatters its gradient in backward) start from the
same weights and take the same SGD steps; one is compiled by Inductor as is, the other inside the
hook. Checked:

* losses and final shards are identical bit for bit: the pass only reorders graph nodes. (Inductor
  may then fuse differently -- here 8 generated kernels without the hook, 9 with -- but each value
  goes through the same float operations in the same order in this model, so equality is exact.
  A model whose reductions were split differently by a new fusion could differ in rounding.)
* in the generated code without the hook, every collective is waited right after it is issued;
  with the hook, compute runs between the issue and the wait of every all-gather but the first
  (forward) and of every reduce-scatter but the last (backward) -- the first has nothing before
  it to overlap, the last nothing after it;
* what runs is that code: a step logs its collectives and waits as they run (issue, wait, issue,
  wait, ... without the hook; all all-gathers first with it);
* (the emulated link's coverage of compiled collectives is tested in tests/tools/test_emulated_link.py, and
  ``benchmarks/bench_scheduler.py --sections compiled`` runs this step behind it.)

Both compiles run on each rank (the ranks compile in parallel), with Inductor's caches off so each
graph is compiled under its own configuration: ~40 s on 2 idle cores, most of it compiling.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterator

import torch

BLOCKS, DIM, HIDDEN, BATCH = 3, 32, 64, 16
STEPS = 4  # per copy after the compiling one; the third one logs what runs


# the hook compiles CPU all-gathers as all_gather_into_tensor_out (scheduler.cpu_all_gather)
_LETTERS = {"all_gather_into_tensor": "G", "all_gather_into_tensor_out": "G", "reduce_scatter_tensor": "R",
            "wait_tensor": "W"}


@contextlib.contextmanager
def _issue_log() -> Iterator[list[str]]:
    """Log, as letters, the functional collectives and waits that run: what the compiled code does,
    not what it says. A CPU kernel in front of torch's for each op, which reaches torch's kernel by
    redispatching with the GIL released, as the emulated link's kernels do (see [Note: calling
    torch's kernel without the GIL] in ``overlap.testing.emulated_link.functional``)."""
    log: list[str] = []
    library = torch.library.Library("_c10d_functional", "IMPL")
    torch_kernel = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)

    def logged(letter: str, op: Any) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            log.append(letter)
            return op.redispatch(torch_kernel, *args, **kwargs)

        return kernel

    try:
        for name, letter in _LETTERS.items():
            library.impl(name, logged(letter, getattr(torch.ops._c10d_functional, name).default), "CPU")
        yield log
    finally:
        library._destroy()


def _train_both(rank: int, world_size: int) -> dict[str, Any]:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    import scheduler
    from compiled_step import ShardedMLP, captured_code, collective_gaps, compiled_step

    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(rank))
    models = [ShardedMLP(BLOCKS, DIM, HIDDEN, rank, world_size) for _ in range(2)]
    without, with_hook = (compiled_step(m, x) for m in models)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        with captured_code() as codes_without:
            losses = [[without()], []]
        with scheduler.inductor_overlap(), captured_code() as codes_with:
            losses[1].append(with_hook())
    for _ in range(STEPS - 2):
        losses[0].append(without())
        losses[1].append(with_hook())
    orders = []
    for step, ls in zip((without, with_hook), losses):
        with _issue_log() as log:
            ls.append(step())
        orders.append("".join(log))
    losses[0].append(without())
    losses[1].append(with_hook())
    return {
        # torch >= 2.15: Inductor's scheduler moves waits after independent compute by itself
        "inductor_overlaps": bool(getattr(getattr(inductor_config, "aten_distributed_optimizations", None),
                                          "enable_simple_overlap", False)),
        "orders": orders,
        "gaps": [[collective_gaps(c) for c in codes] for codes in (codes_without, codes_with)],
        "losses": [torch.stack(ls) for ls in losses],
        "shards_equal": all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters())),
    }


# Was parked under `slow` after a hang in the full suite with no error: the harness then turned a rank's
# error raised with a collective in flight into an idle hang, fixed by [Note: report before destroying the
# process group] in overlap.testing.harness (an error now comes back at once, naming the rank).
def test_compiled_step_with_hook_same_losses_and_waits_after_compute(distributed) -> None:
    for rank, r in enumerate(distributed(_train_both, 2, timeout=240)):
        without, with_hook = r["losses"]
        assert len(without) == STEPS + 1 and torch.isfinite(without).all()
        assert torch.equal(without, with_hook), f"rank {rank}: losses differ: {without} vs {with_hook}"
        assert r["shards_equal"], f"rank {rank}: the shards differ after training"

        # What runs: each step its own compiled code (see [Note: one code object per step]).
        order_without, order_with = r["orders"]
        assert re.fullmatch(f"(GW+){{{BLOCKS}}}(RW+){{{BLOCKS}}}", order_without), order_without
        assert re.fullmatch(f"G{{{BLOCKS}}}W+R{{{BLOCKS}}}W+", order_with), order_with

        for variant, modules in zip(("without", "with"), r["gaps"]):
            gaps = [g for module in modules for g in module]
            gathers = [g.compute_before_wait for g in gaps if g.op == "all_gather_into_tensor"]
            scatters = [g.compute_before_wait for g in gaps if g.op == "reduce_scatter_tensor"]
            assert len(gathers) == len(scatters) == BLOCKS and len(gaps) == 2 * BLOCKS, (variant, gaps)
            if variant == "without":
                if not r["inductor_overlaps"]:
                    # Inductor's default before torch 2.15: each wait right after its collective.
                    assert gathers == scatters == [0] * BLOCKS, gaps
            else:
                assert all(n > 0 for n in gathers[1:]), f"forward: a wait before independent compute: {gaps}"
                assert all(n > 0 for n in scatters[:-1]), f"backward: a wait before independent compute: {gaps}"
