"""Desync detection (``overlap.desync``): sequence numbers, fingerprints and the debug-mode check.

In debug mode a rank that is about to issue a different collective (kind, op, dtype, shape) or the
same ones in another order makes every rank raise ``DesyncError`` naming the sequence number and
what each rank issued; nothing is issued, so the group stays usable. Matching programs -- every
collective kind, a subgroup, a sharded TinyLM's steps -- pass the check unchanged.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlap
from models import TinyLM, local_batch, make_batch, single_threaded
from overlap import desync
from overlap.testing import DistributedTestError, run_distributed


# ----------------------------------------------------------------------------- one process


def test_fingerprint_text() -> None:
    x = torch.zeros(4, 3)
    assert desync.fingerprint(7, "all_gather", [x]) == "#7 all_gather float32[4, 3]"
    assert desync.fingerprint(8, "reduce_scatter", [x, x[:2]], "sum") == "#8 reduce_scatter(sum) float32[4, 3] float32[2, 3]"
    assert desync.fingerprint(9, "broadcast", [x.double()], "src=0") == "#9 broadcast(src=0) float64[4, 3]"
    # all_to_all's dim 0 legitimately differs between ranks (uneven splits)
    assert desync.fingerprint(3, "all_to_all", [x, x[:1]]) == "#3 all_to_all float32[*, 3] float32[*, 3]"


def test_long_fingerprints_keep_fixed_size_and_stay_distinct() -> None:
    many = [torch.zeros(i + 1, 2) for i in range(40)]  # ~600 characters of text
    a = desync._encode(desync.fingerprint(0, "all_gather_coalesced", many))
    b = desync._encode(desync.fingerprint(0, "all_gather_coalesced", many[:-1] + [torch.zeros(41, 3)]))
    assert a.numel() == b.numel() == desync.FINGERPRINT_BYTES
    assert not torch.equal(a, b), "a difference past the readable head must still show in the digest"
    assert desync._decode(a).startswith("#0 all_gather_coalesced float32[1, 2]")


def test_sequence_numbers_count_per_group() -> None:
    first_a, first_b = desync.next_seq("test-a"), desync.next_seq("test-b")
    assert [desync.next_seq("test-a") for _ in range(3)] == [first_a + 1, first_a + 2, first_a + 3]
    assert desync.next_seq("test-b") == first_b + 1


def test_debug_mode_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(desync.DEBUG_ENV, raising=False)
    previous = overlap.set_debug(None)
    try:
        assert overlap.debug_enabled() is False, "off by default"
        monkeypatch.setenv(desync.DEBUG_ENV, "1")
        assert overlap.debug_enabled() is False, "the environment is read once, then cached"
        overlap.set_debug(None)
        assert overlap.debug_enabled() is True, "set_debug(None) follows the environment again"
        with overlap.debug(False):
            assert overlap.debug_enabled() is False and desync.SWITCH.on is False
        assert overlap.debug_enabled() is True
        monkeypatch.setenv(desync.DEBUG_ENV, "sometimes")
        overlap.set_debug(None)
        with pytest.raises(ValueError, match="OVERLAP_DEBUG must be one of .*'1'.*'sometimes'"):
            overlap.debug_enabled()
        with pytest.raises(TypeError, match="set_debug: on must be True, False or None"):
            overlap.set_debug("yes")  # type: ignore[arg-type]
    finally:
        monkeypatch.delenv(desync.DEBUG_ENV, raising=False)
        overlap.set_debug(previous)


# ----------------------------------------------------------------------------- matching programs pass


def _matching_program(rank: int, world_size: int) -> dict:
    """Every collective kind, a subgroup, and two sharded TinyLM steps, with OVERLAP_DEBUG=1."""
    out: dict = {"debug": overlap.debug_enabled()}
    base = torch.arange(6.0).reshape(3, 2)
    x = base + rank
    w = float(world_size)
    checks = {
        "all_gather": torch.equal(overlap.all_gather(x), torch.cat([base + r for r in range(world_size)])),
        "reduce_scatter": torch.equal(overlap.reduce_scatter(torch.ones(world_size * 2, 2)), torch.full((2, 2), w)),
        "all_reduce": torch.equal(overlap.all_reduce(x, op="max"), base + world_size - 1),
        "broadcast": torch.equal(overlap.broadcast(x, src=1), base + 1),
        "all_to_all": torch.equal(overlap.all_to_all(torch.full((world_size, 2), float(rank))),
                                  torch.arange(w).repeat_interleave(2).reshape(-1, 2)),
        "all_gather_coalesced": torch.equal(overlap.all_gather_coalesced([x, x.double()])[1],
                                            overlap.all_gather(x).double()),
        "reduce_scatter_coalesced": torch.equal(overlap.reduce_scatter_coalesced([torch.ones(world_size, 3)])[0],
                                                torch.full((1, 3), w)),
    }
    out["checks"] = checks
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        out["subgroup_sum"] = overlap.all_reduce(torch.ones(2), group=sub).sum().item()
    before = desync._seqs["0"]
    with single_threaded():
        torch.manual_seed(0)
        model = TinyLM(layers=1)
        for block in model.blocks:
            overlap.shard(block)
        overlap.shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            loss = model.loss(local_batch(make_batch(step), rank, world_size))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    out["losses"] = losses
    out["model_collectives"] = desync._seqs["0"] - before
    out["seqs"] = dict(desync._seqs)
    return out


def test_matching_program_passes_in_debug_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(desync.DEBUG_ENV, "1")
    results = run_distributed(_matching_program, 3, timeout=120)
    for rank, r in enumerate(results):
        assert r["debug"] is True, "OVERLAP_DEBUG=1 reaches the ranks"
        assert all(r["checks"].values()), (rank, r["checks"])
    assert [r.get("subgroup_sum") for r in results] == [4.0, 4.0, None]
    assert results[0]["model_collectives"] >= 8, "the sharded steps' gathers and reduce-scatters were checked"
    assert results[0]["seqs"] == results[1]["seqs"], "same collectives on every group"
    assert results[2]["seqs"] == {g: n for g, n in results[0]["seqs"].items() if g == "0"}, "rank 2 is not in the subgroup"


# ----------------------------------------------------------------------------- desynced programs raise


def _issue(kind: str, rank: int, world_size: int) -> torch.Tensor:
    if kind == "gather4":
        return overlap.all_gather(torch.ones(4, 3))
    if kind == "gather5":
        return overlap.all_gather(torch.ones(5, 3))
    if kind == "gather4_double":
        return overlap.all_gather(torch.ones(4, 3, dtype=torch.float64))
    if kind == "reduce":
        return overlap.all_reduce(torch.ones(4, 3))
    if kind == "scatter_sum":
        return overlap.reduce_scatter(torch.ones(world_size * 2))
    if kind == "scatter_max":
        return overlap.reduce_scatter(torch.ones(world_size * 2), op="max")
    if kind == "reduce_max":
        return overlap.all_reduce(torch.ones(4, 3), op="max")
    if kind == "broadcast0":
        return overlap.broadcast(torch.ones(4, 3), src=0)
    if kind == "broadcast1":
        return overlap.broadcast(torch.ones(4, 3), src=1)
    raise ValueError(kind)


# variant -> (what rank 0 issues, what rank 1 issues), in order
_DESYNCS = {
    "shape": (["gather4"], ["gather5"]),
    "dtype": (["gather4"], ["gather4_double"]),
    "kind": (["gather4"], ["reduce"]),
    "op": (["scatter_sum"], ["scatter_max"]),
    "order": (["gather4", "reduce"], ["reduce", "gather4"]),
    # all_reduce's op and broadcast's src are part of the fingerprint too: ranks that disagree on
    # them would otherwise reduce differently, or each send its own data and wait for none.
    "all_reduce op": (["reduce"], ["reduce_max"]),
    "broadcast src": (["broadcast0"], ["broadcast1"]),
}


def _desynced_programs(rank: int, world_size: int) -> dict:
    """Each variant in turn, in debug mode; a DesyncError issues nothing, so the group stays usable."""
    results: dict = {}
    with overlap.debug():
        for variant, programs in _DESYNCS.items():
            errors = []
            for kind in programs[rank]:
                try:
                    overlap.wait(_issue(kind, rank, world_size))
                except overlap.DesyncError as e:
                    errors.append({"seq": e.seq, "group": e.group, "fingerprints": e.fingerprints, "message": str(e)})
            results[variant] = errors
        # still in step after all of that: a matching collective goes through and is right
        results["after"] = overlap.all_reduce(torch.ones(2)).tolist()
    return results


def test_every_rank_raises_naming_seq_and_what_each_issued() -> None:
    results = run_distributed(_desynced_programs, 2, timeout=60)
    seq = 0
    for variant, programs in _DESYNCS.items():
        for position in range(len(programs[0])):
            errors = [results[rank][variant][position] for rank in range(2)]
            assert errors[0] == errors[1], f"{variant}: both ranks report the same mismatch"
            e = errors[0]
            assert e["seq"] == seq and e["group"] == "0", (variant, e)
            assert set(e["fingerprints"]) == {0, 1} and e["fingerprints"][0] != e["fingerprints"][1]
            assert f"at collective #{seq}" in e["message"], e["message"]
            assert f"rank 0: {e['fingerprints'][0]}" in e["message"] and f"rank 1: {e['fingerprints'][1]}" in e["message"]
            seq += 1
    shape, dtype, op = (results[0][v][0]["fingerprints"] for v in ("shape", "dtype", "op"))
    assert shape == {0: "#0 all_gather float32[8, 3]", 1: "#0 all_gather float32[10, 3]"}
    assert dtype[1] == "#1 all_gather float64[8, 3]"
    assert op == {0: "#3 reduce_scatter(sum) float32[2, 2] float32[2]", 1: "#3 reduce_scatter(max) float32[2, 2] float32[2]"}
    assert results[0]["after"] == results[1]["after"] == [2.0, 2.0]


class _Stack(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(4, width)
        self.b = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _sharded_models_differ(rank: int, world_size: int) -> str:
    """Rank 1 built its model 1 unit wider: the first all-gather's shapes differ."""
    torch.manual_seed(0)
    model = _Stack(width=8 + rank)
    overlap.shard(model.a)
    overlap.shard(model)
    with overlap.debug():
        model(torch.ones(2, 4)).sum().backward()
    return "no error"


def test_sharded_model_with_other_shapes_raises_on_every_rank() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_sharded_models_differ, 2, timeout=60)
    failures = info.value.failures
    assert set(failures) == {0, 1}, info.value
    for f in failures.values():
        assert f.traceback is not None and "DesyncError" in f.traceback
        assert "at collective #0" in f.traceback and "rank 0: #0 all_gather" in f.traceback
        assert "rank 1: #0 all_gather" in f.traceback


def _extra_collective(rank: int, world_size: int) -> dict:
    """Rank 0 issues one collective more than rank 1, which then leaves."""
    with overlap.debug():
        overlap.wait(overlap.all_reduce(torch.ones(2)))
        if rank == 1:
            return {}
        start = time.monotonic()
        try:
            overlap.all_reduce(torch.ones(3))
        except overlap.CollectiveError as e:
            return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"error": None}


def test_collective_no_other_rank_issues_raises_instead_of_hanging() -> None:
    pg_timeout = 3.0
    results = run_distributed(_extra_collective, 2, timeout=60, pg_timeout=pg_timeout)
    r = results[0]
    assert r["error"] in ("CollectiveError", "CollectiveTimeoutError"), r
    assert "debug check before #1 all_reduce(sum) float32[3] on group '0'" in r["message"], r["message"]
    assert r["seconds"] < pg_timeout + 30


def _debug_keeps_overlap(rank: int, world_size: int) -> bool:
    """The check runs on a side channel: it does not wait for the collectives in flight."""
    with overlap.debug():
        big = overlap.all_gather(torch.ones(1 << 16))  # ~5 s behind the link below (a wide margin for load)
        overlap.all_reduce(torch.ones(1))  # checked while `big` is in flight
        in_flight = not overlap.inflight()[0].is_done()
        overlap.wait(big)
    return in_flight


def test_debug_check_does_not_wait_for_collectives_in_flight() -> None:
    assert run_distributed(_debug_keeps_overlap, 2, timeout=60, link=(1.0, 3e6)) == [True, True]


def test_off_by_default_builds_no_side_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(desync.DEBUG_ENV, raising=False)
    assert run_distributed(_channels_built, 2, timeout=60) == [0, 0]


def _channels_built(rank: int, world_size: int) -> int:
    overlap.wait(overlap.all_reduce(torch.ones(2)))
    return len(desync._channels)


# ----------------------------------------------------------------------------- two threads, one group


def _two_threads_one_group(rank: int, world_size: int) -> dict:
    """A worker thread's all-gather is held inside its debug check (its side channel is slow to come)
    while the main thread issues on the same group: the main thread must hear about the thread rule.
    Then the worker's check goes on and its all-gather completes on both ranks."""
    import threading

    main_tried = threading.Event()
    entered = threading.Event()
    real_channel = desync._channel

    def held_channel(group: str, timeout):  # noqa: ANN001, ANN202 (signature of desync._channel)
        if threading.current_thread().name == "worker":
            entered.set()
            main_tried.wait(30)
        return real_channel(group, timeout)

    desync._channel = held_channel
    out: dict = {}

    def worker() -> None:
        out["worker"] = overlap.wait(overlap.all_gather(torch.full((2,), float(rank)))).tolist()

    try:
        with overlap.debug():
            thread = threading.Thread(target=worker, name="worker")
            thread.start()
            assert entered.wait(30), "the worker never reached its check"
            try:
                overlap.all_reduce(torch.ones(3))
            except overlap.DesyncError as e:
                out["error"] = str(e)
            finally:
                main_tried.set()
            thread.join(60)
            out["after"] = overlap.wait(overlap.all_reduce(torch.ones(1))).tolist()  # still in step
    finally:
        desync._channel = real_channel
    return out


def test_two_threads_on_one_group_are_reported_as_such() -> None:
    for rank, r in enumerate(run_distributed(_two_threads_one_group, 2, timeout=60)):
        message = r.get("error", "")
        assert "two threads issued collectives on group '0' at once" in message, (rank, r)
        assert "thread 'MainThread'" in message and "thread 'worker' (#0 all_gather float32[4])" in message, message
        assert "one thread at a time" in message
        assert r["worker"] == [0.0, 0.0, 1.0, 1.0], "the first thread's collective went through"
        assert r["after"] == [2.0]


# ----------------------------------------------------------------------------- which rank said what


def _mismatches_named_by_global_rank(rank: int, world_size: int, store_path: str) -> dict:
    """Four mismatches on 3 ranks, each caught by the debug check, each naming ranks by global rank:
    the middle rank alone out of step; on a subgroup of ranks 1 and 2 (its group ranks 0 and 1); at
    three different agreement points; and on WORLD after it was destroyed and made again with the
    ranks renumbered (new rank = old + 1 mod 3), which torch names as it named the old WORLD, so a side
    channel kept by name alone would gather in the old order and put each fingerprint under another
    rank's number. Also whether a group of one rank, checked by nobody, got a side channel."""
    from overlap.agreement import exchange_on_group

    out: dict = {}

    def caught(name: str, issue) -> None:  # noqa: ANN001 (a thunk)
        try:
            issue()
        except overlap.DesyncError as e:
            out[name] = {"fingerprints": e.fingerprints, "message": str(e)}

    with overlap.debug():
        caught("middle", lambda: overlap.all_gather(torch.ones(2 if rank == 1 else 1)))
        sub, alone = dist.new_group([1, 2]), dist.new_group([0])
        if rank == 0:
            overlap.wait(overlap.all_reduce(torch.ones(1), group=alone))
            out["one-rank channel"] = alone.group_name in desync._channels
        if rank in (1, 2):
            caught("subgroup", lambda: overlap.all_gather(torch.ones(rank, 2), group=sub))
        caught("agreements", lambda: exchange_on_group(dist.group.WORLD, f"point {rank}", 0))
        name = dist.group.WORLD.group_name
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size),
                                rank=(rank + 1) % world_size, world_size=world_size)
        out["same name"] = dist.group.WORLD.group_name == name
        new_rank = dist.get_rank()
        caught("remade", lambda: overlap.all_gather(torch.ones(new_rank + 1)))
        out["new rank"] = new_rank
    return out


@pytest.fixture(scope="module")
def mismatches_by_global_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    store = tmp_path_factory.mktemp("remade-world") / "store"
    return run_distributed(_mismatches_named_by_global_rank, 3, str(store), timeout=90)


def test_one_rank_out_of_step_between_two_that_agree_is_caught(mismatches_by_global_rank: list[dict]) -> None:
    """Only the middle of three ranks issues another shape: every rank raises (all fingerprints are
    compared, not the first with the last)."""
    for r in mismatches_by_global_rank:
        fingerprints = r["middle"]["fingerprints"]
        assert fingerprints[0] == fingerprints[2] != fingerprints[1], fingerprints
        assert fingerprints[1].endswith("all_gather float32[6]"), fingerprints


def test_a_group_of_one_rank_is_not_checked(mismatches_by_global_rank: list[dict]) -> None:
    """A collective on a group of one rank in debug mode builds no side channel: nobody to compare with."""
    assert mismatches_by_global_rank[0]["one-rank channel"] is False


def test_a_subgroup_mismatch_names_the_global_ranks(mismatches_by_global_rank: list[dict]) -> None:
    """Subgroup [1, 2]'s ranks say what they issued under their global ranks, 1 and 2 (not their
    ranks in the subgroup, 0 and 1), in the error and its ``fingerprints``."""
    assert "subgroup" not in mismatches_by_global_rank[0], "rank 0 is not in the subgroup"
    for rank in (1, 2):
        e = mismatches_by_global_rank[rank]["subgroup"]
        assert set(e["fingerprints"]) == {1, 2}, e["fingerprints"]
        assert e["fingerprints"][1].endswith("all_gather float32[2, 2]"), e["fingerprints"]
        assert e["fingerprints"][2].endswith("all_gather float32[4, 2]"), e["fingerprints"]
        assert f"rank 1: {e['fingerprints'][1]}; rank 2: {e['fingerprints'][2]}" in e["message"]


def test_ranks_at_different_agreement_points_get_no_hint_about_modules(mismatches_by_global_rank: list[dict]) -> None:
    """The "ran different sharded modules" hint is for a rank at an agreement point while another
    issues a collective; ranks that are all at agreement points, at different ones, do not get it."""
    for rank, r in enumerate(mismatches_by_global_rank):
        e = r["agreements"]
        assert set(e["fingerprints"]) == {0, 1, 2}
        assert all(f" agree(point {g}) " in text for g, text in e["fingerprints"].items()), e["fingerprints"]
        assert "different sharded modules" not in e["message"], (rank, e["message"])


def test_the_debug_check_follows_a_world_made_again_under_the_same_name(mismatches_by_global_rank: list[dict]) -> None:
    """After WORLD is destroyed and made again with the ranks renumbered, each rank's fingerprint
    shows under its new rank: the side channel is built anew for the new group."""
    assert all(r["same name"] for r in mismatches_by_global_rank), "torch reuses the name (else this tests nothing)"
    assert sorted(r["new rank"] for r in mismatches_by_global_rank) == [0, 1, 2]
    for r in mismatches_by_global_rank:
        fingerprints = r["remade"]["fingerprints"]
        assert set(fingerprints) == {0, 1, 2}
        for g, text in fingerprints.items():
            assert text.endswith(f"all_gather float32[{3 * (g + 1)}]"), fingerprints
