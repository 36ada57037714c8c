"""``set_reduce_scatter_max_input_buffers`` (FSDP2's, torch 2.15): at most that many gradient
reduce-scatters hold their input buffers at once; before a reduction past that, the oldest are
waited for (``_Root._hold_reduce_inputs`` in ``overlap/sharding.py``).

On 2 gloo ranks behind a slow emulated link (each reduce-scatter outlasts a block's backward, so
without a cap they pile up), TinyLM with 4 blocks under ``overlap.fully_shard``, 3 AdamW steps,
without a cap and with caps 1 and 2: the reduce-scatters holding their inputs when each reduction
is issued number at most ``cap - 1`` (and more without a cap, else the check proves nothing), and
losses and parameters are bitwise the run without a cap (the cap only waits). Bad input is checked
in ``tests/reliability/test_bad_input_matrix.py``.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

import overlap
from overlap.param_group import ParamGroup
from models import SEED, TinyLM, train_ranks

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

SLOW_LINK = (0.005, 100.0)  # Gbit/s, µs: a block's reduce-scatter (~20 KB) takes ~30 ms, its backward ~1 ms
STEPS = 3


def _run(rank: int, world: int, cap: Optional[int]) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = TinyLM(layers=4)
    for module in (*model.blocks, model):
        overlap.fully_shard(module)
    if cap is not None:
        model.set_reduce_scatter_max_input_buffers(cap)
    held: list[int] = []
    issue = ParamGroup.issue_reduce

    def counted(self: ParamGroup, *args: Any, **kwargs: Any) -> Any:
        held.append(sum(1 for w in overlap.inflight() if w.kind == "reduce_scatter" and w.pending))
        return issue(self, *args, **kwargs)

    ParamGroup.issue_reduce = counted  # type: ignore[method-assign]
    try:
        losses = train_ranks(model, rank, world, STEPS)
    finally:
        ParamGroup.issue_reduce = issue  # type: ignore[method-assign]
    return {"losses": losses, "most_held": max(held),
            "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()}}


def _rank(rank: int, world: int) -> dict[Optional[int], dict[str, Any]]:
    torch.set_num_threads(1)
    return {cap: _run(rank, world, cap) for cap in (None, 1, 2)}


def test_the_cap_bounds_the_reduce_scatters_holding_inputs_and_only_waits(distributed) -> None:
    """Fails if the cap is ignored (the slow link piles them up) or changes a value."""
    for rank, res in enumerate(distributed(_rank, 2, link=SLOW_LINK)):
        assert res[None]["most_held"] >= 2, res[None]["most_held"]  # else the link is too fast to tell
        assert res[1]["most_held"] == 0 and res[2]["most_held"] <= 1, (res[1]["most_held"], res[2]["most_held"])
        for cap in (1, 2):
            assert res[cap]["losses"] == res[None]["losses"], (rank, cap)
            for name, value in res[None]["params"].items():
                assert torch.equal(value, res[cap]["params"][name]), (rank, cap, name)
