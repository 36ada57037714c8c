"""The trial that verifies ``prefetch="auto"``'s choice ([Note: verifying the choice by a trial] in
``scheduler/schedule_trial.py``): after choosing, the chosen plan and the simple plan (depth 1,
nothing gathered ahead) take turns on the real steps, the ranks agree each timed step, and the
choice is kept only if it wins; on 2 and 3 gloo CPU ranks, and the pure parts.

Reference: the plain loop (``prefetch=0``, one AdamW over all parameters after backward, same
sharding), bitwise: losses and parameters across every switch of plan, with a forward under
``no_grad`` in the middle of the trial (not a trial step). The chosen plan is forced (depth 2, one
group gathered ahead) and so is the verdict (keep / fall back), so each path runs whatever this
box's timings are; one run keeps the real verdict. What the module reports after the decision
(``prefetch_depth``, ``modelled_step``: the modelled seconds are forced too) is the plan that runs.
The memory budget (``max_inflight_bytes``, set to what the forced plan holds) is checked over the
trial's steps by the unsharded-bytes counter.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn

import overlap
from models import SEED, TinyLM, assert_same_run, local_batch, make_batch, make_optimizer
from overlap.demo.unsharded_peak import UnshardedPeak
from overlap.sharding import sharded_states
from scheduler.held_bytes import held_bytes
from scheduler.schedule_trial import (CHOSEN, SIMPLE, ScheduleDecision, TrialStep, Verdict, decide, describe,
                                      trial_steps)

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

LAYERS = 3
FORCED: tuple[int, tuple[int, int]] = (2, (1, 1))
"""The plan the choosers are made to pick: depth 2, the first group reduced gathered ahead."""
ROUNDS = 2
TRIAL = trial_steps(ROUNDS, settle=1)  # gather-ahead crosses the step boundary: one untimed step first
STEPS = 1 + len(TRIAL) + 2  # one recorded step, the trial, two on the decided plan
EVAL_AT = 3
"""A forward under no_grad runs before this training step (inside the trial)."""


def _sharded(budget: Optional[int]) -> TinyLM:
    torch.manual_seed(SEED)
    model = TinyLM(layers=LAYERS)
    prefetch: Any = 0 if budget is None else "auto"
    for block in model.blocks:
        overlap.shard(block, prefetch=prefetch, max_inflight_bytes=budget)
    overlap.shard(model, prefetch=prefetch, max_inflight_bytes=budget)
    return model


def _forced_plan_budget() -> int:
    """The unsharded bytes the forced plan holds (``held_bytes`` over the forward order: root, blocks)."""
    probe = _sharded(None)
    nbytes = [s.group.all_gather_bytes() for s in sharded_states(probe)]  # the root first, then the blocks
    return held_bytes(nbytes, FORCED[0], FORCED[1][0])


MODELLED_S = {"chosen": 0.25, "simple": 0.5}
"""The seconds per step the model is made to give the chosen plan and the simple plan."""


def _force_choice(ahead: Optional[tuple[int, int]]) -> None:
    """This rank's choosers pick depth ``FORCED[0]`` with gather-ahead ``ahead`` after one recorded
    step, modelled at :data:`MODELLED_S`, and the trial runs ``ROUNDS`` rounds."""
    from scheduler import cost_samples, gather_ahead, prefetch_depth, schedule_trial

    cost_samples.COST_SAMPLES = 1
    schedule_trial.TRIAL_ROUNDS = ROUNDS
    prefetch_depth.choose_prefetch_depth = lambda *args, **kwargs: FORCED[0]
    gather_ahead.choose_schedule = lambda c, g, nbytes, depth, budget, **kwargs: (depth, ahead)
    gather_ahead.modelled_steady_step = lambda *args, **kwargs: MODELLED_S["chosen"]
    prefetch_depth.modelled_step = lambda *args, **kwargs: MODELLED_S["simple"]


def _train(rank: int, world_size: int, verdict: Optional[bool], trial: bool = True,
           plain: bool = False) -> dict[str, Any]:
    """``STEPS`` AdamW steps of TinyLM (plain: ``prefetch=0``, AdamW after backward; else
    ``prefetch="auto"`` with the optimizer in backward, the plan forced to :data:`FORCED`, the
    verdict forced to ``verdict`` (None: the real one), the trial on or off)."""
    from overlap import schedule_verification

    torch.set_num_threads(1)
    _force_choice(FORCED[1])
    if verdict is not None:
        schedule_verification.decide = lambda c, s: Verdict(verdict, min(c), min(s), len(c))
    budget = None if plain else _forced_plan_budget()
    model = _sharded(budget)
    model.set_schedule_trial(trial)
    if plain:
        opt: Any = make_optimizer(model.parameters())
    else:
        adamw = make_optimizer([nn.Parameter(torch.zeros(1))]).defaults
        opt = overlap.optimizer_in_backward(
            model, torch.optim.AdamW, **{k: adamw[k] for k in ("lr", "betas", "eps", "weight_decay", "foreach")})
    losses, plans = [], []
    with UnshardedPeak(model) as counter:
        for step in range(STEPS):
            batch = local_batch(make_batch(step), rank, world_size)
            if step == EVAL_AT:
                with torch.no_grad():
                    model.loss(batch)
            loss = model.loss(batch)
            plans.append((model._overlap_state.prefetch, model.gather_ahead))  # what this step runs
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    decision = model.schedule_decision
    return {"losses": torch.stack(losses), "plans": plans, "decision": decision, "peak": counter.peak,
            "budget": budget, "max_inflight": model.max_inflight_bytes_seen,
            "depth": model.prefetch_depth, "modelled_step": model.modelled_step,
            "params": {n: p.to_local().clone() for n, p in model.named_parameters()}}


def _runs(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return {"plain": _train(rank, world_size, None, plain=True),
            "kept": _train(rank, world_size, True),
            "fell back": _train(rank, world_size, False),
            "real verdict": _train(rank, world_size, None),
            "trial off": _train(rank, world_size, None, trial=False)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_trial_switches_plans_bitwise_within_the_budget_and_decides_alike(distributed, world_size: int) -> None:
    per_rank = distributed(_runs, world_size, timeout=600)
    simple = (1, None)
    trial_plans = [FORCED if s.plan == CHOSEN else simple for s in TRIAL]
    for runs in per_rank:
        for what, run in runs.items():
            assert_same_run(run, runs["plain"], what)
        for what in ("kept", "fell back", "real verdict"):
            run = runs[what]
            # step 0 records (depth 1 until chosen), then the trial's plans, then the decided plan
            final = run["decision"].plan
            assert run["plans"] == [simple, *trial_plans, final, final], (what, run["plans"])
            assert run["decision"].modelled == FORCED and run["decision"].verdict is not None
            # the unsharded bytes held never exceed the forced plan's (the budget), across every switch
            assert 0 < run["peak"] <= run["budget"], (what, run["peak"], run["budget"])
            assert run["max_inflight"] <= run["budget"]
            # what the module reports is what runs: the decided plan's depth and its modelled step
            # (the simple plan's where the trial fell back)
            assert run["depth"] == final[0], (what, run["depth"], final)
            assert run["modelled_step"] == MODELLED_S["chosen" if final == FORCED else "simple"], what
        assert runs["kept"]["decision"].plan == FORCED and "kept by the trial" in runs["kept"]["decision"].reason
        fell_back = runs["fell back"]["decision"]
        assert fell_back.plan == simple and "did not win the trial" in fell_back.reason
        assert fell_back.verdict is not None and fell_back.verdict.samples == ROUNDS
        off = runs["trial off"]
        assert off["plans"] == [simple] + [FORCED] * (STEPS - 1), off["plans"]
        assert off["decision"].verdict is None and "trial is off" in off["decision"].reason
        assert off["depth"] == FORCED[0] and off["modelled_step"] == MODELLED_S["chosen"]
        assert runs["plain"]["decision"] is None  # a fixed depth decides nothing
    # every rank decided the same from the same agreed (slowest-rank) step times
    assert len({repr(runs["real verdict"]["decision"]) for runs in per_rank}) == 1


CYCLES = 1 + len(trial_steps(ROUNDS, settle=0)) + 1
"""Accumulation cycles: the one whose no_sync micro-batch records, the trial's, one on the decided plan."""


def _accumulating(rank: int, world_size: int, auto: bool) -> dict[str, Any]:
    """``CYCLES`` AdamW steps of TinyLM over two micro-batches each, the first under ``no_sync``
    (auto: the plan forced to depth 2, nothing ahead; else ``prefetch=0``)."""
    torch.set_num_threads(1)
    _force_choice(None)
    torch.manual_seed(SEED)
    model = TinyLM(layers=LAYERS)
    for block in model.blocks:
        overlap.shard(block, prefetch="auto" if auto else 0)
    overlap.shard(model, prefetch="auto" if auto else 0)
    opt = make_optimizer(model.parameters())
    losses, plans = [], []
    for step in range(CYCLES):
        first, second = local_batch(make_batch(step), rank, world_size).chunk(2)
        with overlap.no_sync(model):
            loss = model.loss(first)
            plans.append(model._overlap_state.prefetch)
            loss.backward()
        losses.append(loss.detach())
        loss = model.loss(second)
        plans.append(model._overlap_state.prefetch)
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": torch.stack(losses), "plans": plans, "decision": model.schedule_decision,
            "params": {n: p.to_local().clone() for n, p in model.named_parameters()}}


def _accumulating_runs(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return {"plain": _accumulating(rank, world_size, False), "auto": _accumulating(rank, world_size, True)}


def test_the_trial_times_whole_accumulation_cycles_bitwise(distributed) -> None:
    # [Note: what a trial step is] in overlap/schedule_verification.py: the choice is made after the
    # first (no_sync) micro-batch, so the rest of that cycle runs the simple plan untimed; then each
    # trial step is one whole cycle, both micro-batches on one plan, and the verdict comes after them.
    for runs in distributed(_accumulating_runs, 2):
        auto = runs["auto"]
        assert_same_run(auto, runs["plain"], "auto")
        per_cycle = [1] + [FORCED[0] if s.plan == CHOSEN else 1 for s in trial_steps(ROUNDS, settle=0)]
        final = auto["decision"].plan[0]
        # the first cycle records (its prefetch reads 1 until the choice), its second micro-batch untimed
        assert auto["plans"] == [d for d in per_cycle for _ in range(2)] + [final, final], auto["plans"]
        assert auto["decision"].verdict is not None and auto["decision"].verdict.samples == ROUNDS


def _gather_ahead_off(rank: int, world_size: int) -> Any:
    """The forced plan at depth 1 with gather-ahead turned off by the user: it runs as the simple plan."""
    from scheduler import cost_samples, gather_ahead, prefetch_depth

    cost_samples.COST_SAMPLES = 1
    prefetch_depth.choose_prefetch_depth = lambda *args, **kwargs: 1
    gather_ahead.choose_schedule = lambda c, g, nbytes, depth, budget, **kwargs: (depth, (1, 1))
    model = _sharded(1 << 30)
    model.set_gather_ahead(False)
    overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-3)
    for step in range(2):
        model.loss(local_batch(make_batch(step), rank, world_size)).backward()
    return model.schedule_decision


def test_no_trial_where_the_choice_runs_as_the_simple_plan(distributed) -> None:
    for decision in distributed(_gather_ahead_off, 2):
        assert decision.verdict is None and decision.reason.endswith("runs as the simple plan (gather-ahead is off)")


def test_set_schedule_trial_bad_input(single_rank_group) -> None:
    model = _sharded(None)
    for bad in (1, None, "no"):
        with pytest.raises(TypeError, match="set_schedule_trial: enabled must be a bool"):
            model.set_schedule_trial(bad)  # type: ignore[arg-type]
    assert model._overlap_state.schedule_trial_enabled is True


# ---------------------------------------------------------------- the pure parts
def test_trial_steps_alternate_the_plans_ending_on_the_chosen_one() -> None:
    s, c = TrialStep(SIMPLE, False), TrialStep(CHOSEN, False)
    st, ct = TrialStep(SIMPLE, True), TrialStep(CHOSEN, True)
    assert trial_steps(2, 0) == [st, ct, st, ct]
    assert trial_steps(1, 2) == [s, s, st, c, c, ct]
    assert trial_steps(0, 1) == []
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="rounds must be an int >= 0"):
            trial_steps(bad, 0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="settle must be an int >= 0"):
            trial_steps(1, bad)  # type: ignore[arg-type]


def test_decide_keeps_the_choice_only_when_its_least_step_wins_by_the_margin() -> None:
    # the least of each side: a spike in one chosen step does not lose the choice
    assert decide([0.90, 2.0, 0.91], [1.00, 1.01, 1.2], margin=0.02) == Verdict(True, 0.90, 1.00, 3)
    assert decide([0.99, 0.985], [1.00, 1.0], margin=0.02).keep is False  # 1.5% faster: not enough
    assert decide([1.0], [1.0], margin=0.0).keep is False  # a tie falls back
    assert decide([1.1], [1.0], margin=0.0).keep is False
    assert decide([0.5], [1.0]).keep is True  # the default margin
    with pytest.raises(ValueError, match="at least one timed step"):
        decide([], [1.0])
    with pytest.raises(ValueError, match="finite seconds >= 0"):
        decide([float("nan")], [1.0])
    with pytest.raises(ValueError, match="finite seconds >= 0"):
        decide([1.0], [-1.0])
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="margin must be a share"):
            decide([1.0], [1.0], margin=bad)


def test_the_decision_says_what_runs_and_why() -> None:
    decision = ScheduleDecision((3, (1, 2)), (3, (1, 2)), 0.5, 0.6, Verdict(True, 0.4, 0.5, 3), "kept")
    assert str(decision) == "depth 3, gather-ahead (1, 2): kept"
    assert describe((1, None)) == "depth 1, nothing ahead"


# ---------------------------------------------------------------- the runtime trial, agreement faked
def _fake_group() -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(size=2, pg=SimpleNamespace(group_name="g"), global_rank=lambda r: r)


def test_the_trial_times_the_slowest_rank_and_skips_forwards_without_backward(monkeypatch) -> None:
    from overlap import schedule_verification

    seen: list[tuple[int, float]] = []

    def exchange(info: Any, point: str, value: tuple[int, float]) -> list[tuple[int, float]]:
        seen.append(value)
        return [value, (value[0], 9.0)]  # the other rank took 9 s

    monkeypatch.setattr(schedule_verification.agreement, "exchange", exchange)
    trial = schedule_verification.ScheduleTrial([_fake_group(), None], rounds=1, settle=0, backward_count=5,
                                                synced_count=5)
    assert trial.at_forward_start(5, 5) == SIMPLE  # the first trial step starts
    assert trial.at_forward_start(5, 5) == SIMPLE  # a forward without backward: not a trial step
    assert trial.at_forward_start(6, 6) == CHOSEN and [p for p, _ in seen] == [0]  # the simple step ended, agreed
    assert trial.at_forward_start(7, 7) is None  # the chosen step ended: the verdict
    assert trial.times == {SIMPLE: [9.0], CHOSEN: [9.0]} and trial.verdict == Verdict(False, 9.0, 9.0, 1)
    assert trial.at_forward_start(8, 8) is None and len(seen) == 2  # over: nothing more is agreed


def test_a_trial_step_is_a_whole_gradient_accumulation_cycle(monkeypatch) -> None:
    # [Note: what a trial step is]: two micro-batches per step, the first under no_sync. Timed per
    # backward, the simple plan would always get the no_sync micro-batch and the chosen plan the
    # reducing one; as whole cycles, each plan's step holds both, and is timed from its first
    # forward (an evaluation forward before it not counted) to the forward after its reduction.
    from overlap import schedule_verification

    clock = [0.0]
    monkeypatch.setattr(schedule_verification.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(schedule_verification.agreement, "exchange", lambda info, point, value: [value])
    trial = schedule_verification.ScheduleTrial([_fake_group()], rounds=2, settle=0, backward_count=10,
                                                synced_count=5)
    plans: list[Optional[str]] = []
    backwards = synced = 0
    for step in range(4):
        if step == 1:  # an evaluation forward: it ends step 0, and the clock restarts at the next forward
            assert trial.at_forward_start(10 + backwards, 5 + synced) == CHOSEN
            clock[0] += 50.0
        for reduces, seconds in ((False, 3.0), (True, 7.0 if step % 2 else 5.0)):
            plans.append(trial.at_forward_start(10 + backwards, 5 + synced))
            clock[0] += seconds
            backwards, synced = backwards + 1, synced + reduces
    assert plans == [SIMPLE, SIMPLE, CHOSEN, CHOSEN, SIMPLE, SIMPLE, CHOSEN, CHOSEN]
    assert trial.at_forward_start(10 + backwards, 5 + synced) is None
    assert trial.times == {SIMPLE: [8.0, 8.0], CHOSEN: [10.0, 10.0]}  # each a whole cycle: 3 + 5 or 3 + 7
    assert trial.verdict == Verdict(False, 10.0, 8.0, 2)


def test_only_no_sync_backwards_never_end_a_trial_step(monkeypatch) -> None:
    from overlap import schedule_verification

    monkeypatch.setattr(schedule_verification.agreement, "exchange", lambda info, point, value: [value])
    trial = schedule_verification.ScheduleTrial([_fake_group()], rounds=1, settle=0, backward_count=0, synced_count=0)
    assert [trial.at_forward_start(b, 0) for b in range(5)] == [SIMPLE] * 5
    assert trial.position == 0 and trial.times == {SIMPLE: [], CHOSEN: []} and trial.verdict is None


def test_a_rank_at_another_trial_step_is_a_desync_on_every_rank(monkeypatch) -> None:
    from overlap import schedule_verification
    from overlap.desync import DesyncError

    monkeypatch.setattr(schedule_verification.agreement, "exchange",
                        lambda info, point, value: [value, (value[0] + 1, 0.1)])
    trial = schedule_verification.ScheduleTrial([_fake_group()], rounds=1, settle=0, backward_count=0, synced_count=0)
    trial.at_forward_start(0, 0)
    with pytest.raises(DesyncError, match="rank 0: step 0; rank 1: step 1"):
        trial.at_forward_start(1, 1)
