"""``overlap.tensor_parallel`` against torch's ``parallelize_module`` with the same plan and against
the unsharded module: forward output, input gradient and every parameter gradient.

Blocks and plans: ``tp_blocks.py`` (sequence-parallel MLP, attention with and without sequence
parallelism, Megatron MLP). Each case builds the unsharded block, a copy parallelized by torch and a
copy parallelized by ``overlap.tensor_parallel``, runs the same global input and output gradient
through all three (the sharded ones on their local slices) and compares full tensors.

Tolerances (max abs difference <= atol + rtol * max abs of the reference):

* ``chunks=1`` against torch TP: bitwise. It is torch's order: one collective, one matmul on the
  whole operand, the same two-rank sums. So is ``chunks=None`` where the rows allow no two chunks
  of ``MIN_ROWS`` (the chosen count is then 1; every count above 1 is covered by 2, 3 and 8).
* ``chunks > 1`` against torch TP, fp32: 1e-5 / 1e-5. Each chunk is its own GEMM (row blocks of
  one GEMM are not guaranteed to be summed in the same order when split), and the rowwise weight
  and bias gradients are summed chunk by chunk. bf16: 2e-2 / 2e-2 (bf16 has 8 significant bits,
  eps 3.9e-3: a few roundings of values of order 1).
* against the unsharded block: fp32 1e-5 / 1e-5 (the rowwise matmul's inner sum is split over
  ranks and summed by the collective); bf16: 5e-2 / 5e-2 (bf16 rounding of the split sums, and of
  each partial sum where the unsharded block rounds once).
* 3 ranks (``slow``): gloo's three-way sums may associate differently from the reduce-scatter's
  rank-order sum, so ``chunks=1`` against torch is held to the fp32 tolerance there too.

Uneven sequence lengths: torch's ``SequenceParallel`` / ``Shard(1)`` input reads a *plain* local
tensor as an even shard (``DTensor.from_local`` infers the global length as ``w`` times the local
one), so uneven lengths only work in torch when the input is a DTensor carrying the global shape
(``distribute_tensor(x, mesh, [Shard(1)])``: torch.chunk's rule, ``ceil(S / w)`` per rank, the
last fewer or none). The uneven cases pass such a DTensor to both.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

import overlap
from overlap.tensor_parallelism.chunks import MIN_ROWS, TRIAL_ROUNDS
from overlap.tensor_parallelism.layers import TensorParallelLinear
from scheduler.torch_versions import DIST_ALL_GATHER, TORCH_VERSION
from tp_blocks import SP_BLOCKS, make_block, plan_for, sizes_for

BATCH = 2
FP32_TOL = (1e-5, 1e-5)  # (atol, rtol)
BF16_TOL = (2e-2, 2e-2)
BF16_REF_TOL = (5e-2, 5e-2)


@dataclass(frozen=True)
class Case:
    """One comparison: block, bias, chunk count, sequence length, dtype, and whether the sharded
    input is a DTensor (needed for uneven lengths) or a plain local tensor."""

    block: str
    chunks: Optional[int] = 2
    bias: bool = True
    seq: int = 8
    dtype: torch.dtype = torch.float32
    dtensor_input: bool = False

    @property
    def name(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        kind = "dtensor" if self.dtensor_input else "local"
        return f"{self.block}-chunks{self.chunks}-bias{int(self.bias)}-seq{self.seq}-{dtype}-{kind}"


def _close(what: str, got: torch.Tensor, want: torch.Tensor, tol: Optional[tuple[float, float]]) -> list[str]:
    """Problems (empty: none): shapes differ, or values beyond ``tol`` (None: must be bitwise equal)."""
    if got.shape != want.shape:
        return [f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"]
    if tol is None:
        if not torch.equal(got, want):
            return [f"{what}: not bitwise equal (max abs diff {(got.float() - want.float()).abs().max().item():.3g})"]
        return []
    atol, rtol = tol
    diff = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    bound = atol + rtol * (want.float().abs().max().item() if want.numel() else 0.0)
    return [f"{what}: max abs diff {diff:.3g} > {bound:.3g}"] if diff > bound else []


def _seq_slice(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's slice of dim 1 under DTensor's ``Shard`` rule (torch.chunk's sizes: ``ceil(S / w)``
    each, the last ranks fewer or none; unlike ``torch.chunk`` an empty slice for those)."""
    per = -(-t.shape[1] // world)
    start = min(rank * per, t.shape[1])
    return t.narrow(1, start, max(0, min(per, t.shape[1] - start)))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _run(model: torch.nn.Module, case: Case, x: torch.Tensor, dy: torch.Tensor, mesh: Any, rank: int,
         world: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward of ``model`` on this rank's part of ``x`` with output gradient ``dy``;
    returns (this rank's output, the full input gradient, full parameter gradients)."""
    if case.block in SP_BLOCKS and mesh is not None:
        if case.dtensor_input:
            xin = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
        else:
            xin = _seq_slice(x, world, rank).clone().requires_grad_()
        dy = _seq_slice(dy, world, rank)
    else:
        xin = x.clone().requires_grad_()
    y = model(xin)
    y = y.to_local() if isinstance(y, DTensor) else y
    (y * dy).sum().backward()
    grad_x = _full(xin.grad)  # a plain local input: this rank's slice
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    return y, grad_x, grads


def torch_tp_runs(case: Case, world: int) -> bool:
    """Whether torch's own TP runs ``case``: on torch 2.11 an uneven sequence sharded as a DTensor
    input fails inside torch (``F.linear``: "view size is not compatible with input tensor's size
    and stride"), so there the comparison with torch TP is left out (the unsharded one stays)."""
    return TORCH_VERSION >= (2, 13) or not (case.dtensor_input and case.seq % world)


def _check_case(case: Case, mesh: Any, rank: int, world: int, bitwise_chunks1: bool,
                compared: Optional[list[str]] = None) -> list[str]:
    """Problems of ``case`` vs the unsharded block and torch TP; ``compared`` gets the case's name
    once it has been compared with torch TP."""
    sizes = sizes_for(world)
    ref = make_block(case.block, case.bias, **sizes).to(case.dtype)
    ours = overlap.tensor_parallel(copy.deepcopy(ref), mesh, plan_for(case.block), chunks=case.chunks)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, case.seq, sizes["dim"], generator=gen).to(case.dtype)
    dy = torch.randn(BATCH, case.seq, sizes["dim"], generator=gen).to(case.dtype)

    y_ref, gx_ref, g_ref = _run(ref, case, x, dy, None, rank, world)
    y_ours, gx_ours, g_ours = _run(ours, case, x, dy, mesh, rank, world)
    if torch_tp_runs(case, world):
        theirs = parallelize_module(copy.deepcopy(ref), mesh, plan_for(case.block))
        y_torch, gx_torch, g_torch = _run(theirs, case, x, dy, mesh, rank, world)
    sp = case.block in SP_BLOCKS
    if sp:  # this rank's slice of the unsharded results
        y_ref = _seq_slice(y_ref, world, rank)
        if not case.dtensor_input:
            gx_ref = _seq_slice(gx_ref, world, rank)
    low = case.dtype != torch.float32
    # chunks=None on fewer than 2 MIN_ROWS rows per rank is 1 without measuring: torch's order too
    one = case.chunks == 1 or (case.chunks is None and -(-case.seq // world) < 2 * MIN_ROWS)
    vs_torch = (None if one and bitwise_chunks1 else (BF16_TOL if low else FP32_TOL))
    vs_ref = BF16_REF_TOL if low else FP32_TOL
    problems = []
    problems += _replicas_differ(ours)
    for what, got, unsharded in [("output", y_ours, y_ref), ("input grad", gx_ours, gx_ref),
                                 *[(f"{n}.grad", g_ours[n], g_ref[n]) for n in g_ref]]:
        problems += _close(f"{what} vs unsharded", got, unsharded, vs_ref)
    if torch_tp_runs(case, world):
        for what, got, torch_ in [("output", y_ours, y_torch), ("input grad", gx_ours, gx_torch),
                                  *[(f"{n}.grad", g_ours[n], g_torch[n]) for n in g_ref]]:
            problems += _close(f"{what} vs torch TP", got, torch_, vs_torch)
        if compared is not None:
            compared.append(case.name)
    return problems


def _replicas_differ(model: torch.nn.Module) -> list[str]:
    """Replicated parameters whose gradient is not bitwise the same on every rank (their replicas
    would drift apart step by step)."""
    problems = []
    for n, p in model.named_parameters():
        if isinstance(p.grad, DTensor) and all(pl.is_replicate() for pl in p.grad.placements):
            local = p.grad.to_local()
            copies = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(copies, local)
            if not all(torch.equal(c, copies[0]) for c in copies):
                problems.append(f"{n}.grad: replicated, but differs between ranks")
    return problems


def _numerics_rank(rank: int, world: int, cases: list[Case], bitwise_chunks1: bool,
                   compared: Optional[list[str]] = None) -> dict[str, list[str]]:
    mesh = init_device_mesh("cpu", (world,))
    return {case.name: _check_case(case, mesh, rank, world, bitwise_chunks1, compared) for case in cases}


def _assert_no_problems(results: list[dict[str, list[str]]]) -> None:
    for rank, problems in enumerate(results):
        assert {k: v for k, v in problems.items() if v} == {}, f"rank {rank}"


DEFAULT_CASES = [
    # sequence-parallel MLP: all-gather -> matmul, matmul -> reduce-scatter
    Case("sp_mlp", chunks=1), Case("sp_mlp", chunks=2), Case("sp_mlp", chunks=3, bias=False),
    Case("sp_mlp", chunks=None),
    Case("sp_mlp", chunks=1, seq=7, dtensor_input=True), Case("sp_mlp", chunks=3, seq=7, dtensor_input=True),
    Case("sp_mlp", chunks=8, seq=33, dtensor_input=True),  # MAX_CHUNKS, uneven (17 and 16 rows)
    # Megatron MLP and attention: replicated input (grad all-reduce), matmul -> all-reduce
    Case("mlp", chunks=1), Case("mlp", chunks=2, bias=False), Case("mlp", chunks=3),
    Case("attention", chunks=1), Case("attention", chunks=2),
    Case("sp_attention", chunks=1), Case("sp_attention", chunks=2, seq=7, dtensor_input=True),
    Case("prepared_attn", chunks=1), Case("prepared_attn", chunks=2),
    # bf16
    Case("sp_mlp", chunks=1, dtype=torch.bfloat16), Case("sp_mlp", chunks=2, dtype=torch.bfloat16),
    Case("mlp", chunks=2, dtype=torch.bfloat16),
]


def _two_rank_suite(rank: int, world: int, path: str) -> dict[str, Any]:
    """Everything the default suite checks on 2 ranks, in one run (the ranks' start-up, importing
    overlap and torch's DTensor, costs more than the checks)."""
    compared: list[str] = []
    return {"numerics": _numerics_rank(rank, world, DEFAULT_CASES, True, compared),
            "vs_torch": compared,
            "ecosystem": _ecosystem_rank(rank, world, path),
            "collectives": {chunks: _collectives_rank(rank, world, chunks) for chunks in (1, 3)},
            "order": _event_order_rank(rank, world),
            "siblings": _siblings_rank(rank, world),
            "prepared": _prepared_input_rank(rank, world),
            "chosen": _chosen_rank(rank, world),
            "trial isolation": _trial_isolation_rank(rank, world),
            "bf16 sums": _bf16_chunk_sums_rank(rank, world)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Per rank, :func:`_two_rank_suite`'s results."""
    from overlap.testing import run_distributed

    return run_distributed(_two_rank_suite, 2, str(tmp_path_factory.mktemp("tp") / "ckpt"), timeout=240)


def test_numerics_two_ranks(two_ranks: list[dict[str, Any]]) -> None:
    """Every block, layout and chunk count on 2 ranks: torch TP (bitwise with chunks=1; where torch
    TP runs, :func:`torch_tp_runs`) and the unsharded block."""
    _assert_no_problems([r["numerics"] for r in two_ranks])


@pytest.mark.skipif(TORCH_VERSION < (2, 13), reason=f"torch {torch.__version__}'s own TP fails on an uneven sequence "
                                                    "sharded as a DTensor input (F.linear: view size not compatible)")
def test_uneven_dtensor_inputs_are_compared_with_torch_tp(two_ranks: list[dict[str, Any]]) -> None:
    uneven = {case.name for case in DEFAULT_CASES if case.dtensor_input and case.seq % 2}
    assert uneven and all(uneven <= set(r["vs_torch"]) for r in two_ranks)


SLOW_CASES = [Case(block, chunks, bias, seq, dtype, seq % 3 != 0 and block in SP_BLOCKS)
              for block in ("sp_mlp", "attention", "sp_attention", "mlp", "prepared_attn")
              for chunks in (1, 2, 3) for bias in (True, False) for seq in (9, 7, 4)
              for dtype in (torch.float32,)]
SLOW_CASES += [Case(block, chunks, True, 9, torch.bfloat16) for block in ("sp_mlp", "mlp") for chunks in (1, 3)]


@pytest.mark.slow
def test_numerics_three_ranks(distributed: Callable[..., list[Any]]) -> None:
    """The full matrix on 3 ranks, uneven lengths included (``seq=4``: the last rank holds no rows)."""
    _assert_no_problems(distributed(_numerics_rank, 3, SLOW_CASES, False, timeout=600))


# ------------------------------------------------------------------ DTensor ecosystem: specs, clip, DCP
def _ecosystem_rank(rank: int, world: int, path: str) -> list[str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    mesh = init_device_mesh("cpu", (world,))
    problems = []
    ref = make_block("sp_mlp", True)
    theirs = parallelize_module(copy.deepcopy(ref), mesh, plan_for("sp_mlp"))
    ours = overlap.tensor_parallel(copy.deepcopy(ref), mesh, plan_for("sp_mlp"), chunks=2)
    sd_t, sd_o = get_model_state_dict(theirs), get_model_state_dict(ours)
    if list(sd_t) != list(sd_o):
        problems.append(f"state-dict keys {list(sd_o)} != torch's {list(sd_t)}")
    for k in sd_t:
        t, o = sd_t[k], sd_o[k]
        if not isinstance(o, DTensor) or o.placements != t.placements or o.shape != t.shape:
            problems.append(f"{k}: {type(o).__name__} {getattr(o, 'placements', None)} {tuple(o.shape)}, torch: "
                            f"{t.placements} {tuple(t.shape)}")
        elif not torch.equal(o.to_local(), t.to_local()):
            problems.append(f"{k}: local shard differs from torch's")
    gen = torch.Generator().manual_seed(3)
    x = _seq_slice(torch.randn(BATCH, 8, 16, generator=gen), world, rank)
    norms = []
    for model in (theirs, ours):
        model(x).square().sum().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0))
    norm_t, norm_o = (n.full_tensor() if isinstance(n, DTensor) else n for n in norms)
    problems += _close("clip_grad_norm_ total norm vs torch TP", norm_o, norm_t, FP32_TOL)
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if type(p.grad) is not type(q.grad) or p.grad.placements != q.grad.placements:
            problems.append(f"{n}.grad placements {p.grad.placements} != torch's {q.grad.placements}")
        problems += _close(f"{n}.grad after clipping", _full(p.grad), _full(q.grad), FP32_TOL)
    dcp.save(get_model_state_dict(ours), checkpoint_id=path)
    fresh = parallelize_module(make_block("sp_mlp", True, seed=1), mesh, plan_for("sp_mlp"))
    loaded = get_model_state_dict(fresh)
    dcp.load(loaded, checkpoint_id=path)
    for k, v in loaded.items():
        problems += _close(f"DCP round trip {k}", v.full_tensor(), sd_o[k].full_tensor(), None)
    return problems


def test_dtensor_ecosystem(two_ranks: list[dict[str, Any]]) -> None:
    """Parameters are torch TP's DTensors (keys, placements, local shards bitwise); gradients carry
    torch's placements and ``clip_grad_norm_`` gives torch's total norm; a DCP checkpoint of ours
    loads into a torch-TP model."""
    for rank, results in enumerate(two_ranks):
        assert results["ecosystem"] == [], f"rank {rank}"


# ------------------------------------------------------------------ the decomposition itself
def _collective_counts(link: Any) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) the link carried; gloo's reduce-scatter is an all-to-all (see
    [Note: gloo's reduce-scatter cannot say it is done])."""
    by_op = link.stats().by_op
    return (sum(v for k, v in by_op.items() if k.startswith("all_gather")),
            sum(v for k, v in by_op.items() if k.startswith("all_to_all")))


def _collectives_rank(rank: int, world: int, chunks: int) -> dict[str, tuple[int, int]]:
    from overlap.testing import emulated_link

    mesh = init_device_mesh("cpu", (world,))
    model = overlap.tensor_parallel(make_block("sp_mlp", True), mesh, plan_for("sp_mlp"), chunks=chunks)
    x = torch.randn(BATCH, 8, 16).requires_grad_()
    with emulated_link(1e6, 0.0) as link:
        y = model(x)
        forward = _collective_counts(link)
        link.reset_stats()
        y.sum().backward()
        backward = _collective_counts(link)
    return {"forward": forward, "backward": backward}


@pytest.mark.parametrize("chunks", [1, 3])
def test_collectives_are_chunked(two_ranks: list[dict[str, Any]], chunks: int) -> None:
    """The sequence-parallel MLP issues ``chunks`` collectives per decomposed collective: forward, w1's
    all-gather and w2's reduce-scatter (on gloo an all-to-all, see [Note: gloo's reduce-scatter
    cannot say it is done]); backward, w2's grad all-gather and w1's grad reduce-scatter."""
    counts = two_ranks[0]["collectives"][chunks]
    assert counts["forward"] == (chunks, chunks), counts
    assert counts["backward"] == (chunks, chunks), counts


def _event_order_rank(rank: int, world: int) -> dict[str, list[str]]:
    """The sequence-parallel MLP's forward and backward with chunks=2, as this rank's sequence of
    events: ``issue all_gather`` / ``issue reduce_scatter`` (a chunk's collective issued), ``wait
    all_gather`` / ``wait reduce_scatter`` (a chunk waited for) and ``mm`` (a matmul ran)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from overlap.inflight_work import InflightWork

    import overlap.tensor_parallelism.collective_matmul as cm

    events: list[str] = []
    kinds: dict[int, str] = {}
    matmuls = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}

    class LogMatmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func.overloadpacket in matmuls:
                events.append("mm")
            return func(*args, **(kwargs or {}))

    def logged(issue: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            work = issue(*args, **kwargs)
            events.append(f"issue {kind}")
            kinds[id(work)] = kind
            return work
        return wrapper

    plain_wait = InflightWork.wait

    def logged_wait(work: InflightWork, *args: Any, **kwargs: Any) -> None:
        if id(work) in kinds:
            events.append(f"wait {kinds[id(work)]}")
        plain_wait(work, *args, **kwargs)

    mesh = init_device_mesh("cpu", (world,))
    model = overlap.tensor_parallel(make_block("sp_mlp", True), mesh, plan_for("sp_mlp"), chunks=2)
    x = torch.randn(BATCH, 8, 16).requires_grad_()
    plain = cm.all_gather_into, cm.reduce_scatter_into
    cm.all_gather_into, cm.reduce_scatter_into = logged(plain[0], "all_gather"), logged(plain[1], "reduce_scatter")
    InflightWork.wait = logged_wait
    try:
        with LogMatmuls():
            y = model(x)
            forward, events[:] = list(events), []
            (y.to_local() if isinstance(y, DTensor) else y).sum().backward()
    finally:
        cm.all_gather_into, cm.reduce_scatter_into = plain
        InflightWork.wait = plain_wait
    return {"forward": forward, "backward": list(events)}


def _compute_before_waits(events: list[str], backward: bool) -> list[str]:
    """Problems with the order of ``events`` (see :func:`_event_order_rank`), empty if none:
    after a gather's chunks are issued, this rank's own rows are multiplied before the first chunk
    is waited for; a reduce-scatter chunk is issued before the next chunk's matmul; in backward,
    the weight gradient's matmul runs between the last reduce-scatter issue and its wait."""
    problems = []
    for i, event in enumerate(events):
        nxt = events[i + 1] if i + 1 < len(events) else "end"
        if event == "issue all_gather" and nxt != "issue all_gather" and nxt != "mm":
            problems.append(f"event {i}: the gather's first wait (or {nxt!r}) before any matmul: {events}")
        if event == "issue reduce_scatter":
            after = [e for e in events[i + 1:] if e in ("issue reduce_scatter", "wait reduce_scatter", "mm")]
            last = "issue reduce_scatter" not in after[:after.index("wait reduce_scatter")]
            if (backward or not last) and after[:1] != ["mm"]:
                problems.append(f"event {i}: nothing computed after this reduce-scatter chunk's issue: {events}")
    return problems


def test_own_rows_and_weight_gradients_are_computed_while_chunks_are_on_the_link(
        two_ranks: list[dict[str, Any]]) -> None:
    """[Note: decomposing a collective matmul], as an order of events (no timing): the sequence-
    parallel MLP with chunks=2 issues its chunks and computes before it waits, forward (w1's gather,
    w2's reduce-scatter) and backward (w2's grad gather: the own rows first; w1's input-grad
    reduce-scatter: the weight gradient before the wait)."""
    for rank, results in enumerate(two_ranks):
        order = results["order"]
        for phase in ("forward", "backward"):
            assert order[phase].count("issue all_gather") == 2, (rank, phase, order[phase])
            assert order[phase].count("issue reduce_scatter") == 2, (rank, phase, order[phase])
            assert _compute_before_waits(order[phase], phase == "backward") == [], (rank, phase)


def _siblings_rank(rank: int, world: int) -> dict[str, Any]:
    """q, k and v of the sequence-parallel attention (chunks=2) read one sequence-sharded input:
    collectives of forward and backward, and the input gradient against the unsharded projections,
    in several uses of the siblings (each: ``(forward gathers, backward reduce-scatters, problems)``)."""
    from torch.utils.checkpoint import checkpoint

    from overlap.testing import emulated_link

    mesh = init_device_mesh("cpu", (world,))
    ref = make_block("sp_attention", True)
    ours = overlap.tensor_parallel(copy.deepcopy(ref), mesh, plan_for("sp_attention"), chunks=2)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(BATCH, 8, 16, generator=gen)
    dys = [torch.randn(BATCH, 8, 16, generator=gen) for _ in range(3)]
    out: dict[str, Any] = {}
    unused: list[torch.Tensor] = []

    def projections(model: torch.nn.Module, inp: torch.Tensor, used: str, sharded: bool,
                    called: str = "") -> torch.Tensor:
        """sum(proj(norm(inp)) * dy) over the used projections; a sharded projection's output is this
        rank's output features (its heads) of every position, so it meets those columns of dy. The
        projections in ``called`` run too, their outputs left out of the loss but kept alive (in
        ``unused``, until the next call) as a caller's would be."""
        h = model.norm(inp)
        loss = torch.zeros(())
        unused.clear()
        for p, dy in zip("qkv", dys):
            if p in used or p in called:
                y = getattr(model, f"w{p}")(h)
                if p in used:
                    loss = loss + (y * (dy.chunk(world, -1)[rank] if sharded else dy)).sum()
                else:
                    unused.append(y)
        return loss

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def grad(loss: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(loss, [inp], retain_graph=True)[0]

    def run(name: str, used: str, times: int, called: str = "") -> None:
        """Input grad of the used projections, ``times`` backwards over one graph."""
        xr = x.clone().requires_grad_()
        want = _seq_slice(grad(projections(ref, xr, used, False), xr), world, rank) * times
        xl = _seq_slice(x, world, rank).clone().requires_grad_()
        with emulated_link(1e6, 0.0) as link:
            loss = projections(ours, xl, used, True, called)
            gathers = _collective_counts(link)[0]
            link.reset_stats()
            got = sum(grad(loss, xl) for _ in range(times))
            scatters = _collective_counts(link)[1]
        out[name] = (gathers, scatters, _close(f"{name}: input grad", got, want, FP32_TOL))

    run("q, k, v", "qkv", 1)
    run("q, k (v not called)", "qk", 1)
    run("q, k (v called, its output unused)", "qk", 1, called="v")
    run("q alone", "q", 1)
    run("q, k, v, two backwards over the retained graph", "qkv", 2)

    # the whole block under activation checkpointing (torch's, non-reentrant): the recomputed forward
    # shares its gather too, the original nodes' backward their reduce-scatter; bitwise the plain block
    grads, counts = [], []
    for checkpointed in (False, True):
        model = overlap.tensor_parallel(copy.deepcopy(ref), mesh, plan_for("sp_attention"), chunks=2)
        xl = _seq_slice(x, world, rank).clone().requires_grad_()
        with emulated_link(1e6, 0.0) as link:
            y = checkpoint(model, xl, use_reentrant=False) if checkpointed else model(xl)
            link.reset_stats()
            (y * _seq_slice(dys[0], world, rank)).sum().backward()
            counts.append(_collective_counts(link))
        grads.append([xl.grad, *(local(p.grad) for p in model.parameters())])
    out["checkpointed block, backward"] = (counts, [n for n, (a, b) in enumerate(zip(*grads)) if not torch.equal(a, b)])

    # an in-place change of the input between k and v: v gathers (and reduce-scatters) on its own
    with emulated_link(1e6, 0.0) as link:
        h = ours.norm(_seq_slice(x, world, rank))
        ours.wq(h), ours.wk(h)
        with torch.no_grad():
            h.to_local().mul_(2)  # v must not reuse the gather of the old values
        ours.wv(h)
        out["changed before v"] = _collective_counts(link)[0]
    return out


def test_sibling_layers_share_one_gather_and_one_reduce_scatter(two_ranks: list[dict[str, Any]]) -> None:
    """[Note: sibling layers share one gather] and [Note: sibling layers share one reduce-scatter]:
    q, k and v of the sequence-parallel attention (chunks=2) gather their common input once (2 chunk
    collectives, where torch's plan gathers three times) and reduce-scatter its summed gradient
    once (2, not 6); with v not called, or called but its output left out of the loss (its
    backward never runs, so q and k must not leave their sum to it), q and k share one; a second
    backward over the retained graph reduce-scatters again; the input gradient matches the unsharded
    projections in each case.
    Under activation checkpointing the recomputed forward shares too and gradients are bitwise the
    plain block's. An input changed in place is gathered again. Whole-block numerics: ``test_numerics_two_ranks``."""
    for rank, results in enumerate(two_ranks):
        counts = results["siblings"]
        assert counts.pop("changed before v") == 4, rank
        # plain: wo's 2 gathers, 2 shared reduce-scatters; checkpointed: the recomputed forward's 2 + 2 on top
        assert counts.pop("checkpointed block, backward") == ([(2, 2), (4, 4)], []), rank
        assert counts == {"q, k, v": (2, 2, []), "q, k (v not called)": (2, 2, []),
                          "q, k (v called, its output unused)": (2, 2, []), "q alone": (2, 2, []),
                          "q, k, v, two backwards over the retained graph": (2, 4, [])}, rank


class _PreparedWithSkip(torch.nn.Module):
    """Two column-parallel projections of a prepared (gathered) input and a plain op on that input,
    the op before the projections (``op_first``) or between them: ``wq(x) * sum(x * x) + wk(x)``."""

    def __init__(self, dim: int, op_first: bool) -> None:
        super().__init__()
        self.op_first = op_first
        self.wq, self.wk = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def op() -> torch.Tensor:
            s = (x * x).sum(-1, keepdim=True)
            # replicated, but each rank's use of it (its output columns) gives a partial gradient
            return s.to_local(grad_placements=[Partial()]) if isinstance(s, DTensor) else s

        s = op() if self.op_first else None
        q = self.wq(x)
        s = op() if s is None else s
        return q * s + self.wk(x)


def _prepared_input_rank(rank: int, world: int) -> dict[str, Any]:
    """torchtitan's plan (``PrepareModuleInput(Shard(1) -> Replicate())`` before column-parallel
    q/k/v), chunks=2: each collective the link carries, by op, forward and backward, ours and
    torch's; then a prepared input also read by a plain op (before or between two projections):
    forward gathers, and the input and parameter gradients against torch TP and the unsharded module."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput

    from overlap.testing import emulated_link

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(BATCH, 8, 16, generator=gen)
    dy = torch.randn(BATCH, 8, 16, generator=gen)
    out: dict[str, Any] = {}
    ref = make_block("prepared_attn", True)
    for name, model in (("torch", parallelize_module(copy.deepcopy(ref), mesh, plan_for("prepared_attn"))),
                        ("ours", overlap.tensor_parallel(copy.deepcopy(ref), mesh, plan_for("prepared_attn"),
                                                         chunks=2))):
        with emulated_link(1e6, 0.0, functional=True) as link:
            y = model(_seq_slice(x, world, rank))
            forward = dict(link.stats().by_op)
            link.reset_stats()
            (y * _seq_slice(dy, world, rank)).sum().backward()
            out[name] = (forward, dict(link.stats().by_op))

    prepare_input = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    prepare_both = PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                            output_layouts=Shard(-1), desired_output_layouts=Shard(-1))
    for op_first, prepare in ((False, prepare_input), (True, prepare_input), (False, prepare_both)):
        plan = {"": prepare, "wq": ColwiseParallel(), "wk": ColwiseParallel()}
        torch.manual_seed(0)
        unsharded = _PreparedWithSkip(16, op_first)
        results = []
        for model in (unsharded, parallelize_module(copy.deepcopy(unsharded), mesh, dict(plan)),
                      overlap.tensor_parallel(copy.deepcopy(unsharded), mesh, dict(plan), chunks=2)):
            sharded = model is not unsharded
            xin = (_seq_slice(x, world, rank) if sharded else x).clone().requires_grad_()
            with emulated_link(1e6, 0.0, functional=True) as link:
                y = model(xin)
                gathers = sum(v for k, v in link.stats().by_op.items() if "all_gather" in k)
            (y * (dy.chunk(world, -1)[rank] if sharded else dy)).sum().backward()
            grads = [_seq_slice(xin.grad, world, rank) if not sharded else xin.grad,
                     *(_full(p.grad) for p in model.parameters())]
            results.append((gathers, grads))
        problems = [p for k, (got, want_torch, want) in enumerate(zip(results[2][1], results[1][1], results[0][1]))
                    for p in _close(f"grad {k} vs torch TP", got, want_torch, FP32_TOL)
                    + _close(f"grad {k} vs unsharded", got, want, FP32_TOL)]
        style = "" if prepare is prepare_input else f", {type(prepare).__name__}"
        out[f"plain op {'before' if op_first else 'between'}{style}"] = (results[2][0], results[1][0], problems)

    # inputs torch prepares that are not deferred: a local output asked for, the features sharded
    for name, prepare, sharded_dim in (
            ("local output", PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                                use_local_output=True), 1),
            ("features sharded", PrepareModuleInput(input_layouts=Shard(2), desired_input_layouts=Replicate()), 2)):
        torch.manual_seed(0)
        unsharded = _RecordsItsInput(16)
        runs = []
        for model in (parallelize_module(copy.deepcopy(unsharded), mesh, {"": prepare, "wq": ColwiseParallel()}),
                      overlap.tensor_parallel(copy.deepcopy(unsharded), mesh, {"": prepare, "wq": ColwiseParallel()},
                                              chunks=2)):
            xin = x.chunk(world, sharded_dim)[rank].clone().requires_grad_()
            y = model(xin)
            (y * dy.chunk(world, -1)[rank]).sum().backward()
            runs.append((model.seen, [y, xin.grad, *(_full(p.grad) for p in model.parameters())]))
        (theirs_seen, theirs), (ours_seen, ours) = runs
        out[name] = (ours_seen, theirs_seen, [p for k, (got, want) in enumerate(zip(ours, theirs))
                                              for p in _close(f"{name}: value {k} vs torch TP", got, want, FP32_TOL)])
    return out


class _RecordsItsInput(torch.nn.Module):
    """One projection ``wq``; records the type of each input its forward is given."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq = torch.nn.Linear(dim, dim)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(type(x).__name__)
        return self.wq(x)


def test_prepared_input_is_gathered_by_the_layers_that_read_it(two_ranks: list[dict[str, Any]]) -> None:
    """[Note: deferring a prepared input's gather]: with torchtitan's plan torch gathers the
    attention's input whole in ``PrepareModuleInput`` and reduce-scatters its gradient whole; ours
    (chunks=2) issues those as 2 chunk collectives shared by q, k and v, so forward and backward
    each carry 2 all-gathers and 2 reduce-scatters (the other pair: wo's) and no whole one. A plain
    op on the prepared input gathers it whole (reusing the layers' gather when it comes after
    one), and gradients match torch TP and the unsharded module; ``PrepareModuleInputOutput``'s
    input defers alike. An input prepared with ``use_local_output=True``, or sharded on its features,
    is prepared as torch prepares it: the module is given what torch gives it, and the output and
    gradients match torch TP."""
    for rank, results in enumerate(two_ranks):
        got = results["prepared"]
        torch_whole = {"_c10d_functional.all_gather_into_tensor": 1, "_c10d_functional.reduce_scatter_tensor": 1}
        assert got.pop("torch") == (torch_whole, torch_whole), rank
        ours = {DIST_ALL_GATHER: 2, "all_to_all_single": 2}
        assert got.pop("ours") == (ours, ours), rank
        # (our forward gathers, torch's, problems): between the projections the op reuses wq's 2 chunks
        # not deferred, as torch prepares them: a local output (the module is given a plain tensor)
        # and a feature-sharded input (no sequence dim to gather along)
        assert got.pop("local output") == (["Tensor"], ["Tensor"], []), rank
        assert got.pop("features sharded") == (["DTensor"], ["DTensor"], []), rank
        assert got == {"plain op between": (2, 1, []), "plain op before": (1, 1, []),
                       "plain op between, PrepareModuleInputOutput": (2, 1, [])}, rank


def _bf16_chunk_sums_rank(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 row-parallel Linear(2 -> 1) with a sequence-sharded output, chunks=4 over 8 positions,
    all-ones input, output gradient 256 at position 0 and 1 at positions 4-7: (weight grad, bias
    grad), full tensors."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    layer = overlap.tensor_parallel(torch.nn.Linear(2, 1).to(torch.bfloat16), mesh,
                                    RowwiseParallel(output_layouts=Shard(1)), chunks=4)
    x = torch.ones(1, 8, 2 // world, dtype=torch.bfloat16)
    dy = torch.tensor([256.0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bfloat16).view(1, 8, 1)
    layer(x).backward(dy.chunk(world, 1)[rank])
    return _full(layer.weight.grad), _full(layer.bias.grad)


def test_bf16_weight_and_bias_gradients_are_summed_over_chunks_in_fp32(two_ranks: list[dict[str, Any]]) -> None:
    """A row-parallel layer's weight and bias gradients, summed piece by piece as the output
    gradient's chunks land, are summed in fp32 and rounded to bf16 once. The pieces are exact
    (256, 0 and 1), their sum 260 is too; summed in bf16, 256 + 1 rounds back to 256 at every
    piece (the bf16 step at 256 is 2), so rank 0's weight column (its own rows first: 256, then
    four 1s) and the bias (summed by position) would be 256."""
    for rank, results in enumerate(two_ranks):
        weight_grad, bias_grad = results["bf16 sums"]
        assert weight_grad.tolist() == [[260.0, 260.0]], rank
        assert bias_grad.tolist() == [260.0], rank


def test_one_rank_is_the_plain_module(single_rank_group: dist.ProcessGroup) -> None:
    """On a 1-rank mesh nothing is communicated (no collective on the link, forward or backward,
    a prepared input not deferred either) and the block computes exactly the unsharded block."""
    from overlap.testing import emulated_link

    mesh = init_device_mesh("cpu", (1,))
    for block in ("sp_mlp", "attention", "mlp", "prepared_attn"):
        ref = make_block(block, True)
        ours = overlap.tensor_parallel(copy.deepcopy(ref), mesh, plan_for(block), chunks=2)
        x = torch.randn(BATCH, 8, 16)
        with emulated_link(1e6, 0.0) as link:
            y_ref, y_ours = ref(x), ours(x)
            y_ours = y_ours.to_local() if isinstance(y_ours, DTensor) else y_ours
            y_ours.sum().backward()
            assert link.stats().by_op == {}, block
        assert torch.equal(y_ours, y_ref), block
        last = {"attention": "wo", "prepared_attn": "attn.wo"}.get(block, "w2")
        assert isinstance(ours.get_submodule(last), TensorParallelLinear), block


def test_frozen_parameters_stay_frozen_as_torch_tp_leaves_them(single_rank_group: dist.ProcessGroup) -> None:
    """A parameter that does not need a gradient before parallelizing does not after, as torch's
    styles keep ``requires_grad``: a frozen colwise weight and a frozen rowwise bias."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    mesh = init_device_mesh("cpu", (1,))
    frozen = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    frozen[0].weight.requires_grad_(False)
    frozen[1].bias.requires_grad_(False)
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    theirs = parallelize_module(copy.deepcopy(frozen), mesh, dict(plan))
    ours = overlap.tensor_parallel(copy.deepcopy(frozen), mesh, dict(plan))
    want = {n: p.requires_grad for n, p in theirs.named_parameters()}
    assert want == {"0.weight": False, "0.bias": True, "1.weight": True, "1.bias": False}
    assert {n: p.requires_grad for n, p in ours.named_parameters()} == want


def test_an_input_without_a_sequence_dim_at_the_declared_shard_is_refused(single_rank_group: dist.ProcessGroup
                                                                           ) -> None:
    """A column-parallel layer declared ``Shard(1)`` (a sequence dim) given a 2-D input, whose dim 1
    is the features: a ``ValueError`` naming the layer and the dims allowed, not a gather of the
    features."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    mesh = init_device_mesh("cpu", (1,))
    layer = overlap.tensor_parallel(torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh,
                                    {"0": ColwiseParallel(input_layouts=Shard(1))})
    with pytest.raises(ValueError, match=r"'0' got an input of shape \(3, 4\) sharded on dim 1: .* one of 0..0"):
        layer(torch.randn(3, 4))


@pytest.mark.parametrize("world", range(1, 9))
def test_shard_sizes_follow_dtensors_shard_rule(world: int) -> None:
    """Each rank's extent of a sequence of 0 to 19 positions is what DTensor's ``Shard`` gives it
    (torch.chunk's pieces, ranks past the last piece empty), never negative: 5 positions over 4
    ranks are 2, 2, 1 and 0."""
    from overlap.tensor_parallelism.collective_matmul import shard_sizes

    for n in range(20):
        pieces = [len(p) for p in torch.arange(n).chunk(world)] if n else []
        assert shard_sizes(n, world) == pieces + [0] * (world - len(pieces)), n


def test_a_held_gather_is_reused_only_for_the_same_input_layout_and_group() -> None:
    """[Note: sibling layers share one gather]: the held gather is found again for the same input,
    layout and group, and not for another group of the same size and rank (a 2-D mesh's other dim
    gathers other ranks' rows), another layout, or the input changed in place."""
    from types import SimpleNamespace

    from overlap.tensor_parallelism.collective_matmul import SeqLayout, _SharedGather, _SiblingGrads

    held, grads = _SharedGather(), _SiblingGrads()
    x, full = torch.randn(2, 4, 3), torch.randn(2, 8, 3)
    layout = SeqLayout([4, 4], 1, 2, 0)
    group, other_group = SimpleNamespace(pg=object()), SimpleNamespace(pg=object())
    held.remember(x, layout, group, full, grads)
    found = held.lookup(x, layout, group)
    assert found is not None and found[0] is full and found[1] is grads
    assert held.lookup(x, layout, other_group) is None
    assert held.lookup(x, SeqLayout([4, 4], 0, 2, 0), group) is None
    x.add_(1)
    assert held.lookup(x, layout, group) is None


def test_siblings_outside_a_backward_pass_each_reduce_their_own_gradient() -> None:
    """[Note: sibling layers share one reduce-scatter]: where the autograd engine cannot say which
    nodes it will run (outside its own execution, as in a traced backward), no sibling leaves its
    partial gradient to another: each reduce-scatters its own, which is exact whoever runs."""
    from overlap.tensor_parallelism.collective_matmul import _SiblingGrads

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return 2 * t

        @staticmethod
        def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return 2 * g

    t = torch.ones(1, requires_grad=True)
    first, second = Twice.apply(t).grad_fn, Twice.apply(t).grad_fn
    siblings = _SiblingGrads()
    siblings.join(first)
    siblings.join(second)
    asked: list[str] = []
    assert not siblings.defer(first, lambda: asked.append("partial") or torch.ones(1))
    assert asked == [] and siblings.take() is None


def test_each_kind_of_layer_call_hands_the_chunk_choice_its_rows_and_wire_bytes(monkeypatch) -> None:
    """What a parallelized Linear tells the chunk choice (``Workload``), 2 ranks, fp32, a 6-row
    input of 4 features, a weight shard of 3 x 4: an all-reduce moves 2 (w - 1) / w of the reduced
    tensor per rank (a ring's reduce-scatter and all-gather), the output's 6 x 3 for ``all_reduce``
    and the input gradient's 6 x 4 for ``all_reduce_grad``; a gather or scatter along the sequence
    moves (w - 1) / w of the whole tensor (every rank's positions: 2 x 5 of them here, ranks of 3
    and 2 positions), the input's 4 features for ``gather``, the output's 3 for ``scatter``, and
    caps the count by the widest rank's 3 positions."""
    from types import SimpleNamespace

    from overlap.tensor_parallelism import layers
    from overlap.tensor_parallelism.plan import LinearPlan

    asked: list[Any] = []
    monkeypatch.setattr(layers, "choose_chunks", lambda work, *args: asked.append(work) or 1)
    plan = LinearPlan("layer", "colwise", Shard(1), Shard(-1), True, None)
    state = layers._State(plan, SimpleNamespace(device_type="cpu"), SimpleNamespace(size=2, rank=0))
    weight = torch.empty(3, 4)
    state.rows_call(torch.empty(2, 3, 4), weight, "all_reduce")
    state.rows_call(torch.empty(2, 3, 4), weight, "all_reduce_grad")
    state.seq_call(torch.empty(2, 3, 4), [3, 2], 1, weight, "gather")
    state.seq_call(torch.empty(2, 5, 4), [3, 2], 1, weight, "scatter")  # a row-parallel input: every position
    got = [(w.kind, w.rows, w.gemm_rows, w.in_features, w.out_features, w.wire_bytes) for w in asked]
    assert got == [("all_reduce", 6, 6, 4, 3, 6 * 3 * 4.0), ("all_reduce_grad", 6, 6, 4, 3, 6 * 4 * 4.0),
                   ("gather", 3, 10, 4, 3, 10 * 4 * 4 / 2), ("scatter", 3, 10, 4, 3, 10 * 3 * 4 / 2)]


def test_chunk_count_model_worked_by_hand() -> None:
    """[Note: choosing the chunk count]'s pipeline, by hand, for a gather on 2 ranks: G(n) = 1 ms per
    100 rows (N = 400 rows: 4 ms), O = 0.1 ms, L = 0, T = 8 ms (wire 8e6 bytes at 1e-9 s/byte).
    c = 1: forward T + G(N) + O = 12.1; backward G(N) + O = 4.1, then the reduce-scatter (8) beside
    the weight gradient (4): max(12.1, 8.1) = 12.1; 24.2 ms in all.
    c = 2: forward: own rows G(200) = 2 (no wait), chunk 0 lands at 4 -> 4 + G(100) + O = 5.1, chunk
    1 lands at 8 -> 9.1; backward: chunk GEMMs G(200) + O = 2.1 each, the link 2.1 -> 6.1 -> 10.1,
    beside the host's 4.2 + 4 = 8.2: 10.1; 19.2 ms in all."""
    from overlap.tensor_parallelism.chunks import GemmCost, Workload, modelled_seconds

    work = Workload("gather", rows=200, gemm_rows=400, in_features=64, out_features=64, wire_bytes=8e6)
    gemm = GemmCost(0.0, 1e-5)
    assert modelled_seconds(work, 1, gemm, 1e-4, 0.0, 1e-9, 2) == pytest.approx(24.2e-3)
    assert modelled_seconds(work, 2, gemm, 1e-4, 0.0, 1e-9, 2) == pytest.approx(19.2e-3)
    with pytest.raises(ValueError, match="kind must be one of"):
        modelled_seconds(Workload("gathr", 200, 400, 64, 64, 8e6), 2, gemm, 1e-4, 0.0, 1e-9, 2)
    # no transfer to wait for, a GEMM of 1 ms + 1 ms per 100 rows: c = 1 has no head (no rows need no
    # wait), so no GEMM of 0 rows is charged its fixed cost: 3 G(N) + 2 O = 15.2 ms
    free = Workload("gather", rows=200, gemm_rows=400, in_features=64, out_features=64, wire_bytes=0.0)
    assert modelled_seconds(free, 1, GemmCost(1e-3, 1e-5), 1e-4, 0.0, 1e-9, 2) == pytest.approx(15.2e-3)


def test_a_choice_is_made_again_behind_another_link(monkeypatch) -> None:
    """A count chosen behind a slow link (a 20 ms transfer beside 10 ms of GEMM: split, modelled to
    save over ``TRUSTED_SAVING``, no trial) is not reused behind a link that costs nothing (1)."""
    from types import SimpleNamespace

    from overlap.tensor_parallelism import chunks as tp_chunks

    figures = {"link": (0.0, 20e-3 / 8e6)}
    monkeypatch.setattr(tp_chunks, "_host_cost", lambda info, device: tp_chunks.HostCost(50e-6, 0.0, 0.0))
    monkeypatch.setattr(tp_chunks, "_gemm_cost", lambda work, info, device: tp_chunks.GemmCost(0.0, 10e-3 / 1024))
    monkeypatch.setattr(tp_chunks, "_link_figures", lambda info, host: figures["link"])
    info = SimpleNamespace(size=2, pg=SimpleNamespace(group_name="a group of 2"))
    work = tp_chunks.Workload("gather", 1024, 1024, 64, 64, 8e6)
    tp_chunks.reset_measurements()
    try:
        behind_slow = tp_chunks.choose_chunks(work, info)
        figures["link"] = (0.0, 0.0)
        behind_free = tp_chunks.choose_chunks(work, info)
        assert not tp_chunks._trials
    finally:
        tp_chunks.reset_measurements()
    assert behind_slow > 1 and behind_free == 1, (behind_slow, behind_free)


def test_host_and_link_figures_follow_from_the_timed_gathers(monkeypatch) -> None:
    """[Note: choosing the chunk count]'s figures from injected timings, 4 ranks: a tiny gather takes
    0.2 ms of host time in 1 chunk and 0.1 ms more per extra chunk, 1.2 ms of wall time; the
    calibration gather (``CALIBRATION_BYTES`` per rank) 11 ms. So ``O`` = 0.1 ms, ``L`` = 1 ms,
    and ``s`` = 9.8 ms over the 3 MiB each rank receives (3 other ranks' MiB, not 4)."""
    from types import SimpleNamespace

    from overlap.tensor_parallelism import chunks as tp_chunks

    def timed(n: int, chunks: int, info: Any, device: torch.device) -> tuple[float, float]:
        if n == tp_chunks.CALIBRATION_BYTES // 4:
            return 0.5e-3, 11e-3
        return 0.2e-3 + 0.1e-3 * (chunks - 1), 1.2e-3 + 0.1e-3 * (chunks - 1)

    monkeypatch.setattr(tp_chunks, "_gather_seconds", timed)
    per_chunk, latency, per_byte = tp_chunks.measure_host_cost(SimpleNamespace(size=4), torch.device("cpu"))
    assert per_chunk == pytest.approx(0.1e-3) and latency == pytest.approx(1e-3)
    assert per_byte == pytest.approx(9.8e-3 / (3 * tp_chunks.CALIBRATION_BYTES))


@pytest.mark.parametrize("kind", ["gather", "scatter", "all_reduce", "all_reduce_grad"])
def test_chunk_count_follows_the_costs(kind: str) -> None:
    """One collective matmul (1024 rows, 10 ms of GEMM) under [Note: choosing the chunk count]:

    * a transfer that is tiny beside the per-chunk host cost (10 µs vs 0.5 ms): 1 (undecomposed);
    * a transfer about the GEMM's (20 ms) with a small per-chunk cost (50 µs): more than 1, and not
      fewer than with a dearer chunk (0.5 ms);
    * the same transfer with next to no compute to hide behind (10 µs of GEMM): 1;
    * a count that saves less than ``MARGIN`` of c = 1's time is not taken;
    * never more than ``MAX_CHUNKS``, nor than ``MIN_ROWS`` rows per chunk allow."""
    from overlap.tensor_parallelism.chunks import (MARGIN, MAX_CHUNKS, MIN_ROWS, GemmCost, Workload, best_chunks,
                                                   modelled_seconds)

    def work(wire: float, rows: int = 512) -> Workload:
        return Workload(kind, rows=rows, gemm_rows=1024, in_features=256, out_features=512, wire_bytes=wire)

    gemm, idle = GemmCost(0.0, 10e-3 / 1024), GemmCost(0.0, 10e-6 / 1024)
    per_byte = 1e-9  # a 20 ms transfer is 2e7 bytes
    assert best_chunks(work(1e4), gemm, 5e-4, 0.0, per_byte, 2) == 1
    dear = best_chunks(work(2e7), gemm, 5e-4, 20e-6, per_byte, 2)
    busy = best_chunks(work(2e7), gemm, 5e-5, 20e-6, per_byte, 2)
    assert 1 < busy <= MAX_CHUNKS and dear <= busy, (dear, busy)
    assert best_chunks(work(2e7), idle, 5e-5, 20e-6, per_byte, 2) == 1
    assert best_chunks(work(6e7, rows=3 * MIN_ROWS), gemm, 5e-5, 20e-6, per_byte, 2) <= 3
    # the margin: the per-chunk cost at which the best count saves MARGIN / 2 of c = 1's time (bisected)

    def saves(per_chunk: float) -> float:
        times = [modelled_seconds(work(2e7), c, gemm, per_chunk, 20e-6, per_byte, 2) for c in range(1, MAX_CHUNKS + 1)]
        return 1 - min(times) / times[0]

    lo, hi = 5e-5, 1e-1
    assert saves(lo) > MARGIN and saves(hi) == 0.0
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if saves(mid) > MARGIN / 2 else (lo, mid)
    assert 0 < saves(hi) < MARGIN
    assert best_chunks(work(2e7), gemm, hi, 20e-6, per_byte, 2) == 1


def test_a_trial_is_due_where_the_model_proposes_a_split_and_it_fits_the_budget() -> None:
    """``trial_rounds`` of synthetic modelled tables (seconds per count): none where the model's best
    is 1, ``TRIAL_ROUNDS`` for a cheap layer, fewer so that (rounds + 1) x (T(1) + T(best)) stays
    within ``TRIAL_BUDGET_S``, none where not one round fits, none where the model's saving is at
    least ``TRUSTED_SAVING`` (taken as modelled)."""
    from overlap.tensor_parallelism.chunks import TRIAL_BUDGET_S, TRUSTED_SAVING, trial_rounds

    assert trial_rounds({1: 0.010, 2: 0.011, 3: 0.012}) == 0
    assert trial_rounds({1: 0.010, 2: 0.009, 3: 0.0095}) == TRIAL_ROUNDS
    per_round = TRIAL_BUDGET_S / 2.5  # two passes fit, one untimed: one round
    assert trial_rounds({1: 0.55 * per_round, 4: 0.45 * per_round}) == 1
    assert trial_rounds({1: 0.6 * TRIAL_BUDGET_S, 8: 0.5 * TRIAL_BUDGET_S}) == 0
    assert trial_rounds({1: 0.010, 2: 0.010 * (1 - TRUSTED_SAVING) + 1e-6}) == TRIAL_ROUNDS
    assert trial_rounds({1: 0.010, 2: 0.010 * (1 - TRUSTED_SAVING) - 1e-6}) == 0


def test_a_trial_settles_on_the_count_only_where_it_saves_more_than_the_margin() -> None:
    """``settled_chunks``: the candidate must be faster than chunks=1 in every round and, in the
    quietest round (least seconds of its two passes together), take less than ``1 - TRIAL_MARGIN``
    of chunks=1's seconds; a slow chunks=1 pass does not make the candidate win; a trial without
    rounds is an error."""
    from overlap.tensor_parallelism.chunks import TRIAL_MARGIN, settled_chunks

    assert settled_chunks(4, [[10.0, 10.0 * (1 - TRIAL_MARGIN) - 0.1]]) == 4
    assert settled_chunks(4, [[10.0, 10.0 * (1 - TRIAL_MARGIN) + 0.1]]) == 1
    assert settled_chunks(4, [[30.0, 5.0], [10.0, 11.0], [10.0, 11.0]]) == 1  # a slow chunks=1 pass
    assert settled_chunks(4, [[10.0, 9.5], [10.0, 8.0], [10.0, 8.5]]) == 4  # every round won, the quietest by 20%
    assert settled_chunks(4, [[10.0, 10.5], [10.0, 8.0], [10.0, 8.5]]) == 1  # one round lost
    assert settled_chunks(8, [[196e-3, 131e-3], [189e-3, 133e-3]]) == 8  # two rounds, both won
    # the quietest round is the one whose two passes took least together (the first: the candidate
    # saves 2%, under the margin), not the one where the candidate was fastest (a slow chunks=1 pass)
    assert settled_chunks(4, [[10.0, 9.8], [30.0, 9.7]]) == 1
    with pytest.raises(ValueError, match="at least one round"):
        settled_chunks(4, [])


def test_the_128x512_flip_goes_to_a_trial() -> None:
    """The sequence-parallel MLP at dim 128 x 512 tokens (bench_tp's grid point whose choice flipped:
    0.79x torch at 6 / 5 chunks, 1.03x at 1), with the figures measured there on 2 ranks (the 2-core
    box, 2026-11-26): the model alone takes 5 chunks for the rowwise (scatter) layer, a saving of
    13% that the step did not show; its best count is tried instead (3 rounds: the layer is cheap).
    Trials measured there (2026-11-26, 4 or 2 chunks proposed) settle on 1: the colwise layer's
    timings of a loaded run (4 slower in every round), the rowwise layer's of that run (4 faster
    in the quietest round, slower in another: its step at 4 chunks was 0.87x ``chunks=1``'s time,
    a gain forgone), a trial with slow spells on both sides, and at dim 64 x 128 tokens on a
    quieter box a rowwise trial whose quietest round had 2 chunks 11% faster but one round 5%
    slower (the split that trial chose under the quietest-round rule alone ran 9% slower). A
    two-round trial at dim 256 x 2048 tokens that won both rounds by 30% settles on 8; with another
    run's figures there the model's 8 chunks save 28% and are taken untried, as at a layer 16x as
    large."""
    from overlap.tensor_parallelism.chunks import (GemmCost, Workload, _least, best_chunks, modelled_table,
                                                   settled_chunks, trial_rounds)

    host, latency, per_byte = 1.248641440594968e-4, 20e-6, 2.98e-8  # O; the emulated link's L and s
    scatter = Workload("scatter", 128, 512, 256, 128, 131072.0)
    gemm = GemmCost(0.0, 1.0751004505696722e-06)
    assert best_chunks(scatter, gemm, host, latency, per_byte, 2) == 5
    times = modelled_table(scatter, gemm, host, latency, per_byte, 2)
    assert trial_rounds(times) == TRIAL_ROUNDS and _least(times) == 5
    colwise = [[29.69e-3, 33.07e-3], [27.9e-3, 35.37e-3], [29.43e-3, 32.74e-3]]  # (chunks=1, 4) per round
    rowwise = [[37.77e-3, 34.98e-3], [30.13e-3, 31.74e-3], [27.49e-3, 24.61e-3]]
    spiky = [[30.76e-3, 116.24e-3], [81.26e-3, 138.74e-3], [186.19e-3, 27.06e-3]]
    small = [[6.21e-3, 6.54e-3], [6.61e-3, 5.58e-3], [6.38e-3, 5.68e-3]]  # dim 64 x 128 tokens, 2 chunks
    assert [settled_chunks(4, t) for t in (colwise, rowwise, spiky)] == [1, 1, 1] and settled_chunks(2, small) == 1
    assert settled_chunks(8, [[195.98e-3, 130.62e-3], [188.56e-3, 132.59e-3]]) == 8
    gather = Workload("gather", 128, 512, 128, 256, 131072.0)
    times = modelled_table(gather, GemmCost(9.643715852040001e-06, 7.248482104062402e-07), host, latency, per_byte, 2)
    assert trial_rounds(times) == TRIAL_ROUNDS and _least(times) > 1
    # dim 256 x 2048 tokens, the link calibrated there (s 8.1e-8 s/byte): 8 chunks, untried
    big = Workload("gather", 256, 2048, 256, 512, 1048576.0)
    times = modelled_table(big, GemmCost(0.0, 1.8329823102395233e-05), 2.5e-4, latency, 8.1e-8, 2)
    assert _least(times) == 8 and trial_rounds(times) == 0
    assert best_chunks(big, GemmCost(0.0, 1.8329823102395233e-05), 2.5e-4, latency, 8.1e-8, 2) == 8
    huge = Workload("gather", 256, 2048, 256, 512, 16 * 1048576.0)
    huge_gemm = GemmCost(0.0, 16 * 1.8329823102395233e-05)
    assert trial_rounds(modelled_table(huge, huge_gemm, 2.5e-4, latency, 8.1e-8, 2)) == 0
    assert best_chunks(huge, huge_gemm, 2.5e-4, latency, 8.1e-8, 2) == 8


# per rank: (per-chunk host s, real link s per collective and per byte) and (GEMM s on the whole
# operand, on an 8th of it): rank 0 sees cheap chunks and a slow GEMM, rank 1 dear chunks and a fast one
INJECTED_HOST = ((2e-5, 1e-4, 1e-9), (3e-3, 5e-5, 2e-9))
INJECTED_GEMM = ((8e-3, 1e-3), (4e-3, 0.5e-3))
# per rank and layer kind: a trial's seconds (chunks=1, the model's count); maxed over ranks the
# gather's count saves 1% (under TRIAL_MARGIN: 1), the scatter's 30% (taken), while rank 0 alone
# would take both and rank 1 alone the scatter's only
INJECTED_TRIAL = ({"gather": (10e-3, 5e-3), "scatter": (10e-3, 5e-3)},
                  {"gather": (10e-3, 9.9e-3), "scatter": (10e-3, 7e-3)})
CHOSEN_DIMS, CHOSEN_SEQ, CHOSEN_GBPS = (32, 128), 128, 0.016  # dim, hidden; global rows; a link of T ~ G


def _chosen_rank(rank: int, world: int) -> dict[str, Any]:
    """The sequence-parallel MLP with ``chunks=None`` behind a link, each rank's measurements replaced
    by :data:`INJECTED_HOST` / :data:`INJECTED_GEMM` (different per rank): the counts its layers
    chose, the collectives they issued, what was measured, and a choice at too few rows."""
    from overlap.groups import resolve_group
    from overlap.tensor_parallelism import chunks as tp_chunks
    from overlap.tensor_parallelism import layers
    from overlap.testing import emulated_link

    mesh = init_device_mesh("cpu", (world,))
    measured: list[str] = []
    chosen: dict[str, list[int]] = {}
    saved = tp_chunks.measure_host_cost, tp_chunks.measure_gemm, layers.choose_chunks, tp_chunks.trial_seconds

    def recording(work: Any, *args: Any, **kwargs: Any) -> int:
        count = saved[2](work, *args, **kwargs)
        chosen.setdefault(work.kind, []).append(count)
        return count

    tp_chunks.measure_host_cost = lambda *a: measured.append("host") or INJECTED_HOST[rank]
    tp_chunks.measure_gemm = lambda *a: measured.append("gemm") or INJECTED_GEMM[rank]

    def trial(work: Any, counts: tuple[int, ...], info: Any, device: Any, rounds: int,
              go_on: Any = None) -> list[list[float]]:
        measured.append(f"trial {work.kind} {counts} x{rounds}")
        assert all(go_on(0.0) for _ in range(rounds - 1))  # an agreement each round, within the budget
        return [list(INJECTED_TRIAL[rank][work.kind]) for _ in range(rounds)]

    tp_chunks.trial_seconds = trial
    layers.choose_chunks = recording
    tp_chunks.reset_measurements()
    try:
        dim, hidden = CHOSEN_DIMS
        model = overlap.tensor_parallel(make_block("sp_mlp", True, dim=dim, hidden=hidden), mesh, plan_for("sp_mlp"))
        x = torch.randn(BATCH, CHOSEN_SEQ // world, dim).requires_grad_()
        counts = []
        with emulated_link(CHOSEN_GBPS, 20.0) as link:
            for _ in range(2):  # the second step measures nothing
                link.reset_stats()
                y = model(x)
                forward = _collective_counts(link)
                link.reset_stats()
                y.sum().backward()
                counts.append((forward, _collective_counts(link)))
        few = tp_chunks.choose_chunks(tp_chunks.Workload("gather", 2 * tp_chunks.MIN_ROWS - 1, 64, 7, 7, 1e9),
                                      resolve_group(mesh, "mesh"))
    finally:
        tp_chunks.measure_host_cost, tp_chunks.measure_gemm, layers.choose_chunks, tp_chunks.trial_seconds = saved
        tp_chunks.reset_measurements()
    # measured for real, no link: each rank times its own, the figures are agreed
    info = resolve_group(mesh, "mesh")
    real = tp_chunks.choose_chunks(tp_chunks.Workload("gather", 256, 512, 64, 64, 1e6), info)
    figures = (tp_chunks._host[("cpu", info.pg.group_name)], *tp_chunks._gemm.values())
    tp_chunks.reset_measurements()
    # a trial for real behind a link whose transfer is about the GEMM's: every rank's agreed timings
    tried = tp_chunks.Workload("scatter", 64, 256, 64, 32, 256 * 32 * 4 / 2)
    with emulated_link(0.5, 20.0):
        tried_count = tp_chunks._tried(tried, 2, 2, info, torch.device("cpu"), ("key",))
    trial = dict(tp_chunks._trials[("key",)])
    tp_chunks.reset_measurements()
    return {"chosen": chosen, "counts": counts, "measured": measured, "few rows": few, "real": (real, figures),
            "trial": (tried_count, trial["rounds"], trial["chosen"])}


def _alone_and_agreed(kind: str, world: int) -> tuple[list[int], int, int]:
    """What each rank of :func:`_chosen_rank` would choose from its own injected figures and trial
    timings for ``kind``'s layer, what the figures and timings maxed over ranks give, and the count
    the agreed figures' model proposes for a trial."""
    from overlap.tensor_parallelism.chunks import (GemmCost, Workload, _bucket, _least, best_chunks, modelled_table,
                                                   settled_chunks, trial_rounds)

    dim, hidden = CHOSEN_DIMS
    rows = BATCH * CHOSEN_SEQ
    inf, outf = (dim, hidden // world) if kind == "gather" else (hidden // world, dim)
    cols = inf if kind == "gather" else outf
    work = Workload(kind, CHOSEN_SEQ // world, rows, inf, outf, rows * cols * 4 * (world - 1) / world)
    per_byte = 8.0 / (CHOSEN_GBPS * 1e9)

    def choice(host: tuple[float, float, float], gemm: tuple[float, float], trial: tuple[float, float]
               ) -> tuple[int, int]:
        fit = GemmCost.fit(_bucket(rows), *gemm)
        times = modelled_table(work, fit, host[0], 20e-6, per_byte, world)
        if trial_rounds(times) == 0:
            return best_chunks(work, fit, host[0], 20e-6, per_byte, world), 1
        return settled_chunks(_least(times), [list(trial)]), _least(times)

    alone = [choice(INJECTED_HOST[r], INJECTED_GEMM[r], INJECTED_TRIAL[r][kind])[0] for r in range(world)]
    agreed, candidate = choice(*(tuple(map(max, zip(*figures))) for figures in
                                 (INJECTED_HOST, INJECTED_GEMM, [t[kind] for t in INJECTED_TRIAL])))
    return alone, agreed, candidate


def test_chosen_count_is_the_same_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    """With each rank measuring different costs (injected), every rank's layers choose the count the
    figures maxed over ranks give (not any one rank's own choice, which differ here), issue that
    many collectives per decomposed collective in both directions, measure once per group and GEMM
    shape (two shapes: w1 32 -> 64, w2 64 -> 32 per rank), and take 1 without measuring where the rows allow no 2 chunks."""
    want, tried = {}, {}
    for kind in ("gather", "scatter"):
        alone, agreed, candidate = _alone_and_agreed(kind, 2)
        assert len(set(alone)) > 1, (kind, alone)  # the injection makes the ranks disagree on their own
        want[kind], tried[kind] = agreed, candidate
    assert want["gather"] == 1 < tried["gather"], (want, tried)  # tried, and the trial said no
    assert want["scatter"] == tried["scatter"] > 1, (want, tried)  # tried, and the trial said yes
    for rank, results in enumerate(two_ranks):
        got = results["chosen"]
        assert got["chosen"] == {kind: [want[kind]] * 2 for kind in want}, rank
        # (all-gathers, reduce-scatters): forward w1's gather, w2's scatter; backward the other way round
        step = ((want["gather"], want["scatter"]), (want["scatter"], want["gather"]))
        assert got["counts"] == [step, step], rank
        assert got["measured"] == ["host", "gemm", f"trial gather (1, {tried['gather']}) x{TRIAL_ROUNDS}",
                                   "gemm", f"trial scatter (1, {tried['scatter']}) x{TRIAL_ROUNDS}"], rank
        assert got["few rows"] == 1, rank


def _trial_isolation_rank(rank: int, world: int) -> dict[str, Any]:
    """A trial of every layer kind run from inside a caller's ``torch.no_grad`` and saved-tensor hooks
    (as activation checkpointing installs), after a real layer's gather is held for its siblings:
    what the trial returned, whether the caller's hooks saw anything, whether the held gather
    survived."""
    from overlap.groups import resolve_group
    from overlap.tensor_parallelism import chunks as tp_chunks
    from overlap.tensor_parallelism import collective_matmul as cm

    info = resolve_group(init_device_mesh("cpu", (world,)), "mesh")
    x = torch.randn(2, 8, 16)
    call = cm.Call(info, 2, "f", "b", cm.SeqLayout([8] * world, 1, 2, rank))
    cm.AllGatherMatmul.apply(x, torch.randn(12, 16), None, call)
    held = cm._shared_gather._full
    hooked: list[str] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        hooked.append("pack")
        return t

    returned = {}
    rng = torch.random.get_rng_state()
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for kind in ("gather", "scatter", "all_reduce", "all_reduce_grad"):
            work = tp_chunks.Workload(kind, 32, 128, 16, 8, 1e3)
            returned[kind] = tp_chunks.trial_seconds(work, (1, 3), info, torch.device("cpu"), 2)
        asked: list[float] = []
        stopped = tp_chunks.trial_seconds(tp_chunks.Workload("gather", 32, 128, 16, 8, 1e3), (1, 3), info,
                                          torch.device("cpu"), 3, lambda elapsed: asked.append(elapsed) or False)
    return {"returned": returned, "hooked": hooked, "held kept": cm._shared_gather._full is held,
            "stopped": (len(stopped), len(asked), all(e > 0 for e in asked)),
            "rng kept": torch.equal(torch.random.get_rng_state(), rng)}


def test_a_trial_times_each_kind_apart_from_the_caller(two_ranks: list[dict[str, Any]]) -> None:
    """A trial on 2 ranks returns its rounds of (chunks=1, candidate) seconds for every layer kind,
    runs its autograd graph apart from the caller's (no_grad and saved-tensor hooks of the caller
    neither stop it nor see it), leaves a real layer's held sibling gather and the caller's random
    stream in place, and stops after
    the round where ``go_on`` (given the seconds so far) says no; a real trial
    behind a link is agreed: every rank has the same timings and the same count."""
    import math

    for results in two_ranks:
        got = results["trial isolation"]
        assert got["hooked"] == [] and got["held kept"] and got["rng kept"], got
        assert got["stopped"] == (1, 1, True), got  # go_on said no after the first of 3 rounds
        for kind, rounds in got["returned"].items():
            assert len(rounds) == 2 and all(len(r) == 2 and all(math.isfinite(t) and t > 0 for t in r)
                                            for r in rounds), (kind, rounds)
    count, rounds, chosen = two_ranks[0]["chosen"]["trial"]
    assert (count, rounds, chosen) == two_ranks[1]["chosen"]["trial"]
    assert count == chosen in (1, 2) and 1 <= len(rounds) <= 2, (count, rounds)  # fewer past the budget


def test_trial_rejects_bad_arguments() -> None:
    """A trial names what it accepts: the four layer kinds, at least one round."""
    from overlap.tensor_parallelism.chunk_trial import trial_seconds
    from overlap.tensor_parallelism.chunks import Workload

    with pytest.raises(ValueError, match="kind must be one of"):
        trial_seconds(Workload("gathr", 32, 64, 8, 8, 1e3), (1, 2), None, torch.device("cpu"), 1)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        trial_seconds(Workload("gather", 32, 64, 8, 8, 1e3), (1, 2), None, torch.device("cpu"), 0)


def test_measured_costs_are_agreed(two_ranks: list[dict[str, Any]]) -> None:
    """Measured for real (no injection): one host figure set and one GEMM fit, finite, not negative,
    and the same on every rank (agreed), hence the same count."""
    import dataclasses
    import math

    (count, figures), other = two_ranks[0]["chosen"]["real"], two_ranks[1]["chosen"]["real"]
    assert (count, figures) == other
    assert len(figures) == 2 and 1 <= count <= 8, figures
    values = [v for f in figures for v in dataclasses.astuple(f)]
    assert all(math.isfinite(v) and v >= 0 for v in values) and figures[1].per_row_s > 0, figures


def test_chunks_override_on_one_rank(single_rank_group: dist.ProcessGroup) -> None:
    """``chunks=`` wins, capped at the rows; on a 1-rank group the choice is 1 without measuring."""
    from overlap.groups import resolve_group
    from overlap.tensor_parallelism import chunks as tp_chunks

    info = resolve_group(None, "group")
    work = tp_chunks.Workload("gather", 1024, 2048, 16, 16, 1e9)
    assert tp_chunks.choose_chunks(work, info, override=3) == 3
    assert tp_chunks.choose_chunks(tp_chunks.Workload("gather", 2, 4, 16, 16, 1e9), info, override=3) == 2
    tp_chunks.reset_measurements()
    assert tp_chunks.choose_chunks(work, info) == 1
    assert not tp_chunks._host and not tp_chunks._gemm
