"""Property-based tests of ``scheduler.overlap_pass`` on random graphs drawn by Hypothesis.

Graphs come from ``fx_graphs.random_graph`` with ``variety`` (elementwise ops and mm, every
``_c10d_functional`` collective the pass knows, coalesced ones included, on two process groups;
waits right after their collective or a few nodes later; unused waits; direct reads of a
collective's output after its wait; waits on waited results; in-place barriers), driven by
Hypothesis' ``st.randoms()`` so that a failing graph shrinks. The budget is drawn too (none, 0,
small, large). For every graph the pass's output must be:

* the same nodes, in a topological order (so every wait precedes every user of its result), with
  every direct reader of a collective's output after a wait on it;
* the same collectives per group, in the same order; nothing moved across a barrier; no
  collective issued later than its place among the compute; within the budget (or one collective
  alone where one exceeds it); a fixed point (running the pass again changes nothing);
* the same values: both graphs run on a 1-rank gloo group in this process and must agree bitwise.

Example counts come from the Hypothesis profile (conftest: ``OVERLAP_HYPOTHESIS_PROFILE``).
"""
from __future__ import annotations

import copy
import random
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fx_graphs import (  # noqa: E402
    barrier_prefixes,
    check_topological,
    check_waits_precede_direct_readers,
    compute_before,
    group_sequences,
    inflight_profile,
    names,
    random_graph,
    random_inputs,
)
from scheduler import overlap_pass  # noqa: E402

BUDGETS = st.sampled_from([None, 0, 64, 128, 200, 1 << 20])


@pytest.fixture(scope="module")
def groups(single_rank_group: dist.ProcessGroup) -> tuple[str, str]:
    """Names of two 1-rank gloo groups in this process: WORLD and another one."""
    return single_rank_group.group_name, dist.new_group([0]).group_name


RANDOMS = st.randoms(use_true_random=False)  # Hypothesis drives (and shrinks) the graph's choices


def _graph_and_copy(rng: random.Random, groups: tuple[str, str], barriers: bool) -> tuple[fx.GraphModule, ...]:
    """A random graph and an independent copy of it (same node names) for the pass to reorder."""
    original = random_graph(rng, groups, barriers, variety=True)
    return original, copy.deepcopy(original)


@given(rng=RANDOMS, barriers=st.booleans(), budget=BUDGETS)
def test_random_graphs_keep_the_contract(groups: tuple[str, str], rng: random.Random, barriers: bool,
                                         budget: Optional[int]) -> None:
    """Structure: permutation, topological, waits before readers, per-group order, barriers,
    collectives only rise, budget, fixed point."""
    original, gm = _graph_and_copy(rng, groups, barriers)
    assert names(gm) == names(original)
    overlap_pass(gm, max_inflight_bytes=budget)
    assert sorted(names(gm)) == sorted(names(original))
    check_topological(gm)
    check_waits_precede_direct_readers(gm)
    assert group_sequences(gm) == group_sequences(original)
    assert barrier_prefixes(gm) == barrier_prefixes(original)
    after, before = compute_before(gm), compute_before(original)
    assert all(after[c] <= before[c] for c in before), "a collective was issued later than its place"
    if budget is not None:
        for name, size, inflight in inflight_profile(gm):
            assert inflight <= max(budget, size), (name, inflight)
    order = names(gm)
    overlap_pass(gm, max_inflight_bytes=budget)
    assert names(gm) == order


@given(rng=RANDOMS, barriers=st.booleans(), budget=BUDGETS, input_seed=st.integers(0, 2**16))
def test_random_graphs_compute_the_same_values(groups: tuple[str, str], rng: random.Random, barriers: bool,
                                               budget: Optional[int], input_seed: int) -> None:
    """Values: the reordered graph, run on the 1-rank group, returns bitwise what the input graph
    returns (a shrinkable random source, so a failure shrinks to a small graph)."""
    original, moved = _graph_and_copy(rng, groups, barriers)
    overlap_pass(moved, max_inflight_bytes=budget)
    check_topological(moved)
    inputs = random_inputs(input_seed)
    expected = original(*[t.clone() for t in inputs])
    got = moved(*[t.clone() for t in inputs])
    assert len(got) == len(expected)
    for e, m in zip(expected, got):
        torch.testing.assert_close(m, e, rtol=0, atol=0, equal_nan=True)
