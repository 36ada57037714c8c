"""Property-based tests of the one step model behind both schedule choosers
(``scheduler.replayed_step``, [Note: replaying a step on a FIFO link]), on costs drawn by Hypothesis.

Properties, against references that do not replay anything:

* without gathers issued ahead the link is empty at each step's end, so the steady state of
  ``gather_ahead.modelled_steady_step(..., count=0)`` is ``prefetch_depth.modelled_step`` (the cold
  first step) for any lag: the two choosers' baselines are the same number;
* with no link time a step is its compute, forward plus backward at twice that (three times the
  sum), whatever the depth or the gathers ahead;
* with no compute the link never idles, so a step is the link's work: every gather, the re-gathers
  of all but the ``1 + depth`` groups kept for backward (and those left sharded in backward,
  ``backward_gathers``), and every reduce-scatter (at its own ``reduce`` seconds where they are
  given);
* ``reduce`` left out is ``reduce=gather``, and a longer reduce-scatter never ends a step earlier
  (the replay is made of sums and maxima only); all-reduces of no seconds on the replicate link
  change nothing, and longer ones never end a step earlier;
* extra steps do not change earlier ones, and steps end in order.

Float sums in a different order differ in the last bits, hence the relative 1e-9.
Example counts come from the Hypothesis profile (conftest: ``OVERLAP_HYPOTHESIS_PROFILE``).
"""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from scheduler.gather_ahead import LAGS, modelled_steady_step  # noqa: E402
from scheduler.prefetch_depth import modelled_step  # noqa: E402
from scheduler.replayed_step import step_ends  # noqa: E402

REL = 1e-9
SECONDS = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)


@st.composite
def costs(draw: st.DrawFn, min_groups: int = 0) -> tuple[list[float], list[float]]:
    n = draw(st.integers(min_groups, 9))
    return draw(st.lists(SECONDS, min_size=n, max_size=n)), draw(st.lists(SECONDS, min_size=n, max_size=n))


@given(costs(), st.integers(0, 10), st.sampled_from(LAGS))
def test_steady_state_without_gathers_ahead_is_the_first_step(cg: tuple, depth: int, lag: int) -> None:
    compute, gather = cg
    assert modelled_steady_step(compute, gather, depth, 0, lag) == pytest.approx(
        modelled_step(compute, gather, depth), rel=REL, abs=1e-12)


@given(costs(), st.integers(0, 10), st.data())
def test_without_link_time_a_step_is_its_compute(cg: tuple, depth: int, data: st.DataObject) -> None:
    compute = cg[0]
    gather = [0.0] * len(compute)
    count = data.draw(st.integers(0, len(compute)))
    lag = data.draw(st.sampled_from(LAGS))
    assert modelled_step(compute, gather, depth) == pytest.approx(3 * sum(compute), rel=REL)
    assert modelled_steady_step(compute, gather, depth, count, lag) == pytest.approx(3 * sum(compute), rel=REL)


@given(costs(), st.integers(0, 10))
def test_without_compute_the_link_never_idles(cg: tuple, depth: int) -> None:
    gather = cg[1]
    compute = [0.0] * len(gather)
    kept = max(0, len(gather) - 1 - depth)  # groups 0 .. kept-1 are re-gathered in backward
    link_work = sum(gather) + sum(gather[:kept]) + sum(gather)
    assert modelled_step(compute, gather, depth) == pytest.approx(link_work, rel=REL)


@given(costs(), st.integers(0, 10), st.data())
def test_a_group_left_sharded_in_backward_is_not_gathered_again(cg: tuple, depth: int, data: st.DataObject) -> None:
    gather = cg[1]
    compute = [0.0] * len(gather)
    regathers = data.draw(st.lists(st.booleans(), min_size=len(gather), max_size=len(gather)))
    kept = max(0, len(gather) - 1 - depth)
    link_work = sum(gather) + sum(g for g, again in zip(gather[:kept], regathers) if again) + sum(gather)
    assert modelled_step(compute, gather, depth, backward_gathers=regathers) == pytest.approx(link_work, rel=REL)
    assert modelled_step(compute, gather, depth, backward_gathers=[True] * len(gather)) == modelled_step(
        compute, gather, depth)


@given(costs(), st.integers(0, 10), st.data())
def test_without_compute_the_link_carries_each_reduce_scatter_at_its_own_cost(cg: tuple, depth: int,
                                                                              data: st.DataObject) -> None:
    gather = cg[1]
    reduce = data.draw(st.lists(SECONDS, min_size=len(gather), max_size=len(gather)))
    compute = [0.0] * len(gather)
    kept = max(0, len(gather) - 1 - depth)
    link_work = sum(gather) + sum(gather[:kept]) + sum(reduce)
    assert modelled_step(compute, gather, depth, reduce=reduce) == pytest.approx(link_work, rel=REL)


@given(costs(min_groups=1), st.integers(0, 10), st.integers(1, 4), st.data())
def test_a_longer_reduce_scatter_never_ends_a_step_earlier(cg: tuple, depth: int, steps: int,
                                                          data: st.DataObject) -> None:
    compute, gather = cg
    n = len(compute)
    count = data.draw(st.integers(0, n))
    lag = data.draw(st.sampled_from(LAGS))
    backward = data.draw(st.lists(SECONDS, min_size=n, max_size=n))
    reduce = data.draw(st.lists(SECONDS, min_size=n, max_size=n))
    longer = [r + extra for r, extra in zip(reduce, data.draw(st.lists(SECONDS, min_size=n, max_size=n)))]
    assert step_ends(compute, gather, depth, steps, count, lag, backward) == step_ends(
        compute, gather, depth, steps, count, lag, backward, reduce=list(gather))
    base = step_ends(compute, gather, depth, steps, count, lag, backward, reduce=reduce)
    slower = step_ends(compute, gather, depth, steps, count, lag, backward, reduce=longer)
    assert all(s >= b * (1 - REL) - 1e-12 for s, b in zip(slower, base))
    assert step_ends(compute, gather, depth, steps, count, lag, backward, reduce=reduce, replicate=[0.0] * n) == base
    replicas = step_ends(compute, gather, depth, steps, count, lag, backward, reduce=reduce, replicate=longer)
    assert all(s >= b * (1 - REL) - 1e-12 for s, b in zip(replicas, base))


@given(costs(min_groups=1), st.integers(0, 10), st.integers(1, 5), st.data())
def test_later_steps_do_not_change_earlier_ones(cg: tuple, depth: int, steps: int, data: st.DataObject) -> None:
    compute, gather = cg
    count = data.draw(st.integers(0, len(compute)))
    lag = data.draw(st.sampled_from(LAGS))
    ends = step_ends(compute, gather, depth, steps + 1, count, lag)
    assert ends[:steps] == step_ends(compute, gather, depth, steps, count, lag)
    assert ends == sorted(ends)


def test_no_groups_and_bad_input() -> None:
    assert step_ends([], [], 1, steps=3) == []
    assert modelled_step([], [], 1) == 0.0 == modelled_steady_step([], [], 1, 0)
    with pytest.raises(ValueError, match="ahead must be an int in 0..2"):
        step_ends([1.0, 1.0], [1.0, 1.0], 1, ahead=3)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        step_ends([1.0], [1.0], 1, steps=0)
    with pytest.raises(ValueError, match="reduce must have one entry per group"):
        step_ends([1.0, 1.0], [1.0, 1.0], 1, reduce=[1.0])
    with pytest.raises(ValueError, match="replicate must have one entry per group"):
        step_ends([1.0, 1.0], [1.0, 1.0], 1, replicate=[1.0])
    with pytest.raises(ValueError, match="backward_gathers must have one entry per group"):
        step_ends([1.0, 1.0], [1.0, 1.0], 1, backward_gathers=[False])
