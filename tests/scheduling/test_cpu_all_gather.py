"""scheduler.cpu_all_gather: CPU all-gathers compiled under the hook go through
``all_gather_into_tensor_out`` ([Note: gloo's coalesced all-gather with two in flight]) on a copy of
the input taken at issue ([Note: the out variant's input is snapshotted]).

Hand-written graphs check the rewrite (structure; CPU values only; a symbolic size read from the
input). On 2 gloo ranks, an input overwritten right after issue, while gloo's worker threads are
busy so that the gather reads its input late: torch's out variant sends the overwritten rows (the
race this file's snapshot closes, shown so that the test is known to exercise it), the snapshot the
original ones. A program compiled by Inductor with the hook on 2 gloo ranks, with three all-gathers in
flight at once, static and dynamic shapes, checks the generated code and that the values are bit
for bit the program compiled without the hook (and within 1e-5 of eager: Inductor's fused kernels
round differently from ATen's); the ``slow`` test runs it for enough steps that the functional path
(``allgather_into_tensor_coalesced``) crashed more often than not on torch 2.13.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from scheduler.cpu_all_gather import ALL_GATHER_OUT, SNAPSHOT_ALL_GATHER_OUT, use_out_variant_on_cpu
from scheduler.torch_versions import funcol_all_gather

C10D = torch.ops._c10d_functional
AG, WAIT = C10D.all_gather_into_tensor.default, C10D.wait_tensor.default


def _gather_graph(device: str) -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8, device=device)
    ag = g.call_function(AG, (x, 2, "0"))
    ag.meta["val"] = torch.empty(8, 8, device=device)
    wait = g.call_function(WAIT, (ag,))
    wait.meta["val"] = torch.empty(8, 8, device=device)
    g.output(wait)
    return g


def test_cpu_gathers_become_the_out_variant_in_place() -> None:
    g = _gather_graph("cpu")
    assert use_out_variant_on_cpu(g) == 1
    calls = [n for n in g.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [torch.ops.aten.empty.memory_format, SNAPSHOT_ALL_GATHER_OUT, WAIT]
    empty, gather, wait = calls
    assert gather.args == (g.find_nodes(op="placeholder")[0], 2, "0", empty) and gather.kwargs == {}
    assert empty.args == ([8, 8],) and empty.kwargs["dtype"] == torch.float32
    assert empty.kwargs["device"] == torch.device("cpu")
    assert wait.args == (empty,) and empty.meta["val"].shape == (8, 8)
    g.lint()


def test_gathers_off_the_cpu_are_left_alone() -> None:
    g = _gather_graph("meta")  # what a CUDA graph's values are to this rewrite: not CPU
    before = [(n.op, n.target, n.args) for n in g.nodes]
    assert use_out_variant_on_cpu(g) == 0
    assert [(n.op, n.target, n.args) for n in g.nodes] == before


def test_symbolic_sizes_come_from_the_input() -> None:
    """A graph compiled with dynamic shapes: the output buffer's symbolic rows are the input's
    ``sym_size`` times the group size."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    g = _gather_graph("cpu")
    x = next(n for n in g.nodes if n.op == "placeholder")
    ag = next(n for n in g.nodes if n.target is AG)
    rows = mode.shape_env.create_unbacked_symint()
    with mode:
        x.meta["val"] = torch.empty(rows, 8)
        ag.meta["val"] = torch.empty(rows * 2, 8)
    assert use_out_variant_on_cpu(g) == 1
    calls = [n for n in g.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [torch.ops.aten.sym_size.int, operator.mul,
                                         torch.ops.aten.empty.memory_format, SNAPSHOT_ALL_GATHER_OUT, WAIT]
    size, times, empty = calls[:3]
    assert size.args == (x, 0) and times.args == (size, 2) and empty.args == ([times, 8],)
    g.lint()


def _three_in_flight(rank: int, world: int, steps: int, dynamic: bool = False) -> dict[str, object]:
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    import scheduler

    group = dist.group.WORLD
    xs = [torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(3)]
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(7))

    def program(xs: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        gathered = [funcol_all_gather(x, 0, group) for x in xs]  # the hook issues all three first
        return sum((g @ w).sin() for g in gathered)

    torch._dynamo.reset()
    plain = torch.compile(program, backend="inductor", fullgraph=True, dynamic=dynamic)  # waited at once
    want = plain(xs, w)
    torch._dynamo.reset()
    with scheduler.inductor_overlap(collective_matmul_chunks=None):  # three gathers, not split
        compiled = torch.compile(program, backend="inductor", fullgraph=True, dynamic=dynamic)
        got, codes = run_and_get_code(compiled, xs, w)
    same = torch.equal(got, want)
    for _ in range(steps):
        same = same and torch.equal(compiled(xs, w), want)
    if dynamic:  # other row counts through the same dynamic graph
        for rows in (5, 11):
            short = [x[:rows] for x in xs]
            same = same and torch.equal(compiled(short, w), plain(short, w))
    code = "\n".join(set(codes))
    return {"same": same, "close to eager": torch.allclose(got, program(xs, w), rtol=1e-5, atol=1e-5),
            "out": code.count("snapshot_all_gather_into_tensor_out.default("),
            "functional": code.count("all_gather_into_tensor.default(")}


def _check(results: list[dict[str, object]]) -> None:
    for rank, r in enumerate(results):
        assert r["same"], f"rank {rank}: values differ from the same program compiled without the hook"
        assert r["close to eager"], f"rank {rank}: compiled values not within 1e-5 of eager"
        assert (r["out"], r["functional"]) == (3, 0), f"rank {rank}: {r}"


def _input_changed_after_issue(rank: int, world: int) -> dict[str, bool]:
    """Per op: whether the gathered result holds every rank's input as it was at issue, when the caller
    overwrites its input right after issue (what Inductor's buffer reuse did on torch 2.15) and rank 1
    is late, so that rank 0's earlier all-reduces hold gloo's worker threads (2 by default) and its
    gather waits in gloo's queue, input unread, until rank 1 comes."""
    import time

    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    results = {}
    for label, op in (("torch out variant", ALL_GATHER_OUT), ("snapshot", SNAPSHOT_ALL_GATHER_OUT)):
        if rank == 1:
            time.sleep(0.5)
        blockers = [dist.all_reduce(torch.ones(4), async_op=True) for _ in range(8)]
        x = torch.full((3, 5), float(rank + 1))
        out = torch.empty(3 * world, 5)
        if op is ALL_GATHER_OUT:
            op(x, world, name, out=out)
        else:
            op(x, world, name, out)
        x.fill_(-1.0)
        for b in blockers:
            b.wait()
        C10D.wait_tensor.default(out)
        results[label] = torch.equal(out, torch.arange(1.0, world + 1).repeat_interleave(3)[:, None].expand(-1, 5))
    return results


def _two_ranks_checks(rank: int, world: int, steps: int) -> dict[str, dict[str, object]]:
    """On one set of ranks (a start-up each, Inductor's included, costs more than the checks): the
    overwritten input (:func:`_input_changed_after_issue`, first, on fresh ranks as alone), then the
    program with three gathers in flight compiled static and dynamic (:func:`_three_in_flight`)."""
    return {"input changed": _input_changed_after_issue(rank, world),
            "static": _three_in_flight(rank, world, steps, False),
            "dynamic": _three_in_flight(rank, world, steps, True)}


@pytest.fixture(scope="module")
def two_ranks_checks() -> list[dict[str, dict[str, object]]]:
    from overlap.testing import run_distributed

    return run_distributed(_two_ranks_checks, 2, 20, timeout=280)


def test_input_overwritten_right_after_issue_does_not_change_the_gather(two_ranks_checks) -> None:
    """Contract 2 (a collective's input may be changed right after issue) for the gather the hook
    emits; torch's out variant alone breaks it when gloo reads late, which this setup forces."""
    for rank, r in enumerate(r["input changed"] for r in two_ranks_checks):
        assert not r["torch out variant"], (
            f"rank {rank}: race not exercised: torch's out variant read its input before the overwrite")
        assert r["snapshot"], f"rank {rank}: the snapshot gather returned the overwritten input"


@pytest.mark.parametrize("shapes", ["static", "dynamic"])
def test_compiled_cpu_gathers_use_the_out_variant(two_ranks_checks, shapes: str) -> None:
    _check([r[shapes] for r in two_ranks_checks])


@pytest.mark.slow
def test_many_steps_with_gathers_in_flight_do_not_crash(distributed) -> None:
    """The crash this rewrite avoids: 4000 steps with three gathers in flight each (with the rewrite
    turned off it failed 3 runs of 3; in the one whose output was read, a rank aborted with
    "malloc(): unaligned tcache chunk detected")."""
    _check(distributed(_three_in_flight, 2, 4000, timeout=600))
