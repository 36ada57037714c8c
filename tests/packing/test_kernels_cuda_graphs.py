"""The packing kernels captured in a CUDA graph and replayed, against the torch references.

Skipped without a GPU (``requires_cuda``); on a GPU machine ``pytest -m gpu`` runs it. What it
checks is [Note: table memory] / [Note: tables in CUDA graphs] in ``overlap_kernels.table_memory``:

* capture works at all: no pinned allocation, event query or host sync happens in the launch path
  (any of them fails a global-mode capture);
* every replay, with new data in the static inputs, equals the references bitwise (NaN-free data:
  copies, RTNE casts, and scale/accumulate computed like the references, without FMA);
* it still does after the ``ShardLayout.from_spec`` cache (256 layouts) has been churned, the
  captured layout dropped, other tables created and freed, and freed memory overwritten: the graph's
  tables (pointer tables of capture-time addresses, and block tables) must stay valid for as long as
  the graph may replay;
* tables whose upload copy was not yet seen complete at capture get their own copy in the graph,
  and tables used first on another stream are waited for (eager);
* the runtime's copy-out into views of one storage (``packed=``, [Note: packed placements] in
  ``overlap_kernels._launch``: its table is keyed on the storage's address) replays the same after that
  table was evicted from the layout's cache by 2 x ``POINTER_CACHE_SIZE`` other storages.

The same rules are checked with a fake CUDA runtime on CPU in tests/packing/test_kernels_table_memory.py.
"""
from __future__ import annotations

import gc

import pytest
import torch

from conftest import requires_cuda
from overlap_kernels import (
    ShardLayout,
    _jit,
    _launch,
    all_gather_copy_in,
    all_gather_copy_in_ref,
    all_gather_copy_out,
    all_gather_copy_out_ref,
    reduce_scatter_copy_in,
    reduce_scatter_copy_in_ref,
    reduce_scatter_copy_out,
    reduce_scatter_copy_out_ref,
    table_memory,
)
from overlap_kernels.all_gather_copy_out import _all_gather_copy_out

pytestmark = [
    pytest.mark.gpu,
    requires_cuda,
    pytest.mark.skipif(_jit.INTERPRET, reason="TRITON_INTERPRET sends CUDA tensors to the torch fallback"),
]

# odd shapes, a parameter with unmasked (vector) blocks, one whose shards start unaligned
SHAPES = [(10, 3), (7,), (), (4099, 5), (5, 1024), (33, 7), (1,)]
WORLD_SIZE, RANK = 2, 1
f32, bf16 = torch.float32, torch.bfloat16


class Step:
    """Static inputs and the four ops on them: the body that is captured."""

    def __init__(self, layout: ShardLayout, device: torch.device) -> None:
        self.layout = layout
        self.fulls = [torch.empty(s, device=device) for s in layout.shapes]
        self.ag_buffer = torch.empty(layout.buffer_numel, dtype=bf16, device=device)
        self.outs = [torch.empty(s, device=device) for s in layout.shapes]
        self.rs_slot = torch.empty(layout.slot_numel, device=device)
        self.shard_grads = [torch.empty(s, device=device) for s in layout.shard_shapes(RANK)]

    def fill(self, seed: int) -> None:
        gen = torch.Generator(device=self.ag_buffer.device).manual_seed(seed)
        for t in [*self.fulls, self.ag_buffer, self.rs_slot, *self.shard_grads]:
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device))

    def __call__(self) -> dict[str, object]:
        """The outputs it allocates; ``outs`` and ``shard_grads`` are written in place."""
        layout = self.layout
        ag_input, _ = all_gather_copy_in(layout.shards(self.fulls, RANK), layout, RANK, bf16)
        all_gather_copy_out(self.ag_buffer, layout, self.outs)
        rs_input = reduce_scatter_copy_in(self.fulls, layout, 1 / WORLD_SIZE, bf16)
        reduce_scatter_copy_out(self.rs_slot, self.shard_grads, layout, RANK, 0.5, True)
        # outs allocated here: during capture, new addresses, so a pointer table built in capture
        new_outs = all_gather_copy_out(self.ag_buffer, layout, dtype=f32)
        return {"ag_input": ag_input, "rs_input": rs_input, "new_outs": new_outs}

    def references(self) -> dict[str, object]:
        """What the step computes, by the references, from the current inputs (before it runs)."""
        layout = ShardLayout(SHAPES, WORLD_SIZE)  # an equal layout: the captured one may be gone
        grads = [g.clone() for g in self.shard_grads]
        reduce_scatter_copy_out_ref(self.rs_slot, grads, layout, RANK, 0.5, True)
        outs = all_gather_copy_out_ref(self.ag_buffer, layout, [torch.empty_like(o) for o in self.outs])
        return {
            "ag_input": all_gather_copy_in_ref(layout.shards(self.fulls, RANK), layout, RANK, bf16)[0].clone(),
            "outs": outs,
            "new_outs": outs,
            "rs_input": reduce_scatter_copy_in_ref(self.fulls, layout, 1 / WORLD_SIZE, bf16),
            "shard_grads": grads,
        }


def assert_results(step: Step, outputs: dict[str, object], expected: dict[str, object]) -> None:
    assert torch.equal(outputs["ag_input"], expected["ag_input"])
    assert torch.equal(outputs["rs_input"], expected["rs_input"])
    for name, actual in [("outs", step.outs), ("new_outs", outputs["new_outs"]), ("shard_grads", step.shard_grads)]:
        assert len(actual) == len(expected[name])
        for a, e in zip(actual, expected[name]):
            assert torch.equal(a, e), name


def replay_and_check(step: Step, graph: torch.cuda.CUDAGraph, outputs: dict[str, object], seeds: range) -> None:
    """New data in the static inputs, a replay, the references: once per seed."""
    for seed in seeds:
        step.fill(seed)
        expected = step.references()
        graph.replay()
        torch.cuda.synchronize()
        assert_results(step, outputs, expected)


def churn(device: torch.device, rounds: int = 300) -> None:
    """Evict every layout from the ``from_spec`` cache (creating and freeing their tables), run the
    ops on them, then overwrite freed device memory."""
    for i in range(rounds):
        layout = ShardLayout.from_spec((WORLD_SIZE, 2, 1, 50 + i, 2, 3, 7))
        fulls = [torch.randn(s, device=device) for s in layout.shapes]
        all_gather_copy_out(all_gather_copy_in(layout.shards(fulls, 0), layout, 0)[1], layout)
    gc.collect()
    garbage = [torch.full((1 << 16,), float("nan"), device=device) for _ in range(64)]
    del garbage
    torch.cuda.synchronize()


def capture(step: Step) -> tuple[torch.cuda.CUDAGraph, dict[str, object]]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks (Triton compiles here)
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def test_capture_replay_matches_references_and_survives_layout_churn() -> None:
    device = torch.device("cuda")
    spec = ShardLayout(SHAPES, WORLD_SIZE).spec
    step = Step(ShardLayout.from_spec(spec), device)
    step.fill(0)
    graph, outputs = capture(step)
    assert table_memory.graph_tables() > 0
    replay_and_check(step, graph, outputs, range(1, 4))
    step.layout = None  # the captured layout is now held by nothing but the LRU
    churn(device)
    replay_and_check(step, graph, outputs, range(4, 6))


def test_tables_not_yet_ready_at_capture_are_copied_into_the_graph() -> None:
    device = torch.device("cuda")
    warm = Step(ShardLayout(SHAPES, WORLD_SIZE), device)
    warm.fill(0)
    capture(warm)  # compiles the kernels
    step = Step(ShardLayout(SHAPES, WORLD_SIZE), device)  # an equal layout: new, uncached tables
    step.fill(1)
    torch.cuda._sleep(50_000_000)  # the uploads queue behind it: not seen complete before the capture
    step()
    assert len(table_memory._PENDING) > 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    churn(device, rounds=50)
    replay_and_check(step, graph, outputs, range(2, 4))


def test_first_use_on_another_stream_waits_for_the_upload() -> None:
    device = torch.device("cuda")
    step = Step(ShardLayout(SHAPES, WORLD_SIZE), device)
    step.fill(0)
    expected = step.references()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs are ready for the side stream
    torch.cuda._sleep(50_000_000)  # the current stream is busy for a while...
    for rank, pad in [(RANK, True), (None, False), (None, True), (RANK, False)]:  # ...and uploads behind it
        _launch.block_table(step.layout, rank, pad=pad, device=device)
    with torch.cuda.stream(side):  # used at once from the side stream: it must wait for them
        outputs = step()
    torch.cuda.synchronize()
    assert_results(step, outputs, expected)


def test_packed_copy_out_replays_after_its_table_was_evicted() -> None:
    device = torch.device("cuda")
    layout = ShardLayout(SHAPES, WORLD_SIZE)
    placement = _launch.PackedPlacement.of(layout.shapes, [f32] * len(layout.shapes))
    storage = torch.empty(placement.nbytes, dtype=torch.uint8, device=device).untyped_storage()
    outs = placement.views(storage)
    ag_buffer = torch.empty(layout.buffer_numel, dtype=bf16, device=device)

    def body() -> None:  # what ParamGroup runs to unshard: one launch keyed on the storage
        _all_gather_copy_out(ag_buffer, layout, outs, packed=(storage, placement))

    def replay_and_compare(seeds: range) -> None:
        for seed in seeds:
            gen = torch.Generator(device=device).manual_seed(seed)
            ag_buffer.copy_(torch.randn(ag_buffer.shape, generator=gen, device=device))
            expected = all_gather_copy_out_ref(ag_buffer, layout, [torch.empty_like(o) for o in outs])
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            for got, want in zip(outs, expected):
                assert torch.equal(got, want)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, builds the packed table)
        body()
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    replay_and_compare(range(2))
    others = [torch.empty(placement.nbytes, dtype=torch.uint8, device=device).untyped_storage()
              for _ in range(2 * _launch.POINTER_CACHE_SIZE)]
    for other in others:  # each a new address: the captured table leaves the layout's cache
        _all_gather_copy_out(ag_buffer, layout, placement.views(other), packed=(other, placement))
    del others
    gc.collect()
    torch.cuda.synchronize()
    replay_and_compare(range(2, 4))
