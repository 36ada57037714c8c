"""Async collectives on gloo ranks, bitwise against torch.distributed's blocking collectives.

Each rank function batches many checks into one spawn (spawning ranks costs seconds); a failed
assertion names the collective, and the harness reports the rank and its traceback.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import overlap
from overlap.testing import run_distributed
from scheduler import AsyncTensor

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _data(rank: int, shape: tuple, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def _ref_all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _ref_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    y = x.clone()
    torch_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}[op]
    dist.all_reduce(y, op=torch_op)
    return y / dist.get_world_size() if op == "avg" else y


def _ref_reduce_scatter(x: torch.Tensor, op: str, dim: int = 0) -> torch.Tensor:
    world = dist.get_world_size()
    stacked = torch.cat(x.chunk(world, dim=dim), dim=0).contiguous() if dim else x.contiguous()
    out = torch.empty_like(stacked.chunk(world)[0])
    torch_op = dist.ReduceOp.SUM if op == "avg" else {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                                       "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}[op]
    dist.reduce_scatter_tensor(out, stacked, op=torch_op)
    return out / world if op == "avg" else out


def _check_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape}/{got.dtype} vs {want.shape}/{want.dtype}"
    assert torch.equal(got, want), f"{name}: values differ from torch.distributed"


def _matches_torch(rank: int, world: int) -> int:
    checks = 0
    for dtype in DTYPES:
        for shape in [(world * 3, 5), (7,), (2, 3, 4)]:
            x = _data(rank, shape, dtype)
            for dim in range(len(shape)):
                y = overlap.all_gather(x, dim=dim)
                assert type(y) is AsyncTensor
                _check_equal(f"all_gather {dtype} {shape} dim={dim}", y, _ref_all_gather(x, dim))
                checks += 1
                if shape[dim] % world == 0:
                    for op in ("sum", "max", "min") + (("avg",) if dtype.is_floating_point else ()):
                        want = _ref_reduce_scatter(x, op, dim)
                        _check_equal(f"reduce_scatter {op} {dtype} dim={dim}", overlap.reduce_scatter(x, op=op, dim=dim), want)
                        checks += 1
            for op in ("sum", "max", "min", "product") + (("avg",) if dtype.is_floating_point else ()):
                _check_equal(f"all_reduce {op} {dtype}", overlap.all_reduce(x, op=op), _ref_reduce(x, op))
                checks += 1
        x = _data(rank, (world * 2, 3), dtype)
        want = torch.empty_like(x)
        dist.all_to_all_single(want, x)
        _check_equal(f"all_to_all {dtype}", overlap.all_to_all(x), want)
        splits_in = [rank + i + 1 for i in range(world)]  # rank r sends r+i+1 rows to rank i
        splits_out = [j + rank + 1 for j in range(world)]
        x = _data(rank, (sum(splits_in), 2), dtype, salt=1)
        want = torch.empty(sum(splits_out), 2, dtype=dtype)
        dist.all_to_all_single(want, x, splits_out, splits_in)
        _check_equal(f"all_to_all uneven {dtype}", overlap.all_to_all(x, splits_out, splits_in), want)
        for src in range(world):
            x = _data(rank, (4, 2), dtype, salt=2)
            want = x.clone()
            dist.broadcast(want, src=src)
            _check_equal(f"broadcast src={src} {dtype}", overlap.broadcast(x, src=src), want)
        checks += 2 + world
    # coalesced, with mixed dtypes, an empty tensor, and uneven dim-0 sizes
    xs = [_data(rank, (3, 2), torch.float32), _data(rank, (5,), torch.int64), _data(rank, (0, 4), torch.float32),
          _data(rank, (1, 2, 2), torch.bfloat16)]
    for i, got in enumerate(overlap.all_gather_coalesced(xs)):
        _check_equal(f"all_gather_coalesced[{i}]", got, _ref_all_gather(xs[i], 0))
    xs = [_data(rank, (world * 2, 3), torch.float32), _data(rank, (world,), torch.int64), _data(rank, (world * 3,), torch.float32)]
    for op in ("sum", "max"):
        for i, got in enumerate(overlap.reduce_scatter_coalesced(xs, op=op)):
            want = _ref_reduce_scatter(xs[i], op)
            if world > 2 and op == "sum" and want.dtype.is_floating_point:
                # Packing moves each element to another segment of gloo's ring, and the order in which
                # three or more float addends are summed follows the segment: equal up to rounding.
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            else:
                _check_equal(f"reduce_scatter_coalesced {op}[{i}]", got, want)
    # Negative dims count from the end, as in torch (dim=-3 is dim 0 of a 3-dim tensor): a range check
    # off by one at the low end, or a negative dim used unnormalized, fails here.
    x = _data(rank, (world * 2, 3, world * 2), torch.float32)
    for dim in (-1, -2, -3):
        _check_equal(f"all_gather dim={dim}", overlap.all_gather(x, dim=dim), _ref_all_gather(x, dim % 3))
        if x.shape[dim] % world == 0:
            _check_equal(f"reduce_scatter dim={dim}", overlap.reduce_scatter(x, dim=dim),
                         _ref_reduce_scatter(x, "sum", dim % 3))
    # avg over coalesced tensors: gloo has no native average, so each result is divided at first use.
    xs = [_data(rank, (world * 2, 3), torch.float32), _data(rank, (world,), torch.bfloat16)]
    for i, got in enumerate(overlap.reduce_scatter_coalesced(xs, op="avg")):
        want = _ref_reduce_scatter(xs[i], "avg")
        if world > 2 and want.dtype == torch.float32:  # packed into another ring segment, as above
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            _check_equal(f"reduce_scatter_coalesced avg[{i}]", got, want)
    # non-contiguous inputs are copied, not refused
    x = _data(rank, (4, world * 2), torch.float32).t()
    _check_equal("all_gather non-contiguous", overlap.all_gather(x), _ref_all_gather(x, 0))
    _check_equal("reduce_scatter non-contiguous", overlap.reduce_scatter(x), _ref_reduce_scatter(x, "sum"))
    # The sharded runtime's reduce-scatter (an all-to-all, then a sum of the slots on gloo) adds the
    # ranks' slots in the order gloo's reduce-scatter does, so its gradients are bitwise FSDP2's at any
    # world size: shards of an even number of elements, values of mixed magnitudes so that the order
    # shows. With three or more ranks rank 0's rank-order sum differs somewhere (what the order fixes;
    # gloo's ring runs down the ranks, so the last rank's order happens to be the rank order).
    from overlap.collectives import reduce_scatter_into
    from overlap.groups import resolve_group

    for shard in (16, 1000):
        x = _data(rank, (world * shard,), torch.float32) * torch.logspace(-4, 4, world * shard)
        out = torch.empty(shard)
        reduce_scatter_into(out, x, resolve_group(None)).wait()
        want = _ref_reduce_scatter(x, "sum")
        _check_equal(f"reduce_scatter_into {shard}", out, want)
        rows = _ref_all_gather(x, 0).view(world, world, shard)[:, rank]  # every rank's slot for this shard
        if world > 2 and shard == 1000 and rank == 0:
            in_rank_order = rows[0].clone()
            for row in rows[1:]:
                in_rank_order += row
            assert not torch.equal(in_rank_order, want), "the rank-order sum is gloo's here: no order checked"
    return checks


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_torch_bitwise(world_size: int) -> None:
    checks = run_distributed(_matches_torch, world_size)
    assert all(c > 50 for c in checks)


def _inputs_are_safe_and_unmodified(rank: int, world: int) -> None:
    base = _data(rank, (world * 4, 3), torch.float32)
    for name, fn, ref in [
        ("all_gather", lambda x: overlap.all_gather(x), lambda x: _ref_all_gather(x, 0)),
        ("reduce_scatter", lambda x: overlap.reduce_scatter(x), lambda x: _ref_reduce_scatter(x, "sum")),
        ("all_reduce", lambda x: overlap.all_reduce(x), lambda x: _ref_reduce(x, "sum")),
        ("all_to_all", lambda x: overlap.all_to_all(x), None),
        ("broadcast", lambda x: overlap.broadcast(x, src=world - 1), None),
    ]:
        x = base.clone()
        y = fn(x)
        assert torch.equal(x, base), f"{name} modified its input"
        x.mul_(-3).add_(7)  # mutate right after issue: the result must not change
        if ref is not None:
            _check_equal(f"{name} after input mutation", y, ref(base))
        else:
            want = fn(base.clone())
            _check_equal(f"{name} after input mutation", y, overlap.wait(want))
    xs = [base.clone(), base[:, :2].clone()]
    ys = overlap.all_gather_coalesced(xs)
    for x in xs:
        x.zero_()
    _check_equal("all_gather_coalesced after input mutation", ys[0], _ref_all_gather(base, 0))


@pytest.mark.parametrize("world_size", [2, 3])
def test_inputs_are_snapshotted(world_size: int) -> None:
    run_distributed(_inputs_are_safe_and_unmodified, world_size)


def _consumers_see_completed_data(rank: int, world: int) -> None:
    x = _data(rank, (3, 4), torch.float32)
    full = _ref_all_gather(x, 0)
    lin = torch.nn.Linear(4, 2)
    consumers = {
        "arith": (lambda t: t * 2 + 1, lambda f: f * 2 + 1),
        "view": (lambda t: t.view(-1)[3:], lambda f: f.view(-1)[3:]),
        "transpose": (lambda t: t.transpose(0, 1) + 0, lambda f: f.transpose(0, 1) + 0),
        "chunk": (lambda t: t.chunk(world)[-1] + 0, lambda f: f.chunk(world)[-1] + 0),
        "inplace": (lambda t: t.add_(1), lambda f: f + 1),
        "item": (lambda t: torch.tensor(t[-1, -1].item()), lambda f: torch.tensor(f[-1, -1].item())),
        "tolist": (lambda t: torch.tensor(t.tolist()), lambda f: f),
        "numpy": (lambda t: torch.from_numpy(t.numpy().copy()), lambda f: f),
        "repr": (lambda t: torch.tensor(len(repr(t))), lambda f: torch.tensor(len(repr(f)))),
        "cat": (lambda t: torch.cat([t, torch.ones(1, 4)]), lambda f: torch.cat([f, torch.ones(1, 4)])),
        "copy_": (lambda t: torch.zeros(3 * world, 4).copy_(t), lambda f: f),
        "module": (lambda t: lin(t), lambda f: lin(f)),
    }
    for name, (use, ref) in consumers.items():
        got = use(overlap.all_gather(x))
        _check_equal(f"consumer {name}", got.detach(), ref(full.clone()).detach())
    # autograd through the results of differentiable collectives
    w = torch.randn(3 * world, 4, generator=torch.Generator().manual_seed(7))
    xg = x.clone().requires_grad_(True)
    (overlap.all_gather(xg) * w).sum().backward()
    _check_equal("all_gather backward", xg.grad, _ref_reduce_scatter(w, "sum"))
    big = _data(rank, (world * 2, 4), torch.float32).requires_grad_(True)
    wr = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    (overlap.reduce_scatter(big, op="avg") * wr).sum().backward()
    _check_equal("reduce_scatter avg backward", big.grad, _ref_all_gather(wr, 0) / world)
    xa = x.clone().requires_grad_(True)
    (overlap.all_reduce(xa) * (rank + 1)).sum().backward()
    _check_equal("all_reduce backward", xa.grad, torch.full_like(x, sum(range(1, world + 1))))
    xb = x.clone().requires_grad_(True)
    overlap.broadcast(xb, src=0).sum().backward()
    _check_equal("broadcast backward", xb.grad, torch.full_like(x, world) if rank == 0 else torch.zeros_like(x))
    xt = _data(rank, (world * 2, 3), torch.float32).requires_grad_(True)
    (overlap.all_to_all(xt) * (rank + 1)).sum().backward()
    want = torch.cat([torch.full((2, 3), float(j + 1)) for j in range(world)])
    _check_equal("all_to_all backward", xt.grad, want)
    # all_reduce(avg)'s adjoint averages too (a sum's adjoint would give world times the gradient).
    xv = x.clone().requires_grad_(True)
    (overlap.all_reduce(xv, op="avg") * (rank + 1)).sum().backward()
    _check_equal("all_reduce avg backward", xv.grad, torch.full_like(x, sum(range(1, world + 1)) / world))
    # Uneven all_to_all: the adjoint sends each gradient block back where its row came from, so the
    # split sizes swap roles. Rank r sends 1 + r + 2i rows to rank i: no rank's send and receive
    # sizes agree, so splits that did not swap fail here.
    splits_in = [1 + rank + 2 * i for i in range(world)]
    splits_out = [1 + j + 2 * rank for j in range(world)]
    xu = _data(rank, (sum(splits_in), 3), torch.float32, salt=3).requires_grad_(True)
    gu = _data(rank, (sum(splits_out), 3), torch.float32, salt=4)
    (overlap.all_to_all(xu, splits_out, splits_in) * gu).sum().backward()
    want = torch.empty(sum(splits_in), 3)
    dist.all_to_all_single(want, gu, splits_in, splits_out)
    _check_equal("all_to_all uneven backward", xu.grad, want)
    # max/min/product reductions have no adjoint here: backward raises instead of returning a sum's
    # gradient (every rank raises before issuing anything, so none hangs).
    for name, call in (("reduce_scatter", lambda t: overlap.reduce_scatter(t, op="max")),
                       ("all_reduce", lambda t: overlap.all_reduce(t, op="min"))):
        xm = _data(rank, (world * 2, 3), torch.float32).requires_grad_(True)
        try:
            call(xm).sum().backward()
        except RuntimeError as e:
            assert f"overlap.{name} is not differentiable" in str(e), str(e)
        else:
            raise AssertionError(f"{name} backward through a max/min reduction did not raise")


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_consumer_sees_completed_data(world_size: int) -> None:
    run_distributed(_consumers_see_completed_data, world_size)


def _groups_and_bad_input(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    x = _data(rank, (world * 2, 3), torch.float32)
    want = _ref_all_gather(x, 0)
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    for group in (None, dist.group.WORLD, mesh1, (mesh2, 0), (mesh2, "dp")):
        _check_equal(f"group {group!r}", overlap.all_gather(x, group=group), want)
    _check_equal("size-1 group", overlap.all_gather(x, group=(mesh2, "tp")), x)
    # broadcast's src is a rank within the group: rank 1's "tp" group holds only global rank 1, whose
    # group rank is 0 (src taken as a global rank would name rank 0, outside that group).
    _check_equal("broadcast in a size-1 group", overlap.broadcast(x, src=0, group=(mesh2, "tp")), x)
    # op names are case-insensitive ('MAX' is 'max').
    _check_equal("all_reduce op='MAX'", overlap.all_reduce(x, op="MAX"), _ref_reduce(x, "max"))

    def raises(exc, match, fn):
        try:
            fn()
        except exc as e:
            assert match in str(e), f"message {str(e)!r} lacks {match!r}"
        else:
            raise AssertionError(f"expected {exc.__name__} matching {match!r}")

    raises(TypeError, "x must be a torch.Tensor", lambda: overlap.all_gather([1, 2]))
    raises(IndexError, "dim=2 is out of range", lambda: overlap.all_gather(x, dim=2))
    raises(ValueError, f"x.shape[0]=5 is not divisible by the group size {world}",
           lambda: overlap.reduce_scatter(torch.ones(5, 2) if world != 5 else torch.ones(6, 2)))
    raises(ValueError, "'sum', 'avg', 'max', 'min', 'product'", lambda: overlap.all_reduce(x, op="mean"))
    raises(ValueError, "needs a floating-point", lambda: overlap.all_reduce(torch.ones(2, dtype=torch.int64), op="avg"))
    raises(ValueError, "needs a dim", lambda: overlap.all_gather(x, group=mesh2))
    raises(ValueError, "no dim named 'pp'", lambda: overlap.all_gather(x, group=(mesh2, "pp")))
    raises(TypeError, "group must be a ProcessGroup", lambda: overlap.all_gather(x, group="world"))
    raises(ValueError, "src must be a rank in the group", lambda: overlap.broadcast(x, src=world))
    raises(ValueError, "one entry per rank", lambda: overlap.all_to_all(x, [1], [1]))
    raises(ValueError, "must all be on one device", lambda: overlap.all_gather_coalesced([x, x.to("meta")]))
    raises(RuntimeError, "not differentiable", lambda: overlap.all_gather_coalesced([x.clone().requires_grad_(True)]))
    assert not overlap.inflight(), "a rejected call left a collective in flight"


@pytest.mark.parametrize("world_size", [2])
def test_group_arguments_and_bad_input(world_size: int) -> None:
    run_distributed(_groups_and_bad_input, world_size)


def test_no_process_group_says_how_to_initialize() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        overlap.all_gather(torch.ones(2))


def _unwaited_results_keep_buffers(rank: int, world: int) -> None:
    for _ in range(5):
        overlap.all_gather(torch.ones(1000))  # dropped without use, still on the (slow) link
    assert len(overlap.inflight()) == 5, "a dropped result's collective must stay tracked until it is done"
    assert overlap.inflight_bytes() == 5 * 1000 * 4 * world
    overlap.wait_all()
    assert not overlap.inflight()
    y = overlap.all_gather(torch.ones(4))
    assert len(overlap.inflight()) == 1
    y + 1  # the first use waits and releases
    assert not overlap.inflight()


def test_unwaited_results_are_tracked_until_done() -> None:
    run_distributed(_unwaited_results_keep_buffers, 2, link=(1.0, 50_000.0))


def test_stream_purpose_per_collective_kind() -> None:
    # One table decides each kind's CUDA stream, for the collectives and the profiler alike
    # (overlap.streams, [Note: one stream per purpose]).
    from overlap.streams import STREAM_PURPOSES, stream_purpose

    assert stream_purpose("all_gather") == stream_purpose("all_gather_coalesced") == "all_gather"
    assert stream_purpose("reduce_scatter") == stream_purpose("reduce_scatter_coalesced") == "reduce_scatter"
    assert stream_purpose("all_reduce") == "all_reduce"  # HSDP's cross-replica all-reduces among them
    for kind in ("all_to_all", "broadcast"):
        assert stream_purpose(kind) == "other"
    assert {stream_purpose(k) for k in ("all_gather", "reduce_scatter", "all_reduce", "broadcast")} <= set(STREAM_PURPOSES)


def _traced_matches_eager(rank: int, world: int) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, w):
        g = overlap.all_gather(x, dim=1)
        r = overlap.reduce_scatter(x, op="avg")
        a = overlap.all_reduce(x, op="max")
        z = w @ w
        return g.sum(0) + z.sum(), r * 2, a + overlap.broadcast(x, src=1).sum() + overlap.all_to_all(x)

    x = _data(rank, (world * 2, 4), torch.float32)
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    eager = [overlap.wait(t) for t in step(x, w)]
    gm = make_fx(step)(x, w)
    code = gm.code
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast", "all_to_all_single", "wait_tensor"):
        assert f"_c10d_functional.{op}" in code, f"make_fx graph lacks {op}:\n{code}"
    for got, want in zip(gm(x, w), eager):
        _check_equal("make_fx", got, want)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    for got, want in zip(compiled(x, w), eager):
        # Inductor fuses and reorders the float reductions (sum) of the step: equal up to rounding.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_make_fx_and_compile_match_eager() -> None:
    run_distributed(_traced_matches_eager, 2, timeout=300)
