"""Recorded schedules (``scheduler.Scheduler``): first uses found, replays equal first-use waits,
mismatches handled, ranks agree, verify mode.

Rank functions run on gloo ranks behind an emulated link slow enough that a collective is still in
flight at its first use, so a wait at the wrong place would read unfinished data.
"""
from __future__ import annotations

import contextlib

from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlap
from scheduler import ScheduleMismatchError, Scheduler, is_pending
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = [i for i in range(len(self.blocks)) if i != self.skip]
        pending = overlap.all_gather(self.shards[order[0]])
        for n, i in enumerate(order):
            following = overlap.all_gather(self.shards[order[n + 1]]) if n + 1 < len(order) else None
            x = self.blocks[i](x, pending)
            pending = following
        return x.square().mean()


def _train(model: Layered, steps: int, sched: Optional[Scheduler], skip_at: Optional[int], rank: int) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        model.skip = 1 if step == skip_at else None
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        with (sched.step() if sched is not None else contextlib.nullcontext()):
            loss = model(x)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _replay_equals_first_use(rank: int, world: int, steps: int, skip_at: Optional[int]) -> dict[str, Any]:
    reference = _train(Layered(), steps, None, skip_at, rank)
    model = Layered()
    sched = Scheduler(model)
    losses = _train(model, steps, sched, skip_at, rank)
    return {"same": all(torch.equal(a, b) for a, b in zip(losses, reference)),
            "recorded": sched.steps_recorded, "replayed": sched.steps_replayed,
            "fallback": sched.steps_fallen_back, "reason": sched.last_fallback_reason}


def test_replay_for_50_steps_equals_first_use_waits(distributed) -> None:
    for res in distributed(_replay_equals_first_use, 2, 50, None, link=FAST_LINK):
        assert res["same"]
        assert (res["recorded"], res["replayed"], res["fallback"]) == (1, 49, 0)


def test_changed_control_flow_falls_back_and_records_again(distributed) -> None:
    for res in distributed(_replay_equals_first_use, 2, 8, 4, link=FAST_LINK):
        assert res["same"]  # the fallback step still waited before every use
        # step 0 records, 1-3 replay, 4 leaves the schedule (fallback), 5 records, 6-7 replay
        assert (res["recorded"], res["replayed"], res["fallback"]) == (2, 5, 1)
        assert "point" in res["reason"] or "collective" in res["reason"]


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


def _desynchronized(rank: int, world: int) -> str:
    model = nn.Linear(2, 2)
    sched = Scheduler(model)
    a, b = torch.ones(4, 2), torch.ones(2, 4)
    try:
        with sched.step():
            first, second = (a, b) if rank == 0 else (b, a)  # same bytes, different order of shapes
            overlap.wait(overlap.all_reduce(first))
            overlap.wait(overlap.all_reduce(second))
    except ScheduleMismatchError as e:
        return str(e)
    return "no error"


def test_desynchronized_schedules_raise_on_every_rank(distributed) -> None:
    messages = distributed(_desynchronized, 2, timeout=60)
    for message in messages:
        assert "collective 0" in message
        assert "rank 0: #0 all_reduce" in message and "4x2" in message
        assert "rank 1: #0 all_reduce" in message and "2x4" in message


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


def test_first_difference_names_each_rank() -> None:
    same = [("all_gather", "0", (4,), "float32")]
    assert first_difference([same, list(same)]) is None
    other = [("all_reduce", "0", (4,), "float32")]
    seq, per_rank = first_difference([same, other])  # type: ignore[misc]
    assert seq == 0 and per_rank == ["#0 all_gather(group=0, 4, float32)", "#0 all_reduce(group=0, 4, float32)"]
    seq, per_rank = first_difference([same, same + other])  # type: ignore[misc]
    assert seq == 1 and per_rank[0] == "#1 nothing (the step ended)"
    assert Schedule((), (), 0, ()).digest() == Schedule((), (), 5, ()).digest()
