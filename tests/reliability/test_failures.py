"""Timeouts and failed ranks: every wait is bounded, and a rank that dies or raises mid-step makes the
others raise a clear error (naming the collective, its bytes and shapes, group and sequence number)
instead of hanging.

The process groups use a short timeout (``run_distributed(..., pg_timeout=...)``), and the harness
is given a failure grace longer than it, so the survivors' own errors are collected and checked.
"""
from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch
from torch import nn

import overlap
from models import TinyLM, local_batch, make_batch, single_threaded
from overlap.testing import DistributedTestError, run_distributed

PG_TIMEOUT = 3.0
# A described collective in an error: "<kind> #<seq> on group '<name>' (<bytes> bytes: <dtype>[shape] ...)"
DESCRIBED = re.compile(r"overlap: .*(all_gather|reduce_scatter)\S* #\d+ on group '0' \(\d+ bytes: \w+\[\d+")


ALLOWED_TIMEOUTS = "'default', None, a number of seconds or a datetime.timedelta, from 0.001 s (1 ms) to 1e+09 s"


@pytest.mark.parametrize(
    ("bad", "exc", "shown"),
    [
        (0, ValueError, "got 0"),
        (-1.0, ValueError, "got -1.0"),
        (1e-9, ValueError, "got 1e-09"),  # the value passed, not the timedelta(0) it would round to
        (float("nan"), ValueError, "got nan"),
        (float("inf"), ValueError, "got inf"),
        (1e300, ValueError, "got 1e+300"),
        (10**400, ValueError, "got 1000"),  # too big for a float: still named, not an OverflowError
        (datetime.timedelta(0), ValueError, "got datetime.timedelta(0)"),
        (datetime.timedelta(microseconds=10), ValueError, "got datetime.timedelta(microseconds=10)"),
        ("5", TypeError, "got str '5'"),
        (True, TypeError, "got bool True"),
        ([2.0], TypeError, "got list [2.0]"),
    ],
)
def test_set_wait_timeout_names_the_value_and_what_is_allowed(bad: object, exc: type, shown: str) -> None:
    previous = overlap.set_wait_timeout(2.5)
    try:
        with pytest.raises(exc) as info:
            overlap.set_wait_timeout(bad)  # type: ignore[arg-type]
        assert str(info.value).startswith(f"set_wait_timeout: timeout must be {ALLOWED_TIMEOUTS}; ")
        assert shown in str(info.value), str(info.value)
        assert overlap.wait_timeout() == datetime.timedelta(seconds=2.5), "a failed call changes nothing"
    finally:
        overlap.set_wait_timeout(previous)


def test_set_wait_timeout_accepts_seconds_and_timedeltas_in_range() -> None:
    previous = overlap.set_wait_timeout(2.5)
    try:
        assert overlap.wait_timeout() == datetime.timedelta(seconds=2.5)
        assert overlap.set_wait_timeout(datetime.timedelta(milliseconds=1)) == datetime.timedelta(seconds=2.5)
        assert overlap.wait_timeout() == datetime.timedelta(milliseconds=1)
        overlap.set_wait_timeout(1e9)
        assert overlap.wait_timeout() == datetime.timedelta(seconds=1e9)
    finally:
        overlap.set_wait_timeout(previous)


def test_wait_timeout_names_a_group_that_does_not_exist() -> None:
    with pytest.raises(ValueError, match="wait_timeout: group 'nope' is not the name of a live process group"):
        overlap.wait_timeout("nope")
    with pytest.raises(TypeError, match="wait_timeout: device_type must be a device type name"):
        overlap.wait_timeout("", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wait_timeout: device_type must be a device type name .* got 'gpu0'"):
        overlap.wait_timeout("", "gpu0")


def _unanswered_waits(rank: int, world_size: int) -> dict:
    """Rank 1 never issues: rank 0's waits time out, first after the group's timeout, then after an
    override."""
    if rank == 1:
        time.sleep(1.0 + 0.3 + 1.0)  # stays alive (its connections open) until rank 0 is done
        return {}
    out: dict = {"default": overlap.wait_timeout("0").total_seconds()}
    for name, override in (("group's", None), ("override", 0.3)):
        overlap.set_wait_timeout(override)
        x = overlap.all_gather(torch.ones(3, 5))
        start = time.monotonic()
        try:
            overlap.wait(x)
        except overlap.CollectiveTimeoutError as e:
            out[name] = (str(e), time.monotonic() - start)
    return out


def test_wait_times_out_naming_the_collective() -> None:
    r = run_distributed(_unanswered_waits, 2, timeout=60, pg_timeout=1.0)[0]
    assert r["default"] == 1.0, "the default never exceeds the process group's timeout"
    message, seconds = r["group's"]
    assert "wait for all_gather #0 on group '0' (120 bytes: float32[6, 5]) timed out after 1 s" in message, message
    assert seconds < 1.0 + 30
    message, seconds = r["override"]
    assert "all_gather #1 on group '0'" in message and "timed out after 0.3 s" in message, message
    assert seconds < 0.3 + 30


# ----------------------------------------------------------------------------- a rank fails mid-step


class _FailAt(nn.Module):
    """Wraps a block; on ``rank`` at step ``step`` it dies (``os._exit``) or raises."""

    def __init__(self, inner: nn.Module, rank: int, how: str) -> None:
        super().__init__()
        self.inner, self.rank, self.how, self.step = inner, rank, how, -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step == 1 and torch.distributed.get_rank() == self.rank:
            if self.how == "exit":
                os._exit(9)
            raise ValueError("rank fails in its forward")
        return self.inner(x)


def _train_until_failure(rank: int, world_size: int, failing_rank: int, how: str) -> None:
    """Sharded TinyLM steps; ``failing_rank`` fails inside block 1's forward at step 1, while the
    others are mid-step (their next collectives need it)."""
    with single_threaded():
        torch.manual_seed(0)
        model = TinyLM(layers=3)
        failing = _FailAt(model.blocks[1], failing_rank, how)
        model.blocks[1] = failing
        for block in model.blocks:
            overlap.shard(block)
        overlap.shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            failing.step = step
            model.loss(local_batch(make_batch(step), rank, world_size)).backward()
            opt.step()
            opt.zero_grad()


def _run_failing(failing_rank: int, how: str) -> tuple[DistributedTestError, float]:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_train_until_failure, 3, failing_rank, how, timeout=120, pg_timeout=PG_TIMEOUT,
                        failure_grace=PG_TIMEOUT + 15)
    return info.value, time.monotonic() - start


def _assert_survivors_named_the_collective(err: DistributedTestError, survivors: list[int]) -> None:
    for rank in survivors:
        failure = err.failures.get(rank)
        assert failure is not None and failure.traceback is not None, f"rank {rank} must report its error:\n{err}"
        assert "CollectiveError" in failure.traceback or "CollectiveTimeoutError" in failure.traceback, failure.traceback
        assert DESCRIBED.search(failure.traceback), failure.traceback


def test_a_timeout_at_a_groups_first_collective_names_the_ranks_behind(single_rank_group) -> None:
    """Sequence numbers start at 0: a wait that times out at a group's very first collective names
    the ranks that have not issued it, as at any later one (here the one rank, which reported no
    collective on the group)."""
    from overlap import errors

    for seq in (0, 1):
        e = errors.collective_failure("wait for all_gather", datetime.timedelta(seconds=2), None, "", seq, {})
        assert isinstance(e, overlap.CollectiveTimeoutError) and e.missing == {0: None}, (seq, e.missing)
        assert f"ranks that have not issued #{seq} on group '': 0" in str(e), str(e)


def test_killed_rank_makes_the_others_raise() -> None:
    err, seconds = _run_failing(1, "exit")
    assert err.failures[1].exitcode == 9 and err.failures[1].traceback is None
    assert "rank 1 exited with code 9" in str(err)
    _assert_survivors_named_the_collective(err, [0, 2])
    assert seconds < PG_TIMEOUT + 30


def test_rank_raising_in_forward_makes_the_others_raise() -> None:
    err, seconds = _run_failing(2, "raise")
    failure = err.failures[2]
    assert failure.traceback is not None and "ValueError: rank fails in its forward" in failure.traceback
    _assert_survivors_named_the_collective(err, [0, 1])
    assert seconds < PG_TIMEOUT + 30


# ----------------------------------------------------------------------------- bounded by default


def test_default_timeout_rule() -> None:
    """min(group's timeout, max(floor, STEP_FACTOR x slowest step)); see [Note: wait timeouts]."""
    from overlap import errors

    minutes = datetime.timedelta(minutes=30)
    assert errors.default_timeout(minutes, errors.DEFAULT_FLOOR_S, 0.0) == datetime.timedelta(seconds=300)
    assert errors.default_timeout(minutes, 300.0, 100.0) == datetime.timedelta(seconds=100 * errors.STEP_FACTOR)
    assert errors.default_timeout(minutes, 300.0, 1e4) == minutes, "never longer than the group's timeout"
    assert errors.default_timeout(datetime.timedelta(seconds=60), 300.0, 0.0) == datetime.timedelta(seconds=60)


def test_default_follows_the_slowest_step_and_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    from overlap import errors

    monkeypatch.setattr(errors, "_slowest_step_s", 0.0)
    monkeypatch.setattr(errors, "_floor_s", None)
    monkeypatch.setenv(errors.FLOOR_ENV, "7.5")
    previous = overlap.set_wait_timeout("default")
    try:
        group_timeout = errors._group_timeout("", "cpu")
        assert overlap.wait_timeout() == min(group_timeout, datetime.timedelta(seconds=7.5))
        errors.observe_step(4.0)
        errors.observe_step(1.0)  # the slowest one counts
        assert overlap.wait_timeout() == min(group_timeout, datetime.timedelta(seconds=4.0 * errors.STEP_FACTOR))
        assert errors.timeout_for("", check=True) == overlap.wait_timeout(), "past both floors: the same"
        monkeypatch.setattr(errors, "_slowest_step_s", 0.0)
        monkeypatch.setattr(errors, "_floor_s", None)
        monkeypatch.delenv(errors.FLOOR_ENV)
        assert errors.timeout_for("", check=True) == min(group_timeout, datetime.timedelta(seconds=errors.DEBUG_FLOOR_S))
        assert overlap.set_wait_timeout(None) == "default"
        assert overlap.wait_timeout() == group_timeout, "None: the group's own timeout"
        monkeypatch.setattr(errors, "_floor_s", None)
        monkeypatch.setenv(errors.FLOOR_ENV, "soon")
        overlap.set_wait_timeout("default")
        with pytest.raises(ValueError, match="OVERLAP_WAIT_TIMEOUT_FLOOR must be a number of seconds .* got 'soon'"):
            overlap.wait_timeout()
    finally:
        overlap.set_wait_timeout(previous)


def _timeouts_of_recreated_groups(rank: int, world_size: int) -> dict:
    """The group's own timeout (``set_wait_timeout(None)``) of WORLD and of a subgroup, read once,
    then again after both are destroyed and made anew with other timeouts: torch names the new ones
    as it named the old (``''`` / ``'1'``: its group counter restarts), so a timeout cached by
    name alone would be the old one."""
    import torch.distributed as dist

    overlap.set_wait_timeout(None)
    sub = dist.new_group([0], timeout=datetime.timedelta(seconds=4))
    before = (overlap.wait_timeout().total_seconds(), overlap.wait_timeout(sub.group_name).total_seconds())
    name = sub.group_name
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=9))
    sub = dist.new_group([0], timeout=datetime.timedelta(seconds=6))
    after = (overlap.wait_timeout().total_seconds(), overlap.wait_timeout(sub.group_name).total_seconds())
    return {"before": before, "after": after, "same name": sub.group_name == name}


def test_wait_timeout_follows_a_group_made_again_under_the_same_name() -> None:
    r = run_distributed(_timeouts_of_recreated_groups, 1, timeout=60, pg_timeout=3.0)[0]
    assert r["same name"], "premise: the new subgroup has the old one's name"
    assert r["before"] == (3.0, 4.0)
    assert r["after"] == (9.0, 6.0), "the new groups' own timeouts, not the destroyed ones'"


def _rank_stays_after_its_error(rank: int, world_size: int) -> dict:
    """Rank 1 raises inside block 1's forward at step 1, catches it and stays alive (its connections
    open) until rank 0 is done; rank 0 goes on into the step and must time out by the default."""
    import torch.distributed as dist
    from overlap import desync, errors

    store = dist.distributed_c10d._get_default_store()
    try:
        _train_until_failure(rank, world_size, 1, "raise")
    except ValueError:
        issued = desync._seqs["0"]
        store.wait(["rank0-done"], datetime.timedelta(seconds=100))
        return {"issued": issued}
    except overlap.CollectiveTimeoutError as e:
        store.set("rank0-done", "1")
        return {"message": str(e), "group": e.group, "seq": e.seq, "missing": e.missing,
                "timeout": overlap.wait_timeout("0").total_seconds(), "slowest": errors._slowest_step_s}
    store.set("rank0-done", "1")
    return {}


@pytest.mark.torch_kernels  # the interpreted kernels make a step ~4 s here, and the bound 5 steps
def test_rank_that_stops_issuing_makes_the_others_time_out_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """No set_wait_timeout, a group timeout of 120 s: the default bound (here with a floor of 2 s)
    ends rank 0's wait, naming the group, the collective and the rank that has not issued it."""
    monkeypatch.setenv("OVERLAP_WAIT_TIMEOUT_FLOOR", "2")
    r0, r1 = run_distributed(_rank_stays_after_its_error, 2, timeout=110, pg_timeout=120)
    assert "message" in r0, r0
    assert r0["timeout"] == pytest.approx(max(2.0, 5 * r0["slowest"]), abs=1e-5), "the default rule"
    assert r0["timeout"] < 120, "not the group's timeout"
    assert r0["group"] == "0" and r0["seq"] >= r1["issued"], (r0, r1)
    assert r0["missing"] == {1: r1["issued"] - 1}, (r0["missing"], r1)
    assert f"timed out after {r0['timeout']:g} s" in r0["message"], r0["message"]
    assert (f"ranks that have not issued #{r0['seq']} on group '0': 1 (last #{r1['issued'] - 1})"
            in r0["message"]), r0["message"]


def test_arrivals_publish_only_counts_that_stopped_changing() -> None:
    """[Note: publishing where a rank stopped]: nothing is written while a rank issues, its counts are
    written once they are the same at two looks, and not again until they change and stop again."""
    from overlap.arrivals import _Looks

    looks = _Looks()
    assert looks.due({"0": 1}) is None, "first look: nothing to compare with"
    assert looks.due({"0": 5}) is None and looks.due({"0": 9, "1": 2}) is None, "still issuing"
    assert looks.due({"0": 9, "1": 2}) == {"0": 9, "1": 2}, "stopped: written"
    looks.published = {"0": 9, "1": 2}
    assert looks.due({"0": 9, "1": 2}) is None, "written once"
    assert looks.due({"0": 10, "1": 2}) is None and looks.due({"0": 10, "1": 2}) == {"0": 10, "1": 2}


def _ranks_behind_on_a_subgroup(rank: int, world_size: int) -> dict:
    """On 3 ranks, subgroup [0, 1] runs one all-reduce; rank 0 waits until rank 1, which then stops
    issuing, has published its counts ([Note: publishing where a rank stopped]), issues the
    subgroup's next all-reduce and, before rank 1 issues it, asks which ranks have not: the answer
    must be drawn from the subgroup's ranks (not WORLD's: rank 2 never issues on it) and read rank
    0's own live counts (any it published are one collective old)."""
    import torch.distributed as dist
    from overlap import arrivals, desync

    store = dist.distributed_c10d._get_default_store()
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        overlap.wait(overlap.all_reduce(torch.ones(2), group=sub))
    out: dict = {}
    if rank == 0:
        import json

        published, deadline = arrivals._store(), time.monotonic() + 30
        while not (published.check(["1"]) and json.loads(published.get("1")).get(sub.group_name) == 1):
            assert time.monotonic() < deadline, "rank 1 never published its counts"
            time.sleep(arrivals.INTERVAL_S / 5)  # rank 1 stopped issuing: it publishes within two looks
        pending = overlap.all_reduce(torch.ones(2), group=sub)  # #1 on the subgroup
        out["missing"] = arrivals.missing(sub.group_name, 1, desync._seqs)
        out["text"] = arrivals.describe_missing(sub.group_name, 1, out["missing"])
        out["group"] = sub.group_name
        store.set("asked", "1")
        overlap.wait(pending)
    elif rank == 1:
        store.wait(["asked"], datetime.timedelta(seconds=60))
        overlap.wait(overlap.all_reduce(torch.ones(2), group=sub))
    return out


def test_the_ranks_behind_are_the_groups_and_this_ranks_own_count_is_live() -> None:
    """Which ranks have not issued a subgroup's collective: only the subgroup's, this rank's own
    count read live (see ``_ranks_behind_on_a_subgroup``)."""
    r0 = run_distributed(_ranks_behind_on_a_subgroup, 3, timeout=60)[0]
    assert r0["missing"] == {1: 0}, r0
    assert r0["text"] == f"; ranks that have not issued #1 on group {r0['group']!r}: 1 (last #0)", r0["text"]


def test_a_timeout_after_every_rank_issued_says_so() -> None:
    """A wait can time out with every rank having issued the collective (a slow link): the error then
    says so, as last reported; with no report to read, it says nothing."""
    from overlap.arrivals import describe_missing

    assert describe_missing("0", 3, {}) == "; every rank of group '0' has issued #3 (as last reported)"
    assert describe_missing("0", 3, None) == ""
