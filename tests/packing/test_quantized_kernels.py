"""The block-quantized packing ops (``overlap_kernels.quantized_*``), int8 and fp8 (e4m3) codes: Triton against
the torch fallback, round trips within the stated per-block error bound, zero blocks, NaN / inf, tails,
every dtype pair; fp8's encoding against torch's ``float8_e4m3fn`` cast on every code and every tie.

Paths: ``triton`` launches the kernels (under ``TRITON_INTERPRET=1`` on CPU, set by conftest; skipped
with the reason when Triton does not run CPU tensors in this process); ``torch`` is the fallback
(``_*_torch``) CPUs run without the interpreter. The two must agree bit for bit ([Note: why the
arithmetic is bitwise portable] in ``overlap_kernels/block_quantization.py``): every comparison between
them is ``torch.equal`` on the bytes.

The error bound ([Note: the per-block error bound]) is checked against an independent computation
of each element's block: a parameter's shard, flattened, cut into chunks of ``block`` from its
first element (blocks never span parameters: [Note: quantized slots]).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from overlap_kernels import ShardLayout, _launch, quantized_layout  # noqa: E402
from overlap_kernels.block_quantization import FORMATS, QMAX, error_bound  # noqa: E402
from overlap_kernels.quantized_all_gather_copy_out import (  # noqa: E402
    _quantized_all_gather_copy_out, _quantized_all_gather_copy_out_torch, quantized_all_gather_copy_out)
from overlap_kernels.quantized_copy_in import (  # noqa: E402
    _quantized_copy_in, _quantized_copy_in_torch, quantized_all_gather_copy_in, quantized_reduce_scatter_copy_in)
from overlap_kernels.quantized_layout import BLOCKS, QuantizedLayout, _programs  # noqa: E402
from overlap_kernels.quantized_reduce_scatter_copy_out import (  # noqa: E402
    _quantized_reduce_scatter_copy_out, _quantized_reduce_scatter_copy_out_torch, quantized_reduce_scatter_copy_out)
from models import block_absmax  # noqa: E402

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
FLOATS = (f32, bf16, f16)
CPU = torch.device("cpu")
TRITON_ON_CPU = _launch.triton_enabled(CPU)
requires_triton_on_cpu = pytest.mark.skipif(
    not TRITON_ON_CPU, reason="Triton runs CPU tensors only under TRITON_INTERPRET=1 (conftest sets it without a GPU)")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
examples = settings(suppress_health_check=[HealthCheck.too_slow, *settings().suppress_health_check], deadline=None)
half_examples = settings(examples, max_examples=max(1, settings().max_examples // 2))
"""For a test whose example runs every op under the interpreter: half the profile's examples (the
bitwise test took 30-34 s of the 2-core CI box at 50; "long" still explores 40x more)."""

DIMS = st.sampled_from([0, 1, 2, 3, 7, 16, 17, 31, 33])
SHAPE = st.lists(DIMS, min_size=0, max_size=2).filter(lambda s: math.prod(s) <= 700).map(tuple)
SHAPES = st.lists(SHAPE, min_size=1, max_size=4)
DTYPES = st.lists(st.sampled_from(FLOATS), min_size=1, max_size=3)
BLOCK = st.sampled_from([32, 64, 256])
FORMAT = st.sampled_from(FORMATS)
PER_PROGRAM = st.sampled_from([None, 1, 2, 4, 8])
"""Blocks per kernel program ([Note: several blocks per program]); None: ``blocks_per_program``'s."""


@contextlib.contextmanager
def _blocks_per_program(per_program: int | None) -> Iterator[None]:
    """The quantized kernels launched with ``per_program`` blocks per program (None: the choice)."""
    saved = quantized_layout.BLOCKS_PER_PROGRAM
    quantized_layout.BLOCKS_PER_PROGRAM = per_program
    try:
        yield
    finally:
        quantized_layout.BLOCKS_PER_PROGRAM = saved


def _tensors(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype], seed: int,
             zero_every: int = 0) -> list[torch.Tensor]:
    """Random values over several magnitudes (so blocks have different scales), dtypes cycled; with
    ``zero_every``, every ``zero_every``-th tensor is all zeros."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        x = torch.randn(shape, generator=gen) * 10.0 ** float(torch.randint(-3, 3, (), generator=gen))
        if zero_every and i % zero_every == 0:
            x.zero_()
        out.append(x.to(dtypes[i % len(dtypes)]))
    return out


def _gathered(fulls: Sequence[torch.Tensor], qlayout: QuantizedLayout, copy_in=_quantized_copy_in) -> torch.Tensor:
    """Every rank's copy-in, then the all-gather, simulated: the quantized buffer all ranks receive."""
    layout = qlayout.layout
    buffer = torch.empty(qlayout.buffer_bytes, dtype=torch.uint8)
    for r in range(layout.world_size):
        q_input, _ = copy_in([layout.shard(t, r) for t in fulls], qlayout, r)
        buffer.view(layout.world_size, -1)[r] = q_input
    return buffer


def _run(path: str, fn_triton, fn_torch, *args):
    """The op on ``path``: the launcher with Triton enabled, or the torch fallback."""
    if path == "triton":
        return fn_triton(*args)
    with _launch.torch_fallback_on_cpu():
        return fn_torch(*args)


# --------------------------------------------------------------------- triton == torch, bit for bit
@requires_triton_on_cpu
@half_examples
@given(shapes=SHAPES, world=st.integers(1, 5), dtypes=DTYPES, block=BLOCK, seed=st.integers(0, 2**16),
       data=st.data(), format=FORMAT)
def test_triton_and_torch_fallback_are_bitwise_equal(shapes, world, dtypes, block, seed, data, format) -> None:
    """All three ops, both formats, every dtype mix in and out, odd shapes (tails, empty and 0-dim
    shards), zero blocks, with 1 to 8 blocks per kernel program (parameters whose block count they
    do not divide) and the runtime's choice."""
    with _blocks_per_program(data.draw(PER_PROGRAM, label="blocks per program")):
        _check_bitwise_equal(shapes, world, dtypes, block, seed, data, format)


def _check_bitwise_equal(shapes, world, dtypes, block, seed, data, format) -> None:
    layout = ShardLayout(shapes, world)
    qlayout = QuantizedLayout(layout, block, format)
    fulls = _tensors(shapes, dtypes, seed, zero_every=3)
    rank = data.draw(st.integers(0, world - 1), label="rank")
    shards = [layout.shard(t, rank) for t in fulls]
    # gather copy-in: this rank's slot
    q_triton = _quantized_copy_in(shards, qlayout, rank)[0]
    q_torch = torch.empty(qlayout.buffer_bytes, dtype=torch.uint8)
    _quantized_copy_in_torch(shards, qlayout, rank, q_torch)
    assert torch.equal(q_triton, q_torch.view(world, -1)[rank])
    # gather copy-out into outs of drawn dtypes
    buffer = _gathered(fulls, qlayout)
    out_dtypes = data.draw(st.lists(st.sampled_from(FLOATS), min_size=len(shapes), max_size=len(shapes)))
    outs_triton = [torch.empty(s, dtype=d) for s, d in zip(shapes, out_dtypes)]
    outs_torch = [torch.empty(s, dtype=d) for s, d in zip(shapes, out_dtypes)]
    _quantized_all_gather_copy_out(buffer, qlayout, outs_triton)
    _quantized_all_gather_copy_out_torch(buffer, qlayout, outs_torch)
    for a, b in zip(outs_triton, outs_torch):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    # reduce: scale (1 / world is the runtime's average), accumulate, drawn grad dtypes
    scale = data.draw(st.sampled_from([None, 1 / world, 0.5, 1 / 3]), label="scale")
    _check_reduce_bitwise_equal(fulls, qlayout, [rank], out_dtypes, seed, scale, data.draw(st.booleans(), label="accumulate"))


def _check_reduce_bitwise_equal(fulls, qlayout, ranks, grad_dtypes, seed, scale, accumulate) -> None:
    """The reduce copy-in of ``fulls`` (every slot) and, on each of ``ranks``, the reduce copy-out
    into gradients of ``grad_dtypes`` (``scale``, ``accumulate``): Triton and torch bit for bit."""
    layout = qlayout.layout
    r_triton = _quantized_copy_in(fulls, qlayout, None)[0]
    r_torch = torch.empty(qlayout.buffer_bytes, dtype=torch.uint8)
    _quantized_copy_in_torch(fulls, qlayout, None, r_torch)
    assert torch.equal(r_triton, r_torch)
    for rank in ranks:
        olds = _tensors([layout.shard_shape(i, rank) for i in range(len(fulls))], grad_dtypes, seed + 1)
        grads_triton, grads_torch = [g.clone() for g in olds], [g.clone() for g in olds]
        _quantized_reduce_scatter_copy_out(r_triton, grads_triton, qlayout, rank, scale, accumulate)
        _quantized_reduce_scatter_copy_out_torch(r_torch, grads_torch, qlayout, rank, scale, accumulate)
        for a, b in zip(grads_triton, grads_torch):
            assert torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b)), (rank, scale, accumulate)


@requires_triton_on_cpu
@pytest.mark.parametrize("format", FORMATS)
def test_the_runtime_average_over_4_ranks_is_bitwise_equal(format: str) -> None:
    """The post-scale the runtime passes at world size 4 (1 / 4; the drawn test above reaches it only
    when it draws world 4 and that scale), with and without accumulation, on every rank: shards with
    tails, an empty last shard, a zero block, mixed gradient dtypes."""
    shapes, dtypes = [(70, 3), (9,), (300,), (5, 7)], [f32, bf16, f16, f32]
    qlayout = QuantizedLayout(ShardLayout(shapes, 4), 32, format)
    fulls = _tensors(shapes, dtypes, seed=4, zero_every=3)
    for accumulate in (False, True):
        _check_reduce_bitwise_equal(fulls, qlayout, range(4), [bf16, f32, f16, bf16], 4, 1 / 4, accumulate)


@requires_triton_on_cpu
@pytest.mark.parametrize("per_program", [1, 4, None])
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("vector_path", [True, False])
def test_the_aligned_full_block_path_changes_no_bit(monkeypatch, vector_path: bool, format: str,
                                                    per_program: int | None) -> None:
    """[Note: the aligned full-block path] on and off, against the torch fallback: parameters with
    many full blocks (with 4 blocks per program: two full programs per shard, and one of six blocks:
    a full program and a two-block one), one whose tensors start 4 bytes past an aligned address (no
    block of it is aligned), one with a tail, mixed dtypes, two ranks."""
    monkeypatch.setattr(quantized_layout, "VECTOR_PATH", vector_path)
    monkeypatch.setattr(quantized_layout, "BLOCKS_PER_PROGRAM", per_program)
    shapes = [(8, 64), (130,), (3, 64), (12, 32)]
    layout = ShardLayout(shapes, 2)
    qlayout = QuantizedLayout(layout, 32, format)
    fulls = _tensors(shapes, [f32, bf16, f32, bf16], seed=3)
    fulls[2] = torch.empty(fulls[2].numel() + 1)[1:].view(fulls[2].shape).copy_(fulls[2])  # misaligned
    for rank in range(2):
        shards = [layout.shard(t, rank) for t in fulls]
        q_torch = torch.empty(qlayout.buffer_bytes, dtype=torch.uint8)
        _quantized_copy_in_torch(shards, qlayout, rank, q_torch)
        assert torch.equal(_quantized_copy_in(shards, qlayout, rank)[0], q_torch.view(2, -1)[rank])
    buffer = _gathered(fulls, qlayout)
    outs = [[torch.empty(s, dtype=d) for s, d in zip(shapes, (bf16, f32, f32, f16))] for _ in range(2)]
    outs[0][2] = torch.empty(outs[0][2].numel() + 1)[1:].view(shapes[2])  # a misaligned output too
    outs[1][2] = torch.empty(outs[1][2].numel() + 1)[1:].view(shapes[2])
    _quantized_all_gather_copy_out(buffer, qlayout, outs[0])
    _quantized_all_gather_copy_out_torch(buffer, qlayout, outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    received = _quantized_copy_in(fulls, qlayout, None)[0]
    r_torch = torch.empty(qlayout.buffer_bytes, dtype=torch.uint8)
    _quantized_copy_in_torch(fulls, qlayout, None, r_torch)
    assert torch.equal(received, r_torch)
    olds = _tensors([layout.shard_shape(i, 1) for i in range(4)], [f32, f32, bf16, f16], seed=4)
    grads = [[g.clone() for g in olds] for _ in range(2)]
    _quantized_reduce_scatter_copy_out(received, grads[0], qlayout, 1, 0.5, True)
    _quantized_reduce_scatter_copy_out_torch(received, grads[1], qlayout, 1, 0.5, True)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ----------------------------------------------------------------------------- round trip, bounds
BOUND_PATHS = [pytest.param("triton", marks=pytest.mark.slow), "torch"]
"""The bound tests' paths: the interpreted Triton one only under ``slow``. By default the bounds are
checked on the torch fallback, and ``test_triton_and_torch_fallback_are_bitwise_equal`` checks that
the kernels give the fallback's bytes for all three ops on the same drawn shapes, worlds, dtypes,
blocks and formats (with scales and accumulation): the bounds hold for the kernels' results too."""


@pytest.mark.parametrize("path", BOUND_PATHS)
@examples
@given(shapes=SHAPES, world=st.integers(1, 5), dtypes=DTYPES, block=BLOCK, seed=st.integers(0, 2**16),
       out_dtype=st.sampled_from(FLOATS), format=FORMAT)
def test_gather_round_trip_within_the_per_block_bound(path, shapes, world, dtypes, block, seed, out_dtype,
                                                      format) -> None:
    """Copy-in on every rank, all-gather, copy-out: each element within its block's bound in float32;
    a 16-bit out is the float32 result cast; zero blocks come back as zeros; int8 codes stay in
    +-127, fp8 codes are never NaN (0x7F / 0xFF). The Triton path runs under ``slow``
    (:data:`BOUND_PATHS`: test_triton_and_torch_fallback_are_bitwise_equal covers it by default)."""
    if path == "triton" and not TRITON_ON_CPU:
        pytest.skip("Triton runs CPU tensors only under TRITON_INTERPRET=1")
    layout = ShardLayout(shapes, world)
    qlayout = QuantizedLayout(layout, block, format)
    fulls = _tensors(shapes, dtypes, seed, zero_every=2)
    copy_in = _quantized_copy_in if path == "triton" else _torch_copy_in
    buffer = _gathered(fulls, qlayout, copy_in)
    outs32 = [torch.empty(s, dtype=f32) for s in shapes]
    outs = [torch.empty(s, dtype=out_dtype) for s in shapes]
    _run(path, _quantized_all_gather_copy_out, _quantized_all_gather_copy_out, buffer, qlayout, outs32)
    _run(path, _quantized_all_gather_copy_out, _quantized_all_gather_copy_out, buffer, qlayout, outs)
    for full, got32, got in zip(fulls, outs32, outs):
        assert torch.equal(got, got32.to(out_dtype))
        for r in range(world):
            x, y = layout.shard(full, r).float(), layout.shard(got32, r)
            absmax = block_absmax(x, block)
            assert ((x - y).abs() <= error_bound(absmax, x, format)).all(), (x, y)
            assert torch.equal(y[absmax == 0], torch.zeros_like(y[absmax == 0]))  # zero blocks stay zero
    scales = qlayout.scales(buffer)
    codes = qlayout.codes(buffer).long()
    assert (scales >= 0).all()
    if format == "int8":
        assert (codes.abs() <= QMAX).all()
    else:
        assert not ((codes & 0x7F) == 0x7F).any()


def _torch_copy_in(tensors, qlayout, rank):
    with _launch.torch_fallback_on_cpu():
        return _quantized_copy_in(tensors, qlayout, rank)


@pytest.mark.parametrize("path", BOUND_PATHS)
@examples
@given(shapes=SHAPES, world=st.integers(1, 4), dtypes=DTYPES, block=BLOCK, seed=st.integers(0, 2**16),
       data=st.data(), format=FORMAT)
def test_reduce_averages_within_the_summed_bounds(path, shapes, world, dtypes, block, seed, data, format) -> None:
    """Each rank quantizes its full gradients, the all-to-all is simulated, each owner sums in float32
    and scales by 1/w: within ``sum_s bound_s / w`` (plus float32 rounding of the sum) of the exact
    mean, in every element; with ``accumulate`` the result is ``float32(old) + that``, cast. The
    Triton path runs under ``slow`` (:data:`BOUND_PATHS`: test_triton_and_torch_fallback_are_bitwise_equal
    covers it by default)."""
    if path == "triton" and not TRITON_ON_CPU:
        pytest.skip("Triton runs CPU tensors only under TRITON_INTERPRET=1")
    layout = ShardLayout(shapes, world)
    qlayout = QuantizedLayout(layout, block, format)
    per_rank = [_tensors(shapes, dtypes, seed + s) for s in range(world)]
    copy_in = _quantized_copy_in if path == "triton" else _torch_copy_in
    inputs = [copy_in(g, qlayout, None)[0].view(world, -1) for g in per_rank]
    out_dtype = data.draw(st.sampled_from(FLOATS), label="out dtype")
    for r in range(world):
        received = torch.stack([inputs[s][r] for s in range(world)]).view(-1)
        got = [torch.empty(layout.shard_shape(i, r)) for i in range(len(shapes))]
        _run(path, _quantized_reduce_scatter_copy_out, _quantized_reduce_scatter_copy_out,
             received, got, qlayout, r, 1.0 / world, False)
        for i, g in enumerate(got):
            xs = [layout.shard(per_rank[s][i], r).float() for s in range(world)]
            exact = sum(xs) / world
            bound = sum(error_bound(block_absmax(x, block), x, format) for x in xs) / world
            slack = sum(x.abs() for x in xs) * world * 2**-23 / world  # float32 sum and scale
            assert ((g - exact).abs() <= bound + slack).all(), (g, exact)
        olds = _tensors([layout.shard_shape(i, r) for i in range(len(shapes))], [out_dtype], seed)
        acc = [o.clone() for o in olds]
        _run(path, _quantized_reduce_scatter_copy_out, _quantized_reduce_scatter_copy_out,
             received, acc, qlayout, r, 1.0 / world, True)
        for a, o, g in zip(acc, olds, got):
            assert torch.equal(a, (o.float() + g).to(out_dtype))


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_a_tie_rounds_half_to_even_and_reaches_half_a_step(path: str) -> None:
    """31 and 15.5 in one block: 15.5 / (31 / 127) is 63.5 exactly, rounded to the even 64, and the
    error exceeds ``absmax / 254`` (the rounded scale is above 31 / 127) but stays within the bound."""
    if path == "triton" and not TRITON_ON_CPU:
        pytest.skip("Triton runs CPU tensors only under TRITON_INTERPRET=1")
    qlayout = QuantizedLayout(ShardLayout([(2,)], 1), 32)
    x = torch.tensor([31.0, 15.5])
    ctx = _launch.torch_fallback_on_cpu() if path == "torch" else _nothing()
    with ctx:
        buffer = quantized_all_gather_copy_in([x], qlayout, 0)[1]
        y = quantized_all_gather_copy_out(buffer, qlayout)[0]
    assert qlayout.codes(buffer)[0, :2].tolist() == [127, 64]
    error = (y - x).abs()[1]
    assert 31 / 254 < error <= error_bound(torch.tensor(31.0))


def _e4m3_probe_values() -> torch.Tensor:
    """Every finite positive e4m3 value, every midpoint between neighbours (0 and the smallest
    subnormal included), each midpoint one float32 step below and above, and their negatives and
    -0.0: 448 first, so a block holding them has scale 448 / 448 = 1 and ``x / scale`` is ``x``."""
    values = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0x01 .. 0x7E
    lower = torch.cat([torch.zeros(1), values[:-1]])
    mids = (lower + values) / 2  # exact in float32
    below = torch.nextafter(mids, torch.zeros(1))
    above = torch.nextafter(mids, torch.full((1,), 1000.0))
    pos = torch.cat([values.flip(0), mids, below, above])
    return torch.cat([pos, -pos, torch.tensor([0.0, -0.0])])


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_fp8_codes_are_torchs_float8_e4m3fn_cast_on_every_code_and_tie(path: str) -> None:
    """The kernels' integer e4m3 encoding (and decoding) against torch's own ``float8_e4m3fn``
    casts, on every code, every tie (rounded to even) and its float32 neighbours, with scale 1."""
    if path == "triton" and not TRITON_ON_CPU:
        pytest.skip("Triton runs CPU tensors only under TRITON_INTERPRET=1")
    x = _e4m3_probe_values()
    qlayout = QuantizedLayout(ShardLayout([tuple(x.shape)], 1), 4096, "fp8")
    assert x.numel() <= 4096 and x[0] == 448.0
    ctx = _launch.torch_fallback_on_cpu() if path == "torch" else _nothing()
    with ctx:
        buffer = quantized_all_gather_copy_in([x], qlayout, 0)[1]
        y = quantized_all_gather_copy_out(buffer, qlayout)[0]
    expected = x.to(torch.float8_e4m3fn)
    assert qlayout.scales(buffer).tolist() == [[1.0]]
    assert torch.equal(qlayout.codes(buffer)[0, : x.numel()].view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(y.view(torch.int32), expected.float().view(torch.int32))  # -0.0 stays -0.0


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_fp8_tie_reaches_a_seventeenth_and_subnormals_round_to_even(path: str) -> None:
    """448 sets scale 1: 1.0625 (the tie between 1 and 1.125) rounds to the even 1.0, an error of
    exactly ``|x| / 17`` (the bound's relative term is reached); 2**-10 (half the smallest
    subnormal) rounds to 0, 3 * 2**-10 to 2**-8 (even)."""
    if path == "triton" and not TRITON_ON_CPU:
        pytest.skip("Triton runs CPU tensors only under TRITON_INTERPRET=1")
    x = torch.tensor([448.0, 1.0625, 2**-10, 3 * 2**-10])
    qlayout = QuantizedLayout(ShardLayout([(4,)], 1), 32, "fp8")
    ctx = _launch.torch_fallback_on_cpu() if path == "torch" else _nothing()
    with ctx:
        y = quantized_all_gather_copy_out(quantized_all_gather_copy_in([x], qlayout, 0)[1], qlayout)[0]
    assert y.tolist() == [448.0, 1.0, 0.0, 2**-8]
    assert (x - y).abs()[1] == x[1] / 17
    assert ((x - y).abs() <= error_bound(torch.full((4,), 448.0), x, "fp8")).all()


def _both_paths() -> list[str]:
    """The paths this process runs: the torch fallback, and Triton where it runs CPU tensors."""
    return (["triton"] if TRITON_ON_CPU else []) + ["torch"]


@pytest.mark.parametrize("format", FORMATS)
def test_a_block_whose_scale_is_subnormal_clamps_its_codes(format: str) -> None:
    """A block whose absolute maximum is a few float32 subnormal steps (``absmax < 2**-135``): its
    scale is rounded to a multiple of 2**-149 and can come out well below ``absmax / QMAX`` (570 *
    2**-149 / 127 = 4.49 * 2**-149 rounds to 4 * 2**-149; / 448 = 1.27 * 2**-149 rounds to 2**-149),
    so ``x / scale`` exceeds the code range (142.5, 570): only the clamp keeps the codes at +-127
    (not a wrapped -128) and at e4m3's 448 (not the NaN code 0x7F). Both paths give the same bytes
    and every element stays within ``error_bound`` (int8's largest are off by 62 * 2**-149 here: its
    last term is ``2**-143``, [Note: the per-block error bound]). Catches a clamp dropped from either
    int8 path or from the fp8 kernel (no other test draws a value below 2**-135)."""
    tiny = 2.0**-149
    x = torch.tensor([570 * tiny, -570 * tiny, 300 * tiny, tiny, 0.0, -3 * tiny])
    qlayout = QuantizedLayout(ShardLayout([(6,)], 1), 32, format)
    results = []
    for path in _both_paths():
        with _launch.torch_fallback_on_cpu() if path == "torch" else _nothing():
            buffer = quantized_all_gather_copy_in([x], qlayout, 0)[1]
            y = quantized_all_gather_copy_out(buffer, qlayout)[0]
        scale, codes = qlayout.scales(buffer)[0, 0], qlayout.codes(buffer)[0, :6]
        if format == "int8":
            assert scale == 4 * tiny and codes[:2].tolist() == [127, -127], (path, scale, codes)
        else:
            assert scale == tiny and codes[:2].view(torch.float8_e4m3fn).float().tolist() == [448.0, -448.0], (path, codes)
        assert ((x - y).abs() <= error_bound(block_absmax(x, 32), x, format)).all(), (path, x - y)
        results.append((buffer, y))
    for buffer, y in results[1:]:
        assert torch.equal(buffer, results[0][0]) and torch.equal(y, results[0][1])


def test_the_owners_sum_starts_from_plus_zero_on_both_paths() -> None:
    """The reduce copy-out sums ``((0 + d_0) + d_1) + ...`` on both paths: an element whose
    dequantized versions are all -0.0 (fp8 code 0x80: a negative value below half of e4m3's smallest
    subnormal step times the scale) comes out +0.0, as from the kernel's zero-filled accumulator, with
    and without a post-scale. Only the sign tells; catches a fallback sum that starts from ``d_0``."""
    x = torch.tensor([448.0, -1e-6, 1e-6, 3.0])
    qlayout = QuantizedLayout(ShardLayout([(4,)], 1), 32, "fp8")
    with _launch.torch_fallback_on_cpu():
        received = _quantized_copy_in([x], qlayout, None)[0]
    assert qlayout.codes(received)[0, 1].item() == -128  # 0x80: e4m3's -0.0
    for path in _both_paths():
        for scale in (None, 0.5):
            out = [torch.full((4,), 7.0)]
            _run(path, _quantized_reduce_scatter_copy_out, _quantized_reduce_scatter_copy_out_torch,
                 received, out, qlayout, 0, scale, False)
            assert out[0][1] == 0 and not torch.signbit(out[0][1]), (path, scale, out)


# ------------------------------------------------------------------------------------ inf / NaN
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_an_error_never_a_finite_result(path: str, bad: float, format: str) -> None:
    """The public ops raise naming the tensor (copy-in) or the rank (copy-out); the unchecked ones
    give the block a NaN scale, and that block only comes out NaN, in every element."""
    if path == "triton" and not TRITON_ON_CPU:
        pytest.skip("Triton runs CPU tensors only under TRITON_INTERPRET=1")
    layout = ShardLayout([(100,), (40, 3)], 2)
    qlayout = QuantizedLayout(layout, 32, format)
    fulls = _tensors(layout.shapes, [f32, bf16], 7)
    fulls[1][25, 1] = bad  # rank 1's rows 20..39: its flat element 16, the first block of the shard
    ctx = _launch.torch_fallback_on_cpu() if path == "torch" else _nothing()
    with ctx:
        with pytest.raises(ValueError, match=rf"shards\[1\] hold NaN or inf; {format} block quantization"):
            quantized_all_gather_copy_in([layout.shard(t, 1) for t in fulls], qlayout, 1)
        with pytest.raises(ValueError, match=r"grads\[1\] hold NaN or inf"):
            quantized_reduce_scatter_copy_in(fulls, qlayout)
        buffer = _gathered(fulls, qlayout)
        assert torch.isnan(qlayout.scales(buffer)).sum() == 1
        outs = [torch.zeros(s) for s in layout.shapes]
        with pytest.raises(ValueError, match=r"ranks \[1\] hold non-finite blocks"):
            quantized_all_gather_copy_out(buffer, qlayout, outs)
        assert all(not o.any() for o in outs)  # refused before writing
        _quantized_all_gather_copy_out(buffer, qlayout, outs)
    nan_rows = torch.isnan(outs[1]).any(dim=1).nonzero().flatten().tolist()
    assert nan_rows == list(range(20, 31)) and torch.isnan(outs[1][20:30]).all()  # 32 elements: rows 20..30
    assert not torch.isnan(outs[0]).any() and not torch.isnan(outs[1][:20]).any()


@pytest.mark.parametrize("format", FORMATS)
def test_unusable_blocks_have_zero_codes_on_both_paths(format: str) -> None:
    """The module's table: the codes of a non-finite block (NaN, inf) and of an all-zero block (one
    holding -0.0 included: its code is 0x00, not e4m3's -0.0 0x80) are 0, on the kernels and on the
    torch fallback alike, byte for byte, scales included (NaN for the non-finite blocks). What the
    block dequantizes to does not tell: NaN times any code is NaN, and -0.0 times 0 is -0.0 only in
    its sign. Catches a fallback that leaves the rounded values of a non-finite block (int8) or of an
    unusable block (fp8) in its codes."""
    x = torch.randn(128, generator=torch.Generator().manual_seed(8))
    x[3], x[40], x[70] = math.nan, math.inf, -math.inf  # blocks 0, 1 (inf), 2 (-inf); block 3 finite
    zeros = torch.zeros(40)
    zeros[[1, 33]] = -0.0  # blocks 0 and 1 of the second parameter: all zeros, two -0.0
    qlayout = QuantizedLayout(ShardLayout([(128,), (40,)], 1), 32, format)
    buffers = []
    for path in _both_paths():
        with _launch.torch_fallback_on_cpu() if path == "torch" else _nothing():
            buffer = _quantized_copy_in([x, zeros], qlayout, 0)[1]
        codes, scales = qlayout.codes(buffer)[0], qlayout.scales(buffer)[0]
        first, second = qlayout.layout.slot_offsets
        assert not codes[first: first + 96].any() and codes[first + 96: first + 128].any(), path
        assert not codes[second: second + 40].any(), path
        assert torch.isnan(scales[:3]).all() and scales[3] > 0 and (scales[4:] == 0).all(), path
        buffers.append(buffer)
    for buffer in buffers[1:]:
        assert torch.equal(buffer, buffers[0])


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ------------------------------------------------------------------------------- host side
@requires_triton_on_cpu
@pytest.mark.parametrize("format", FORMATS)
def test_strided_tensors_quantize_as_their_contiguous_copies(format: str) -> None:
    """The copy-in reads its tensors in one contiguity pass and copies only a list that has a strided
    tensor: gradients and shards with transposed strides give the codes and scales of their
    contiguous copies, and are left as they were."""
    shapes = [(33, 17), (16,), (7, 31)]
    layout = ShardLayout(shapes, 2)
    qlayout = QuantizedLayout(layout, 32, format)
    strided = [t.t().contiguous().t() for t in _tensors([(33, 17)], [f32], 3)] + _tensors(shapes[1:], FLOATS, 4)
    assert strided[0].shape == (33, 17) and not strided[0].is_contiguous()
    before = [t.clone() for t in strided]
    contiguous = [t.contiguous() for t in strided]
    assert torch.equal(_quantized_copy_in(strided, qlayout, None)[0], _quantized_copy_in(contiguous, qlayout, None)[0])
    shards = [layout.shard(t, 1) for t in strided]
    assert torch.equal(_quantized_copy_in(shards, qlayout, 1)[0],
                       _quantized_copy_in([s.contiguous() for s in shards], qlayout, 1)[0])
    assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(strided, before))


@pytest.mark.parametrize("format", FORMATS)
def test_launches_stubbed_runs_the_quantized_ops_up_to_the_kernel(format: str) -> None:
    """``benchmarks/bench_kernels.py``'s quantized host table: under ``launches_stubbed`` each of the
    four ops builds its tables and arguments and counts one launch, writing nothing."""
    shapes = [(8, 5), (3,)]
    layout = ShardLayout(shapes, 2)
    qlayout = QuantizedLayout(layout, 32, format)
    fulls = _tensors(shapes, [f32], 5)
    buffer = torch.full((qlayout.buffer_bytes,), 9, dtype=torch.uint8)
    outs = [torch.full(s, 7.0) for s in shapes]
    grads = [torch.full(layout.shard_shape(i, 0), 7.0) for i in range(len(shapes))]
    with _launch.launches_stubbed() as launched:
        _quantized_copy_in([layout.shard(t, 0) for t in fulls], qlayout, 0)
        _quantized_copy_in(fulls, qlayout, None)
        _quantized_all_gather_copy_out(buffer, qlayout, outs)
        _quantized_reduce_scatter_copy_out(buffer, grads, qlayout, 0, 0.5, True)
    assert launched == [4]
    assert all(bool((t == 7.0).all()) for t in outs + grads), "a stubbed launch writes nothing"
    assert bool((buffer == 9).all())
    assert _launch._stubbed_launches is None


def _same_table(a: _launch.PointerTable, b: _launch.PointerTable) -> bool:
    return (torch.equal(a.pointers, b.pointers) and a.dtypes == b.dtypes and a.num_groups == b.num_groups
            and a.torch_dtypes == b.torch_dtypes)


def test_pointer_tables_per_role_are_the_tables_of_their_addresses_and_dtypes() -> None:
    """``quantized_layout.pointer_table``: a list at new addresses with the dtypes of the role's newest
    table gets that table moved; other dtypes get a table of their own; each is the table
    ``_launch.pointer_table`` builds for the list. A repeated address set is the same table; each
    role keeps the ``POINTER_CACHE_SIZE`` newest; roles do not mix."""
    shapes = [(6, 5), (4,), (3, 3)]
    layout = ShardLayout(shapes, 2)
    qlayout = QuantizedLayout(layout, 32)
    lists = [_tensors(shapes, [f32, bf16], seed) for seed in range(_launch.POINTER_CACHE_SIZE + 8)]
    other_dtypes = _tensors(shapes, [f16], 99)
    role = ("copy-in", None)
    first = quantized_layout.pointer_table(qlayout, role, lists[0], CPU)
    assert _same_table(first, _launch.pointer_table(layout, lists[0], CPU))
    moved = quantized_layout.pointer_table(qlayout, role, lists[1], CPU)
    assert moved is not first and _same_table(moved, _launch.pointer_table(layout, lists[1], CPU))
    assert quantized_layout.pointer_table(qlayout, role, lists[0], CPU) is first  # a hit
    own = quantized_layout.pointer_table(qlayout, role, other_dtypes, CPU)
    assert own.torch_dtypes == (f16,) and _same_table(own, _launch.pointer_table(layout, other_dtypes, CPU))
    after = quantized_layout.pointer_table(qlayout, role, lists[2], CPU)  # the newest is f16's: built anew
    assert _same_table(after, _launch.pointer_table(layout, lists[2], CPU))
    for tensors in lists:
        assert _same_table(quantized_layout.pointer_table(qlayout, role, tensors, CPU),
                           _launch.pointer_table(layout, tensors, CPU))
    kept = layout._device_cache[("quantized pointers", role, CPU)]
    assert len(kept) == _launch.POINTER_CACHE_SIZE
    other_role = quantized_layout.pointer_table(qlayout, ("all-gather copy-out",), lists[-1], CPU)
    assert other_role is not quantized_layout.pointer_table(qlayout, role, lists[-1], CPU)
    assert _same_table(other_role, _launch.pointer_table(layout, lists[-1], CPU))


def test_a_list_at_known_addresses_with_other_dtypes_gets_a_table_of_its_dtypes() -> None:
    """A pointer table is kept per address set with its list's dtypes, and a hit compares them: a
    list at the addresses of a kept table but of other dtypes (a freed float32 gradient buffer
    reused for bfloat16 ones, here two views of one storage) gets a table of its own dtypes, the one
    ``_launch.pointer_table`` builds, and the float32 list's table stays as it was. Catches a hit
    taken on the addresses alone (the kernel would then read bfloat16 values as float32)."""
    layout = ShardLayout([(8,), (4,)], 2)
    qlayout = QuantizedLayout(layout, 32)
    storage = torch.randn(16).to(bf16).float()  # the low halves are 0: finite read either way
    f32s = [storage[:8], storage[8:12]]
    bf16s = [storage.view(bf16)[:8], storage.view(bf16)[16:20]]
    assert [t.data_ptr() for t in f32s] == [t.data_ptr() for t in bf16s]
    role = ("copy-in", None)
    first = quantized_layout.pointer_table(qlayout, role, f32s, CPU)
    other = quantized_layout.pointer_table(qlayout, role, bf16s, CPU)
    assert other.torch_dtypes == (bf16,) and _same_table(other, _launch.pointer_table(layout, bf16s, CPU))
    assert first.torch_dtypes == (f32,) and _same_table(first, _launch.pointer_table(layout, f32s, CPU))


@requires_triton_on_cpu
@pytest.mark.parametrize("format", FORMATS)
def test_gradients_at_new_addresses_every_call_quantize_as_the_fallback(format: str) -> None:
    """The reduce copy-in as the runtime calls it on CPU, a list of gradients at new addresses every
    call (moved pointer tables), and the copy-outs into new outputs: bitwise the torch fallback."""
    shapes = [(9, 7), (5,), (33,)]
    layout = ShardLayout(shapes, 2)
    qlayout = QuantizedLayout(layout, 32, format)
    lists = [_tensors(shapes, [bf16, f32], seed) for seed in range(3)]  # all alive: three address sets
    for seed, grads in enumerate(lists):
        expected = torch.empty(qlayout.buffer_bytes, dtype=torch.uint8)
        _quantized_copy_in_torch(grads, qlayout, None, expected)
        got = _quantized_copy_in(grads, qlayout, None)[0]
        assert torch.equal(got, expected), seed
        outs_triton = [torch.empty(layout.shard_shape(i, 1)) for i in range(len(shapes))]
        outs_torch = [torch.empty(layout.shard_shape(i, 1)) for i in range(len(shapes))]
        _quantized_reduce_scatter_copy_out(got, outs_triton, qlayout, 1, 0.5, False)
        _quantized_reduce_scatter_copy_out_torch(expected, outs_torch, qlayout, 1, 0.5, False)
        assert all(torch.equal(a, b) for a, b in zip(outs_triton, outs_torch)), seed


# ------------------------------------------------------------------------------- layout and bytes
def test_quantized_layout_bytes_and_blocks() -> None:
    """Blocks start at each parameter's region and never span two; bytes on the link of a large
    layout: <= 0.53x of bf16's and <= 0.28x of fp32's (the issue's goals) at block 256."""
    layout = ShardLayout([(1000, 512), (3,), (4096,)], 4)
    qlayout = QuantizedLayout(layout, 256)
    starts, lengths = qlayout.block_starts.tolist(), qlayout.block_lengths.tolist()
    assert sum(lengths) == layout.slot_numel and all(0 < n <= 256 for n in lengths)
    assert set(layout.slot_offsets) <= set(starts)
    for off, n in zip(layout.slot_offsets, layout.padded_numels):  # no block crosses a region's end
        assert off + n in set(starts) | {layout.slot_numel}
    assert qlayout.buffer_bytes <= 0.53 * layout.buffer_numel * 2
    assert qlayout.buffer_bytes <= 0.28 * layout.buffer_numel * 4


def test_quantized_layouts_are_equal_when_layout_block_and_format_are() -> None:
    """``QuantizedLayout`` equality and hash follow ``(layout, block, format)``: the same layout and
    block in int8 and in fp8 are two layouts (their bytes mean different values), as are two blocks;
    equal ones hash alike. Catches an equality that leaves out the format."""
    layout = ShardLayout([(8, 2), (5,)], 2)
    a, b = QuantizedLayout(layout, 32, "int8"), QuantizedLayout(ShardLayout([(8, 2), (5,)], 2), 32, "int8")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != QuantizedLayout(layout, 32, "fp8") and a != QuantizedLayout(layout, 64, "int8")
    assert a != QuantizedLayout(ShardLayout([(8, 2), (5,)], 1), 32, "int8") and a != layout


@examples
@given(shapes=SHAPES, world=st.integers(1, 5), block=BLOCK, per_program=st.sampled_from([1, 2, 4, 8, 128]),
       rank=st.integers(0, 4))
def test_segment_tables_cover_each_block_once_within_one_parameter(shapes, world, block, per_program, rank) -> None:
    """[Note: segment tables] expanded row by row equal the per-block facts computed here from the
    layout alone: every block of every slot once, in order, a program's blocks all in one
    parameter's region, each row's valid elements (a prefix of the shard's) and scale number."""
    layout = ShardLayout(shapes, world)
    qlayout = QuantizedLayout(layout, block)
    for r in (None, rank % world):
        programs = _programs(qlayout, r, per_program)
        expected, got = [], []
        for s in range(world) if r is None else (r,):
            for i, (off, padded) in enumerate(zip(layout.slot_offsets, layout.padded_numels)):
                valid = layout.shard_numel(i, s)
                base = layout.chunk_numels[i] * s if r is None else 0
                first = sum(qlayout.param_blocks[:i])
                for k in range(qlayout.param_blocks[i]):
                    start = off + k * block
                    length = min(block, padded - k * block)
                    expected.append((start, length, i, base + k * block, max(0, min(valid - k * block, length)),
                                     first + k))
        for flat, length, param, tensor, n_valid, first in programs.tolist():
            assert 0 < length <= per_program * block
            rows = -(-length // block)
            for j in range(rows):
                got.append((flat + j * block, min(block, length - j * block), param, tensor + j * block,
                            max(0, min(block, n_valid - j * block)), first + j))
        assert got == expected
        assert len(programs) == (world if r is None else 1) * sum(-(-c // per_program) for c in qlayout.param_blocks)


def test_bad_input_names_the_argument() -> None:
    layout = ShardLayout([(8, 2)], 2)
    qlayout = QuantizedLayout(layout, 32)
    with pytest.raises(ValueError, match=r"block must be one of \(32, 64"):
        QuantizedLayout(layout, 100)
    with pytest.raises(ValueError, match=r"format must be one of \('int8', 'fp8'\), got 'fp4'"):
        QuantizedLayout(layout, 32, "fp4")
    with pytest.raises(TypeError, match="layout must be a overlap_kernels.ShardLayout"):
        QuantizedLayout([(8, 2)], 32)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="qlayout must be"):
        quantized_all_gather_copy_in([torch.zeros(4, 2)], layout, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"shards must be float32, bfloat16 or float16 tensors, got \['torch.float64'\]"):
        quantized_all_gather_copy_in([torch.zeros(4, 2, dtype=torch.float64)], qlayout, 0)
    with pytest.raises(ValueError, match="shape"):
        quantized_all_gather_copy_in([torch.zeros(5, 2)], qlayout, 0)
    with pytest.raises(ValueError, match="rank must be an int in"):
        quantized_all_gather_copy_in([torch.zeros(4, 2)], qlayout, 2)
    with pytest.raises(ValueError, match=r"q_output must be a contiguous uint8 tensor of \d+ bytes"):
        quantized_all_gather_copy_out(torch.zeros(3, dtype=torch.uint8), qlayout)
    good = torch.zeros(qlayout.buffer_bytes, dtype=torch.uint8)
    with pytest.raises(TypeError, match="outs must be float32, bfloat16 or float16"):
        quantized_all_gather_copy_out(good, qlayout, [torch.zeros(8, 2, dtype=torch.int32)])
    # given outs and a dtype: every out must be of that dtype
    with pytest.raises(TypeError, match=r"outs must be .* tensors of dtype torch.bfloat16, got \['torch.float32'\]"):
        quantized_all_gather_copy_out(good, qlayout, [torch.zeros(8, 2)], torch.bfloat16)
    with pytest.raises(TypeError, match="accumulate must be a bool"):
        quantized_reduce_scatter_copy_out(good, [torch.zeros(4, 2)], qlayout, 0, None, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="received must be a contiguous uint8"):
        quantized_reduce_scatter_copy_out(good[:-1], [torch.zeros(4, 2)], qlayout, 0)
    with pytest.raises(ValueError, match="received must be a contiguous uint8"):  # the right size, strided
        quantized_reduce_scatter_copy_out(torch.zeros(2 * qlayout.buffer_bytes, dtype=torch.uint8)[::2],
                                          [torch.zeros(4, 2)], qlayout, 0)
    with pytest.raises(ValueError, match=r"quantized_reduce_scatter_copy_out: rank must be an int in \[0, 2\), got 2"):
        quantized_reduce_scatter_copy_out(good, [torch.zeros(4, 2)], qlayout, 2)
    assert 32 in BLOCKS
    for bad in (3, 0, True, 2.0):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(quantized_layout, "BLOCKS_PER_PROGRAM", bad)
            with pytest.raises(ValueError, match=r"BLOCKS_PER_PROGRAM must be None or a power of two >= 1, got"):
                qlayout.segment_table(0, CPU)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or _launch.INTERPRET,
                    reason="compiled Triton kernels need a CUDA device (and TRITON_INTERPRET unset)")
@pytest.mark.parametrize("per_program", [1, None])
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("block", [32, 256, 4096])
def test_cuda_kernels_equal_the_torch_fallback(monkeypatch, block: int, format: str, per_program: int | None) -> None:
    """Under real codegen (div_rn, no FMA) the three kernels equal the CPU torch fallback bit for bit
    (fp8: integer encoding, no float8 type, so any GPU; checked against torch's CPU float8 cast),
    one block per program and the runtime's choice ([Note: several blocks per program])."""
    monkeypatch.setattr(quantized_layout, "BLOCKS_PER_PROGRAM", per_program)
    shapes = [(4097, 33), (7,), (), (0, 5), (1000,), (129, 64)]
    world = 3
    layout = ShardLayout(shapes, world)
    qlayout = QuantizedLayout(layout, block, format)
    fulls = _tensors(shapes, [f32, bf16, f16], 11, zero_every=4)
    cuda = [t.cuda() for t in fulls]
    with _launch.torch_fallback_on_cpu():
        expected = _gathered(fulls, qlayout)
        expected_reduce = _quantized_copy_in(fulls, qlayout, None)[0]
    got = torch.empty(qlayout.buffer_bytes, dtype=torch.uint8, device="cuda")
    for r in range(world):
        got.view(world, -1)[r] = _quantized_copy_in([layout.shard(t, r) for t in cuda], qlayout, r)[0]
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(_quantized_copy_in(cuda, qlayout, None)[0].cpu(), expected_reduce)
    outs = [torch.empty(s, dtype=bf16, device="cuda") for s in shapes]
    ref = [torch.empty(s, dtype=bf16) for s in shapes]
    _quantized_all_gather_copy_out(got, qlayout, outs)
    _quantized_all_gather_copy_out_torch(expected, qlayout, ref)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(outs, ref))
    for r in range(world):
        grads = [torch.ones(layout.shard_shape(i, r), device="cuda") for i in range(len(shapes))]
        ref_grads = [g.cpu() for g in grads]
        _quantized_reduce_scatter_copy_out(got, grads, qlayout, r, 1 / 3, True)
        _quantized_reduce_scatter_copy_out_torch(expected, ref_grads, qlayout, r, 1 / 3, True)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(grads, ref_grads))
