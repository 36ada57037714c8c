"""``set_unshard_in_backward(False)`` (FSDP2's, on a module whose backward reads none of its
parameters): the group is neither gathered nor prefetched in backward, and training is bitwise what
it is with the group gathered there.

TinyLM's position embedding (untied: its backward reads the positions, not the weight) is sharded
as a group of its own, between the root's group and the blocks'. Each loop runs twice from one seed,
with and without the setting, on 2 gloo ranks behind the counting link, and compares losses and
parameters bitwise and the embedding group's all-gathers issued inside backward. The loops: a fixed
``prefetch=1`` (the step's all-gathers counted on the link too), ``prefetch="auto"`` (the recording
steps and the chosen schedule, whose step model is told the group is not gathered again), and
``no_sync`` micro-batches (the group gathered for each forward, its unsharded gradients accumulated
across them while its storage is freed). FSDP2 side by side: ``tests/clients/test_fully_shard.py``.
"""
from __future__ import annotations

from typing import Any, Union

import pytest
import torch

import overlap
from models import COUNTING_LINK, SEED, TinyLM, all_gathers, assert_same_run, local_batch, make_batch, make_optimizer

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

LAYERS = 4  # the embedding's group is never among the last groups kept for backward at depth <= 3
STEPS = 5


def _model(left_sharded: bool, prefetch: Union[int, str]) -> TinyLM:
    torch.manual_seed(SEED)
    model = TinyLM(layers=LAYERS)
    overlap.shard(model.pos, prefetch=prefetch)
    for block in model.blocks:
        overlap.shard(block, prefetch=prefetch)
    overlap.shard(model, prefetch=prefetch)
    model.pos.set_unshard_in_backward(not left_sharded)
    return model


def _run(rank: int, world: int, left_sharded: bool, loop: str) -> dict[str, Any]:
    from overlap.testing import current_link

    torch.set_num_threads(1)
    model = _model(left_sharded, "auto" if loop == "auto" else 1)
    state = model.pos._overlap_state
    group = state.group
    in_backward: list[int] = [0]
    issue = group.issue_gather

    def counted() -> None:  # a gather for this backward (not one ahead for the next step's forward)
        root = state.root
        in_backward[0] += (root.in_backward and state.index not in root._done and not group.is_unsharded
                           and group.pending_gather is None)
        issue()

    group.issue_gather = counted
    link = current_link()
    opt = make_optimizer(model.parameters())
    losses, link_gathers, backward_gathers = [], [], []
    for step in range(STEPS):
        before_link, before_backward = all_gathers(link.stats()), in_backward[0]
        micro_batches = 3 if loop == "no_sync" else 1
        for micro in range(micro_batches):
            tokens = local_batch(make_batch(10 * step + micro), rank, world)
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            loss = model.loss(tokens)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        link_gathers.append(all_gathers(link.stats()) - before_link)
        backward_gathers.append(in_backward[0] - before_backward)
    return {"losses": torch.stack(losses), "link_gathers": link_gathers, "backward_gathers": backward_gathers,
            "params": {n: p.to_local().clone() for n, p in model.named_parameters()},
            "modelled": state.root._backward_gathers()}  # what the choosers' step model is told



def _loops(rank: int, world: int) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    return {loop: (_run(rank, world, True, loop), _run(rank, world, False, loop))
            for loop in ("fixed", "auto", "no_sync")}


@pytest.fixture(scope="module")
def loops() -> list[dict[str, tuple[dict[str, Any], dict[str, Any]]]]:
    from overlap.testing import run_distributed

    return run_distributed(_loops, 2, link=COUNTING_LINK)


def test_the_group_is_not_gathered_in_backward_and_training_is_the_same(loops) -> None:
    for rank in loops:
        left, usual = rank["fixed"]
        assert_same_run(left, usual, "fixed")
        assert left["backward_gathers"] == [0] * STEPS
        assert usual["backward_gathers"] == [1] * STEPS  # prefetched by blocks[0]'s pre-backward before
        # one all-gather less per step on the link
        assert [u - g for u, g in zip(usual["link_gathers"], left["link_gathers"])] == [1] * STEPS


def test_prefetch_auto_records_and_chooses_with_the_group_left_sharded(loops) -> None:
    for rank in loops:
        left, usual = rank["auto"]
        assert_same_run(left, usual, "auto")
        assert left["backward_gathers"] == [0] * STEPS
        # the choosers model no backward gather for the embedding's group (forward position 1, after the root's)
        assert usual["modelled"] is None and left["modelled"] == [True, False] + [True] * LAYERS


def test_no_sync_micro_batches_accumulate_into_the_freed_parameters(loops) -> None:
    for rank in loops:
        left, usual = rank["no_sync"]
        assert_same_run(left, usual, "no_sync")
        assert left["backward_gathers"] == [0] * STEPS
        assert usual["backward_gathers"] == [3] * STEPS  # one per micro-batch before
