"""The edges of the step: ``overlap.prefetch_next_step`` (the next forward's first all-gathers issued
right after the optimizer step), on gloo CPU ranks.

Every run is compared with the same loop without the prefetch, bitwise: the prefetch may only move
when a gather happens, never what it gathers. Covered: a parameter changed in place between the
prefetch and the next forward (it must be gathered again), through the DTensor or through its local
tensor (``to_local()``, as the local optimizer step writes), a group held gathered by ``unshard()``
across such a change, ``no_sync`` micro-batches, a forward that skips the group that was prefetched,
and a rank that exits with a prefetch in flight. Besides, what each forward gathers beside FSDP2:
in its accumulation recipe (groups held between micro-batches by ``set_reshard_after_backward``)
and after ``unshard()``.
"""
from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

import overlap
from models import COUNTING_LINK, SEED, TinyLM, all_gathers, assert_same_run, local_batch, make_batch, make_optimizer

pytestmark = pytest.mark.torch_kernels  # long training loops: packing by the torch fallback (conftest)


def _sharded(model: TinyLM, reshard_after_forward: bool = True) -> TinyLM:
    # depth 1 fixed: prefetch_next_step gathers 1 + depth groups, and prefetch="auto" would choose
    # the depth from this box's timings after three steps
    for block in model.blocks:
        overlap.shard(block, prefetch=1, reshard_after_forward=reshard_after_forward)
    overlap.shard(model, prefetch=1)
    return model


def _model(runtime: str, world_size: int, reshard_after_forward: bool = True) -> TinyLM:
    """:class:`TinyLM` from ``SEED``, sharded by ``runtime`` ("overlap": :func:`_sharded`; "fsdp2":
    ``models.fsdp2_model``)."""
    from models import fsdp2_model

    if runtime == "fsdp2":
        return fsdp2_model(world_size, reshard_after_forward=reshard_after_forward)
    torch.manual_seed(SEED)
    return _sharded(TinyLM(), reshard_after_forward)



def _train(rank: int, world_size: int, prefetch: bool, skip_first_on_odd_steps: bool = False) -> dict[str, Any]:
    """4 AdamW steps; after step 2's optimizer step, one weight is halved in place (after the
    prefetch, which must then be gathered again); after step 1's, one weight of blocks[0] is halved
    through its local tensor (a write the DTensor's own version counter does not see), and, with
    ``prefetch``, blocks[1] is gathered by ``unshard()`` before one of its weights is halved (its
    held unsharded parameters are then old: forward must gather again); with
    ``skip_first_on_odd_steps``, odd steps run without blocks[0] (the group the prefetch gathered
    for them)."""
    from overlap.testing import current_link

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = _sharded(TinyLM())
    first = model.blocks[0]
    held_weight = model.blocks[1].mlp.fc1.weight  # the sharded one: after unshard() the module holds the full one
    opt = make_optimizer(model.parameters())
    link = current_link()
    losses, prefetched, held = [], [], []
    for step in range(4):
        if skip_first_on_odd_steps:
            model.blocks[0] = first if step % 2 == 0 else nn.Identity()
        loss = model.loss(local_batch(make_batch(step), rank, world_size))
        if skip_first_on_odd_steps and step % 2:  # the skipped group's prefetch: dropped at the end of forward
            held.append(first._overlap_state.group.pending_gather is not None)
        loss.backward()
        opt.step()
        if prefetch:
            before = all_gathers(link.stats())
            overlap.prefetch_next_step(model)
            prefetched.append(all_gathers(link.stats()) - before)
        if step == 1:
            if prefetch:
                model.blocks[1].unshard()  # held gathered into the next forward, like a prefetch
            with torch.no_grad():
                first.mlp.fc2.weight.to_local().mul_(0.5)  # through the local tensor, after the prefetch
                held_weight.mul_(0.5)  # its shard, after the unshard() above
        if step == 2:
            with torch.no_grad():
                first.mlp.fc1.weight.mul_(0.5)  # in place, after the prefetch packed it
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    model.blocks[0] = first
    return {"losses": torch.stack(losses), "prefetched": prefetched, "held": held,
            "params": {n: p.to_local().clone() for n, p in model.named_parameters()}}


def _both(rank: int, world_size: int, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return _train(rank, world_size, True, **kwargs), _train(rank, world_size, False, **kwargs)


def test_prefetch_next_step_changes_nothing_but_when_gathers_run(distributed) -> None:
    for with_prefetch, plain in distributed(_both, 2, link=COUNTING_LINK):
        assert_same_run(with_prefetch, plain)
        # The root group (embeddings, head, final norm) and the first block: 1 + prefetch groups.
        assert with_prefetch["prefetched"] == [2] * 4, with_prefetch["prefetched"]


def test_prefetch_for_a_group_the_next_forward_skips(distributed) -> None:
    """Also: the forward that skips the prefetched group drops its gather (the group holds no
    all-gather output into the next step)."""
    for with_prefetch, plain in distributed(_both, 2, link=COUNTING_LINK, skip_first_on_odd_steps=True):
        assert_same_run(with_prefetch, plain)
        assert with_prefetch["prefetched"] == [2] * 4, with_prefetch["prefetched"]  # blocks[0] was prefetched
        assert with_prefetch["held"] == [False, False], with_prefetch["held"]


def _micro_batches(rank: int, world_size: int, prefetch: bool) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = _sharded(TinyLM())
    opt = make_optimizer(model.parameters())
    model.loss(local_batch(make_batch(0), rank, world_size)).backward()  # a first step: the agreed order
    opt.step()
    opt.zero_grad(set_to_none=True)
    for micro in range(3):
        if prefetch:
            overlap.prefetch_next_step(model)
        tokens = local_batch(make_batch(10 + micro), rank, world_size)
        if micro < 2:
            with overlap.no_sync(model):
                model.loss(tokens).backward()
        else:
            model.loss(tokens).backward()
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}


def _micro_both(rank: int, world_size: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return _micro_batches(rank, world_size, True), _micro_batches(rank, world_size, False)


def test_prefetch_between_no_sync_micro_batches(distributed) -> None:
    for with_prefetch, plain in distributed(_micro_both, 2):
        for name, grad in with_prefetch.items():
            assert torch.equal(grad, plain[name]), name


def _exit_with_prefetch_in_flight(rank: int, world_size: int) -> bool:
    torch.manual_seed(SEED)
    model = _sharded(TinyLM())
    model.loss(local_batch(make_batch(0), rank, world_size)).backward()
    issued = overlap.prefetch_next_step(model)
    return issued  # the harness then destroys the process group with the gathers unwaited


def test_exit_with_a_prefetch_in_flight_does_not_hang(distributed) -> None:
    assert distributed(_exit_with_prefetch_in_flight, 2, link=(0.01, 0.0), timeout=60) == [True, True]


def _before_any_step(rank: int, world_size: int) -> bool:
    return overlap.prefetch_next_step(_sharded(TinyLM()))


def test_prefetch_next_step_before_any_step_issues_nothing(distributed) -> None:
    assert distributed(_before_any_step, 2) == [False, False]


def test_prefetch_next_step_refuses_an_unsharded_module() -> None:
    with pytest.raises(TypeError, match="module must be a module sharded by overlap.shard"):
        overlap.prefetch_next_step(TinyLM())


def _forward_gathers_beside_fsdp2(rank: int, world_size: int) -> dict[str, Any]:
    """Each forward's all-gathers on the link (FSDP2's pass through it too) over two steps, the
    sharded model's and FSDP2's side by side, in three recipes:

    - ``held``: three ``no_sync`` micro-batches per step, FSDP2's accumulation recipe: the first two
      with ``set_reshard_after_backward(False)``, the last with it on again (turned on just before
      its forward); ``plain`` is the same loop that reshards after every backward. The gradients
      of the sharded runs are kept too.
    - ``unshard``: ``plain`` with ``blocks[0].unshard()`` before each step's first forward, which
      then has that block's parameters.

    Besides, for both, :func:`_forwards_before_backward` of each of :data:`FORWARDS_BEFORE_BACKWARD`
    and :func:`_step_gathers` of each of :data:`STEP_RECIPES`."""
    from overlap.testing import current_link

    link = current_link()
    out: dict[str, Any] = {}
    for runtime in ("overlap", "fsdp2"):
        for recipe in ("held", "plain", "unshard"):
            model = _model(runtime, world_size)
            forward_gathers = []
            for step in range(2):
                for micro in range(3):
                    last = micro == 2
                    model.set_reshard_after_backward(last or recipe != "held")
                    model.set_requires_gradient_sync(last)
                    if recipe == "unshard" and micro == 0:
                        model.blocks[0].unshard()
                    before = all_gathers(link.stats())
                    loss = model.loss(local_batch(make_batch(3 * step + micro), rank, world_size))
                    forward_gathers.append(all_gathers(link.stats()) - before)
                    loss.backward()
            out[runtime, recipe] = {"forward_gathers": forward_gathers,
                                    "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()}}
    for runtime in ("overlap", "fsdp2"):
        for recipe in FORWARDS_BEFORE_BACKWARD:
            out[runtime, recipe] = _forwards_before_backward(runtime, recipe, rank, world_size, link)
        for recipe in STEP_RECIPES:
            out[runtime, recipe] = _step_gathers(runtime, recipe, rank, world_size, link)
    return out


STEP_RECIPES = ("one forward per step", "eval between steps", "reshard after the step", "no reshard after forward")
"""Training loops: ``one forward per step``; an evaluation forward under ``torch.no_grad()``
before each step; ``reshard()`` of the root after each optimizer step; the blocks sharded with
``reshard_after_forward=False``."""


def _step_gathers(runtime: str, recipe: str, rank: int, world_size: int, link: Any) -> list[int]:
    """The all-gathers of each of four AdamW steps of ``recipe`` (:data:`STEP_RECIPES`)."""
    model = _model(runtime, world_size, reshard_after_forward=recipe != "no reshard after forward")
    opt = make_optimizer(model.parameters())
    gathers = []
    for step in range(4):
        before = all_gathers(link.stats())
        tokens = local_batch(make_batch(step), rank, world_size)
        if recipe == "eval between steps":
            with torch.no_grad():
                model(tokens[:, :-1])
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
        if recipe == "reshard after the step":
            model.reshard()
        gathers.append(all_gathers(link.stats()) - before)
    return gathers


FORWARDS_BEFORE_BACKWARD = ("summed", "two backwards", "dropped", "inference between")
"""Steps with two forwards before backward: ``summed``, one backward of the two losses' sum;
``two backwards``, one per loss, in forward order; ``dropped``, the first forward's graph dropped
(its loss only read), the second's backward; ``inference between``, the second forward under
``torch.inference_mode()``, then the first's backward."""


def _forwards_before_backward(runtime: str, recipe: str, rank: int, world_size: int, link: Any) -> dict[str, Any]:
    """Three AdamW steps of ``recipe`` (:data:`FORWARDS_BEFORE_BACKWARD`): each step's full gradients
    and all-gathers."""
    model = _model(runtime, world_size)
    opt = make_optimizer(model.parameters())
    grads, gathers = [], []
    for step in range(3):
        before = all_gathers(link.stats())
        first = model.loss(local_batch(make_batch(2 * step), rank, world_size))
        with torch.inference_mode() if recipe == "inference between" else contextlib.nullcontext():
            second = model.loss(local_batch(make_batch(2 * step + 1), rank, world_size))
        if recipe == "summed":
            (first + second).backward()
        elif recipe == "two backwards":
            first.backward()
            second.backward()
        elif recipe == "dropped":
            first.item()
            del first
            second.backward()
        else:
            first.backward()
        gathers.append(all_gathers(link.stats()) - before)
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "gathers": gathers}


@pytest.fixture(scope="module")
def forward_gathers() -> list[dict[str, Any]]:
    from overlap.testing import run_distributed

    return run_distributed(_forward_gathers_beside_fsdp2, 2, link=COUNTING_LINK)


def test_a_group_held_after_backward_is_not_gathered_again_in_the_next_forward(forward_gathers) -> None:
    """``set_reshard_after_backward(False)`` keeps the groups unsharded into the next micro-batch's
    forward, which gathers nothing (FSDP2's accumulation recipe), with the same gradients as the
    loop that reshards and gathers again. That holds also for the last micro-batch, whose forward
    runs after ``set_reshard_after_backward(True)``: the groups the last backward held stay, as
    FSDP2's do (they were gathered again there once). Each forward gathers when FSDP2's does: at a
    step's first micro-batch, not after."""
    for res in forward_gathers:
        held, plain = res["overlap", "held"], res["overlap", "plain"]
        firsts = plain["forward_gathers"][0::3]
        assert all(n > 0 for n in plain["forward_gathers"]), plain
        assert held["forward_gathers"] == [firsts[0], 0, 0, firsts[1], 0, 0], (held, plain)
        fsdp2 = res["fsdp2", "held"]["forward_gathers"]
        assert [n > 0 for n in fsdp2] == [n > 0 for n in held["forward_gathers"]], (held, fsdp2)
        assert held["grads"].keys() == plain["grads"].keys()
        assert all(torch.equal(g, plain["grads"][n]) for n, g in held["grads"].items())


def test_a_forward_after_unshard_gathers_one_group_fewer_as_fsdp2(forward_gathers) -> None:
    """A forward after ``blocks[0].unshard()`` uses the gathered parameters: it gathers one group
    fewer than the same forward without, as FSDP2's does, and the gradients are the plain loop's."""
    for res in forward_gathers:
        for runtime in ("overlap", "fsdp2"):
            unshard, plain = res[runtime, "unshard"]["forward_gathers"], res[runtime, "plain"]["forward_gathers"]
            assert unshard == [n - (i % 3 == 0) for i, n in enumerate(plain)], (runtime, unshard, plain)
        plain_grads = res["overlap", "plain"]["grads"]
        assert all(torch.equal(g, plain_grads[n]) for n, g in res["overlap", "unshard"]["grads"].items())


@pytest.mark.parametrize("recipe", FORWARDS_BEFORE_BACKWARD)
def test_two_forwards_before_backward_train_as_fsdp2(forward_gathers, recipe: str) -> None:
    """Two forwards before backward ([Note: forwards before one backward]): the second continues the
    step, so the first's graph finds its groups when backward reaches it (a second forward that
    started a new step resharded them, and backward read freed storage), and every gradient is
    bitwise FSDP2's, whether the losses are summed, each gets its own backward, the first graph is
    dropped or the second forward runs under ``inference_mode``. No step gathers more than FSDP2's
    (after the first, whose order agreement is an all-gather too)."""
    for res in forward_gathers:
        ours, fsdp2 = res["overlap", recipe], res["fsdp2", recipe]
        for step, (got, want) in enumerate(zip(ours["grads"], fsdp2["grads"])):
            assert got.keys() == want.keys()
            assert all(torch.equal(got[n], want[n]) for n in want), (recipe, step)
        assert all(g <= f for g, f in zip(ours["gathers"][1:], fsdp2["gathers"][1:])), (ours["gathers"], fsdp2["gathers"])


@pytest.mark.parametrize("recipe", STEP_RECIPES)
def test_no_step_gathers_more_than_fsdp2(forward_gathers, recipe: str) -> None:
    """In common training loops (:data:`STEP_RECIPES`) no step all-gathers more than FSDP2's, after
    the first (whose order agreement is an all-gather too): the groups kept for backward and the
    gathers issued ahead only ever save gathers."""
    for res in forward_gathers:
        ours, fsdp2 = res["overlap", recipe], res["fsdp2", recipe]
        assert all(0 < g <= f for g, f in zip(ours[1:], fsdp2[1:])), (recipe, ours, fsdp2)
