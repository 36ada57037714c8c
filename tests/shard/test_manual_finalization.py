"""``set_manual_backward_finalization`` / ``finalize_backward`` (FSDP2's, torch 2.15): each backward
leaves its reductions in flight at its end, and ``finalize_backward()`` waits for them and sets the
sharded gradients ([Note: manual backward finalization] in ``overlap/sharding.py``).

On 1 and 2 gloo ranks, TinyLM under ``overlap.fully_shard`` (each block, then the root), AdamW, each
manual loop bitwise the automatic loop it stands for, and FSDP2's automatic loop beside it (FSDP2's
manual loop too where its torch has the method, 2.15):

- ``finalize``: forward, backward, ``finalize_backward()``, step;
- ``accumulate``: two micro-batches under ``no_sync``, then sync on and ``finalize_backward()``,
  which reduces the sum once (automatic: the second micro-batch synced);
- ``forgotten``: two synced micro-batches, ``finalize_backward()`` only after the second: the next
  forward finishes the first implicitly (automatic: two synced backwards accumulating);
- ``async``: ``finalize_backward(async_op=True)``, forward refused until ``wait()``;
- ``step_first``: no ``finalize_backward()`` at all: the optimizer step finishes the backward first.

Behind a slow emulated link the reductions are still in flight when ``backward()`` returns and some
sharded gradient is still unset; ``finalize_backward()`` sets them all. The rules (root only, the
mode fixed per backward, not inside backward nor between a forward and its backward, a handle
invalidated by ``reset_iter_state``) on 2 ranks too. On 4 ranks, HSDP's partial reductions
(``set_requires_all_reduce(False)``), which FSDP2 refuses under manual finalization, bitwise the
automatic loop. And ``overlap.shard``'s own schedule (``prefetch="auto"``) with the optimizer
stepped in backward, the demo's setting, behind a link: bitwise the automatic loop.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import overlap
from models import SEED, TinyLM, assert_same_run, local_batch, make_batch, make_optimizer, run_of

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

STEPS = 2
LOOPS = ("finalize", "accumulate", "forgotten", "async", "step_first")
SLOW_LINK = (0.005, 100.0)  # Gbit/s, µs: a block's reduce-scatter (~20 KB) takes ~30 ms, its backward ~1 ms


def _fsdp2_has_manual_finalization() -> bool:
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_manual_backward_finalization")


def _model(runtime: str, world: int, manual: bool, layers: int = 2) -> TinyLM:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = TinyLM(layers=layers)
    shard = overlap.fully_shard if runtime == "overlap" else fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for module in (*model.blocks, model):
        shard(module, mesh=mesh)
    if manual:
        model.set_manual_backward_finalization(True)
    return model


def _micro(model: TinyLM, rank: int, world: int, seed: int) -> torch.Tensor:
    loss = model.loss(local_batch(make_batch(seed), rank, world))
    loss.backward()
    return loss.detach()


def _train(model: TinyLM, rank: int, world: int, loop: str, manual: bool) -> dict[str, Any]:
    """``loop``'s steps, manual (as the module docstring says) or its automatic counterpart."""
    opt = make_optimizer(model.parameters())
    losses = []
    refused = []
    for step in range(STEPS):
        if loop in ("finalize", "async", "step_first"):
            losses.append(_micro(model, rank, world, step))
        elif loop == "accumulate":
            for micro in range(2):
                model.set_requires_gradient_sync(not manual and micro == 1)
                losses.append(_micro(model, rank, world, 2 * step + micro))
            model.set_requires_gradient_sync(True)
        else:  # forgotten: no finalize after the first micro-batch
            for micro in range(2):
                losses.append(_micro(model, rank, world, 2 * step + micro))
        if manual and loop == "async":
            handle = model.finalize_backward(async_op=True)
            try:
                model.loss(local_batch(make_batch(0), rank, world))
            except RuntimeError as e:
                refused.append("wait" in str(e))
            handle.wait()
        elif manual and loop != "step_first":
            model.finalize_backward()
        opt.step()
        opt.zero_grad()
    return {**run_of(losses, model), "refused": refused}


def _loops(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for loop in LOOPS:
        for manual in (False, True):
            out[f"{loop}/overlap/{manual}"] = _train(_model("overlap", world, manual), rank, world, loop, manual)
        out[f"{loop}/fsdp2/False"] = _train(_model("fsdp2", world, False), rank, world, loop, False)
        if _fsdp2_has_manual_finalization() and loop not in ("forgotten", "step_first"):  # no implicit finish there
            out[f"{loop}/fsdp2/True"] = _train(_model("fsdp2", world, True), rank, world, loop, True)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_manual_finalization_trains_bitwise_as_the_automatic_loop_and_fsdp2(distributed, world: int) -> None:
    """Fails if finalize_backward loses, repeats or reorders a reduction, if it does not reduce what
    no_sync backwards accumulated, if a forward does not finish an unfinalized backward (its
    gradients would be lost or added late), or if a forward is allowed before an async handle's
    wait()."""
    for rank, res in enumerate(distributed(_loops, world)):
        for loop in LOOPS:
            automatic = res[f"{loop}/overlap/False"]
            for other in (f"{loop}/overlap/True", f"{loop}/fsdp2/False", f"{loop}/fsdp2/True"):
                if other not in res:
                    continue
                assert_same_run(automatic, res[other], (rank, other))
        assert res["async/overlap/True"]["refused"] == [True] * STEPS, rank


def _in_flight_at_backward_end(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = _model("overlap", world, manual=True, layers=4)
    _micro(model, rank, world, 0)
    pending = sum(1 for w in overlap.inflight() if w.kind == "reduce_scatter" and w.pending)
    unset = sum(p.grad is None for p in model.parameters())
    model.finalize_backward()
    return {"pending": pending, "unset": unset, "unset_after": sum(p.grad is None for p in model.parameters())}


def test_reductions_stay_in_flight_until_finalize_backward(distributed) -> None:
    """Fails if the end of backward waits for the reductions under manual finalization (nothing
    pending when backward returns), or if finalize_backward leaves a gradient unset."""
    for rank, res in enumerate(distributed(_in_flight_at_backward_end, 2, link=SLOW_LINK)):
        assert res["pending"] >= 1 and res["unset"] >= 1, (rank, res)
        assert res["unset_after"] == 0, (rank, res)


def _raises(fn: Callable[[], Any], *words: str) -> bool:
    try:
        fn()
    except RuntimeError as e:
        return all(w in str(e) for w in words)
    return False


def _steps(opt: torch.optim.Optimizer) -> bool:
    for p in (p for g in opt.param_groups for p in g["params"]):
        p.grad = torch.ones_like(p)
    opt.step()
    return True


def _rules(rank: int, world: int) -> dict[str, bool]:
    torch.set_num_threads(1)
    model = _model("overlap", world, manual=False)
    block = model.blocks[0]
    batch = local_batch(make_batch(0), rank, world)
    got = {"no-op before the first forward": model.finalize_backward() is None}
    got["before the first forward, async"] = model.finalize_backward(async_op=True).wait() is None
    loss = model.loss(batch)
    got["not on a block"] = _raises(lambda: block.set_manual_backward_finalization(True), "root")
    got["finalize needs the mode"] = _raises(lambda: model.finalize_backward(), "set_manual_backward_finalization(True)")
    loss.backward()
    model.set_manual_backward_finalization(True)
    loss = model.loss(batch)
    got["not between forward and backward"] = _raises(lambda: model.finalize_backward(), "between")
    got["finalize on a block"] = _raises(lambda: block.finalize_backward(), "root")
    inside: list[bool] = []
    loss.register_hook(lambda g: inside.extend([
        _raises(lambda: model.finalize_backward(), "after backward completes"),
        _raises(lambda: model.set_manual_backward_finalization(False), "during backward")]))
    loss.backward()
    got["not inside backward"], got["no mode change inside backward"] = inside
    got["no mode change before finalize"] = _raises(lambda: model.set_manual_backward_finalization(False), "after backward")
    model.finalize_backward()
    got["a second finalize is a no-op"] = model.finalize_backward() is None
    model.set_manual_backward_finalization(False)  # allowed again: the backward is finalized
    model.set_manual_backward_finalization(True)
    model.loss(batch).backward()
    handle = model.finalize_backward(async_op=True)
    got["no second finalize before wait"] = _raises(lambda: model.finalize_backward(), "wait")
    opt = make_optimizer(model.parameters())
    got["no optimizer step before wait"] = _raises(opt.step, "wait", "optimizer step")
    got["an unrelated optimizer steps"] = _steps(make_optimizer(nn.Linear(2, 2).parameters()))
    model.reset_iter_state()
    got["reset invalidates the handle"] = _raises(handle.wait, "invalidated")
    model.loss(batch).backward()  # training goes on
    model.finalize_backward()
    got["gradients after the reset"] = all(p.grad is not None for p in model.parameters())
    fresh = _model("overlap", world, manual=False)
    fresh.blocks[0].set_manual_backward_finalization(True)  # not known to be a block until its first forward
    got["a block's mode refused at the first forward"] = _raises(lambda: fresh.loss(batch), "root")
    try:
        model.set_manual_backward_finalization(1)  # type: ignore[arg-type]
        got["a bool"] = False
    except ValueError as e:
        got["a bool"] = "enabled must be a bool" in str(e)
    return got


def test_the_rules_of_manual_finalization(distributed) -> None:
    for rank, got in enumerate(distributed(_rules, 2)):
        assert all(got.values()), (rank, [k for k, v in got.items() if not v])


def _hsdp_partial(rank: int, world: int) -> dict[bool, dict[str, Any]]:
    """HSDP on a (2, 2) mesh, per step a micro-batch with ``set_requires_all_reduce(False)`` then one
    with ``True``, manual (``finalize_backward()`` after each) and automatic."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for manual in (False, True):
        torch.manual_seed(SEED)
        model = TinyLM(layers=2)
        for module in (*model.blocks, model):
            overlap.fully_shard(module, mesh=mesh)
        model.set_manual_backward_finalization(manual)
        opt = make_optimizer(model.parameters())
        losses = []
        for step in range(STEPS):
            for micro in range(2):
                model.set_requires_all_reduce(micro == 1)
                losses.append(_micro(model, rank, world, 2 * step + micro))
                if manual:
                    model.finalize_backward()
            opt.step()
            opt.zero_grad()
        out[manual] = run_of(losses, model)
    return out


def test_hsdp_partial_reductions_under_manual_finalization(distributed) -> None:
    """Beyond FSDP2 (which refuses it): the partial sum a micro-batch without the replica all-reduce
    keeps is added by the next one, finalized or not. Fails if finalize_backward drops or repeats it."""
    for rank, res in enumerate(distributed(_hsdp_partial, 4)):
        assert_same_run(res[False], res[True], rank)


def _in_backward_steps(rank: int, world: int) -> dict[bool, dict[str, Any]]:
    """``overlap.shard`` with ``prefetch="auto"`` (its choice, trial, gather-ahead and deferred steps,
    whichever the timing picks) and the optimizer stepped in backward, the demo's setting."""
    torch.set_num_threads(1)
    out = {}
    for manual in (False, True):
        torch.manual_seed(SEED)
        model = TinyLM(layers=4)
        for module in (*model.blocks, model):
            overlap.shard(module)
        model.set_manual_backward_finalization(manual)
        opt = overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2, foreach=False)
        losses = []
        for step in range(8):
            losses.append(_micro(model, rank, world, step))
            if manual:
                model.finalize_backward()
            opt.step()
        out[manual] = run_of(losses, model)
    return out


def test_manual_finalization_with_the_optimizer_in_backward_and_the_chosen_schedule(distributed) -> None:
    """The steps the epilogues run, the deferred ones and the next step's gathers issued at the end of
    backward all move into finalize_backward; fails if one is lost or runs twice."""
    for rank, res in enumerate(distributed(_in_backward_steps, 2, link=(1.0, 50.0))):
        assert_same_run(res[False], res[True], rank)
