"""Alignment per run and the scalar paths' steps ([Note: alignment per run], [Note: per-thread width]
in ``overlap_kernels._jit``), under the interpreter.

The interpreter computes every path alike, so what is checked here is the logic around the paths:

* ``block_run``'s ``aligned`` flag, block by block, against the rule (address a multiple of 16 bytes
  and first element a multiple of 16);
* the four ops, bitwise against their references and the first-principles expectations of
  tests/packing/test_kernels_ops.py, with the GPU's step structure forced onto the interpreter: small blocks
  (so runs have unmasked blocks, aligned and not, in one launch) and scalar paths in steps of a
  quarter block, as on a GPU (on CPU a step is the whole block).

What the compiled code looks like (vector widths, no shared memory, registers) is
tests/packing/test_aot_compile.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from overlap_kernels import ShardLayout, _jit, _launch
from kernel_cases import (  # noqa: F401  (uninitialized_memory_is_filled: autouse)
    DTYPE_CASES,
    MODES,
    check_all_gather_copy_in,
    check_all_gather_copy_out,
    check_reduce_scatter_copy_in,
    check_reduce_scatter_copy_out,
    make_tensors,
    uninitialized_memory_is_filled,
)

pytestmark = [
    pytest.mark.skipif(not _jit.INTERPRET, reason="checks the kernels under TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


def test_vector_width_is_16_bytes_of_the_widest_destination() -> None:
    assert _launch.vector_width([f32]) == 4
    assert _launch.vector_width([bf16]) == _launch.vector_width([f16, bf16]) == 8
    assert _launch.vector_width([bf16, f32, f16]) == 4  # mixed destinations: the widest sets it
    assert _launch.vector_width([torch.float64]) == 2
    assert _launch.vector_width([torch.int8, torch.uint8]) == 16


@triton.jit
def _aligned_probe_kernel(blocks_ptr, runs_ptr, pointers_ptr, out_ptr, BLOCK: tl.constexpr):
    _, _, _, _, _, _, aligned = _jit.block_run(blocks_ptr, runs_ptr, pointers_ptr, BLOCK)
    tl.store(out_ptr + tl.program_id(0), aligned.to(tl.int32))


def test_block_run_decides_alignment_per_run() -> None:
    """Three parameters, three ranks (rank ``None`` runs start at ``rank * chunk_numel``), addresses
    chosen by hand: the flag is per run, whatever the other runs are."""
    layout = ShardLayout([(48, 16), (30, 5), (64,)], world_size=3)  # chunks: 256, 50, 22 elements
    table = _launch.block_table(layout, None, pad=False, device=torch.device("cpu"))
    addresses = [1 << 20, (1 << 21) + 4, 1 << 22]  # the second one 4 bytes off
    pointers = torch.tensor([[a, 0] for a in addresses], dtype=torch.int64)
    out = torch.full((table.num_blocks,), -1, dtype=torch.int32)
    _aligned_probe_kernel[(table.num_blocks,)](table.blocks, table.runs, pointers, out, BLOCK=table.block)
    runs = table.runs.numpy()
    expected = [
        int(addresses[runs[r, 0]] % 16 == 0 and runs[r, 1] % 16 == 0) for r in table.blocks.numpy()
    ]
    assert out.tolist() == expected
    # both kinds occur: parameter 0 is aligned on every rank, parameter 1 on none, parameter 2 on rank 0 only
    assert {(int(runs[r, 0]), int(runs[r, 1]), e) for r, e in zip(table.blocks.numpy(), expected)} == {
        (0, 0, 1), (0, 256, 1), (0, 512, 1), (1, 0, 0), (1, 50, 0), (1, 100, 0), (2, 0, 1), (2, 22, 0), (2, 44, 0),
    }


# Runs longer than the forced 128-element block, starting at element offsets that are and are not
# multiples of 16, with shard addresses that are and are not 16-byte aligned (rows of odd sizes).
SHAPES = [(300,), (17, 19), (256,), (5, 64), (129,), (3, 7), (1, 160)]


@pytest.fixture
def gpu_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 128 elements and scalar paths in steps of a quarter block, as ``_pick_block`` does
    on a GPU (there a step is 4 elements per thread)."""

    def pick(max_run: int, device: torch.device) -> tuple[int, int, int]:
        return 128, 4, 32

    monkeypatch.setattr(_launch, "_pick_block", pick)


@pytest.mark.parametrize("case", ["fp32", "bf16-fp32", "fp32-bf16", "mixed-fp32", "int8"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ops_with_gpu_block_structure(world_size: int, case: str, gpu_steps: None) -> None:
    dtypes, buffer_dtype = DTYPE_CASES[case]
    fulls = make_tensors(SHAPES, dtypes, seed=world_size)
    check_all_gather_copy_in(fulls, world_size, buffer_dtype)
    check_all_gather_copy_out(SHAPES, world_size, dtypes, buffer_dtype, seed=world_size)
    check_reduce_scatter_copy_in(fulls, world_size, None, buffer_dtype)
    floating = buffer_dtype.is_floating_point and dtypes[0].is_floating_point
    if floating:
        check_reduce_scatter_copy_in(fulls, world_size, 1 / 3, buffer_dtype)
    for rank in range(world_size):
        modes = list(MODES) if floating else ["copy"]
        for mode in modes:
            check_reduce_scatter_copy_out(SHAPES, world_size, rank, dtypes, buffer_dtype, mode, seed=rank)


def test_forced_structure_has_unmasked_blocks_of_both_kinds(gpu_steps: None) -> None:
    """The layout above does exercise aligned and unaligned unmasked blocks (not only tails)."""
    layout = ShardLayout(SHAPES, 2)
    runs = _launch.block_table(layout, None, pad=False, device=torch.device("cpu")).runs.numpy()
    long_runs = runs[runs[:, 3] >= 128]
    starts = set((long_runs[:, 1] % 16 == 0).tolist())
    assert starts == {True, False}
    fulls = make_tensors(SHAPES, (f32,), seed=0)
    shard_addresses = {s.data_ptr() % 16 == 0 for s in layout.shards(fulls, 1) if s.numel() >= 128}
    assert shard_addresses == {True, False}
    assert np.all(runs[:, 4] >= runs[:, 3])
