"""Property-based tests of the four packing ops: random layouts, dtype mixes, world sizes and ranks.

Hypothesis draws the parameter shapes (0-dim, empty dims, primes, 16 and its neighbours, up to 3-D),
the world size (1 to 8), the rank, the dtype case (``test_kernels_ops.DTYPE_CASES``: one dtype,
casts both ways, mixes of up to 4 dtypes, ints), the options (scales, accumulation, the buffer
dtype) and whether the inputs are strided views. Each property runs on two paths:

* ``triton``: the public op, which launches the Triton kernel (under ``TRITON_INTERPRET=1`` on CPU,
  set by conftest); skipped with the reason when Triton does not run CPU tensors in this process;
* ``torch``: the batched torch fallback (``_*_torch``) that CPUs run without the interpreter.

Properties and their tolerances (the reasons are in ``test_kernels_ops``' module docstring):

* every op equals its ``*_ref``: bitwise (NaN payloads included) for copies without a cast, and on
  the torch path always (the fallback is cut like the reference, NaNs included); with a cast or a
  scale on the Triton path, bitwise except the bit pattern of a NaN (positions must match), which
  torch itself does not fix;
* round trips are exact: copy-in on every rank, a simulated all-gather and copy-out give back the
  full parameters; reduce-scatter copy-in and each rank's copy-out of its slot give back that rank's
  rows. Bitwise when the buffer has the parameters' dtype; through a buffer dtype that holds every
  value of the parameters' dtypes (e.g. bf16 -> fp32, int8 -> fp16) every value comes back, NaN bits
  aside (a widening cast quiets a signalling NaN).

Sizes stay small (at most a few hundred elements per parameter): the interpreter pays per program.
Example counts come from the Hypothesis profile (conftest: ``OVERLAP_HYPOTHESIS_PROFILE``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from overlap_kernels import (  # noqa: E402
    ShardLayout,
    _launch,
    all_gather_copy_in,
    all_gather_copy_in_ref,
    all_gather_copy_out,
    all_gather_copy_out_ref,
    reduce_scatter_copy_in,
    reduce_scatter_copy_in_ref,
    reduce_scatter_copy_out,
    reduce_scatter_copy_out_ref,
)
from overlap_kernels.all_gather_copy_in import _all_gather_copy_in_torch  # noqa: E402
from overlap_kernels.all_gather_copy_out import _all_gather_copy_out_torch  # noqa: E402
from overlap_kernels.reduce_scatter_copy_in import _reduce_scatter_copy_in_torch  # noqa: E402
from overlap_kernels.reduce_scatter_copy_out import _reduce_scatter_copy_out_torch  # noqa: E402
from kernel_cases import (  # noqa: E402  (the op tests' dtype cases, data and comparisons)
    DTYPE_CASES,
    FLOAT_CASES,
    assert_bitwise,
    assert_same_values,
    make_tensor,
    uninitialized_memory_is_filled,  # noqa: F401  (autouse: torch.empty returns NaN / max int here too)
)

f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
i64, i32, i16, i8, u8 = torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8
CPU = torch.device("cpu")

# The data holds inf, NaN and the dtypes' max on purpose; the interpreter computes with numpy,
# which warns about each.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


# ``uninitialized_memory_is_filled`` (autouse, imported above) sets global flags around each test call;
# Hypothesis' examples of one call share them, as intended, so its function-scope check is off here.
shared_fixtures = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, *settings().suppress_health_check]
)


# ------------------------------------------------------------------------------------------ paths
@dataclass(frozen=True)
class Path:
    """One implementation of the four ops, called with every argument explicit."""

    all_gather_copy_in: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    all_gather_copy_out: Callable[..., None]
    reduce_scatter_copy_in: Callable[..., torch.Tensor]
    reduce_scatter_copy_out: Callable[..., None]
    exact_casts: bool  # casts match the reference NaN bits too (the torch fallback's promise)


TRITON = Path(
    all_gather_copy_in=lambda shards, layout, rank, dtype: all_gather_copy_in(shards, layout, rank, dtype),
    all_gather_copy_out=lambda buffer, layout, outs: all_gather_copy_out(buffer, layout, outs),
    reduce_scatter_copy_in=lambda grads, layout, scale, dtype: reduce_scatter_copy_in(grads, layout, scale, dtype),
    reduce_scatter_copy_out=lambda slot, grads, layout, rank, scale, acc, divisor=None: reduce_scatter_copy_out(
        slot, grads, layout, rank, scale, acc, divisor),
    exact_casts=False,
)
TORCH = Path(
    all_gather_copy_in=lambda shards, layout, rank, dtype: _all_gather_copy_in_torch(shards, layout, rank, dtype, CPU),
    all_gather_copy_out=_all_gather_copy_out_torch,
    reduce_scatter_copy_in=lambda grads, layout, scale, dtype: _reduce_scatter_copy_in_torch(
        grads, layout, scale, dtype, CPU),
    reduce_scatter_copy_out=_reduce_scatter_copy_out_torch,
    exact_casts=True,
)
TRITON_ON_CPU = _launch.triton_enabled(CPU)


@pytest.fixture(scope="module", params=["triton", "torch"])
def path(request: pytest.FixtureRequest) -> Path:
    """The op implementation under test (see the module docstring)."""
    if request.param == "triton":
        if not TRITON_ON_CPU:
            pytest.skip("Triton runs CPU tensors only under TRITON_INTERPRET=1 (conftest sets it without a GPU)")
        return TRITON
    return TORCH


# ------------------------------------------------------------------------------------- strategies
DIMS = st.sampled_from([0, 1, 2, 3, 5, 7, 13, 15, 16, 17, 31])
MAX_PARAM_NUMEL = 600


def _small(shape: list[int]) -> bool:
    numel = 1
    for d in shape:
        numel *= d
    return numel <= MAX_PARAM_NUMEL


SHAPE = st.lists(DIMS, min_size=0, max_size=3).filter(_small).map(tuple)
SHAPES = st.lists(SHAPE, min_size=1, max_size=5)
WORLD = st.integers(1, 8)
SEED = st.integers(0, 2**16)
CASE = st.sampled_from(sorted(DTYPE_CASES))
FLOAT_CASE = st.sampled_from(sorted(FLOAT_CASES))
SCALES = st.sampled_from([0.1, 1 / 3, -0.5, 3.0, 0.125])

# Lossless buffers: the buffer dtype holds every value of each parameter dtype (the round trips).
LOSSLESS_CASES: dict[str, tuple[tuple[torch.dtype, ...], torch.dtype]] = {
    "fp32": ((f32,), f32),
    "bf16": ((bf16,), bf16),
    "fp16": ((f16,), f16),
    "bf16-fp32": ((bf16,), f32),
    "fp16-fp32": ((f16,), f32),
    "mixed-fp32": ((f32, bf16, f16), f32),
    "mixed-fp64": ((f64, f32, bf16, f16), f64),
    "int64": ((i64,), i64),
    "mixed-int-int32": ((i32, i16, i8, u8), i32),
    "int8-fp16": ((i8, u8), f16),
    "int16-fp32": ((i16,), f32),
    "int32-fp64": ((i32,), f64),
}


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (dims reversed in memory), for inputs that are read."""
    if t.dim() < 2:
        return t
    return t.permute(*reversed(range(t.dim()))).contiguous().permute(*reversed(range(t.dim())))


def tensors(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], seed: int, *,
            specials: bool = True, as_strided: bool = False) -> list[torch.Tensor]:
    """``make_tensor`` per shape (dtypes cycled), optionally as non-contiguous views."""
    out = [make_tensor(s, dtypes[i % len(dtypes)], seed * 1000 + i, specials=specials) for i, s in enumerate(shapes)]
    return [strided(t) for t in out] if as_strided else out


def check(actual: torch.Tensor, expected: torch.Tensor, *, exact: bool) -> None:
    (assert_bitwise if exact else assert_same_values)(actual, expected)


# ---------------------------------------------------------------------------- ops vs references
@shared_fixtures
@given(shapes=SHAPES, world=WORLD, case=CASE, seed=SEED, data=st.data(), as_strided=st.booleans())
def test_all_gather_copy_in_equals_reference(path: Path, shapes: list, world: int, case: str, seed: int,
                                             data: st.DataObject, as_strided: bool) -> None:
    """Packing a rank's shards: the slot equals the reference's, and sits at the rank's offset."""
    dtypes, buffer_dtype = DTYPE_CASES[case]
    rank = data.draw(st.integers(0, world - 1), label="rank")
    layout = ShardLayout(shapes, world)
    shards = layout.shards(tensors(shapes, dtypes, seed, as_strided=as_strided), rank)
    ag_input, ag_output = path.all_gather_copy_in(shards, layout, rank, buffer_dtype)
    assert ag_output.shape == (layout.buffer_numel,) and ag_output.dtype == buffer_dtype
    assert ag_input.data_ptr() == ag_output.data_ptr() + rank * layout.slot_numel * ag_output.element_size()
    expected = all_gather_copy_in_ref(shards, layout, rank, buffer_dtype)[0]
    check(ag_input, expected, exact=path.exact_casts or all(d == buffer_dtype for d in dtypes))


@shared_fixtures
@given(shapes=SHAPES, world=WORLD, case=CASE, seed=SEED)
def test_all_gather_copy_out_equals_reference(path: Path, shapes: list, world: int, case: str, seed: int) -> None:
    """Unpacking a gathered buffer (padding holding random values) into outs of the parameter dtypes."""
    dtypes, buffer_dtype = DTYPE_CASES[case]
    layout = ShardLayout(shapes, world)
    out_dtypes = [dtypes[i % len(dtypes)] for i in range(len(shapes))]
    # no NaN / inf where a float becomes an int (undefined behaviour, in torch as in Triton)
    buffer = make_tensor((layout.buffer_numel,), buffer_dtype, seed,
                         specials=all(d.is_floating_point for d in out_dtypes))
    outs = [torch.full(s, 5, dtype=d) for s, d in zip(shapes, out_dtypes)]
    expected = all_gather_copy_out_ref(buffer, layout, [o.clone() for o in outs])
    path.all_gather_copy_out(buffer, layout, outs)
    for out, exp in zip(outs, expected, strict=True):
        check(out, exp, exact=path.exact_casts or all(d == buffer_dtype for d in out_dtypes))


@shared_fixtures
@given(shapes=SHAPES, world=WORLD, case=CASE, seed=SEED, data=st.data(), as_strided=st.booleans())
def test_reduce_scatter_copy_in_equals_reference(path: Path, shapes: list, world: int, case: str, seed: int,
                                                 data: st.DataObject, as_strided: bool) -> None:
    """Packing full gradients rank-major, with or without a pre-scale (floating-point cases only)."""
    dtypes, buffer_dtype = DTYPE_CASES[case]
    scale = data.draw(st.none() | SCALES, label="pre_scale") if case in FLOAT_CASES else None
    layout = ShardLayout(shapes, world)
    grads = tensors(shapes, dtypes, seed, as_strided=as_strided)
    rs_input = path.reduce_scatter_copy_in(grads, layout, scale, buffer_dtype)
    assert rs_input.shape == (layout.buffer_numel,) and rs_input.dtype == buffer_dtype
    expected = reduce_scatter_copy_in_ref(grads, layout, scale, buffer_dtype)
    check(rs_input, expected, exact=path.exact_casts or (scale is None and all(d == buffer_dtype for d in dtypes)))


@shared_fixtures
@given(shapes=SHAPES, world=WORLD, case=CASE, seed=SEED, data=st.data())
def test_reduce_scatter_copy_out_equals_reference(path: Path, shapes: list, world: int, case: str, seed: int,
                                                  data: st.DataObject) -> None:
    """Unpacking a reduced slot into a rank's shard gradients: copied, scaled or divided, and/or
    accumulated."""
    dtypes, slot_dtype = DTYPE_CASES[case]
    rank = data.draw(st.integers(0, world - 1), label="rank")
    modes = [(None, None, False)]
    if case in FLOAT_CASES:
        modes += [(s, None, a) for s in (None, 0.3, 1 / 3, -2.0) for a in (False, True) if s is not None or a]
        modes += [(None, d, a) for d in (3.0, 0.7, -6.0) for a in (False, True)]
    scale, divisor, accumulate = data.draw(st.sampled_from(modes), label="(post_scale, post_divisor, accumulate)")
    layout = ShardLayout(shapes, world)
    slot = make_tensor((layout.slot_numel,), slot_dtype, seed,
                       specials=all(d.is_floating_point for d in dtypes))  # no float -> int UB
    grads = tensors(layout.shard_shapes(rank), dtypes, seed + 1)
    expected = [g.clone() for g in grads]
    reduce_scatter_copy_out_ref(slot, expected, layout, rank, scale, accumulate, divisor)
    path.reduce_scatter_copy_out(slot, grads, layout, rank, scale, accumulate, divisor)
    plain = scale is None and divisor is None and not accumulate and all(g.dtype == slot_dtype for g in grads)
    for got, exp in zip(grads, expected, strict=True):
        check(got, exp, exact=path.exact_casts or plain)


# ------------------------------------------------------------------------------------ round trips
@shared_fixtures
@given(shapes=SHAPES, world=WORLD, case=st.sampled_from(sorted(LOSSLESS_CASES)), seed=SEED,
       as_strided=st.booleans())
def test_all_gather_round_trip_is_exact(path: Path, shapes: list, world: int, case: str, seed: int,
                                        as_strided: bool) -> None:
    """Copy-in on every rank, the all-gather simulated by concatenating the slots, copy-out: the full
    parameters come back."""
    dtypes, buffer_dtype = LOSSLESS_CASES[case]
    layout = ShardLayout(shapes, world)
    fulls = tensors(shapes, dtypes, seed, as_strided=as_strided)
    slots = [path.all_gather_copy_in(layout.shards(fulls, r), layout, r, buffer_dtype)[0] for r in range(world)]
    gathered = torch.cat(slots)
    outs = [torch.full(f.shape, 5, dtype=f.dtype) for f in fulls]
    path.all_gather_copy_out(gathered, layout, outs)
    for out, full in zip(outs, fulls, strict=True):
        check(out, full, exact=full.dtype == buffer_dtype)


@shared_fixtures
@given(shapes=SHAPES, world=WORLD, case=st.sampled_from(sorted(LOSSLESS_CASES)), seed=SEED,
       as_strided=st.booleans())
def test_reduce_scatter_round_trip_is_exact(path: Path, shapes: list, world: int, case: str, seed: int,
                                            as_strided: bool) -> None:
    """Reduce-scatter copy-in, then each rank's copy-out of its own slot (a 1-rank "reduction"):
    every rank gets back exactly its rows of each gradient."""
    dtypes, buffer_dtype = LOSSLESS_CASES[case]
    layout = ShardLayout(shapes, world)
    grads = tensors(shapes, dtypes, seed, as_strided=as_strided)
    rs_input = path.reduce_scatter_copy_in(grads, layout, None, buffer_dtype).view(world, layout.slot_numel)
    for rank in range(world):
        shard_grads = [torch.full(s, 5, dtype=g.dtype) for s, g in zip(layout.shard_shapes(rank), grads)]
        path.reduce_scatter_copy_out(rs_input[rank], shard_grads, layout, rank, None, False)
        for got, grad in zip(shard_grads, grads, strict=True):
            check(got, layout.shard(grad, rank), exact=grad.dtype == buffer_dtype)
