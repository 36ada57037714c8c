"""``overlap.plan``: the step model against schedules worked out by hand (see [Note: the step model]).

Its predictions against measured emulated-link runs are in ``benchmarks/bench_hsdp.py`` (timings
never go in assertions)."""
from __future__ import annotations

import math

import pytest

from overlap.plan import LinkCost, ModelCost, Topology, predict, table

MB = 1e6
INTRA = LinkCost(gbps=800.0, latency_us=0.0)
INTER = LinkCost(gbps=100.0, latency_us=0.0)


def _seconds(gbps: float, nbytes: float) -> float:
    return nbytes * 8 / (gbps * 1e9)


def test_one_block_runs_gather_compute_reduce_in_series() -> None:
    model = ModelCost(blocks=1, param_bytes=8 * MB, forward_seconds=1e-3)
    p = predict(model, Topology(2, 1, INTRA, INTER), "full")
    gather = reduce = _seconds(100.0, 0.5 * 8 * MB)  # 2 ranks across nodes: half the buffer each
    assert math.isclose(p.step_seconds, gather + 3e-3 + reduce, rel_tol=1e-12)
    assert math.isclose(p.exposed_seconds, gather + reduce, rel_tol=1e-12)
    assert p.hidden_share == pytest.approx(0.0, abs=1e-12)


def test_compute_bound_blocks_expose_only_the_edges() -> None:
    # 8 blocks; each block's gather (0.16 ms) and reduce fit under its compute (1 ms forward).
    model = ModelCost(blocks=8, param_bytes=4 * MB, forward_seconds=1e-3)
    p = predict(model, Topology(1, 4, INTRA, INTER), "full")
    gather = _seconds(800.0, 0.75 * 4 * MB)
    assert math.isclose(p.exposed_seconds, 2 * gather, rel_tol=1e-9)  # first gather, last reduce
    assert math.isclose(p.compute_seconds, 8 * 3e-3)


def test_comm_bound_step_is_the_link_time_plus_the_compute_at_the_edges() -> None:
    model = ModelCost(blocks=4, param_bytes=100 * MB, forward_seconds=1e-5, backward_seconds=1e-5)
    p = predict(model, Topology(2, 1, INTRA, INTER), "full")
    link = p.shard_link_seconds
    # 4 gathers and 4 reduce-scatters; re-gathered in backward: all but the last block and the one
    # before it, which stay gathered at depth 1 (the runtime's [Note: kept for backward])
    assert link == pytest.approx(4 * 2 * _seconds(100.0, 50 * MB) + 2 * _seconds(100.0, 50 * MB))
    # The link never idles once started, except while the first forward and the last backward compute.
    assert link < p.step_seconds <= link + 2e-5 + 1e-12
    # two ahead: one block fewer to re-gather, and the step one gather shorter
    deeper = predict(model, Topology(2, 1, INTRA, INTER), "full", prefetch=2)
    assert deeper.shard_link_seconds == pytest.approx(link - _seconds(100.0, 50 * MB))
    assert deeper.shard_link_seconds < deeper.step_seconds <= deeper.shard_link_seconds + 2e-5 + 1e-12


def test_hsdp_on_one_node_is_full_sharding() -> None:
    model = ModelCost(blocks=3, param_bytes=2 * MB, forward_seconds=2e-4)
    topology = Topology(1, 8, INTRA, INTER)
    assert predict(model, topology, "hsdp").step_seconds == predict(model, topology, "full").step_seconds


def test_hsdp_moves_gathers_to_the_fast_tier_and_adds_the_shard_all_reduce() -> None:
    model = ModelCost(blocks=1, param_bytes=16 * MB, forward_seconds=0.0, backward_seconds=0.0)
    p = predict(model, Topology(2, 4, INTRA, INTER), "hsdp")
    gather = _seconds(800.0, 0.75 * 16 * MB)
    all_reduce = _seconds(100.0, 2 * 0.5 * 16 * MB / 4)  # the 1/4 shard, ring all-reduce over 2 nodes
    assert math.isclose(p.step_seconds, gather + gather + all_reduce, rel_tol=1e-12)  # gather, reduce, AR
    assert math.isclose(p.replicate_link_seconds, all_reduce, rel_tol=1e-12)


def test_hsdp_all_reduces_queue_on_the_replicate_link() -> None:
    # 2 blocks, no compute, both kept gathered into backward: gathers 0 and 1 back to back (2g), then
    # RS1 (g: the same bytes) and AR1 after it; RS0 lands at 2g + 2g, before AR1 is done (an
    # all-reduce here, a, is longer than g), so AR0 waits for AR1: the step is 2g + g + 2a
    model = ModelCost(blocks=2, param_bytes=16 * MB, forward_seconds=0.0, backward_seconds=0.0)
    p = predict(model, Topology(2, 4, INTRA, INTER), "hsdp")
    gather = _seconds(800.0, 0.75 * 16 * MB)
    all_reduce = _seconds(100.0, 2 * 0.5 * 16 * MB / 4)
    assert all_reduce > gather
    assert math.isclose(p.step_seconds, 3 * gather + 2 * all_reduce, rel_tol=1e-12)
    assert math.isclose(p.replicate_link_seconds, 2 * all_reduce, rel_tol=1e-12)
    assert math.isclose(p.shard_link_seconds, 4 * gather, rel_tol=1e-12)


def test_latency_is_paid_per_ring_hop() -> None:
    slow = LinkCost(gbps=1e6, latency_us=10.0)
    model = ModelCost(blocks=1, param_bytes=0.0, forward_seconds=0.0)
    p = predict(model, Topology(1, 8, slow, slow), "full")
    assert p.step_seconds == pytest.approx(2 * 7 * 10e-6)  # gather and reduce-scatter, 7 hops each
    per_collective = LinkCost(gbps=1e6, latency_us=10.0, per_hop=False)
    p = predict(model, Topology(1, 8, per_collective, per_collective), "full")
    assert p.step_seconds == pytest.approx(2 * 10e-6)


def test_reductions_move_the_gradient_bytes_not_the_parameter_bytes() -> None:
    """A model whose gradients are reduced in a wider dtype than its parameters are gathered in
    (``grad_bytes``: bfloat16 parameters, float32 reductions) pays its reduce-scatter, and with HSDP
    its cross-replica all-reduce of the shard, for the gradient's bytes; the gather for the
    parameters'."""
    model = ModelCost(blocks=1, param_bytes=8 * MB, grad_bytes=16 * MB, forward_seconds=0.0, backward_seconds=0.0)
    full = predict(model, Topology(2, 1, INTRA, INTER), "full")
    gather, reduce = _seconds(100.0, 0.5 * 8 * MB), _seconds(100.0, 0.5 * 16 * MB)  # 2 ranks across nodes
    assert math.isclose(full.step_seconds, gather + reduce, rel_tol=1e-12)
    assert math.isclose(full.shard_link_seconds, gather + reduce, rel_tol=1e-12)
    hsdp = predict(model, Topology(2, 4, INTRA, INTER), "hsdp")
    gather, reduce = _seconds(800.0, 0.75 * 8 * MB), _seconds(800.0, 0.75 * 16 * MB)
    all_reduce = _seconds(100.0, 2 * 0.5 * 16 * MB / 4)  # the 1/4 gradient shard over 2 nodes
    assert math.isclose(hsdp.step_seconds, gather + reduce + all_reduce, rel_tol=1e-12)
    assert math.isclose(hsdp.replicate_link_seconds, all_reduce, rel_tol=1e-12)


def test_the_replica_all_reduce_pays_latency_per_hop_of_its_ring() -> None:
    """HSDP on 4 nodes of 2: the shard group's gather and reduce-scatter take 1 hop each, the
    all-reduce over the 4 replicas 2 * 3 hops (a ring all-reduce: reduce-scatter, then all-gather)."""
    slow = LinkCost(gbps=1e6, latency_us=10.0)
    model = ModelCost(blocks=1, param_bytes=0.0, forward_seconds=0.0)
    p = predict(model, Topology(4, 2, slow, slow), "hsdp")
    assert p.step_seconds == pytest.approx((1 + 1 + 6) * 10e-6)
    assert p.replicate_link_seconds == pytest.approx(6 * 10e-6)


def test_table_lists_every_size() -> None:
    text = table(ModelCost(blocks=4, param_bytes=MB, forward_seconds=1e-4), 8, INTRA, INTER, gpus=(8, 64))
    assert [line.split()[0] for line in text.splitlines()[1:]] == ["8", "64"]


@pytest.mark.parametrize("make, match", [
    (lambda: LinkCost(gbps=0.0), "LinkCost.gbps must be > 0"),
    (lambda: LinkCost(gbps=1.0, latency_us=float("nan")), "LinkCost.latency_us must be a finite number"),
    (lambda: Topology(0, 8, INTRA, INTER), "Topology.nodes must be an int >= 1"),
    (lambda: ModelCost(blocks=0, param_bytes=1.0, forward_seconds=1.0), "ModelCost.blocks must be an int >= 1"),
    (lambda: predict(ModelCost(1, 1.0, 1.0), Topology(1, 1, INTRA, INTER), "zero3"), "strategy must be one of"),
    (lambda: predict(ModelCost(1, 1.0, 1.0), Topology(1, 1, INTRA, INTER), prefetch=-1), "prefetch must be an int"),
    (lambda: table(ModelCost(1, 1.0, 1.0), 8, INTRA, INTER, gpus=(12,)), "12 GPUs is not a multiple"),
])
def test_bad_input_names_the_argument(make, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        make()
