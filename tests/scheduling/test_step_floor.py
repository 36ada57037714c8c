"""``scheduler.step_floor``: the floor of an exact step ([Note: the end-of-step chain's floor]).

The floor is only worth printing if no schedule goes below it, so the property test replays every
plan the choosers can pick (depth, gathers ahead and their issue point, with loss and tail) on
costs drawn by Hypothesis (reduce-scatters as long as their gathers, or of their own drawn
seconds) and requires ``K - 1`` replayed steps to take at least ``(K - 1) *
compute + (K - 2) * exposed`` (the windows of steps ``1 .. K - 2`` lie whole between the first and
the last step's end). Float sums in another order differ in the last bits,
hence the relative 1e-9. The hand-worked cases pin which chain binds and what counts beside it.
"""
from __future__ import annotations

import pytest

from scheduler.gather_ahead import LAGS
from scheduler.replayed_step import step_ends
from scheduler.step_floor import step_floor

REL = 1e-9


def test_the_chain_of_the_first_groups_binds_where_the_first_block_is_big() -> None:
    # positions: a small root, an embedding, two blocks; backward 2x forward (the default)
    compute, gather = [1.0, 1.0, 10.0, 10.0], [0.5, 4.0, 12.0, 12.0]
    floor = step_floor(compute, gather, loss=1.0, tail=3.0)
    assert floor.compute == 3 * 22.0 + 1.0 + 3.0
    assert floor.link == 2 * 28.5
    # p = 2: the link carries 2 * (0.5 + 4 + 12) = 33 beside backward 2 + 2, forward 1 + 1, tail 3
    assert (floor.chain, floor.chain_link, floor.chain_host) == (3, 33.0, 9.0)
    assert floor.exposed == 24.0
    assert floor.seconds == 70.0 + 24.0
    assert floor.ratio() == pytest.approx(94.0 / 70.0)


def test_reduce_scatters_of_their_own_cost_lengthen_the_link_and_the_chain() -> None:
    # the case above with each reduce-scatter twice its gather (float32 reductions, bfloat16 gathers)
    compute, gather = [1.0, 1.0, 10.0, 10.0], [0.5, 4.0, 12.0, 12.0]
    floor = step_floor(compute, gather, loss=1.0, tail=3.0, reduce=[2 * g for g in gather])
    assert floor.link == 28.5 + 57.0
    # p = 3 now binds: 85.5 of link beside backward 2 + 2 + 20, forward 1 + 1 + 10, tail 3
    assert (floor.chain, floor.chain_link, floor.chain_host) == (4, 85.5, 39.0)
    assert floor.seconds == 70.0 + 46.5
    assert step_floor(compute, gather, loss=1.0, tail=3.0, reduce=list(gather)) == step_floor(
        compute, gather, loss=1.0, tail=3.0)


def test_steps_of_later_groups_count_beside_the_chain_and_a_compute_bound_step_has_no_floor_above_compute() -> None:
    compute, gather = [1.0, 1.0, 10.0, 10.0], [0.5, 4.0, 12.0, 12.0]
    deferred = step_floor(compute, gather, loss=1.0, tail=3.0, step=[0.0, 0.0, 5.0, 6.0])
    assert deferred.chain_host == 9.0 + 6.0  # only the step after the chain's last position may move in
    assert deferred.exposed == 33.0 - 15.0
    quiet_link = step_floor(compute, [0.01, 0.01, 0.1, 0.1], tail=1.0)
    assert (quiet_link.exposed, quiet_link.chain) == (0.0, 0)
    assert quiet_link.seconds == quiet_link.compute == 67.0
    bare_root = step_floor(compute, [0.01, 0.01, 0.1, 0.1])  # nothing beside the root's own chain
    assert (bare_root.exposed, bare_root.chain) == (0.02, 1)


def test_a_link_bound_step_is_floored_by_the_link_and_its_chain() -> None:
    floor = step_floor([0.1, 0.1], [10.0, 10.0], backward=[0.1, 0.1])
    assert (floor.link, floor.compute) == (40.0, 0.4)
    # the whole step is the chain: 40 of link beside the first position's backward and forward
    assert (floor.chain, floor.chain_host) == (2, 0.2)
    assert floor.seconds == pytest.approx(0.4 + 39.8) and floor.seconds >= floor.link
    # a long backward fills the second position's window, not the first's: 20 of link beside nothing
    long_backward = step_floor([0.1, 0.1], [10.0, 10.0], backward=[30.0, 30.0])
    assert (long_backward.chain, long_backward.exposed) == (1, 20.0)
    assert long_backward.seconds == pytest.approx(60.2 + 20.0)


def test_no_groups_and_bad_input() -> None:
    empty = step_floor([], [])
    assert (empty.seconds, empty.exposed, empty.chain, empty.ratio()) == (0.0, 0.0, 0, 1.0)
    with pytest.raises(ValueError, match="gather must have one entry per forward position"):
        step_floor([1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="step must have one entry per forward position"):
        step_floor([1.0], [1.0], step=[1.0, 1.0])
    with pytest.raises(ValueError, match="reduce must have one entry per forward position"):
        step_floor([1.0], [1.0], reduce=[1.0, 1.0])
    with pytest.raises(ValueError, match="finite seconds >= 0"):
        step_floor([1.0], [float("nan")])
    with pytest.raises(ValueError, match="finite seconds >= 0"):
        step_floor([1.0], [1.0], tail=-1.0)


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SECONDS = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)


@given(st.data(), st.integers(1, 8), st.integers(0, 8), st.sampled_from(LAGS), st.integers(3, 6))
def test_no_replayed_plan_goes_below_the_floor(data: st.DataObject, n: int, depth: int, lag: int, steps: int) -> None:
    compute = data.draw(st.lists(SECONDS, min_size=n, max_size=n))
    gather = data.draw(st.lists(SECONDS, min_size=n, max_size=n))
    backward = data.draw(st.lists(SECONDS, min_size=n, max_size=n))
    reduce = data.draw(st.one_of(st.none(), st.lists(SECONDS, min_size=n, max_size=n)))
    loss, tail = data.draw(SECONDS), data.draw(SECONDS)
    count = data.draw(st.integers(0, n))
    ends = step_ends(compute, gather, depth, steps, count, lag, backward, loss, tail, reduce)
    floor = step_floor(compute, gather, backward, loss, tail, reduce=reduce)
    span = ends[-1] - ends[0]
    bound = (steps - 1) * floor.compute + (steps - 2) * floor.exposed
    assert span >= bound * (1 - REL) - 1e-9
