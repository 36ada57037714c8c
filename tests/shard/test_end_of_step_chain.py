"""The end-of-step chain ([Note: the end-of-step chain] in ``overlap/sharding.py``): with the optimizer
stepped in backward and gather-ahead on, each of the next forward's first groups is gathered right
after its own step at the end of backward, behind the reduce-scatters still on the link, not after
every group's step. On 2 gloo CPU ranks behind a slow emulated link (so the last reduce-scatters are
still in flight when backward ends), against the same loop with gather-ahead off, bitwise.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import overlap
from models import LR, SEED, TinyLM, local_batch, make_batch
from overlap import param_group, sharding
from scheduler import cost_samples, gather_ahead, prefetch_depth, schedule_trial

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

LAYERS = 3
DEPTH = 1  # the next forward's first groups: the root and blocks.0


def _train(rank: int, world_size: int, enabled: bool) -> dict[str, Any]:
    """3 steps of TinyLM, AdamW in backward, plan (0, 1) at depth 1 forced; the end of each backward
    logged as ('step', group) and ('gather', group) events in issue order."""
    torch.set_num_threads(1)
    sharding.END_OF_STEP_CHAIN = True  # off by default (it lost in paired demo runs): the test turns it on
    gather_ahead.choose_gather_ahead = lambda *args, **kwargs: (0, 1)
    prefetch_depth.choose_prefetch_depth = lambda *args, **kwargs: DEPTH
    cost_samples.COST_SAMPLES = 1  # the plan chosen at the end of step 0, as asserted below
    schedule_trial.TRIAL_ROUNDS = 0  # the forced plan runs on, untried
    events: list[tuple[str, int]] = []
    at_end = [False]
    group_cls = param_group.ParamGroup
    finish_reduce, issue_gather = group_cls.finish_reduce, group_cls.issue_gather

    def logged_finish_reduce(self: Any, pending: Any) -> None:
        finish_reduce(self, pending)
        if at_end[0]:
            events.append(("step", id(self)))

    def logged_issue_gather(self: Any) -> None:
        if at_end[0] and self.pending_gather is None and not self.is_unsharded:
            events.append(("gather", id(self)))
        issue_gather(self)

    end_backward = sharding._Root._end_backward

    def logged_end_backward(self: Any) -> None:
        at_end[0] = True
        try:
            end_backward(self)
        finally:
            at_end[0] = False

    group_cls.finish_reduce, group_cls.issue_gather = logged_finish_reduce, logged_issue_gather
    sharding._Root._end_backward = logged_end_backward
    torch.manual_seed(SEED)
    model = TinyLM(layers=LAYERS)
    for block in model.blocks:
        overlap.shard(block, prefetch="auto")
    overlap.shard(model, prefetch="auto")
    model.set_gather_ahead(enabled)
    overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=LR)
    names = {id(s.group): (s.fqn or "root") for s in sharding.sharded_states(model) if s.group is not None}
    losses, ends = [], []
    for step in range(3):
        events.clear()
        loss = model.loss(local_batch(make_batch(step), rank, world_size))
        loss.backward()
        losses.append(loss.detach())
        ends.append([(kind, names[key]) for kind, key in events])
    return {"losses": torch.stack(losses), "ends": ends,
            "params": {n: p.to_local().clone() for n, p in model.named_parameters()}}


def _both(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [_train(rank, world_size, True), _train(rank, world_size, False)]


def test_first_groups_are_gathered_right_after_their_own_step(distributed) -> None:
    for chained, plain in distributed(_both, 2, link=(0.002, 0.0), timeout=300):
        assert torch.equal(chained["losses"], plain["losses"])
        for name, value in chained["params"].items():
            assert torch.equal(value, plain["params"][name]), name
        first = {"root", "blocks.0"}
        for end in chained["ends"][1:]:  # from step 1: the plan is chosen at the end of step 0
            steps = [name for kind, name in end if kind == "step"]
            assert "root" in steps, end  # the root is reduced last: its step is always at the end
            for i, (kind, name) in enumerate(end):
                if kind == "step" and name in first:
                    assert end[i + 1] == ("gather", name), end  # its gather next, before any other step
        for end in plain["ends"]:
            assert not any(kind == "gather" for kind, _ in end), end  # gather-ahead off: nothing at the end
