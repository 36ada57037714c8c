"""``python -m overlap check-gpu``: prove a GPU machine with the torch and Triton it already has.

One command (no network, nothing installed), one table, exit status 1 on any mismatch (2 when no
CUDA device is visible). Each row is one check; a row that cannot run here says why (SKIP):

=================  ==================================================================================
row                what it checks
=================  ==================================================================================
native passes      the packing ops' per-tensor passes built as a C++ extension against this torch
                   ([Note: native passes] in ``overlap_kernels.native_passes``; first, so that every
                   later row and process uses it) and checked on CUDA tensors against their Python
                   definitions; SKIP without a compiler or Python headers (the Python passes run)
gpu tests          ``pytest -m gpu`` from this checkout (needs pytest and the ``tests/`` folder), in its
                   own process while the next four rows run
packing ops        the six packing / chunk ops on the GPU against their pure-torch references on the
                   CPU, over drawn cases: odd and empty shapes, 0-dim parameters, empty shards, tails,
                   world sizes 1-8, every float dtype pair, scale / accumulate / bias epilogues, and
                   one multi-GiB parameter; outputs and fresh allocations are filled with NaN first, so
                   an element the kernel forgets to write shows. Values must be the reference's bit for
                   bit, but for the bit pattern of a NaN (positions must match), as in the unit tests
training           world size 1 on NCCL, 3 AdamW steps: ``overlap.shard`` against the unsharded model
                   and FSDP2 in fp32 (bitwise), against FSDP2 with bf16 mixed precision (bitwise),
                   ``overlap.optimizer_in_backward`` against the plain step (bitwise), a 1x1 HSDP mesh
                   against FSDP2's (bitwise), and blocks compiled with ``torch.compile`` against the
                   eager run (1e-5 relative on the loss: Inductor fuses and reorders the float math)
streams            a collective beside compute: a sleep queued on the all-gather stream stands for a
                   slow link; compute issued after the all-gather must finish before it (timed with
                   events)
cuda graphs        the four packing ops captured in one CUDA graph and replayed on new data, against
                   the references
bench_kernels      ``benchmarks/bench_kernels.py --device cuda --quick --quantized-blocks-per-program 1 0
                   --quantized-scale 1``: its tables (GB/s, and host µs per call; the quantized kernels
                   on full-size workloads at one block per program and at the runtime's choice)
                   appended to ``benchmarks/RESULTS.md``
                   (timings are reported, never checked)
bench_host_bound   ``benchmarks/bench_host_bound.py``: plain vs overlap.shard vs FSDP2 on a host-bound
                   and a GPU-bound step, the host-bound step by phase beside torch's hook mechanism
                   alone, with the profiler's top host costs, appended the same way
default suite      only with ``--suite``: ``pytest tests`` with the CPU suite's default selection (the GPU
                   tests among it), one xdist worker per core but two, last and alone
=================  ==================================================================================

The packing and training checks take a device / backend, so the CPU suite runs them too (Triton's
interpreter, gloo): ``tests/tools/test_gpu_check.py``.
"""
from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["CheckRow", "PackingCase", "check_packing_case", "draw_packing_cases", "format_table", "main",
           "training_checks"]

REPO = Path(__file__).resolve().parents[2]
"""The checkout this package runs from (``tests/`` and ``benchmarks/`` beside it, when present)."""

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SHAPE_POOL = [(), (0, 4), (1,), (2, 0), (7,), (13, 5), (3, 1, 2), (31, 31), (1023,), (4099, 17), (64, 129)]
"""Parameter shapes the packing cases draw from: 0-dim, empty, primes, rows that do not divide."""
BIG_NUMEL = (1 << 29) + 3
"""The multi-GiB case: one fp32 parameter of 2 GiB plus 12 bytes (offsets past 2**31 bytes)."""


@dataclass
class CheckRow:
    """One row of the table: ``ok`` True (pass), False (fail) or None (skipped, ``detail`` says why)."""

    name: str
    ok: Optional[bool]
    seconds: float
    detail: str


# ----------------------------------------------------------------------------------- packing ops
@dataclass(frozen=True)
class PackingCase:
    """One drawn case of the four packing ops and the two chunk ops."""

    seed: int
    shapes: tuple[tuple[int, ...], ...]
    param_dtypes: tuple[torch.dtype, ...]
    buffer_dtype: Optional[torch.dtype]
    world_size: int
    rank: int
    scale: Optional[float]
    accumulate: bool


def draw_packing_cases(count: int, seed: int = 0, big: bool = False) -> list[PackingCase]:
    """``count`` drawn cases (``big``: the last one holds the multi-GiB parameter)."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        world = rng.choice((1, 2, 3, 4, 8))
        shapes = tuple(rng.choice(SHAPE_POOL) for _ in range(rng.randint(1, 12)))
        if big and i == count - 1:
            world, shapes = 8, ((BIG_NUMEL,), (7,))
        dtypes = tuple(rng.sample(FLOATS, rng.randint(1, 3)))
        cases.append(PackingCase(
            seed=seed * 1000 + i, shapes=shapes, param_dtypes=dtypes,  # None: the parameters' one dtype
            buffer_dtype=rng.choice((None, *FLOATS) if len(dtypes) == 1 else FLOATS), world_size=world,
            rank=rng.randrange(world),
            scale=rng.choice((None, 0.3, 1 / 3)), accumulate=rng.random() < 0.5))
    return cases


def _data(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values on the CPU, with NaN, +-inf, -0.0 and subnormals among them."""
    x = torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed)) * 8
    if x.numel():
        tiny = torch.finfo(dtype).smallest_normal
        specials = torch.tensor([math.nan, math.inf, -math.inf, -0.0, tiny / 4, -tiny * 0.75])
        flat = x.view(-1)
        flat[:: 97][: specials.numel()] = specials[: flat[:: 97].numel()]
    return x.to(dtype)


def _same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit but for NaN patterns (NaN positions equal); ``got`` may be on another device."""
    got = got.cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    nan = torch.isnan(got)
    if not torch.equal(nan, torch.isnan(want)):
        return False
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return torch.equal(got.masked_fill(nan, 0).view(bits), want.masked_fill(nan, 0).view(bits))


def _poison(device: torch.device, nbytes: int) -> None:
    """Fill ``nbytes`` of the caching allocator's free memory with NaN bytes, so the next allocations
    of that size start as NaN instead of zeros (a kernel that skips an element then shows)."""
    if device.type == "cuda" and nbytes:
        torch.empty(nbytes // 4 + 1, device=device).fill_(math.nan)


def check_packing_case(case: PackingCase, device: torch.device) -> list[str]:
    """Run the six ops of ``case`` on ``device``; return what differs from the references (empty: none)."""
    from overlap_kernels import (ShardLayout, all_gather_copy_in, all_gather_copy_in_ref, all_gather_copy_out,
                         all_gather_copy_out_ref, reduce_scatter_copy_in, reduce_scatter_copy_in_ref,
                         reduce_scatter_copy_out, reduce_scatter_copy_out_ref)

    problems: list[str] = []
    w, r, layout = case.world_size, case.rank, ShardLayout(list(case.shapes), case.world_size)
    dtypes = [case.param_dtypes[i % len(case.param_dtypes)] for i in range(len(case.shapes))]
    fulls = [_data(s, d, case.seed + i) for i, (s, d) in enumerate(zip(case.shapes, dtypes))]
    buffer_dtype = case.buffer_dtype or case.param_dtypes[0]
    where = f"case {case.seed} (world {w}, rank {r})"

    def expect(what: str, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
        bad = [i for i, (g, e) in enumerate(zip(got, want)) if not _same_values(g, e)]
        if bad or len(got) != len(want):
            problems.append(f"{where}: {what} differs from the reference at tensors {bad[:5]}")

    shards = layout.shards(fulls, r)
    flat_bytes = layout.buffer_numel * 4
    _poison(device, flat_bytes)
    got_in, _ = all_gather_copy_in([s.to(device) for s in shards], layout, r, case.buffer_dtype)
    expect("all_gather_copy_in", [got_in], [all_gather_copy_in_ref(shards, layout, r, case.buffer_dtype)[0]])

    ag_output = _data((layout.buffer_numel,), buffer_dtype, case.seed + 100)
    outs = [torch.full(s, math.nan, dtype=d, device=device) for s, d in zip(case.shapes, dtypes)]
    all_gather_copy_out(ag_output.to(device), layout, outs)
    expect("all_gather_copy_out", outs,
           all_gather_copy_out_ref(ag_output, layout, [torch.empty(s, dtype=d) for s, d in zip(case.shapes, dtypes)]))

    _poison(device, flat_bytes)
    got_rs = reduce_scatter_copy_in([f.to(device) for f in fulls], layout, case.scale, case.buffer_dtype)
    expect("reduce_scatter_copy_in", [got_rs], [reduce_scatter_copy_in_ref(fulls, layout, case.scale, case.buffer_dtype)])

    rs_output = _data((layout.slot_numel,), buffer_dtype, case.seed + 200)
    start = [_data(s, d, case.seed + 300 + i) if case.accumulate else torch.full(s, math.nan, dtype=d)
             for i, (s, d) in enumerate(zip(layout.shard_shapes(r), dtypes))]
    grads = [g.to(device, copy=True) for g in start]  # a copy on the CPU too: the op writes it
    reduce_scatter_copy_out(rs_output.to(device), grads, layout, r, case.scale, case.accumulate)
    want = [g.clone() for g in start]
    reduce_scatter_copy_out_ref(rs_output, want, layout, r, case.scale, case.accumulate)
    expect("reduce_scatter_copy_out", grads, want)
    if case.scale is not None:  # the division instead ([Note: dividing as the reduction's average])
        grads = [g.to(device, copy=True) for g in start]
        reduce_scatter_copy_out(rs_output.to(device), grads, layout, r, None, case.accumulate, post_divisor=3.0)
        want = [g.clone() for g in start]
        reduce_scatter_copy_out_ref(rs_output, want, layout, r, None, case.accumulate, post_divisor=3.0)
        expect("reduce_scatter_copy_out divided by 3", grads, want)

    if not any(math.prod(s) > 1 << 24 for s in case.shapes):  # the chunk ops' cases stay small
        problems += _check_chunk_ops(case, device, where)
    return problems


def _check_chunk_ops(case: PackingCase, device: torch.device, where: str) -> list[str]:
    """``chunk_place`` / ``chunk_pack`` on a (batch, seq, hidden) tensor cut on a drawn dim into
    uneven, possibly empty pieces."""
    from overlap_kernels import chunk_pack, chunk_pack_ref, chunk_place, chunk_place_ref

    rng = random.Random(case.seed)
    dtype, w = case.param_dtypes[0], case.world_size
    shape = [rng.randint(1, 5), rng.randint(w, 4 * w + 3), rng.choice((1, 8, 33))]
    dim = rng.randrange(3)
    n = shape[dim]
    cuts = sorted(rng.randint(0, n) for _ in range(w - 1))
    starts, ends = [0, *cuts], [*cuts, n]
    lengths = [e - s for s, e in zip(starts, ends)]
    width = max(max(lengths), 1)
    buf_shape = [w, *shape]
    buf_shape[1 + dim] = width
    problems = []
    skip = rng.randrange(-1, w)
    full = _data(shape, dtype, case.seed + 400)
    buf = _data(buf_shape, dtype, case.seed + 500)
    got = full.to(device, copy=True)
    chunk_place(got, buf.to(device), starts, lengths, dim, skip)
    if not _same_values(got, chunk_place_ref(full, buf, starts, lengths, dim, skip)):
        problems.append(f"{where}: chunk_place differs from the reference (dim {dim}, lengths {lengths})")
    bias = _data((shape[-1],), dtype, case.seed + 600) if dim != 2 and rng.random() < 0.5 else None
    packed = torch.full(buf_shape, math.nan, dtype=dtype, device=device)
    chunk_pack(packed, full.to(device), starts, lengths, dim, None if bias is None else bias.to(device), case.scale)
    want = chunk_pack_ref(torch.empty(buf_shape, dtype=dtype), full, starts, lengths, dim, bias, case.scale)
    if not _same_values(packed, want):
        problems.append(f"{where}: chunk_pack differs from the reference (dim {dim}, lengths {lengths}, "
                        f"bias {bias is not None}, scale {case.scale})")
    return problems


def _packing_row(device: torch.device) -> CheckRow:
    start = time.perf_counter()
    big = device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory > 24 << 30
    cases = draw_packing_cases(60, seed=1, big=big)
    problems = [p for case in cases for p in check_packing_case(case, device)]
    detail = f"{len(cases)} drawn cases{' (one of 2 GiB)' if big else ''}"
    return CheckRow("packing ops", not problems, time.perf_counter() - start,
                    detail if not problems else f"{detail}; {len(problems)} mismatches, first: {problems[0]}")


# -------------------------------------------------------------------------------------- training
def _stack(dim: int = 64, blocks: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim),
                                                     torch.nn.GELU()) for _ in range(blocks)])


def _train(model: torch.nn.Module, device: torch.device, steps: int = 3,
           step: Optional[Callable[[], None]] = None, opt: Any = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` AdamW steps on fixed batches; returns the losses and the full parameters."""
    from torch.distributed.tensor import DTensor

    opt = opt if opt is not None else torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for i in range(steps):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i)).to(device)
        loss = model(x).float().square().mean()
        loss.backward()
        (step or opt.step)()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
              for n, p in model.named_parameters()}
    return losses, params


def _sharded(runtime: str, device: torch.device, mesh: Any = None, bf16: bool = False,
             compiled: bool = False) -> torch.nn.Module:
    import overlap

    model = _stack().to(device)
    for module in (*model, model):
        if compiled and module is not model:
            module.compile()
        if runtime == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
            fully_shard(module, mesh=mesh, mp_policy=policy)
        else:
            mp = overlap.MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None
            overlap.shard(module, mesh=mesh, mp=mp)
    return model


def training_checks(rank: int, world: int, device_type: str) -> list[tuple[str, bool, str]]:
    """On a 1-rank process group (a ``run_distributed`` rank function): (check, passed, detail) per
    training comparison of the module docstring."""
    import overlap
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (world,))
    out = []

    def bitwise(name: str, a: tuple[list[float], dict], b: tuple[list[float], dict]) -> None:
        same = a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in b[1])
        worst = max((a[1][k] - b[1][k]).abs().max().item() for k in b[1])
        out.append((name, same, f"losses {a[0][-1]:.6g} vs {b[0][-1]:.6g}, max |param diff| {worst:.3g}"))

    plain = _train(_stack().to(device), device)
    ours = _train(_sharded("overlap", device, mesh), device)
    bitwise("fp32 vs unsharded", ours, plain)
    bitwise("fp32 vs FSDP2", ours, _train(_sharded("fsdp2", device, mesh), device))
    bitwise("bf16 vs FSDP2", _train(_sharded("overlap", device, mesh, bf16=True), device),
            _train(_sharded("fsdp2", device, mesh, bf16=True), device))
    model = _sharded("overlap", device, mesh)
    in_backward = overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2, foreach=False)
    bitwise("optimizer in backward vs plain step", _train(model, device, step=in_backward.step, opt=in_backward),
            ours)
    hsdp = init_device_mesh(device_type, (1, world), mesh_dim_names=("replicate", "shard"))
    bitwise("1x1 HSDP vs FSDP2", _train(_sharded("overlap", device, hsdp), device),
            _train(_sharded("fsdp2", device, hsdp), device))
    compiled = _train(_sharded("overlap", device, mesh, compiled=True), device)
    worst = max(abs(a - b) / abs(b) for a, b in zip(compiled[0], ours[0]))
    out.append(("compiled blocks vs eager", worst <= 1e-5, f"max relative loss difference {worst:.2g} (<= 1e-5)"))
    return out


def _training_row() -> CheckRow:
    from overlap.testing import run_distributed

    start = time.perf_counter()
    (results,) = run_distributed(training_checks, 1, "cuda", backend="nccl", timeout=240)
    failed = [f"{name}: {detail}" for name, ok, detail in results if not ok]
    names = ", ".join(name for name, _, _ in results)
    return CheckRow("training (NCCL, world 1)", not failed, time.perf_counter() - start,
                    names if not failed else "; ".join(failed))


# ------------------------------------------------------------------------- streams and CUDA graphs
def _beside_compute(rank: int, world: int) -> dict[str, float]:
    """A 0.1 s+ sleep on the all-gather stream (the slow link) before an all-gather; matmuls issued
    after the all-gather on the compute stream; event times of both. The same round runs once with
    a short sleep first, so that every kernel of it is loaded before the timed round: a kernel's first
    launch would wait for the sleep ([Note: first launches synchronize] in ``overlap/streams.py``)."""
    import overlap
    from overlap.streams import comm_stream

    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1 << 20, device=dev)
    stream = comm_stream(dev, "all_gather")

    def timed_round(sleep_cycles: int) -> dict[str, float]:
        a = torch.randn(1024, 1024, device=dev)
        torch.cuda.synchronize()
        start, comm_done, compute_done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(sleep_cycles)
        y = overlap.all_gather(x)
        comm_done.record(stream)
        for _ in range(8):
            a = (a @ a).tanh()
        compute_done.record()
        equal = bool(torch.equal(y * 1, x))
        torch.cuda.synchronize()
        return {"comm_ms": start.elapsed_time(comm_done), "compute_ms": start.elapsed_time(compute_done),
                "equal": float(equal)}

    timed_round(1000)
    return timed_round(200_000_000)


def _streams_row() -> CheckRow:
    from overlap.testing import run_distributed

    start = time.perf_counter()
    (r,) = run_distributed(_beside_compute, 1, backend="nccl", timeout=120)
    ok = r["equal"] == 1.0 and r["compute_ms"] < r["comm_ms"]
    return CheckRow("streams", ok, time.perf_counter() - start,
                    f"compute done at {r['compute_ms']:.1f} ms, the collective behind a slow link at "
                    f"{r['comm_ms']:.1f} ms (compute must finish first)")


def _cuda_graph_row(device: torch.device) -> CheckRow:
    """Capture the four packing ops once, replay on new data, compare each replay with the refs."""
    from overlap_kernels import (ShardLayout, all_gather_copy_in, all_gather_copy_in_ref, all_gather_copy_out,
                         all_gather_copy_out_ref, reduce_scatter_copy_in, reduce_scatter_copy_in_ref,
                         reduce_scatter_copy_out, reduce_scatter_copy_out_ref)

    start = time.perf_counter()
    shapes, w, r = [(13, 5), (7,), (), (64, 129)], 4, 1
    layout = ShardLayout(shapes, w)
    fulls = [torch.zeros(s, device=device, dtype=torch.bfloat16) for s in shapes]
    shards = [s.clone() for s in layout.shards(fulls, r)]
    ag_output = torch.zeros(layout.buffer_numel, device=device)
    rs_output = torch.zeros(layout.slot_numel, device=device)
    grads = [torch.zeros(s, device=device) for s in layout.shard_shapes(r)]
    outs = [torch.empty(s, device=device) for s in shapes]

    def ops() -> tuple[torch.Tensor, torch.Tensor]:
        ag_input, _ = all_gather_copy_in(shards, layout, r, torch.float32)
        all_gather_copy_out(ag_output, layout, outs)
        rs_input = reduce_scatter_copy_in(fulls, layout, 0.5, torch.float32)
        reduce_scatter_copy_out(rs_output, grads, layout, r, 0.25, True)
        return ag_input, rs_input

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        ops()  # warm-up outside capture: compiles, tables built
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops()
    problems = []
    for replay in range(3):
        new = [_data(s, torch.bfloat16, 10 * replay + i) for i, s in enumerate(shapes)]
        for f, n in zip(fulls, new):
            f.copy_(n)
        for s, n in zip(shards, layout.shards(new, r)):
            s.copy_(n)
        ag_cpu, rs_cpu = _data((layout.buffer_numel,), torch.float32, 77 + replay), _data((layout.slot_numel,),
                                                                                          torch.float32, 88 + replay)
        ag_output.copy_(ag_cpu)
        rs_output.copy_(rs_cpu)
        before = [g.cpu() for g in grads]
        graph.replay()
        torch.cuda.synchronize(device)
        want_grads = [g.clone() for g in before]
        reduce_scatter_copy_out_ref(rs_cpu, want_grads, layout, r, 0.25, True)
        checks = [
            (captured[0], all_gather_copy_in_ref(layout.shards(new, r), layout, r, torch.float32)[0]),
            (captured[1], reduce_scatter_copy_in_ref(new, layout, 0.5, torch.float32)),
            *zip(outs, all_gather_copy_out_ref(ag_cpu, layout, [torch.empty(s) for s in shapes])),
            *zip(grads, want_grads),
        ]
        if not all(_same_values(g, e) for g, e in checks):
            problems.append(f"replay {replay}")
    return CheckRow("cuda graphs", not problems, time.perf_counter() - start,
                    "4 ops captured once, 3 replays on new data" + (f"; wrong: {problems}" if problems else ""))


# ---------------------------------------------------------------------------- subprocess rows
BENCHMARKS = {"bench_kernels": ["--device", "cuda", "--quick", "--quantized-blocks-per-program", "1", "0",
                                  "--quantized-scale", "1"],
              "bench_host_bound": ["--repeats", "5"]}
"""The benchmark rows: script under ``benchmarks/`` -> its options (``--markdown`` is added). The
quantized kernels are timed at one block per program and at the runtime's choice, side by side, on
full-size workloads (issue 30's bandwidth goal is on large workloads; the other tables keep ``--quick``)."""


def _subprocess_row(name: str, argv: list[str], needs: Path, timeout: float,
                    summary: Callable[[str], str], log_dir: Optional[Path] = None) -> CheckRow:
    return _started_row(name, argv, needs, summary, log_dir)(timeout)


def log_path(log_dir: Path, name: str) -> Path:
    """Where a subprocess row's whole output goes under ``--log-dir``: the row's name with every run
    of characters other than letters and digits made one ``-`` (``default suite`` -> ``default-suite.log``)."""
    return log_dir / (re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") + ".log")


def _started_row(name: str, argv: list[str], needs: Path, summary: Callable[[str], str],
                 log_dir: Optional[Path] = None) -> Callable[[float], CheckRow]:
    """Start ``argv`` (from the checkout, with it on ``PYTHONPATH``) now; the returned function waits
    up to ``timeout`` seconds for it and makes its row. With ``log_dir`` the process's whole output
    (stdout and stderr) is also written to ``log_path(log_dir, name)``, also when its time is up."""
    if not needs.exists():
        return lambda timeout: CheckRow(name, None, 0.0, f"{needs} is not here (an installed package): run from a checkout")
    start = time.perf_counter()
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=path))

    def finish(timeout: float) -> CheckRow:
        try:
            output, _ = proc.communicate(timeout=max(0.0, timeout - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            _write_log(log_dir, name, output)
            return CheckRow(name, False, time.perf_counter() - start, f"did not finish in {timeout:.0f} s")
        _write_log(log_dir, name, output)
        detail = summary(output) if proc.returncode == 0 else f"exit {proc.returncode}: {output.strip()[-300:]}"
        return CheckRow(name, proc.returncode == 0, time.perf_counter() - start, detail)

    return finish


def _write_log(log_dir: Optional[Path], name: str, output: Optional[str]) -> None:
    if log_dir is not None:
        log_path(log_dir, name).write_text(output or "")


def _pytest_summary(output: str) -> str:
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error).*?)(?: in [\d.]+s.*)?=*$", output, re.M)
    return found[-1].strip() if found else output.strip()[-200:]


# ------------------------------------------------------------------------------------------ table
_STATUS = {True: "PASS", False: "FAIL", None: "SKIP"}


def format_table(rows: Sequence[CheckRow], title: str) -> str:
    """The table the command prints: one line per row (PASS / FAIL / SKIP, seconds, detail)."""
    status = _STATUS
    width = max(len(r.name) for r in rows)
    lines = [title, f"{'check':<{width}}  result  seconds  detail"]
    lines += [f"{r.name:<{width}}  {status[r.ok]:<6}  {r.seconds:7.1f}  {r.detail}" for r in rows]
    failed = [r.name for r in rows if r.ok is False]
    lines.append(f"FAILED: {', '.join(failed)}" if failed else "all checks that ran passed")
    return "\n".join(lines)


def native_passes_row(device: torch.device) -> CheckRow:
    """The native passes built (or found built) and loaded, each against its Python definition on
    ``device``'s tensors; SKIP where this machine cannot build them (no compiler, no Python headers,
    turned off), FAIL where it should have and did not, or a pass differs."""
    from overlap_kernels import native_passes

    start = time.perf_counter()
    module = native_passes.loaded()
    status = native_passes.status()
    if module is None:
        cannot = status.startswith(("unavailable: no ", "unavailable: built on Linux only", "off"))
        return CheckRow("native passes", None if cannot else False, time.perf_counter() - start,
                        f"{status}; the Python passes run")
    built_s = time.perf_counter() - start
    tensors = [torch.randn(5, device=device), torch.zeros(3, 4, dtype=torch.bfloat16, device=device).t(),
               torch.nn.Parameter(torch.zeros(2, 1, device=device)), torch.empty(0, device=device)]
    problems = []
    if native_passes.address_column(native_passes.addresses(tensors)).tolist() != [t.data_ptr() for t in tensors]:
        problems.append("addresses")
    if native_passes.contiguous(tensors) is not all(t.is_contiguous() for t in tensors):
        problems.append("contiguous")
    if native_passes.dtypes(tensors) != tuple(t.dtype for t in tensors):
        problems.append("dtypes")
    description = native_passes.describe(tensors)
    elsewhere = [torch.empty_like(t, device="meta") for t in tensors]  # the same but for the device
    if description is None or not description.matches(tensors) or description.matches(elsewhere):
        problems.append("guard")
    versions = [t._version for t in tensors]
    native_passes.increment_version(tensors)
    if [t._version for t in tensors] != [v + 1 for v in versions]:
        problems.append("increment_version")
    detail = f"loaded in {built_s:.1f} s (built if new); " + (
        f"differs from the Python definition: {', '.join(problems)}" if problems
        else "addresses, contiguous, dtypes, guard, increment_version equal their Python definitions")
    return CheckRow("native passes", not problems, time.perf_counter() - start, detail)


def _reported(row: CheckRow) -> CheckRow:
    """``row``, after one progress line on stderr: what finished is known even if the check is cut off
    before its table (a machine's time limit)."""
    print(f"check-gpu: {row.name}: {_STATUS[row.ok]} in {row.seconds:.1f} s: {row.detail}", file=sys.stderr,
          flush=True)
    return row


def _guarded(name: str, fn: Callable[[], CheckRow]) -> CheckRow:
    """A row from ``fn``; an exception fails the row (with its message) instead of ending the check."""
    start = time.perf_counter()
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- every row must be reported
        return CheckRow(name, False, time.perf_counter() - start, f"{type(e).__name__}: {str(e).strip()[-400:]}")


SUITE_SECONDS = 420
"""Time limit of the opt-in ``default suite`` row (the suite took 237-261 s with 14 workers on an
H100 machine's 16 cores)."""


def suite_argv(python: str, cpus: int, has_xdist: bool) -> list[str]:
    """The opt-in ``default suite`` row's command: the CPU suite's default selection (GPU tests
    included) with one xdist worker per core but two, so the rows' own ranks have cores left. Its
    summary lists failures, errors and each skip with its reason (``-rfEs``): which tests a GPU
    machine skips is part of what the row proves."""
    workers = ["-n", str(max(1, cpus - 2))] if has_xdist else []
    return [python, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *workers, "tests"]


def main(skip_bench: bool = False, suite: bool = False, log_dir: Optional[Path] = None) -> int:
    """Run every row on the current CUDA device and print the table; 0 all passed, 1 a row failed,
    2 no CUDA device. ``suite``: also run the default test suite, last and alone (a row of its own).
    ``log_dir`` (created): each subprocess row's whole output goes to a file there (``log_path``)."""
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("check-gpu: no CUDA device is visible (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import triton

    device = torch.device("cuda", torch.cuda.current_device())
    python = sys.executable
    native = _reported(_guarded("native passes", lambda: native_passes_row(device)))
    # The GPU tests run in their own process beside the in-process rows (both only check values; the
    # benchmarks below run alone): the whole check then fits its five minutes on one H100.
    gpu_tests = _started_row("gpu tests", [python, "-m", "pytest", "-m", "gpu", "-q", "-n", "0", "-p",
                                           "no:cacheprovider", "tests"], REPO / "tests", _pytest_summary, log_dir)
    rows = [
        _reported(_guarded("packing ops", lambda: _packing_row(device))),
        _reported(_guarded("training (NCCL, world 1)", _training_row)),
        _reported(_guarded("streams", _streams_row)),
        _reported(_guarded("cuda graphs", lambda: _cuda_graph_row(device))),
    ]
    rows[:0] = [native, _reported(gpu_tests(240))]
    for bench, options in BENCHMARKS.items():
        if skip_bench:
            rows.append(CheckRow(bench, None, 0.0, "--skip-bench"))
            continue
        script = f"benchmarks/{bench}.py"
        rows.append(_reported(_subprocess_row(
            bench, [python, script, *options, "--markdown", "benchmarks/RESULTS.md"], REPO / script, 240,
            lambda out: "tables appended to benchmarks/RESULTS.md", log_dir)))
    if suite:
        import importlib.util

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        argv = suite_argv(python, cpus, importlib.util.find_spec("xdist") is not None)
        rows.append(_reported(_subprocess_row("default suite", argv, REPO / "tests", SUITE_SECONDS,
                                              _pytest_summary, log_dir)))
    title = (f"overlap check-gpu: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
             f"Triton {triton.__version__}, CUDA {torch.version.cuda}, Python {sys.version.split()[0]}")
    print(format_table(rows, title), flush=True)
    return 1 if any(r.ok is False for r in rows) else 0
