"""``scheduler.prefetch_depth``: the step model and the depth it chooses, on hand-worked cases
([Note: choosing the prefetch depth]). Pure arithmetic: exact where the model's sums are exact."""
from __future__ import annotations

import pytest

from scheduler.gather_ahead import modelled_steady_step
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
    # the root (position 0, held the whole step) and a window of 1 + d groups of 1 byte: d = 2 needs 4
    assert choose_prefetch_depth(compute, gather, [1] * 8, budget=4) == 2
    assert choose_prefetch_depth(compute, gather, [1] * 8, budget=3) == 1


def test_a_slow_gather_is_started_several_groups_early() -> None:
    compute, gather = [1.0] * 8, [0.5] * 5 + [4.0] + [0.5] * 2
    times = [modelled_step(compute, gather, d) for d in range(1, 8)]
    assert times[0] > times[1] > times[2] == times[3]  # depth 3 hides the 4 s gather behind 3 blocks' compute
    assert choose_prefetch_depth(compute, gather, [1] * 8, BIG) == 3


def test_the_budget_caps_the_depth() -> None:
    compute, gather = [1.0] * 8, [0.5] * 5 + [4.0] + [0.5] * 2
    # the root's 10 bytes and a window of 1 + d groups of 10 bytes: depth 2 holds 40
    assert choose_prefetch_depth(compute, gather, [10] * 8, budget=40) == 2
    assert choose_prefetch_depth(compute, gather, [10] * 8, budget=39) == 1
    assert choose_prefetch_depth(compute, gather, [10] * 8, budget=30) == 1  # before the root counted: 2
    assert choose_prefetch_depth(compute, gather, [10] * 8, budget=0) == 1  # one ahead is always allowed


def test_the_budget_counts_a_large_root() -> None:
    # a 100-byte root and 7 groups of 10 bytes: depth 3 holds 100 + 4 x 10 = 140 at once, depth 4
    # 150; without the root, 50 bytes would have allowed depth 4
    compute, gather = [1.0] * 8, [2.0] * 8  # link-bound: the budget alone caps the depth
    nbytes = [100] + [10] * 7
    assert choose_prefetch_depth(compute, gather, nbytes, budget=149) == 3
    assert choose_prefetch_depth(compute, gather, nbytes, budget=150) == 4
    assert choose_prefetch_depth(compute, gather, nbytes, budget=50) == 1


def test_measured_backward_replaces_twice_forward() -> None:
    # 4 groups, compute 1, gather 1.5 (forward link-bound at depth 1). Twice forward: backward of 2
    # per group hides every re-gather and reduce-scatter, so depth 1 is all it takes. Measured
    # backward of 4 per group: the same, only slower; a step by hand at depth 1 with backward 4:
    # forward: gathers land 1.5, 3, 4.5, 6; compute ends 2.5, 4, 5.5, 7 (waits on each gather);
    # groups 2 and 3 kept. Backward: 3 runs 7..11 (re-gather of 1 issued at 7, lands 8.5 after
    # nothing: link free at 6), RS3 11..12.5; 2 runs 11..15, re-gather 0 issued at 11 lands 14
    # (queued behind RS3 until 12.5); RS2 15..16.5; 1 runs 15..19, RS1 19..20.5; 0 runs 19..23,
    # RS0 23..24.5: the step ends at 24.5.
    compute, gather = [1.0] * 4, [1.5] * 4
    assert modelled_step(compute, gather, 1, backward=[4.0] * 4) == pytest.approx(24.5)
    assert modelled_step(compute, gather, 1) == modelled_step(compute, gather, 1, backward=[2.0] * 4)


def test_a_reduce_scatter_of_twice_the_bytes_holds_the_link_twice_as_long() -> None:
    # [Note: a reduce-scatter's seconds]: the step by hand above (depth 1, backward 4), with each
    # reduce-scatter taking 3 (a float32 reduction of bfloat16 parameters) instead of 1.5. Forward is
    # unchanged (compute ends at 7, link free at 6). Backward: 3 runs 7..11, RS3 11..14; 2 runs
    # 11..15, its re-gather of 1 (issued at 11) queued behind RS3: 14..15.5; RS2 15.5..18.5; 1 runs
    # 15.5..19.5 (waits for its re-gather), the re-gather of 0 (issued at 15) 18.5..20; RS1 20..23;
    # 0 runs 20..24 (waits for its re-gather), RS0 24..27: the step ends at 27.
    compute, gather, backward = [1.0] * 4, [1.5] * 4, [4.0] * 4
    assert modelled_step(compute, gather, 1, backward, reduce=[3.0] * 4) == pytest.approx(27.0)
    assert modelled_step(compute, gather, 1, backward, reduce=[1.5] * 4) == modelled_step(compute, gather, 1, backward)
    with pytest.raises(ValueError, match="reduce must have one entry per group"):
        choose_prefetch_depth(compute, gather, [1] * 4, BIG, reduce=[1.0])
    with pytest.raises(ValueError, match="finite seconds"):
        choose_prefetch_depth(compute, gather, [1] * 4, BIG, reduce=[1.0, 1.0, 1.0, -1.0])


def test_the_host_work_between_the_groups_is_on_the_step() -> None:
    # [Note: the host work between the groups]: the step by hand above, with the loss run between
    # forward's end (7) and backward, and the tail after the last reduce-scatter landed (24.5): the
    # link is free at 7 and after 24.5, so every later point moves by the loss, the end by both
    compute, gather, backward = [1.0] * 4, [1.5] * 4, [4.0] * 4
    assert modelled_step(compute, gather, 1, backward, loss=0.5, tail=0.25) == pytest.approx(24.5 + 0.75)
    # the steady state: compute only, so a step is forward, loss, backward and tail
    assert modelled_steady_step([1.0] * 4, [0.0] * 4, 1, 0, backward=backward, loss=0.5, tail=0.25) == pytest.approx(
        4 + 0.5 + 16 + 0.25)
    # a link-bound end of step: the tail runs before the next forward's first gathers are issued
    assert (modelled_steady_step(compute, gather, 1, 0, backward=backward, tail=0.25)
            == pytest.approx(modelled_steady_step(compute, gather, 1, 0, backward=backward) + 0.25))
    with pytest.raises(ValueError, match="tail must be finite seconds >= 0"):
        modelled_step(compute, gather, 1, tail=-1.0)
    with pytest.raises(ValueError, match="loss must be finite seconds >= 0"):
        choose_prefetch_depth(compute, gather, [1] * 4, BIG, loss=float("nan"))


def test_a_slow_backward_makes_the_link_the_smaller_share() -> None:
    # a link-bound forward: twice forward makes every re-gather cost, so the model goes deep; a
    # measured backward long enough to hide the re-gathers makes depth 1 as good (within 1%)
    compute, gather = [1.0] * 8, [2.0] * 8
    assert choose_prefetch_depth(compute, gather, [1] * 8, 1 << 40) == 7
    assert choose_prefetch_depth(compute, gather, [1] * 8, 1 << 40, backward=[40.0] * 8) == 1


def test_few_groups() -> None:
    assert choose_prefetch_depth([], [], [], BIG) == 1
    assert choose_prefetch_depth([1.0], [3.0], [1], BIG) == 1
    assert modelled_step([], [], 1) == 0.0


def test_bad_input_names_the_argument() -> None:
    with pytest.raises(ValueError, match="one entry per group"):
        choose_prefetch_depth([1.0], [1.0, 2.0], [1], BIG)
    with pytest.raises(ValueError, match="finite seconds"):
        choose_prefetch_depth([float("nan")], [1.0], [1], BIG)
    with pytest.raises(ValueError, match="backward must have one entry per group"):
        choose_prefetch_depth([1.0], [1.0], [1], BIG, backward=[1.0, 2.0])
    with pytest.raises(ValueError, match="finite seconds"):
        choose_prefetch_depth([1.0], [1.0], [1], BIG, backward=[-1.0])
    with pytest.raises(ValueError, match="budget must be an int >= 0"):
        choose_prefetch_depth([1.0], [1.0], [1], -1)
