"""``scheduler.prefetch_depth``: the step model and the depth it chooses, on hand-worked cases
([Note: choosing the prefetch depth]). Pure arithmetic: exact where the model's sums are exact."""
from __future__ import annotations

import pytest

from scheduler.prefetch_depth import choose_prefetch_depth, modelled_step

BIG = 1 << 40  # a budget that binds nothing


def test_uniform_groups_need_one_ahead() -> None:
    # gathers shorter than a block's compute: one ahead hides them all; deeper gains nothing
    compute, gather = [1.0] * 8, [0.5] * 8
    # forward: the first gather (0.5) then 8 blocks; backward: 8 blocks of 2.0; the last
    # reduce-scatter (0.5) after the last block's backward
    assert modelled_step(compute, gather, 1) == pytest.approx(0.5 + 8 + 16 + 0.5)
    assert choose_prefetch_depth(compute, gather, [1] * 8, BIG) == 1


def test_link_bound_groups_go_as_deep_as_the_budget_allows() -> None:
    # the link is the bottleneck: a FIFO link gains nothing from deeper queues, but each unit of
    # depth keeps one more group unsharded into backward, one re-gather (2 s) less on the link.
    compute, gather = [1.0] * 8, [2.0] * 8
    times = [modelled_step(compute, gather, d) for d in range(1, 8)]
    assert [a - b for a, b in zip(times, times[1:])] == [2.0] * 6, times
    assert choose_prefetch_depth(compute, gather, [1] * 8, BIG) == 7
    assert choose_prefetch_depth(compute, gather, [1] * 8, budget=3) == 2  # 3 groups of 1 byte fit


def test_a_slow_gather_is_started_several_groups_early() -> None:
    compute, gather = [1.0] * 8, [0.5] * 5 + [4.0] + [0.5] * 2
    times = [modelled_step(compute, gather, d) for d in range(1, 8)]
    assert times[0] > times[1] > times[2] == times[3]  # depth 3 hides the 4 s gather behind 3 blocks' compute
    assert choose_prefetch_depth(compute, gather, [1] * 8, BIG) == 3


def test_the_budget_caps_the_depth() -> None:
    compute, gather = [1.0] * 8, [0.5] * 5 + [4.0] + [0.5] * 2
    assert choose_prefetch_depth(compute, gather, [10] * 8, budget=30) == 2  # 3 groups of 10 bytes fit
    assert choose_prefetch_depth(compute, gather, [10] * 8, budget=25) == 1
    assert choose_prefetch_depth(compute, gather, [10] * 8, budget=0) == 1  # one ahead is always allowed


def test_few_groups() -> None:
    assert choose_prefetch_depth([], [], [], BIG) == 1
    assert choose_prefetch_depth([1.0], [3.0], [1], BIG) == 1
    assert modelled_step([], [], 1) == 0.0


def test_bad_input_names_the_argument() -> None:
    with pytest.raises(ValueError, match="one entry per group"):
        choose_prefetch_depth([1.0], [1.0, 2.0], [1], BIG)
    with pytest.raises(ValueError, match="finite seconds"):
        choose_prefetch_depth([float("nan")], [1.0], [1], BIG)
    with pytest.raises(ValueError, match="budget must be an int >= 0"):
        choose_prefetch_depth([1.0], [1.0], [1], -1)
