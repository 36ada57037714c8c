"""The sharded runtime's training steps replayed on one compute stream and one FIFO link.

Contract: a pure function of numbers (no torch, no process groups), so every rank computes the same
answer from the same inputs. It is the one model behind both schedule choosers:
``scheduler.prefetch_depth`` (the first step, from a cold start) and ``scheduler.gather_ahead``
(the steady state of several steps, with gathers issued ahead in backward).

Inputs, per group in the order compute needs them (the agreed forward order; one group per position):

==============  ================================================================================
``compute``     seconds the compute stream spends on the group's forward (its compute, and the
                host's packing of its gather where the host issues the kernels)
``gather``      seconds its all-gather occupies the link
``reduce``      seconds its reduce-scatter occupies the link (default: ``gather``; the runtime derives
                it from the gather's measured seconds per byte: a mixed-precision reduce in float32
                moves twice a bfloat16 gather's bytes)
``backward``    seconds of the group's backward on the compute stream (default: twice ``compute``)
``depth``       prefetch depth: groups gathered ahead of the running one
``ahead``       gather-ahead: the first ``ahead`` groups reduced in backward (the last ``ahead``
                forward positions) get their next-step gather issued in this backward
``lag``         ... right after the reduce-scatter of the group reduced ``lag`` after them
``loss``        host seconds between forward's end and backward's start (the caller's loss)
``tail``        host seconds at the end of backward once its reduce-scatters landed (the last
                groups' epilogues and optimizer steps) before the next forward's gathers go out
``replicate``   seconds of the group's cross-replica all-reduce (HSDP) on a second FIFO link,
                issued when its reduce-scatter lands (None: no replicas)
==============  ================================================================================

[Note: replaying a step on a FIFO link]
The link is a FIFO: a collective issued at ``t`` starts when the link is free and ``t`` has come,
and holds it for its cost. Compute is one stream: a group's compute starts when the group before it
is done and its gather has landed. One step:

* forward: at the start of group ``j``, issue the gathers of ``j .. j+depth`` not yet issued, wait
  for ``j``'s, compute;
* the last group and the ``depth`` before it stay unsharded into backward (the runtime's [Note:
  kept for backward]); the host then runs the loss (``loss``);
* backward, in reverse: issue the re-gathers of ``j, j-1 .. j-depth`` not yet held, wait for
  ``j``'s, compute its backward, then queue ``j``'s reduce-scatter (with ``replicate``, its
  all-reduce goes on the second link when the reduce-scatter lands: the group's gradients are final
  when that lands); where ``j + lag`` is gathered ahead, the host waits for that group's final
  gradients (its step must have run) and issues its next-step gather;
* the end of backward waits for every reduction and runs the host's ``tail`` (a step's end),
  then issues the next forward's first ``1 + depth`` gathers (``prefetch_next_step``; the link is
  empty there), then the planned gathers ahead whose point did not come.

``loss`` and ``tail`` are the host work on no group's account ([Note: the host work between the
groups] in ``scheduler/prefetch_depth.py``); both default to 0, the model before they were measured.

Without gathers ahead the link is empty and compute idle at each step's end, so every step takes
what the first one takes: the steady state of ``ahead=0`` is the cold first step (property-tested).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

__all__ = ["step_ends"]


class _FifoLink:
    """A link that carries one collective at a time, in issue order."""

    __slots__ = ("free_at",)

    def __init__(self) -> None:
        self.free_at = 0.0

    def run(self, at: float, seconds: float) -> float:
        """A collective issued at ``at`` for ``seconds``: when it lands."""
        self.free_at = max(self.free_at, at) + seconds
        return self.free_at


def step_ends(compute: Sequence[float], gather: Sequence[float], depth: int, steps: int = 1, ahead: int = 0,
              lag: int = 1, backward: Optional[Sequence[float]] = None, loss: float = 0.0,
              tail: float = 0.0, reduce: Optional[Sequence[float]] = None,
              replicate: Optional[Sequence[float]] = None,
              backward_gathers: Optional[Sequence[bool]] = None) -> list[float]:
    """The time each of ``steps`` consecutive steps ends, from a cold start at 0 (an empty link,
    nothing gathered), under [Note: replaying a step on a FIFO link]; ``[]`` for no groups.
    ``backward``: each group's backward seconds (None: twice its ``compute``); ``loss``, ``tail``:
    the host's seconds after forward and at the end of backward (finite, >= 0); ``reduce``: each
    group's reduce-scatter seconds on the link (None: its ``gather``'s); ``replicate``: each group's
    cross-replica all-reduce seconds on a second link (None: none); ``backward_gathers``: per group,
    whether backward gathers it again when it is not kept (False: ``set_unshard_in_backward(False)``,
    its backward needs no parameters; None: every group)."""
    n = len(compute)
    if backward is None:
        backward = [2 * c for c in compute]
    elif len(backward) != n:
        raise ValueError(f"backward must have one entry per group ({n}), got {len(backward)}")
    if reduce is None:
        reduce = gather
    elif len(reduce) != n:
        raise ValueError(f"reduce must have one entry per group ({n}), got {len(reduce)}")
    if replicate is not None and len(replicate) != n:
        raise ValueError(f"replicate must have one entry per group ({n}), got {len(replicate)}")
    if backward_gathers is not None and len(backward_gathers) != n:
        raise ValueError(f"backward_gathers must have one entry per group ({n}), got {len(backward_gathers)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if isinstance(ahead, bool) or not isinstance(ahead, int) or not 0 <= ahead <= n:
        raise ValueError(f"ahead must be an int in 0..{n} (the number of groups), got {ahead!r}")
    for name, value in (("loss", loss), ("tail", tail)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be finite seconds >= 0, got {value!r}")
    if n == 0:
        return []
    link, replica_link = _FifoLink(), _FifoLink()
    run = link.run
    gathered_ahead = set(range(n - ahead, n))  # forward positions; backward reduces n-1 first
    now = 0.0
    landed = [math.inf] * n
    ends: list[float] = []
    for _ in range(steps):
        for j in range(n):  # forward: issue j and the depth after it, wait for j
            for k in range(j, min(n, j + 1 + depth)):
                if landed[k] == math.inf:
                    landed[k] = run(now, gather[k])
            now = max(now, landed[j]) + compute[j]
        now += loss
        regathered = [math.inf] * n
        for k in range(max(0, n - 1 - depth), n):  # kept unsharded for backward
            regathered[k] = 0.0
        if backward_gathers is not None:  # left sharded in backward: nothing to wait for
            for k in range(n):
                if not backward_gathers[k]:
                    regathered[k] = 0.0
        reduced = [math.inf] * n
        landed = [math.inf] * n  # the next forward's gathers
        for j in reversed(range(n)):
            for k in range(j, max(-1, j - 1 - depth), -1):
                if regathered[k] == math.inf:
                    regathered[k] = run(now, gather[k])
            now = max(now, regathered[j]) + backward[j]
            reduced[j] = run(now, reduce[j])
            if replicate is not None:  # the group's gradients are final when its all-reduce lands
                reduced[j] = replica_link.run(reduced[j], replicate[j])
            if j + lag < n and j + lag in gathered_ahead:
                now = max(now, reduced[j + lag])  # its step must have run
                landed[j + lag] = run(now, gather[j + lag])
        now = max(now, max(reduced)) + tail  # the end of backward waits for every reduction
        ends.append(now)
        for k in [*range(min(n, 1 + depth)), *sorted(gathered_ahead)]:  # first groups, then what is left
            if landed[k] == math.inf:
                landed[k] = run(now, gather[k])
    return ends
