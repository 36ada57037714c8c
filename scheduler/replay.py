"""Record where each collective's result is first used, then replay those waits at module hooks.

``sched = Scheduler(model)``; every training step runs inside ``with sched.step(): ...`` (forward
and backward both inside). The collectives are the ``AsyncTensor`` results made in the step
(``overlap.all_gather`` and friends).

=========  ===============================================================================
step       what happens
=========  ===============================================================================
record     (the first step, and any step after a mismatch) a dispatch mode counts every op;
           module hooks mark the step's points; each collective's issue and first use (the
           op whose first-use wait fires, see ``scheduler.async_tensor``) are recorded. At the
           end: the :class:`~scheduler.schedule.Schedule`, agreed across ranks.
replay     no dispatch mode; at each module hook the scheduler checks that the step follows
           the schedule's points and collectives, and waits for the results whose recorded
           first use comes before the next point. Steady state pays a few Python operations
           per hook and nothing per op.
fallback   a step that leaves the schedule (another point, another collective, a result used
           earlier than recorded) stops the scheduled waits; every result still waits at its
           own first use, so nothing reads unfinished data. The next step records again.
=========  ===============================================================================

Contracts:

* A result never waits later than its first use: replay waits are at or before it, and a result
  that is still pending when it is used waits then (the AsyncTensor contract), whatever the
  schedule says. A result never used in the step waits at the step's end if it is still alive
  (the step holds results weakly: one the caller dropped unused can be read by nothing, and is left
  to its collective, whose buffers the issuing code keeps until it completes).
* Agreement: after each recording step, ranks compare the schedules' signatures (collective kinds,
  groups, shapes, dtypes, in order) through ``group``; on a mismatch every rank raises an error
  naming, per rank, the first collective on which they differ. Whether the next step records again
  is decided by all ranks together (one small all-reduce per step when ``group`` has more than one
  rank), so ranks never disagree on when the agreement collective runs.
* ``verify`` (or ``OVERLAP_VERIFY=1``, read when the scheduler is built; see ``scheduler.env_flags``
  for the values allowed): replay steps also count ops, and raise, naming the op and the
  collective, when a result is first used somewhere other than where it was recorded or a point is
  reached after a different number of ops: what a schedule trusted blindly would get wrong.

Not thread-safe: one step at a time per process (a second ``step()`` inside the first raises).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from scheduler import async_tensor
from scheduler.async_tensor import AsyncTensor
from scheduler.env_flags import env_flag
from scheduler.schedule import OpRef, Point, Schedule, ScheduledCollective, first_difference

__all__ = ["Scheduler", "ScheduleMismatchError", "VERIFY_ENV", "verify_from_env", "Exchange", "set_exchange"]

Exchange = Callable[[dist.ProcessGroup, str, Any], list]
"""``fn(group, point, value)`` -> every rank's ``value`` by group rank: one agreement at ``point``."""
_exchange: Optional[Exchange] = None


def set_exchange(fn: Optional[Exchange]) -> Optional[Exchange]:
    """Route the scheduler's cross-rank agreements (the schedule's signature, whether to record again)
    through ``fn``; returns the previous one. ``overlap`` installs its bounded, debug-checked
    ``overlap.agreement.exchange`` when imported; ``None``: torch's ``all_gather_object`` / ``all_reduce``."""
    global _exchange
    previous, _exchange = _exchange, fn
    return previous


class ScheduleMismatchError(RuntimeError):
    """Ranks recorded different collectives, or (verify mode) a step left its schedule."""


VERIFY_ENV = "OVERLAP_VERIFY"


def verify_from_env() -> bool:
    """``OVERLAP_VERIFY`` (read now): on turns verify mode on for schedulers built without ``verify=``.

    Parsed by :func:`scheduler.env_flags.env_flag` (1/true/yes/on, 0/false/no/off/empty, unset: off);
    any other value raises ``scheduler.env_flags.EnvFlagError`` naming the variable.
    """
    return env_flag(VERIFY_ENV)


class _OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while active (recording and verify steps only)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


class _Issued:
    """A collective issued in the current step."""

    __slots__ = ("seq", "ref", "kind", "group", "shape", "dtype", "nbytes", "issued", "first_use")

    def __init__(self, seq: int, pending: AsyncTensor, kind: str, group: str, issued: OpRef) -> None:
        self.seq = seq
        self.ref = weakref.ref(pending)
        self.kind, self.group = kind, group
        self.shape, self.dtype = tuple(pending.shape), str(pending.dtype).removeprefix("torch.")
        self.nbytes = pending.numel() * pending.element_size()
        self.issued = issued
        self.first_use: Optional[OpRef] = None

    def signature(self) -> tuple:
        return (self.kind, self.group, self.shape, self.dtype)

    def wait(self) -> None:
        pending = self.ref()
        if pending is not None and type(pending) is AsyncTensor:
            pending._overlap_wait()


class _Step:
    """Bookkeeping of the step running now."""

    def __init__(self, schedule: Optional[Schedule], counter: Optional[_OpCounter]) -> None:
        self.schedule = schedule  # None: recording
        self.counter = counter
        self.points: list[Point] = []
        self.point_ops: list[int] = []
        self.issued: list[_Issued] = []
        self.by_id: dict[int, _Issued] = {}
        self.diverged: Optional[str] = None  # why this replay step fell back
        self.in_scheduled_wait = False
        self.backward_hooked: set[int] = set()

    @property
    def recording(self) -> bool:
        return self.schedule is None

    @property
    def ops(self) -> int:
        return self.counter.count if self.counter is not None else -1

    @property
    def current_point(self) -> int:
        return len(self.points) - 1


class Scheduler:
    """Infers, records, agrees and replays the wait points of ``model``'s collectives (see module doc).

    ``group``: the process group ranks agree through (default: the default group, when one is
    initialized). ``verify``: re-check every replay step op by op (default: ``OVERLAP_VERIFY``).
    """

    def __init__(self, model: nn.Module, group: Optional[dist.ProcessGroup] = None,
                 verify: Optional[bool] = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Scheduler: model must be a torch.nn.Module, got {type(model).__name__}")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"Scheduler: group must be None or a torch.distributed.ProcessGroup, got {type(group).__name__}")
        if verify is not None and not isinstance(verify, bool):
            raise TypeError(f"Scheduler: verify must be None or a bool, got {verify!r}")
        self.group = group
        self.verify = verify_from_env() if verify is None else verify
        self.schedule: Optional[Schedule] = None
        self.steps_recorded = 0
        self.steps_replayed = 0
        self.steps_fallen_back = 0
        self.last_fallback_reason: Optional[str] = None
        self._step: Optional[_Step] = None
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._forward_pre_hook(name)))
            self._handles.append(module.register_forward_hook(self._forward_post_hook(name)))

    # ------------------------------------------------------------------ public
    @contextlib.contextmanager
    def step(self) -> Iterator["Scheduler"]:
        """One training step: record it, or replay the schedule (see the module docstring)."""
        if self._step is not None:
            raise RuntimeError("Scheduler.step: a step is already running (steps do not nest)")
        counter = _OpCounter() if self.schedule is None or self.verify else None
        step = _Step(self.schedule, counter)
        self._step = step
        previous = async_tensor.set_observer(self)
        if counter is not None:
            counter.__enter__()
        ok = False
        try:
            yield self
            ok = True
        finally:
            try:
                if ok:
                    self._end(step)
            finally:
                if counter is not None:
                    counter.__exit__(None, None, None)
                async_tensor.set_observer(previous)
                self._step = None
        self._after(step)

    def close(self) -> None:
        """Remove the module hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ observer (AsyncTensor)
    def on_issue(self, pending: AsyncTensor, kind: str, group: str) -> None:
        step = self._step
        if step is None:
            return
        issued = _Issued(len(step.issued), pending, kind, group, OpRef(step.ops, kind, step.current_point))
        step.issued.append(issued)
        step.by_id[id(pending)] = issued
        if step.schedule is not None and step.diverged is None:
            recorded = step.schedule.collectives
            if issued.seq >= len(recorded):
                self._diverge(step, f"collective {issued.seq} ({kind}) was not in the schedule "
                                    f"({len(recorded)} collectives)")
            elif recorded[issued.seq].signature() != issued.signature():
                self._diverge(step, f"collective {issued.seq} is {issued.signature()}, the schedule has "
                                    f"{recorded[issued.seq].signature()}")
            elif recorded[issued.seq].issued.after_point != issued.issued.after_point:
                self._diverge(step, f"collective {issued.seq} was issued after point {issued.issued.after_point}, "
                                    f"the schedule has {recorded[issued.seq].issued.after_point}")

    def on_wait(self, pending: AsyncTensor, func: Optional[Callable]) -> None:
        step = self._step
        if step is None:
            return
        issued = step.by_id.get(id(pending))
        if issued is None or issued.ref() is not pending or step.in_scheduled_wait:
            return
        use = OpRef(step.ops, _op_name(func), step.current_point)
        issued.first_use = use
        if step.schedule is None:
            return
        recorded = step.schedule.collectives[issued.seq] if issued.seq < len(step.schedule.collectives) else None
        if self.verify and recorded is not None and step.diverged is None:
            expected = recorded.first_use
            if expected != use:
                where = "never" if expected is None else (
                    f"at op {expected.index} ({expected.name}) after {step.schedule.point_name(expected.after_point)}")
                raise ScheduleMismatchError(
                    f"overlap verify: {recorded.describe()} is first used by op {use.index} ({use.name}) "
                    f"after {step.schedule.point_name(use.after_point)}, but the schedule recorded its first use "
                    f"{where}; a replay trusting the schedule would read unfinished data")
        if step.diverged is None and (recorded is None or recorded.wait_point is not None):
            self._diverge(step, f"collective {issued.seq} ({issued.kind}) was used by {use.name} before its "
                                f"scheduled wait")

    # ------------------------------------------------------------------ points
    def _forward_pre_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            if self._step is not None:
                self._point(("forward_pre", name))
        return hook

    def _forward_post_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            step = self._step
            if step is None:
                return
            self._point(("forward_post", name))
            if torch.is_grad_enabled():
                self._hook_backward(step, name, output)
        return hook

    def _hook_backward(self, step: _Step, name: str, output: Any) -> None:
        call = len(step.points)  # one backward point per forward call, fired by its first output grad

        def on_grad(grad: torch.Tensor) -> None:
            if self._step is step and call not in step.backward_hooked:
                step.backward_hooked.add(call)
                self._point(("backward_pre", name))

        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(on_grad)

    def _point(self, point: Point) -> None:
        step = self._step
        assert step is not None
        index = len(step.points)
        step.points.append(point)
        step.point_ops.append(step.ops)
        schedule = step.schedule
        if schedule is None or step.diverged is not None:
            return
        if index >= len(schedule.points) or schedule.points[index] != point:
            expected = schedule.points[index] if index < len(schedule.points) else "the end of the step"
            self._diverge(step, f"point {index} is {point}, the schedule has {expected}")
            return
        if self.verify and schedule.point_ops[index] != step.ops:
            raise ScheduleMismatchError(
                f"overlap verify: {schedule.point_name(index)} was reached after {step.ops} ops, the schedule "
                f"recorded {schedule.point_ops[index]}: the ops between points changed")
        self._wait_scheduled(step, schedule.waits_at.get(index, ()))

    def _wait_scheduled(self, step: _Step, seqs: Any) -> None:
        step.in_scheduled_wait = True
        try:
            for seq in seqs:
                if seq < len(step.issued):
                    step.issued[seq].wait()
        finally:
            step.in_scheduled_wait = False

    def _diverge(self, step: _Step, why: str) -> None:
        step.diverged = why

    # ------------------------------------------------------------------ step end
    def _end(self, step: _Step) -> None:
        self._point(("step_end", ""))
        step.in_scheduled_wait = True
        try:
            for issued in step.issued:  # never used (or left by a fallback): wait before the step ends
                issued.wait()
        finally:
            step.in_scheduled_wait = False
        if step.schedule is not None and step.diverged is None and len(step.issued) != len(step.schedule.collectives):
            self._diverge(step, f"{len(step.issued)} collectives were issued, the schedule has "
                                f"{len(step.schedule.collectives)}")

    def _after(self, step: _Step) -> None:
        if step.recording:
            schedule = _build(step)
            self._agree(schedule)
            self.schedule = schedule
            self.steps_recorded += 1
            return
        if self._any_rank(step.diverged is not None):
            self.steps_fallen_back += 1
            self.last_fallback_reason = step.diverged or "another rank left the schedule"
            self.schedule = None  # the next step records again
        else:
            self.steps_replayed += 1

    def _agreement_group(self) -> Optional[dist.ProcessGroup]:
        if self.group is not None:
            return self.group
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def _agree(self, schedule: Schedule) -> None:
        group = self._agreement_group()
        if group is None or dist.get_world_size(group) == 1:
            return
        if _exchange is not None:
            signatures = _exchange(group, "schedule signature", schedule.signature())
        else:
            signatures = [None] * dist.get_world_size(group)
            dist.all_gather_object(signatures, schedule.signature(), group=group)
        difference = first_difference(signatures)
        if difference is not None:
            seq, per_rank = difference
            described = "; ".join(f"rank {r}: {what}" for r, what in enumerate(per_rank))
            raise ScheduleMismatchError(
                f"overlap scheduler: ranks recorded different collectives, first at collective {seq} ({described}). "
                f"Every rank must issue the same collectives in the same order.")

    def _any_rank(self, flag: bool) -> bool:
        group = self._agreement_group()
        if group is None or dist.get_world_size(group) == 1:
            return flag
        if _exchange is not None:
            return any(_exchange(group, "schedule left on some rank", flag))
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t.item())


def _op_name(func: Optional[Callable]) -> str:
    if func is None:
        return "wait_tensor"
    return getattr(func, "__name__", None) or str(func)


def _build(step: _Step) -> Schedule:
    collectives = []
    end = len(step.points) - 1
    for i in step.issued:
        if i.first_use is None:
            wait_point: Optional[int] = end
        elif i.first_use.after_point > i.issued.after_point:
            wait_point = i.first_use.after_point
        else:
            wait_point = None  # used before the next point: its own first-use wait is as late as it gets
        collectives.append(ScheduledCollective(i.seq, i.kind, i.group, i.shape, i.dtype, i.nbytes, i.issued,
                                               i.first_use, wait_point))
    return Schedule(tuple(step.points), tuple(collectives), step.ops, tuple(step.point_ops))
