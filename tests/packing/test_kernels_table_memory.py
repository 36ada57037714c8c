"""Device table memory (``overlap_kernels.table_memory``): uploads, use from several streams, release, and
CUDA graph capture, checked on a CPU-only machine.

The CUDA calls go through ``table_memory.RUNTIME``; here it is a recording fake whose streams,
events and copies model what the device would do:

* a copy made outside capture runs at once; one made during capture is a graph node that runs at
  each ``replay()`` (so a table the graph reads holds garbage until the graph replays, and must
  still hold the right bytes at a replay long after capture);
* events complete when the test says so (``complete()``);
* during capture, pinned allocation, event record/query and stream waits fail the test (they are
  illegal in, or invalidate, a global-mode capture), and nothing here can synchronize: the fake has
  no such method and ``torch.cuda``'s synchronizing calls are tripwires.

The real CUDA behaviour (capture and replay against the references) is
tests/packing/test_kernels_cuda_graphs.py, which needs a GPU.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from overlap_kernels import ShardLayout, _launch, table_memory
from overlap_kernels.table_memory import Use, plan_use

CUDA = torch.device("cuda")
GARBAGE = 0xAB  # what fresh fake device memory holds


class FakeStream:
    def __init__(self, runtime: FakeRuntime, handle: int) -> None:
        self.runtime, self.cuda_stream = runtime, handle

    def wait_event(self, event: FakeEvent) -> None:
        self.runtime.forbid_in_capture("stream wait")
        self.runtime.log.append(("wait", self.cuda_stream, event))


class FakeEvent:
    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime, self.done, self.streams = runtime, False, []

    def record(self, stream: FakeStream) -> None:
        self.runtime.forbid_in_capture("event record")
        self.streams.append(stream.cuda_stream)
        self.runtime.log.append(("record", stream.cuda_stream, self))

    def query(self) -> bool:
        self.runtime.forbid_in_capture("event query")
        return self.done


class FakeRuntime:
    """``table_memory.Runtime`` on host tensors, with a capture mode and a graph to replay."""

    def __init__(self) -> None:
        self.capture = False
        self.stream = FakeStream(self, 1)
        self.log: list[tuple] = []
        self.events: list[FakeEvent] = []
        self.graph: list[tuple[torch.Tensor, torch.Tensor]] = []  # captured copies
        self.blocks: list[weakref.ref[torch.Tensor]] = []  # device allocations (alive or freed)

    def forbid_in_capture(self, what: str) -> None:
        assert not self.capture, f"{what} during CUDA graph capture"

    def capturing(self, device: torch.device) -> bool:
        return self.capture

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.stream

    def current_stream_id(self, device: torch.device) -> int:
        return self.stream.cuda_stream

    def event(self) -> FakeEvent:
        event = FakeEvent(self)
        self.events.append(event)
        return event

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.forbid_in_capture("pinned allocation")
        self.log.append(("pinned", nbytes))
        return torch.zeros(nbytes, dtype=torch.uint8)

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        self.log.append(("empty", nbytes))
        block = torch.full((nbytes,), GARBAGE, dtype=torch.uint8)
        self.blocks.append(weakref.ref(block))
        return block

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("copy", self.stream.cuda_stream, src))
        if self.capture:
            self.graph.append((dst, src))
        else:
            dst.copy_(src)

    def replay(self) -> None:
        for dst, src in self.graph:
            dst.copy_(src)

    def complete(self) -> None:
        for event in self.events:
            event.done = True

    def calls(self, kind: str) -> list[tuple]:
        return [entry for entry in self.log if entry[0] == kind]


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeRuntime]:
    """A fake runtime and fresh module state (pending, retired, graph tables, reserve), with
    torch.cuda's synchronizing calls as tripwires."""
    runtime = FakeRuntime()
    monkeypatch.setattr(table_memory, "RUNTIME", runtime)
    monkeypatch.setattr(table_memory, "_PENDING", collections.deque())
    monkeypatch.setattr(table_memory, "_RETIRED", collections.deque())
    monkeypatch.setattr(table_memory, "_DRAINING", collections.deque())
    monkeypatch.setattr(table_memory, "_IN_GRAPHS", [])
    monkeypatch.setattr(table_memory, "_RESERVE", table_memory._Reserve())

    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("a host synchronization")

    monkeypatch.setattr(torch.cuda, "synchronize", tripwire)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", tripwire)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", tripwire)
    monkeypatch.setattr(torch.Tensor, "pin_memory", tripwire)
    yield runtime


@contextlib.contextmanager
def capturing(runtime: FakeRuntime) -> Iterator[None]:
    runtime.capture = True
    try:
        yield
    finally:
        runtime.capture = False


ARRAYS = [np.arange(5, dtype=np.int32), np.arange(12, dtype=np.int64).reshape(4, 3) * 10**10]


def assert_holds(tensors: tuple[torch.Tensor, ...], arrays: list[np.ndarray]) -> None:
    assert len(tensors) == len(arrays)
    for t, a in zip(tensors, arrays):
        assert t.dtype == torch.from_numpy(a).dtype and t.shape == a.shape
        assert np.array_equal(t.numpy(), a)


# ------------------------------------------------------------------------------------------ the rule
@pytest.mark.parametrize("capturing_now", [False, True])
@pytest.mark.parametrize("copy_pending", [False, True])
@pytest.mark.parametrize("same_stream", [False, True])
def test_plan_use_rule(capturing_now: bool, copy_pending: bool, same_stream: bool) -> None:
    use = plan_use(capturing=capturing_now, copy_pending=copy_pending, same_stream=same_stream)
    if not copy_pending:
        expected = Use.READ  # bytes in device memory: read in place, in eager mode and in a graph
    elif capturing_now:
        expected = Use.COPY_IN_GRAPH  # never wait on an event in capture: the graph copies it itself
    else:
        expected = Use.READ if same_stream else Use.WAIT
    assert use is expected


# ---------------------------------------------------------------------------------------- eager use
def test_upload_is_one_stream_ordered_copy_without_host_sync(rt: FakeRuntime) -> None:
    table = table_memory.upload(ARRAYS, CUDA, cached=True)
    assert_holds(table.tensors, ARRAYS)
    # one pinned staging buffer owned by the table (plus the capture reserve), one device block, one copy
    staging = [n for _, n in rt.calls("pinned") if n != 2 * table_memory.CAPTURE_RESERVE_BYTES]
    assert staging == [table.staging.numel()] and len(rt.calls("empty")) == 1
    assert [entry[1] for entry in rt.calls("copy")] == [1] and rt.calls("copy")[0][2] is table.staging
    # its ready event is recorded on the copy's stream, after the copy
    kinds = [entry[0] for entry in rt.log]
    assert kinds.index("record") > kinds.index("copy") and rt.calls("record")[0][1] == 1
    for offset, _, _ in table.views:
        assert offset % 16 == 0  # every array 16-byte aligned in the allocation


def test_per_call_table_has_no_event_and_no_release_bookkeeping(rt: FakeRuntime) -> None:
    table = table_memory.upload(ARRAYS[:1], CUDA, cached=False)
    assert_holds(table.tensors, ARRAYS[:1])
    assert table.ready is None and table.readers == {} and not rt.calls("record")
    del table
    gc.collect()
    assert table_memory.retiring() == 0  # freed on the stream that queued its launch: nothing to order


def test_launch_on_another_stream_waits_until_the_copy_is_seen_complete(rt: FakeRuntime) -> None:
    table = table_memory.upload(ARRAYS, CUDA, cached=True)
    assert table_memory.prepare([table], CUDA) == [table.tensors]
    assert not rt.calls("wait")  # same stream as the copy: ordered already
    rt.stream = FakeStream(rt, 2)
    table_memory.prepare([table], CUDA)
    assert [(e[1], e[2]) for e in rt.calls("wait")] == [(2, table.ready)]
    assert set(table.readers) == {1, 2}
    rt.complete()
    rt.stream = FakeStream(rt, 3)
    table_memory.prepare([table], CUDA)
    assert len(rt.calls("wait")) == 1 and table.ready is None  # seen complete: no more waits
    assert set(table.readers) == {1, 2, 3}


# ------------------------------------------------------------------------------------------ release
def test_released_table_is_freed_only_after_every_reader_stream(rt: FakeRuntime) -> None:
    table = table_memory.upload(ARRAYS, CUDA, cached=True)
    memory = rt.blocks[-1]
    rt.stream = FakeStream(rt, 2)
    table_memory.prepare([table], CUDA)  # read on stream 2 too
    rt.complete()
    table_memory.prepare([table], CUDA)  # drops the ready event
    del table
    gc.collect()
    assert memory() is not None and table_memory.retiring() == 1  # its owner let go: retired, not freed
    records_before = len(rt.calls("record"))
    table_memory.prepare([], CUDA)  # the next launch puts an event behind each reader
    behind = rt.calls("record")[records_before:]
    assert sorted(entry[1] for entry in behind) == [1, 2]
    gc.collect()
    assert memory() is not None  # those events have not completed: a queued kernel may still read it
    for _, _, event in behind:
        event.done = True
    table_memory.prepare([], CUDA)
    gc.collect()
    assert memory() is None and table_memory.retiring() == 0


def test_evicted_layouts_retire_their_tables(rt: FakeRuntime) -> None:
    """The ``ShardLayout.from_spec`` cache (256 layouts) dropping a layout retires its tables."""
    spec = ShardLayout([(7, 3), (5,)], 2).spec
    layout = ShardLayout.from_spec(spec)
    _launch.block_table(layout, 0, pad=True, device=CUDA)
    memory = rt.blocks[-1]
    del layout
    for i in range(300):  # churn the LRU
        ShardLayout.from_spec((2, 1, 1, 1000 + i))
    rt.complete()
    table_memory.prepare([], CUDA)  # polls the ready event: the table is no longer pending
    gc.collect()
    assert memory() is not None and table_memory.retiring() == 1
    table_memory.prepare([], CUDA)
    rt.complete()
    table_memory.prepare([], CUDA)
    gc.collect()
    assert memory() is None


# ------------------------------------------------------------------------------------------ capture
def test_capture_copies_a_pending_table_into_the_graph_from_its_own_staging(rt: FakeRuntime) -> None:
    table = table_memory.upload(ARRAYS, CUDA, cached=True)  # its ready event has not been seen
    rt.log.clear()
    with capturing(rt):
        (tensors,) = table_memory.prepare([table], CUDA)
    assert not rt.calls("pinned") and not rt.calls("record") and not rt.calls("wait")
    assert tensors[0].data_ptr() != table.tensors[0].data_ptr()
    (copy,) = rt.calls("copy")
    assert copy[2] is table.staging  # nothing rewrites it: every replay copies the same bytes
    assert all((t.numpy().view(np.uint8) == GARBAGE).all() for t in tensors)  # not until replay
    rt.replay()
    assert_holds(tensors, ARRAYS)
    staging = weakref.ref(table.staging)
    del table
    gc.collect()
    assert staging() is not None  # the graph still reads it
    assert table_memory.graph_tables() == 1


def test_capture_reads_a_ready_table_in_place_and_keeps_it_forever(rt: FakeRuntime) -> None:
    table = table_memory.upload(ARRAYS, CUDA, cached=True)
    rt.complete()
    table_memory.prepare([table], CUDA)  # sees the copy complete
    memory = rt.blocks[-1]
    with capturing(rt):
        (tensors,) = table_memory.prepare([table], CUDA)
    assert tensors is table.tensors and table.in_graph
    del table, tensors
    gc.collect()
    table_memory.prepare([], CUDA)
    rt.complete()
    table_memory.prepare([], CUDA)
    gc.collect()
    assert memory() is not None and table_memory.retiring() == 0  # never retired: a graph reads it


def test_new_table_during_capture_comes_from_the_reserve(rt: FakeRuntime) -> None:
    table_memory.upload(ARRAYS[:1], CUDA, cached=False)  # any eager call sets the reserve aside
    reserve = table_memory._RESERVE.chunk
    assert reserve is not None and table_memory._RESERVE.free >= table_memory.CAPTURE_RESERVE_BYTES
    with capturing(rt):
        table = table_memory.upload(ARRAYS, CUDA, cached=True)
    assert table.in_graph and table.ready is None
    assert table.staging._base is reserve  # a slice of memory pinned before capture
    rt.replay()
    assert_holds(table.tensors, ARRAYS)
    for _ in range(3):  # later eager uploads never hand that slice out again
        table_memory.upload(ARRAYS, CUDA, cached=False)
    rt.replay()
    assert_holds(table.tensors, ARRAYS)


def test_reserve_exhausted_during_capture_is_an_error_naming_the_remedy(rt: FakeRuntime) -> None:
    with capturing(rt), pytest.raises(RuntimeError, match=r"overlap_kernels\.table_memory\.reserve\(\d+\)"):
        table_memory.upload(ARRAYS, CUDA, cached=True)  # nothing was set aside: first use in capture
    table_memory.reserve(10_000)
    with capturing(rt):
        table_memory.upload(ARRAYS, CUDA, cached=True)
    with pytest.raises(ValueError, match="nbytes"):
        table_memory.reserve(-1)


def test_launch_path_under_capture(rt: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_launch.launch`` on a CUDA device, end to end but for the kernel: tables built and used in
    eager mode, then in a simulated capture with new tensors (new addresses) and a new layout."""
    launched: list[tuple[tuple, dict]] = []

    class Kernel:
        __name__ = "fake_kernel"

        def __getitem__(self, grid: tuple[int]) -> object:
            return lambda *args, **kwargs: launched.append((args, kwargs))

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: CUDA.index)
    layout = ShardLayout([(300,), (7, 3)], 2)
    tensors = [torch.zeros(s) for s in layout.shard_shapes(0)]

    def run(layout: ShardLayout, tensors: list[torch.Tensor]) -> tuple[_launch.BlockTable, _launch.PointerTable]:
        blocks = _launch.block_table(layout, 0, pad=True, device=CUDA)
        pointers = _launch.pointer_table(layout, tensors, CUDA)
        _launch.launch(Kernel(), blocks, pointers, "slot", VEC=4)
        return blocks, pointers

    blocks, pointers = run(layout, tensors)  # warm-up
    rt.complete()
    run(layout, tensors)
    def tables(layout: ShardLayout) -> dict:
        return {k: v for k, v in layout._device_cache.items() if k[0] in ("blocks", "pointers")}

    cached = tables(layout)
    rt.log.clear()
    with capturing(rt):
        fresh = [torch.zeros(s) for s in layout.shard_shapes(0)]
        _, new_pointers = run(layout, fresh)
        other = ShardLayout([(33, 2)], 2)
        new_blocks, _ = run(other, [torch.zeros(s) for s in other.shard_shapes(0)])
    assert not rt.calls("pinned") and not rt.calls("record") and not rt.calls("wait")
    assert tables(layout) == cached and not tables(other)  # nothing captured is cached
    (args, kwargs), (args2, _) = launched[-2:]
    assert args[0] is blocks.blocks and args[1] is blocks.runs  # ready: read in place
    assert args[2] is new_pointers.pointers and new_pointers.memory.in_graph
    assert args2[0] is new_blocks.blocks and new_blocks.memory.in_graph
    assert args[3] == "slot" and kwargs["VEC"] == 4 and kwargs["num_warps"] == blocks.num_warps
    assert kwargs["enable_fp_fusion"] is False
    rt.replay()
    addresses = args[2].numpy()[:, 0].tolist()
    assert addresses == [t.data_ptr() for t in fresh]
