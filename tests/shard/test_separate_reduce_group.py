"""``set_separate_reduce_scatter_group`` (FSDP2's, torch 2.15): the gradient reductions over a process
group of their own over the shard group's ranks ([Note: a reduce-scatter group of its own] in
``overlap/groups.py``).

On 2 and 3 gloo ranks behind the counting link, TinyLM under ``overlap.fully_shard``, 3 AdamW steps:
with the setting, every gradient reduction is counted on one new group and none on the shard
group, which keeps every all-gather; one group is made for all the modules; losses and parameters
are bitwise the run without it; ``False`` afterwards puts the reductions back on the shard group.
Where torch's FSDP2 has the method (2.15), FSDP2 with it runs beside: bitwise too.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import overlap
from models import COUNTING_LINK, SEED, TinyLM, all_gathers, gradient_reductions, train_ranks

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

STEPS = 3


def _run(runtime: str, rank: int, world: int, separate: bool) -> dict[str, Any]:
    from overlap.testing import current_link

    torch.manual_seed(SEED)
    model = TinyLM()
    fully_shard = overlap.fully_shard if runtime == "overlap" else torch.distributed.fsdp.fully_shard
    for module in (*model.blocks, model):
        fully_shard(module)
    if separate:
        model.set_separate_reduce_scatter_group()
    link = current_link()
    link.reset_stats()
    losses = train_ranks(model, rank, world, STEPS)
    by_group = {name: (all_gathers(stats), gradient_reductions(stats)) for name, stats in link.stats_by_group().items()}
    return {"losses": losses, "by_group": {k: v for k, v in by_group.items() if v != (0, 0)},
            "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
            "model": model}


def _rank(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {(runtime, separate): _run(runtime, rank, world, separate)
           for runtime in ("overlap", "fsdp2") for separate in (False, True)
           if runtime == "overlap" or hasattr(torch.distributed.fsdp.FSDPModule, "set_separate_reduce_scatter_group")}
    model = out[("overlap", True)].pop("model")  # the reductions back on the shard group
    model.set_separate_reduce_scatter_group(False)
    out["reset"] = {s.group.reduce_info is s.group.info for s in overlap.sharding.sharded_states(model)}
    for run in out.values():
        if isinstance(run, dict):
            run.pop("model", None)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_reductions_on_a_group_of_their_own_are_bitwise_the_shared_group(distributed, world: int) -> None:
    """Fails if the setting leaves the reductions on the shard group (no second group counted), makes
    a group per module (more than two groups), moves an all-gather, or changes a value."""
    for rank, res in enumerate(distributed(_rank, world, link=COUNTING_LINK)):
        shared, separate = res[("overlap", False)], res[("overlap", True)]
        (name, (gathers, reductions)), = shared["by_group"].items()  # one group carries everything
        assert gathers > 0 and reductions > 0, shared["by_group"]
        assert len(separate["by_group"]) == 2, separate["by_group"]
        # the shard group keeps the all-gathers (and train_ranks' all-reduce of the loss, one a step)
        assert separate["by_group"][name] == (gathers, STEPS), separate["by_group"]
        (other,) = [v for k, v in separate["by_group"].items() if k != name]
        assert other == (0, reductions - STEPS), separate["by_group"]
        assert res["reset"] == {True}
        runs = [separate] + [res[k] for k in (("fsdp2", False), ("fsdp2", True)) if k in res]
        for run in runs:
            assert run["losses"] == shared["losses"], rank
            for key, value in shared["params"].items():
                assert torch.equal(value, run["params"][key]), (rank, key)
