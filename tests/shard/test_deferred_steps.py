"""Deferred optimizer steps ([Note: deferred optimizer steps] in ``overlap/sharding.py``): with the
optimizer in backward and gather-ahead on, the steps of the groups the next forward needs last run in
the end-of-step chain instead of right after their reduce-scatter; and the pure chooser
(``scheduler.deferred_steps``).

Reference: the plain loop (one AdamW over all parameters after backward, same sharding, same
``prefetch="auto"``) and the optimizer in backward with nothing deferred, bitwise: deferring moves
when a step's math runs, never what it computes. The deferral is forced in the ranks (every
candidate), so it is exercised whatever the model would choose on this box, behind a slow emulated
link so that the last reduce-scatters are still in flight when backward ends. Covered: ``no_sync``
micro-batches (nothing deferred there), a group also gathered ahead (never deferred), 2 and 3 ranks.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import pytest
import torch

import overlap
from models import SEED, TinyLM, assert_same_run, local_batch, make_batch, make_optimizer, make_optimizer_in_backward
from overlap import param_group, sharding
from scheduler import cost_samples, deferred_steps, gather_ahead, prefetch_depth, schedule_trial
from scheduler.deferred_steps import chain_slack, choose_deferred_steps
from scheduler.step_floor import StepFloor

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

STEPS = 4
LAYERS = 3
DEPTH = 1  # the chain: the root and blocks.0; candidates blocks.2, blocks.1 (the order they are deferred in)


def _train(rank: int, world_size: int, in_backward: bool, defer: bool, plan: tuple[int, int] = (0, 1),
           enabled: bool = True) -> dict[str, Any]:
    """``STEPS`` AdamW steps of TinyLM (step 1 in two ``no_sync`` micro-batches) at depth 1 with the
    gather-ahead ``plan`` forced; ``defer``: every candidate's step deferred (else none). Logs, per
    backward, the reduce-scatters, gathers and steps in the order they happened (``("deferred",
    group)``: a step left by its epilogue, run later). ``enabled``: ``set_deferred_steps``."""
    torch.set_num_threads(1)
    # This rank's process only: the plan from step 0's costs, run on untried, as the asserts count.
    cost_samples.COST_SAMPLES = 1
    schedule_trial.TRIAL_ROUNDS = 0
    gather_ahead.choose_schedule = lambda c, g, nbytes, depth, budget, **kwargs: (depth, plan)
    prefetch_depth.choose_prefetch_depth = lambda *args, **kwargs: DEPTH
    deferred_steps.choose_deferred_steps = lambda c, g, s, first, candidates, backward=None, reduce=None: (
        list(candidates) if defer else [])
    events: list[tuple[str, int]] = []
    group_cls = param_group.ParamGroup
    issue_reduce, issue_gather, call_hooks = group_cls.issue_reduce, group_cls.issue_gather, group_cls._call_reduced_hooks
    run_deferred = group_cls.run_deferred_reduced_hooks

    def logged_run_deferred(self: Any) -> None:
        if self.deferred_reduced is not None:
            events.append(("deferred", id(self)))
        run_deferred(self)

    def logged_issue_reduce(self: Any, *args: Any) -> Any:
        events.append(("reduce", id(self)))
        return issue_reduce(self, *args)

    def logged_issue_gather(self: Any) -> None:
        if self.pending_gather is None and not self.is_unsharded:
            events.append(("gather", id(self)))
        issue_gather(self)

    def logged_call_hooks(self: Any, params: Any) -> None:
        if self.reduced_hooks:
            events.append(("step", id(self)))
        call_hooks(self, params)

    group_cls.issue_reduce, group_cls.issue_gather = logged_issue_reduce, logged_issue_gather
    group_cls._call_reduced_hooks, group_cls.run_deferred_reduced_hooks = logged_call_hooks, logged_run_deferred
    torch.manual_seed(SEED)
    model = TinyLM(layers=LAYERS)
    for block in model.blocks:
        overlap.shard(block, prefetch="auto")
    overlap.shard(model, prefetch="auto")
    model.set_deferred_steps(enabled)
    opt: Any = make_optimizer_in_backward(model) if in_backward else make_optimizer(model.parameters())
    names = {id(s.group): (s.fqn or "root") for s in sharding.sharded_states(model) if s.group is not None}
    losses, logs = [], []
    for step in range(STEPS):
        batch = local_batch(make_batch(step), rank, world_size)
        parts = batch.chunk(2) if step == 1 else (batch,)
        for i, part in enumerate(parts):
            with overlap.no_sync(model) if i < len(parts) - 1 else contextlib.nullcontext():
                loss = model.loss(part)
                events.clear()  # the backward that reduces, and its end
                loss.backward()
        logs.append([(kind, names[key]) for kind, key in events])
        stale = [s.fqn for s in sharding.sharded_states(model) if s.group is not None and s.group.stale_gather()]
        assert not stale, f"step {step}: a gather in flight packed shards before their step: {stale}"
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "logs": logs, "deferred": model.deferred_steps, "floor": model.step_floor,
            "params": {n: p.to_local().clone() for n, p in model.named_parameters()}}


def _runs(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return {
        "plain": _train(rank, world_size, False, False),
        "in backward": _train(rank, world_size, True, False),
        "deferred": _train(rank, world_size, True, True),
        "deferred, one ahead": _train(rank, world_size, True, True, plan=(1, 1)),
        "deferred, turned off": _train(rank, world_size, True, True, enabled=False),
    }


def _assert_deferred_into_the_chain(log: list[tuple[str, str]], deferred: list[str]) -> None:
    """Each deferred group is stepped after the last reduce-scatter of the backward and before any
    gather of it that follows its reduce-scatter; every group that reduced is stepped once."""
    last_reduce = max(i for i, (kind, _) in enumerate(log) if kind == "reduce")
    for name in deferred:
        step = log.index(("step", name))
        assert step > last_reduce, (name, log)
        reduced = log.index(("reduce", name))  # gathers before it are this backward's re-gathers
        gathers = [i for i, event in enumerate(log) if event == ("gather", name) and i > reduced]
        assert all(i > step for i in gathers), (name, log)
    assert sorted(name for kind, name in log if kind == "step") == sorted(name for kind, name in log if kind == "reduce")


@pytest.mark.parametrize("world_size", [2, 3])
def test_deferred_steps_are_bitwise_the_plain_loop(distributed, world_size: int) -> None:
    per_rank = distributed(_runs, world_size, link=(0.002, 0.0), timeout=600)
    for runs in per_rank:
        for what, run in runs.items():
            assert_same_run(run, runs["plain"], what)
        assert runs["plain"]["deferred"] is None  # no optimizer in backward: no plan
        assert runs["in backward"]["deferred"] == []
        # The candidates, latest needed first: never the chain (root, blocks.0), never a group gathered ahead.
        assert runs["deferred"]["deferred"] == ["blocks.1", "blocks.2"]  # reported in module order
        assert runs["deferred, one ahead"]["deferred"] == ["blocks.1"]
        assert runs["deferred, turned off"]["deferred"] == ["blocks.1", "blocks.2"]  # chosen, not run
        assert not any(kind == "deferred" for log in runs["deferred, turned off"]["logs"] for kind, _ in log)
        assert any(kind == "deferred" for log in runs["deferred"]["logs"] for kind, _ in log)
        for what, deferred in (("deferred", ["blocks.1", "blocks.2"]), ("deferred, one ahead", ["blocks.1"])):
            logs = runs[what]["logs"]
            # Step 0 chooses at its end (nothing deferred in it); step 1's first micro-batch
            # reduces nothing (no_sync), its second one defers as any step does.
            for log in logs[1:]:
                _assert_deferred_into_the_chain(log, deferred)
    # The floor ([Note: the end-of-step chain's floor]) comes with the steps' seconds, so only with the
    # optimizer in backward, and from agreed costs: every rank reports the same one.
    floors = [{what: run["floor"] for what, run in runs.items()} for runs in per_rank]
    assert all(f["plain"] is None for f in floors)
    for what in ("in backward", "deferred", "deferred, one ahead"):
        assert isinstance(floors[0][what], StepFloor), what
        assert all(f[what] == floors[0][what] for f in floors), what
        floor = floors[0][what]
        assert floor.seconds >= max(floor.compute, floor.link) > 0, what


def test_set_deferred_steps_refuses_a_non_bool(single_rank_group) -> None:
    model = TinyLM(layers=1)
    overlap.shard(model)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        model.set_deferred_steps(1)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the chooser (pure)
def test_chain_slack_is_the_chains_link_time_less_the_host_work_beside_it() -> None:
    compute, gather, step = [1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0], [0.5, 0.25, 0.125, 2.0]
    backward = [3.0, 5.0, 7.0, 9.0]
    # chain of 2 positions: link 2 * (10 + 20); host: backward[0], steps 0-1, forward 0.
    assert chain_slack(compute, gather, step, 2, backward) == 60.0 - (3.0 + 0.75 + 1.0)
    # backward defaults to twice forward
    assert chain_slack(compute, gather, step, 2) == 60.0 - (2.0 + 0.75 + 1.0)
    assert chain_slack(compute, gather, step, 0, backward) == 0.0
    assert chain_slack(compute, [0.0] * 4, step, 3, backward) == 0.0  # host-bound chain: no slack
    # reduce-scatters of their own seconds (twice the gathers): the chain carries 30 + 60
    assert chain_slack(compute, gather, step, 2, backward, reduce=[2 * g for g in gather]) == 90.0 - (3.0 + 0.75 + 1.0)


def test_chooser_defers_the_longest_prefix_that_fits_the_slack() -> None:
    compute, gather, backward = [1.0] * 5, [2.0] * 5, [1.0] * 5
    step = [0.0, 0.0, 1.0, 0.5, 2.0]
    # chain of 2: link 8, host backward 1 + steps 0 + forward 1 = 2 -> slack 6
    assert choose_deferred_steps(compute, gather, step, 2, [4, 3, 2], backward) == [4, 3, 2]  # 3.5 <= 6
    step = [0.0, 0.0, 4.0, 0.5, 2.0]
    assert choose_deferred_steps(compute, gather, step, 2, [4, 3, 2], backward) == [4, 3]  # 2.5, then 6.5 > 6
    step = [0.0, 0.0, 5.0, 0.5, 2.0]
    assert choose_deferred_steps(compute, gather, step, 2, [2, 4, 3], backward) == [2]  # a prefix: 5, then 7 > 6
    assert choose_deferred_steps(compute, gather, [0.0, 0.0, 7.0, 0.5, 2.0], 2, [2, 4], backward) == []
    assert choose_deferred_steps(compute, [0.1] * 5, step, 2, [4, 3], backward) == []  # no slack: never defer


@pytest.mark.parametrize("kwargs, message", [
    (dict(first=5), "first must be"),
    (dict(candidates=[0]), "candidates must be"),
    (dict(candidates=[3, 3]), "candidates must be"),
    (dict(step=[0.0]), "one entry per forward position"),
    (dict(step=[0.0, -1.0, 0.0, 0.0]), "finite seconds"),
])
def test_chooser_refuses_bad_input(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Optional[Any]] = dict(compute=[1.0] * 4, gather=[1.0] * 4, step=[0.0] * 4, first=1, candidates=[3])
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        choose_deferred_steps(**args)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the demo's wrapping
def _demo_model(rank: int, world_size: int, split: bool) -> dict[str, Any]:
    """3 AdamW-in-backward steps of the demo's tiny model, sharded by its ``shard_units`` with the first
    block's MLP its own groups (``split``) or each block whole."""
    from overlap.demo.model import MODEL_SIZES, TransformerLM, token_batch
    from overlap.demo.training import make_optimizer as demo_optimizer, shard_for_mode

    torch.set_num_threads(1)
    size = MODEL_SIZES["tiny"]
    torch.manual_seed(SEED)
    model = TransformerLM(size)
    units = model.shard_units(split_first_block=split)
    shard_for_mode("overlap", model, units, prefetch="auto")
    opt = demo_optimizer(model, 1e-3, in_backward=True)
    losses = []
    for step in range(3):
        loss = model.loss(token_batch(size, step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "units": len(units),
            "params": {n: p.to_local().clone() for n, p in model.named_parameters()}}


def _both_wrappings(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [_demo_model(rank, world_size, True), _demo_model(rank, world_size, False)]


def test_the_demos_split_first_block_is_bitwise_the_whole_one(distributed) -> None:
    for split, whole in distributed(_both_wrappings, 2):
        assert split["units"] == whole["units"] + 2  # blocks.0.up and blocks.0.down
        assert_same_run(split, whole, "split first block")
