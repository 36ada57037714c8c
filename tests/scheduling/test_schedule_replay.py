"""Recorded schedules (``scheduler.Scheduler``): first uses found, replays equal first-use waits,
mismatches handled, ranks agree, verify mode.

Rank functions run on gloo ranks behind an emulated link slow enough that a collective is still in
flight at its first use, so a wait at the wrong place would read unfinished data. The tests of how a
single process's step leaves its schedule issue fake collectives instead (``AsyncTensor`` over a
completion that writes the result only when waited: a missed wait reads zeros).
"""
from __future__ import annotations

import contextlib
import re

from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlap
from overlap.testing import run_distributed
from scheduler import AsyncTensor, ScheduleMismatchError, Scheduler, is_pending, replay
from scheduler.schedule import Schedule, first_difference

SLOW_LINK = (0.5, 2000.0)  # 0.5 Gbit/s, 2 ms per collective: results are in flight at first use
FAST_LINK = (1000.0, 0.0)


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, w: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return h if w is None else h @ w


class Gathering(nn.Module):
    """Gathers ``w`` (sharded over ranks) in forward; where the result is first used depends on ``use``."""

    def __init__(self, use: str, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.use = use
        self.a = Block(width)
        self.b = Block(width)
        self.w = nn.Parameter(torch.randn(width // dist.get_world_size(), width))
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = overlap.all_gather(self.w)  # differentiable: its backward reduce-scatters
        self.kept = [g]
        h = self.a(x)
        if self.use == "straight":
            return (self.b(h) @ g).sum()
        if self.use == "view":
            return (self.b(h)[:, :4] @ g[:4]).sum()  # the slice of g is its first use
        if self.use == "child":
            return self.b(h, g).sum()
        if self.use == "backward":
            w = self.w

            def use_in_backward(grad: torch.Tensor) -> torch.Tensor:
                return grad * (1 + g.detach().mean())

            h.register_hook(use_in_backward)
            return self.b(h).sum() + 0 * w.sum()
        if self.use == "unused":
            return self.b(h).sum() + 0 * self.w.sum()
        raise ValueError(self.use)


def _first_uses(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for use in ("straight", "view", "child", "backward", "unused"):
        model = Gathering(use)
        sched = Scheduler(model)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        with sched.step():
            model(x).backward()
        schedule = sched.schedule
        assert schedule is not None
        c = schedule.collectives[0]
        assert not is_pending(model.kept[0]), f"{use}: still pending after the step"
        out[use] = {
            "kinds": [k.kind for k in schedule.collectives], "kind": c.kind, "shape": c.shape, "first_use": None if c.first_use is None else c.first_use.name,
            "use_point": None if c.first_use is None else schedule.points[c.first_use.after_point],
            "wait_point": None if c.wait_point is None else schedule.points[c.wait_point],
            "text": str(schedule),
        }
    return out


def test_recording_finds_the_first_use(distributed) -> None:
    for res in distributed(_first_uses, 2, link=SLOW_LINK):
        assert res["straight"]["kind"] == "all_gather" and res["straight"]["shape"] == (8, 8)
        # The gather's backward reduce-scatters the gradient: recorded as the step's second collective.
        assert res["straight"]["kinds"] == ["all_gather", "reduce_scatter"]
        assert res["straight"]["first_use"] == "matmul"
        assert res["straight"]["use_point"] == ("forward_post", "b")  # after block b, in the root
        assert res["straight"]["wait_point"] == ("forward_post", "b")
        # A view of the result is a use: the slicing op waits first.
        assert res["view"]["first_use"] == "__getitem__"
        assert res["view"]["use_point"] == ("forward_post", "b")
        # Passed to a child and used inside it, after its Linear ran.
        assert res["child"]["use_point"] == ("forward_post", "b.lin")
        # Used only by a gradient hook: in backward, once block b's backward has started.
        assert res["backward"]["use_point"][0] == "backward_pre"
        assert res["backward"]["wait_point"] == res["backward"]["use_point"]
        # Never used: waited at the end of the step.
        assert res["unused"]["first_use"] is None
        assert res["unused"]["wait_point"] == ("step_end", "")
        assert "replay waits at" in res["straight"]["text"] and "all_gather" in res["straight"]["text"]


class Layered(nn.Module):
    """FSDP-like: each layer's weight is gathered one layer ahead; ``skip`` drops a layer for a step."""

    def __init__(self, layers: int = 4, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        world = dist.get_world_size()
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.shards = nn.ParameterList(nn.Parameter(torch.randn(width // world, width) / width) for _ in range(layers))
        self.skip: Optional[int] = None
        self.peek = False  # read the first gather right after issuing it (before its scheduled wait)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = [i for i in range(len(self.blocks)) if i != self.skip]
        pending = overlap.all_gather(self.shards[order[0]])
        if self.peek:
            pending.sum()
        for n, i in enumerate(order):
            following = overlap.all_gather(self.shards[order[n + 1]]) if n + 1 < len(order) else None
            x = self.blocks[i](x, pending)
            pending = following
        return x.square().mean()


def _train(model: Layered, steps: int, sched: Optional[Scheduler], skip_at: Optional[int], rank: int,
           peek_at: Optional[tuple[int, int]] = None) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        model.skip = 1 if step == skip_at else None
        model.peek = peek_at == (step, rank)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        with (sched.step() if sched is not None else contextlib.nullcontext()):
            loss = model(x)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _replay_equals_first_use(rank: int, world: int, steps: int, skip_at: Optional[int],
                             peek_at: Optional[tuple[int, int]] = None) -> dict[str, Any]:
    reference = _train(Layered(), steps, None, skip_at, rank)
    model = Layered()
    sched = Scheduler(model)
    losses = _train(model, steps, sched, skip_at, rank, peek_at)
    return {"same": all(torch.equal(a, b) for a, b in zip(losses, reference)),
            "recorded": sched.steps_recorded, "replayed": sched.steps_replayed,
            "fallback": sched.steps_fallen_back, "reason": sched.last_fallback_reason}


def test_replay_for_50_steps_equals_first_use_waits(distributed) -> None:
    for res in distributed(_replay_equals_first_use, 2, 50, None, link=FAST_LINK):
        assert res["same"]
        assert (res["recorded"], res["replayed"], res["fallback"]) == (1, 49, 0)


def _leaving_the_schedule(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Every rank skips a block at step 4 of 8; rank 1 alone reads a result early at step 2 of 5, with the
    agreement ``overlap`` installs and with torch's (``set_exchange(None)``)."""
    out = {"every rank": _replay_equals_first_use(rank, world, 8, 4),
           "one rank": _replay_equals_first_use(rank, world, 5, None, peek_at=(2, 1))}
    previous = replay.set_exchange(None)
    try:
        out["one rank, torch's agreement"] = _replay_equals_first_use(rank, world, 5, None, peek_at=(2, 1))
    finally:
        replay.set_exchange(previous)
    return out


@pytest.fixture(scope="module")
def left_the_schedule() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_leaving_the_schedule, 2, link=FAST_LINK, timeout=60)


def test_changed_control_flow_falls_back_and_records_again(left_the_schedule) -> None:
    for ranks in left_the_schedule:
        res = ranks["every rank"]
        assert res["same"]  # the fallback step still waited before every use
        # step 0 records, 1-3 replay, 4 leaves the schedule (fallback), 5 records, 6-7 replay
        assert (res["recorded"], res["replayed"], res["fallback"]) == (2, 5, 1)
        assert "point" in res["reason"] or "collective" in res["reason"]


@pytest.mark.parametrize("agreement", ["one rank", "one rank, torch's agreement"])
def test_a_step_left_on_one_rank_falls_back_on_every_rank(left_the_schedule, agreement: str) -> None:
    """Rank 1 alone uses a result before its scheduled wait at step 2: every rank falls back there (the
    ranks decide together, through ``overlap``'s agreement or torch's all-reduce, so they never disagree on
    when the next recording step's agreement runs), step 3 records on both, step 4 replays; losses
    bitwise the unscheduled loop's."""
    rank0, rank1 = (ranks[agreement] for ranks in left_the_schedule)
    for res in (rank0, rank1):
        assert res["same"]
        assert (res["recorded"], res["replayed"], res["fallback"]) == (2, 2, 1)
    assert rank0["reason"] == "another rank left the schedule"
    assert "before its scheduled wait" in rank1["reason"]


def _steady_state_has_no_dispatch_mode(rank: int, world: int) -> list[bool]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model = Layered()
    sched = Scheduler(model)
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(_get_current_dispatch_mode() is not None))
    _train(model, 3, sched, None, rank)
    return seen


def test_replay_steps_run_without_a_dispatch_mode(distributed) -> None:
    for seen in distributed(_steady_state_has_no_dispatch_mode, 2, link=FAST_LINK):
        assert seen == [True, False, False]  # only the recording step counts ops


def _step_error(sched: Scheduler, issue: Any) -> str:
    try:
        with sched.step():
            issue()
    except ScheduleMismatchError as e:
        return str(e)
    return "no error"


def _desynchronized(rank: int, world: int) -> dict[str, str]:
    model = nn.Linear(2, 2)
    a, b = torch.ones(4, 2), torch.ones(2, 4)
    first, second = (b, a) if rank == world - 1 else (a, b)  # the last rank alone: same bytes, other order of shapes

    def desynchronized() -> None:
        overlap.wait(overlap.all_reduce(first))
        overlap.wait(overlap.all_reduce(second))

    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
    return {"world": _step_error(Scheduler(model), desynchronized),
            "own group": _step_error(Scheduler(model, group=own),
                                     lambda: overlap.wait(overlap.all_reduce(torch.ones(rank + 1), group=own)))}


@pytest.fixture(scope="module")
def desynchronized() -> list[dict[str, str]]:
    return run_distributed(_desynchronized, 3, timeout=60)


def test_desynchronized_schedules_raise_on_every_rank(desynchronized) -> None:
    """3 ranks, the last alone issuing its two all-reduces in the other order: every rank raises,
    naming each rank's first differing collective (a check of two ranks out of three would see none)."""
    for res in desynchronized:
        message = res["world"]
        assert "collective 0" in message
        for rank, shape in ((0, "4x2"), (1, "4x2"), (2, "2x4")):
            assert re.search(rf"rank {rank}: #0 all_reduce\(group=[^,]*, {shape}, float32\)", message), message


def test_a_scheduler_agrees_through_its_own_group(desynchronized) -> None:
    """A scheduler built with ``group=`` compares schedules with that group's ranks only: each rank's
    scheduler on its own 1-rank group records collectives of other shapes and groups than its peers'
    without an error (agreeing over the default group instead would raise on every rank)."""
    for res in desynchronized:
        assert res["own group"] == "no error"


def _verify(rank: int, world: int, verify: bool) -> dict[str, Any]:
    model = Gathering("straight")
    sched = Scheduler(model, verify=verify)
    x = torch.randn(4, 8)
    with sched.step():
        model(x).backward()
    with sched.step():  # replays cleanly
        model(x).backward()
    model.use = "child"  # now the result is first used inside block b, before the scheduled wait
    error = None
    try:
        with sched.step():
            loss = model(x)
            loss.backward()
    except ScheduleMismatchError as e:
        error = str(e)
    reference = Gathering("child")
    return {"error": error, "fallback": sched.steps_fallen_back,
            "same": error is not None or torch.equal(loss.detach(), reference(x).detach())}


def test_verify_mode_names_the_op_and_the_collective(distributed) -> None:
    for res in distributed(_verify, 2, True, link=SLOW_LINK):
        assert res["error"] is not None
        assert "#0 all_gather" in res["error"] and "matmul" in res["error"] and "unfinished" in res["error"]


def test_without_verify_a_wrong_schedule_falls_back_safely(distributed) -> None:
    for res in distributed(_verify, 2, False, link=SLOW_LINK):
        assert res["error"] is None and res["fallback"] == 1 and res["same"]


def test_verify_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERLAP_VERIFY", "1")
    assert Scheduler(nn.Linear(1, 1)).verify is True
    monkeypatch.setenv("OVERLAP_VERIFY", "0")
    assert Scheduler(nn.Linear(1, 1)).verify is False
    assert Scheduler(nn.Linear(1, 1), verify=True).verify is True


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        Scheduler("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="group must be None or a torch.distributed.ProcessGroup"):
        Scheduler(nn.Linear(1, 1), group=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="verify must be None or a bool"):
        Scheduler(nn.Linear(1, 1), verify="yes")  # type: ignore[arg-type]


def test_steps_do_not_nest_and_an_error_leaves_it_usable() -> None:
    from scheduler import async_tensor

    model = nn.Linear(2, 2)
    sched = Scheduler(model)
    with pytest.raises(RuntimeError, match="steps do not nest"):
        with sched.step():
            with sched.step():
                pass
    assert async_tensor._observer is None and sched._step is None
    with pytest.raises(ZeroDivisionError):
        with sched.step():
            model(torch.ones(1, 2))
            1 / 0
    assert async_tensor._observer is None and sched.schedule is None  # nothing half-recorded
    with sched.step():
        model(torch.ones(1, 2))
    assert sched.schedule is not None and sched.schedule.points[0] == ("forward_pre", "")
    sched.close()
    with sched.step():
        model(torch.ones(1, 2))
    assert sched.steps_fallen_back == 1  # without its hooks the step has no points: it left the schedule


class _FillOnWait:
    """A fake collective's completion: writes ``value`` into the result only when waited; counts its waits."""

    def __init__(self, result: torch.Tensor, value: torch.Tensor) -> None:
        self.result, self.value, self.waits = result, value, 0

    def wait(self) -> None:
        self.waits += 1
        self.result.copy_(self.value)


class Local(nn.Module):
    """Two blocks and two fake collectives in one process: #0 (8x8) issued at the start and used after
    block b, #1 issued at the start and never used. ``change`` makes a step leave that schedule in one
    way (``LEAVES``) or run one more op between two points, its points unchanged."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = Block(), Block()
        self.change: Optional[str] = None
        self.completions: list[_FillOnWait] = []
        self.results: list[torch.Tensor] = []  # kept: the scheduler holds results weakly

    def _collective(self, value: torch.Tensor) -> torch.Tensor:
        result = torch.zeros_like(value)
        self.completions.append(_FillOnWait(result, value))
        self.results.append(AsyncTensor.wrap(result, self.completions[-1], "all_reduce", "fake"))
        return self.results[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        change = self.change
        w = torch.linspace(-1.0, 1.0, 64).view(8, 8)
        g = self._collective(w.double() if change == "another dtype" else w)
        if change not in ("one collective fewer", "issued after another point"):
            self._collective(torch.ones(4))
        if change == "one more collective":
            self._collective(torch.ones(4))
        if change == "used before its scheduled wait":
            g.sum()
        h = self.a(x)
        if change == "issued after another point":
            self._collective(torch.ones(4))
        if change == "more ops between points":
            h = h * 1
        return (self.b(h) @ g.float()).sum()


LEAVES = {  # how a step leaves the schedule -> the reason it falls back with
    "one collective fewer": "1 collectives were issued, the schedule has 2",
    "one more collective": "collective 2 (all_reduce) was not in the schedule (2 collectives)",
    "another dtype": "collective 0 is ('all_reduce', 'fake', (8, 8), 'float64'), the schedule has "
                     "('all_reduce', 'fake', (8, 8), 'float32')",
    "issued after another point": "collective 1 was issued after point 4, the schedule has 0",
    "used before its scheduled wait": "collective 0 (all_reduce) was used by sum before its scheduled wait",
}


@pytest.mark.parametrize("change", sorted(LEAVES))
def test_each_way_of_leaving_the_schedule_falls_back_and_records_again(change: str) -> None:
    """One process, fake collectives: steps 0-1 record and replay; steps 2-4 change the step in one way,
    its module points kept: step 2 falls back naming why, 3 records the changed step, 4 replays it. Every
    collective waits exactly once in every step and each loss is bitwise the unscheduled model's."""
    model, reference = Local(), Local()
    sched = Scheduler(model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    for step in range(5):
        model.change = reference.change = change if step >= 2 else None
        model.completions.clear()
        model.results.clear()
        with sched.step():
            loss = model(x)
        assert [c.waits for c in model.completions] == [1] * len(model.completions), step
        assert torch.equal(loss, reference(x)), step
        if step == 2:
            assert (sched.steps_fallen_back, sched.last_fallback_reason) == (1, LEAVES[change])
    assert (sched.steps_recorded, sched.steps_replayed, sched.steps_fallen_back) == (2, 2, 1)


@pytest.mark.parametrize("verify", [True, False])
def test_verify_mode_names_a_point_reached_after_other_ops(verify: bool) -> None:
    """A replay step that runs one more op between block a and block b: verify mode raises at block b's
    start, before any result is used, naming the point and both op counts; without verify the ops are
    not counted and the step replays."""
    model = Local()
    sched = Scheduler(model, verify=verify)
    x = torch.randn(4, 8)
    for _ in range(2):
        with sched.step():
            model(x)
    model.change = "more ops between points"
    if not verify:
        with sched.step():
            model(x)
        assert (sched.steps_recorded, sched.steps_replayed, sched.steps_fallen_back) == (1, 2, 0)
        return
    with pytest.raises(ScheduleMismatchError, match=r"verify: forward_pre\(b\) was reached after") as info:
        with sched.step():
            model(x)
    reached, recorded = map(int, re.search(r"after (\d+) ops, the schedule recorded (\d+)", str(info.value)).groups())
    assert reached == recorded + 1


def test_first_difference_names_each_rank() -> None:
    same = [("all_gather", "0", (4,), "float32")]
    assert first_difference([same, list(same)]) is None
    other = [("all_reduce", "0", (4,), "float32")]
    seq, per_rank = first_difference([same, other])  # type: ignore[misc]
    assert seq == 0 and per_rank == ["#0 all_gather(group=0, 4, float32)", "#0 all_reduce(group=0, 4, float32)"]
    seq, per_rank = first_difference([same, same + other])  # type: ignore[misc]
    assert seq == 1 and per_rank[0] == "#1 nothing (the step ended)"
    assert Schedule((), (), 0, ()).digest() == Schedule((), (), 5, ()).digest()
