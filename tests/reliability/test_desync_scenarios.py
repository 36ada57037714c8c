"""Ranks that run different sharded modules: every rank raises, in bounded time, never a hang.

Four ways a user's ranks run different modules (issue 31): one rank has an extra sharded block, one
rank misses a block, a branch taken on one rank only (after the first step agreed the order), and
an extra ``no_grad`` forward on one rank. With debug mode on, the forward-order agreement and the
collectives meet on the same debug check (``overlap.agreement``), so every rank raises
``DesyncError`` naming what each rank was doing (its collective with the module's fqn, or the
agreement point) within one round trip, while the check's timeout is far longer: the error is a
meeting, not a timeout. With debug off the mismatched collectives crash a rank or time out, bounded
by the wait timeout; the harness's own timeout would turn a hang into a failed test.

The debug-on scenarios run one after another in one spawn per world size: a DesyncError issues
nothing, so the group stays in step for the next scenario (checked by a last all-reduce).
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import overlap
from overlap import desync
from overlap.testing import DistributedTestError, run_distributed

SCENARIOS = ("extra_block", "missing_block", "branch", "extra_no_grad_forward")
CHECK_TIMEOUT_S = 60.0  # the debug check's floor here: an error well before it is a meeting, not a timeout
BOUND_S = 10.0  # issue 31: every rank raises within this


class _Blocks(nn.Module):
    """``n`` same-shaped blocks; ``route`` picks which run (default: all, in order)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        self.route: list[int] = list(range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.route:
            x = torch.tanh(self.blocks[i](x))
        return x


def _model(n: int, mesh: object = None) -> _Blocks:
    torch.manual_seed(0)
    model = _Blocks(n)
    for block in model.blocks:
        overlap.shard(block, mesh=mesh)
    overlap.shard(model, mesh=mesh)
    return model


def _step(model: nn.Module) -> None:
    model(torch.ones(2, 8)).sum().backward()


def _scenario(name: str, rank: int, world_size: int) -> None:
    """Two steps where the last rank does ``name`` differently from the others."""
    odd = rank == world_size - 1
    n = 3 + (1 if odd and name == "extra_block" else 0) - (1 if odd and name == "missing_block" else 0)
    model = _model(n)
    if name == "branch":
        model.route = [0, 1]
    _step(model)  # the first step agrees the forward order
    if name == "branch" and odd:
        model.route = [0, 2]  # same shapes as block 1: only the module differs
    if name == "extra_no_grad_forward" and odd:
        with torch.no_grad():
            model(torch.ones(2, 8))
    _step(model)
    _step(model)


def _all_scenarios_debug_on(rank: int, world_size: int) -> dict:
    out: dict = {}
    with overlap.debug():
        for name in SCENARIOS:
            start = time.monotonic()
            try:
                _scenario(name, rank, world_size)
                out[name] = {"error": None}
            except Exception as e:  # noqa: BLE001 (the type is what the test checks)
                out[name] = {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start,
                             "fingerprints": getattr(e, "fingerprints", None)}
        out["after"] = overlap.wait(overlap.all_reduce(torch.ones(1))).tolist()  # still in step
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_debug_mode_raises_desync_on_every_rank_within_seconds(world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERLAP_WAIT_TIMEOUT_FLOOR", str(CHECK_TIMEOUT_S))
    results = run_distributed(_all_scenarios_debug_on, world_size, timeout=240, pg_timeout=120)
    odd = world_size - 1
    for name in SCENARIOS:
        for rank, r in enumerate(results):
            e = r[name]
            assert e["error"] == "DesyncError", (name, rank, e)
            assert e["seconds"] < BOUND_S, (name, rank, e["seconds"])
        fingerprints = results[0][name]["fingerprints"]
        assert all(r[name]["fingerprints"] == fingerprints for r in results), f"{name}: every rank saw the same"
        assert set(fingerprints) == set(range(world_size))
        others = {fingerprints[r] for r in range(odd)}
        assert len(others) == 1 and fingerprints[odd] not in others, (name, fingerprints)
        message = results[0][name]["message"]
        assert all(f"rank {r}: {fingerprints[r]}" in message for r in range(world_size)), message
    # what each rank was doing, with the module where there is one
    extra = results[0]["extra_block"]["fingerprints"]
    assert "agree(forward order)" in extra[0] and "[root]" in extra[0], extra
    assert "all_gather" in extra[odd] and "[blocks.3]" in extra[odd], extra
    assert "different sharded modules" in results[0]["extra_block"]["message"]
    missing = results[0]["missing_block"]["fingerprints"]
    assert "all_gather" in missing[0] and "[blocks.2]" in missing[0] and "agree(forward order)" in missing[odd]
    branch = results[0]["branch"]["fingerprints"]
    assert "[blocks.2]" in branch[odd] and "[blocks.2]" not in branch[0], branch
    assert all(r["after"] == [float(world_size)] for r in results)


def _one_scenario(rank: int, world_size: int, name: str) -> str:
    _scenario(name, rank, world_size)
    overlap.wait(overlap.all_reduce(torch.ones(1)))  # a rank that got through must still meet the others
    return "no error"


def _debug_off(name: str, world_size: int) -> DistributedTestError:
    pg_timeout = 3.0
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_one_scenario, world_size, name, timeout=90, pg_timeout=pg_timeout,
                        failure_grace=pg_timeout + 20)
    assert time.monotonic() - start < 90
    return info.value


def _assert_bounded_failure(err: DistributedTestError, world_size: int) -> None:
    """Some rank crashed or raised; every rank that reported an error reported ours or the backend's."""
    assert err.failures, err
    for f in err.failures.values():
        if f.traceback is not None:
            assert any(k in f.traceback for k in ("DesyncError", "CollectiveError", "CollectiveTimeoutError")), f.traceback


@pytest.mark.parametrize("name", SCENARIOS)
def test_debug_off_fails_in_bounded_time_on_two_ranks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(desync.DEBUG_ENV, raising=False)
    _assert_bounded_failure(_debug_off(name, 2), 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCENARIOS)
def test_debug_off_fails_in_bounded_time_on_three_ranks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(desync.DEBUG_ENV, raising=False)
    _assert_bounded_failure(_debug_off(name, 3), 3)


def _different_orders(rank: int, world_size: int) -> dict:
    """Same blocks, run in another order on the last rank: with debug off the gathers pair (same
    shapes), and the agreement at the end of the first forward finds the orders differ."""
    model = _model(3)
    if rank == world_size - 1:
        model.route = [1, 0, 2]
    try:
        _step(model)
    except overlap.DesyncError as e:
        return {"error": str(e), "group": e.group}
    return {"error": None}


def test_different_orders_raise_on_every_rank_with_debug_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(desync.DEBUG_ENV, raising=False)
    for r in run_distributed(_different_orders, 2, timeout=60, pg_timeout=30):
        assert r["group"] == "0", r
        assert ("ran the sharded modules in different orders" in r["error"]
                and "rank 0: ['root', 'blocks.0', 'blocks.1', 'blocks.2']" in r["error"]
                and "rank 1: ['root', 'blocks.1', 'blocks.0', 'blocks.2']" in r["error"]), r["error"]


def _different_orders_across_replicas(rank: int, world_size: int) -> dict:
    """HSDP on a 2x1 mesh (two replicas of one rank each): the shard groups have nothing to agree,
    so the replicas must; the second replica runs the blocks in another order."""
    from torch.distributed.device_mesh import init_device_mesh

    model = _model(3, init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")))
    if rank == world_size - 1:
        model.route = [1, 0, 2]
    try:
        _step(model)
    except overlap.DesyncError as e:
        return {"error": str(e)}
    return {"error": None}


def test_different_orders_across_one_rank_shard_groups_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one-rank shard groups the forward order is still agreed across the replicas: a replica
    that ran the blocks in another order raises ``DesyncError`` on every rank, where its gradient
    all-reduces would otherwise pair with the wrong blocks' (same shapes) and no error would come."""
    monkeypatch.delenv(desync.DEBUG_ENV, raising=False)
    for r in run_distributed(_different_orders_across_replicas, 2, timeout=60, pg_timeout=30):
        assert r["error"] is not None and "ran the sharded modules in different orders" in r["error"], r


def _exchanges(rank: int, world_size: int) -> dict:
    """``overlap.agreement.exchange``: equal values cost one collective, different ones two; a value
    that cannot be pickled raises before anything is issued."""
    from overlap import agreement
    from overlap.groups import resolve_group

    info = resolve_group(None)
    out: dict = {}
    before = desync._seqs.get("0", 0)
    out["same"] = agreement.exchange(info, "test", {"a": [1, 2]})
    out["same_cost"] = desync._seqs["0"] - before
    before = desync._seqs["0"]
    out["different"] = agreement.exchange(info, "test", "x" * (rank * 100))  # lengths differ too
    out["different_cost"] = desync._seqs["0"] - before
    # only the middle rank differs: the first and last ranks agreeing must not pass for everyone's
    out["middle_differs"] = agreement.exchange(info, "test", "B" if rank == 1 else "A")
    before = desync._seqs["0"]
    try:
        agreement.exchange(info, "test", lambda: None)
    except TypeError as e:
        out["unpicklable"] = str(e)
    out["unpicklable_cost"] = desync._seqs["0"] - before
    return out


def test_exchange_returns_every_ranks_value() -> None:
    for r in run_distributed(_exchanges, 3, timeout=60):
        assert r["same"] == [{"a": [1, 2]}] * 3 and r["same_cost"] == 1
        assert r["different"] == ["", "x" * 100, "x" * 200] and r["different_cost"] == 2
        assert r["middle_differs"] == ["A", "B", "A"], r["middle_differs"]
        assert "overlap agreement 'test': value must be picklable, got function" in r["unpicklable"]
        assert r["unpicklable_cost"] == 0
