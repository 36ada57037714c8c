"""Device copies of the kernels' host-built tables: upload, use from any stream, CUDA graph capture,
release.

The packing kernels read small int tables (block and pointer tables, ``overlap_kernels._launch``) that the
host builds. This module owns their device memory: a ``DeviceTable`` is one or more host arrays
copied into one device allocation, with typed views per array.

[Note: table memory]
* **Upload** (outside capture): the arrays are packed into a pinned host buffer that the table
  owns for its whole life, and copied on the *current* stream (``non_blocking``): no side stream,
  no host sync. A cached table records a ``ready`` event after its copy.
* **Use** (each launch, outside capture): a kernel on the stream that made the copy is ordered
  after it; a kernel on another stream waits on ``ready`` (a stream wait, not a host wait) until the
  event is seen complete, after which it is dropped. The launching stream is remembered as a
  *reader*.
* **Release** ([Note: table lifetime]): a cached table freed on the host (its layout evicted from the
  ``ShardLayout.from_spec`` cache, or dropped) does not give its device block back at once: the
  caching allocator would hand it to the next allocation on the copy's stream while a kernel queued
  on another stream may still read it. It is *retired*: an event is recorded on every reader stream,
  and the memory is released once all of them have completed.
* **Capture** ([Note: tables in CUDA graphs]): a captured kernel reads the same addresses at every
  replay, so what it reads must stay valid and unchanged for as long as the graph may replay, which
  this module cannot see. A table read during capture is kept for the life of the process. A table
  whose copy is not known complete, or a new table, gets a copy *inside the graph*: from pinned
  memory that nothing ever rewrites (the table's own staging buffer, or a slice of a reserve set
  aside before capture) into device memory allocated on the capturing stream (the graph's pool).
  During capture nothing allocates pinned memory, queries or waits on an event, or synchronizes:
  all of these are illegal in (or invalidate) a global-mode capture.

[Note: table lifetime]
The table a kernel reads must not be reused before the kernel has run. Tables used only on the
stream that allocated them need nothing (the allocator reuses a block on that stream only, after
the kernels already queued there); per-call tables are such. Their pinned staging goes back to
torch's host allocator, which reuses it once the copy has run: right for a copy that runs once,
wrong for a captured one, which runs again at every replay (and would copy whatever the buffer
holds by then): so capture never stages through it. Cached tables may be read from any stream:
retirement orders their reuse after every reader with events, and tables read by a CUDA graph are
never freed.

[Note: tables in CUDA graphs]
Captured tables cost, per captured launch whose tables were not ready: one host-to-device copy node
of the table's bytes (a pointer table is 16 bytes per parameter) at every replay, and the table's
bytes (device and pinned) for the life of the process. Warm up (run each op once, as
``torch.cuda.graph`` asks anyway, and once more so the ``ready`` events are seen) and the block
tables are read in place; pointer tables of tensors allocated during capture are always new.

Concurrency contract: the functions run on the host thread that launches; they never block on the
device. ``DeviceTable`` finalizers may run on any thread (garbage collection) and only append to a
deque. The CUDA calls go through ``RUNTIME`` (``CudaRuntime``), which tests replace with a recording
fake to check the capture rules on a CPU-only machine.

======================  ==============================  =========================================
object                  lives                           freed
======================  ==============================  =========================================
cached table (device)   while its layout caches it      after every reader stream passed an event
cached table (pinned)   with the device copy            with it
per-call table          until its launch is queued      on the stream that queued it
captured table          the process                     never
capture reserve         the process (chunks)            never (slices back captured tables)
======================  ==============================  =========================================
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import weakref
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from overlap_kernels._compiled_launch import current_device_index, current_stream_handle

__all__ = [
    "CAPTURE_RESERVE_BYTES",
    "CudaRuntime",
    "DeviceTable",
    "Runtime",
    "Use",
    "graph_tables",
    "plan_use",
    "prepare",
    "reserve",
    "retiring",
    "upload",
]

ALIGN_BYTES = 16
"""Each array starts 16-byte aligned inside a table's allocation (the kernels' pointer arguments are
specialized as 16-byte divisible)."""

CAPTURE_RESERVE_BYTES = 1 << 19
"""Pinned bytes kept free, outside capture, for tables first needed during a capture (512 KiB: 32768
pointer-table rows). The reserve is refilled in chunks of twice that, so captures that take a little
each do not abandon a chunk each."""


# ------------------------------------------------------------------------------------------ runtime
class Stream(Protocol):
    cuda_stream: int

    def wait_event(self, event: Event) -> None: ...


class Event(Protocol):
    def record(self, stream: Stream) -> None: ...

    def query(self) -> bool: ...


class Runtime(Protocol):
    """The CUDA calls table memory makes (``CudaRuntime``); tests substitute a recording fake."""

    def capturing(self, device: torch.device) -> bool:
        """Whether ``device``'s current stream is capturing a CUDA graph."""
        ...

    def current_stream(self, device: torch.device) -> Stream: ...

    def current_stream_id(self, device: torch.device) -> int:
        """``current_stream(device).cuda_stream``, without building the stream object."""
        ...

    def event(self) -> Event: ...

    def pinned(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned host memory (uint8). Never called during capture."""
        ...

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` of device memory (uint8), allocated on the current stream."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Asynchronous host-to-device copy on the current stream (captured during capture)."""
        ...


class CudaRuntime:
    """``Runtime`` on torch.cuda."""

    def capturing(self, device: torch.device) -> bool:
        if current_device_index() == device.index:  # the launch already made it current
            return torch.cuda.is_current_stream_capturing()
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def current_stream_id(self, device: torch.device) -> int:
        return current_stream_handle(current_device_index() if device.index is None else device.index)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)


RUNTIME: Runtime = CudaRuntime()
"""The runtime every CUDA table goes through (replaced by tests)."""


# ------------------------------------------------------------------------------------------- tables
View = tuple[int, torch.dtype, tuple[int, ...]]
"""``(byte offset, dtype, shape)`` of one array inside a table's allocation."""


@dataclasses.dataclass(eq=False)
class DeviceTable:
    """Host arrays copied into one device allocation; ``tensors`` are typed views, one per array.

    ``staging`` is the pinned host copy (CUDA only), never rewritten while the table lives;
    ``ready`` the event after the upload copy (``None`` once seen complete, or never needed);
    ``readers`` the streams (by handle) that launched kernels reading it.
    """

    tensors: tuple[torch.Tensor, ...]
    views: tuple[View, ...] = ()
    staging: torch.Tensor | None = None
    stream_id: int | None = None
    ready: Event | None = None
    readers: dict[int, Stream] = dataclasses.field(default_factory=dict)
    in_graph: bool = False  # read by a captured kernel: kept for the life of the process


def _pack(arrays: Sequence[np.ndarray]) -> tuple[int, tuple[View, ...]]:
    """Byte offsets of ``arrays`` packed one after the other, each 16-byte aligned."""
    views, offset = [], 0
    for a in arrays:
        views.append((offset, _TORCH_DTYPES[a.dtype], tuple(a.shape)))
        offset += -(-a.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return max(offset, ALIGN_BYTES), tuple(views)


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def _typed_views(memory: torch.Tensor, views: Sequence[View]) -> tuple[torch.Tensor, ...]:
    out = []
    for offset, dtype, shape in views:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out.append(memory[offset : offset + n].view(dtype).view(shape))
    return tuple(out)


def _fill(staging: torch.Tensor, arrays: Sequence[np.ndarray], views: Sequence[View]) -> None:
    host = staging.numpy()
    for a, (offset, _, _) in zip(arrays, views):
        host[offset : offset + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def upload(arrays: Sequence[np.ndarray], device: torch.device, *, cached: bool) -> DeviceTable:
    """``arrays`` (int32/int64) on ``device``.

    ``cached``: the table will be read by later launches, possibly on other streams (``ready`` event,
    readers, retirement); otherwise it serves one launch on the current stream. During capture the
    table is copied inside the graph and kept for the life of the process, whatever ``cached`` says:
    it has ``in_graph`` set, and callers must not cache it (its bytes arrive when the graph replays).
    """
    if device.type != "cuda":
        return DeviceTable(tensors=tuple(torch.from_numpy(a).to(device) for a in arrays))
    rt = RUNTIME
    nbytes, views = _pack(arrays)
    if rt.capturing(device):
        staging = _RESERVE.take(nbytes)
        _fill(staging, arrays, views)
        return _copy_in_graph(rt, staging, views, device)
    _collect(rt)
    _RESERVE.ensure(rt, CAPTURE_RESERVE_BYTES)
    staging = rt.pinned(nbytes)
    _fill(staging, arrays, views)
    memory = rt.empty(nbytes, device)
    rt.copy(memory, staging)
    table = DeviceTable(tensors=_typed_views(memory, views), views=views, staging=staging)
    if cached:
        stream = rt.current_stream(device)
        table.stream_id = stream.cuda_stream
        table.ready = rt.event()
        table.ready.record(stream)
        table.readers[stream.cuda_stream] = stream  # the copy writes it: a use like any other
        _PENDING.append(table)
        finalizer = weakref.finalize(table, _RETIRED.append, (memory, staging, table.readers))
        finalizer.atexit = False
    return table


def _copy_in_graph(rt: Runtime, staging: torch.Tensor, views: tuple[View, ...], device: torch.device) -> DeviceTable:
    """A table whose copy is a node of the graph being captured (from ``staging``, which nothing
    rewrites), kept for the life of the process."""
    memory = rt.empty(staging.numel(), device)
    rt.copy(memory, staging)
    table = DeviceTable(tensors=_typed_views(memory, views), views=views, staging=staging, in_graph=True)
    _IN_GRAPHS.append(table)
    return table


# ---------------------------------------------------------------------------------------------- use
class Use(enum.Enum):
    """How a launch reads a table."""

    READ = "read"  # its bytes are in device memory, ordered before the launch
    WAIT = "wait"  # its copy may be in flight on another stream: the launch stream waits on ``ready``
    COPY_IN_GRAPH = "copy in graph"  # capturing, copy not known complete: the graph gets its own copy


def plan_use(*, capturing: bool, copy_pending: bool, same_stream: bool) -> Use:
    """The rule of [Note: table memory], as a pure function.

    ``copy_pending``: the table's ``ready`` event has not been seen complete; ``same_stream``: the
    launch is on the stream that made the copy. During capture a pending copy is never waited on (the
    replay may run long after, on another stream, unordered with it): the graph copies the table
    itself.
    """
    if not copy_pending:
        return Use.READ
    if capturing:
        return Use.COPY_IN_GRAPH
    return Use.READ if same_stream else Use.WAIT


def prepare(tables: Sequence[DeviceTable], device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """The tensors a launch on ``device``'s current stream passes for ``tables`` (CUDA), having done
    what ``plan_use`` says for each."""
    rt = RUNTIME
    if rt.capturing(device):
        out = []
        for table in tables:
            use = plan_use(capturing=True, copy_pending=table.ready is not None, same_stream=False)
            if use is Use.COPY_IN_GRAPH:  # from the table's own staging, which the copy keeps alive
                out.append(_copy_in_graph(rt, table.staging, table.views, device).tensors)
            else:
                if not table.in_graph:
                    table.in_graph = True
                    _IN_GRAPHS.append(table)
                out.append(table.tensors)
        return out
    if _PENDING:
        _poll_ready()
    if _RETIRED or _DRAINING:
        _collect(rt)
    _RESERVE.ensure(rt, CAPTURE_RESERVE_BYTES)
    sid = rt.current_stream_id(device)
    stream = None  # the Stream object, built only for a wait or a new reader (a repeat launch needs neither)
    for table in tables:
        if plan_use(capturing=False, copy_pending=table.ready is not None, same_stream=sid == table.stream_id) is Use.WAIT:
            stream = stream or rt.current_stream(device)
            stream.wait_event(table.ready)
        if table.stream_id is not None and sid not in table.readers:
            stream = stream or rt.current_stream(device)
            table.readers[sid] = stream
    return [table.tensors for table in tables]


def _poll_ready() -> None:
    """Drop the ``ready`` events of uploads seen complete (outside capture: ``query`` is illegal in
    it), so that later launches, and captures, read those tables in place."""
    for _ in range(len(_PENDING)):
        table = _PENDING.popleft()
        if table.ready is not None and not table.ready.query():
            _PENDING.append(table)
        else:
            table.ready = None


# ------------------------------------------------------------------------------------------ release
Retired = tuple[torch.Tensor, torch.Tensor, dict]
"""``(device memory, pinned staging, readers)`` of a cached table its owner let go."""

_PENDING: collections.deque[DeviceTable] = collections.deque()
_RETIRED: collections.deque[Retired] = collections.deque()  # appended by finalizers, any thread
_DRAINING: collections.deque[tuple[Retired, list[Event]]] = collections.deque()
_IN_GRAPHS: list[object] = []  # tables (and staging buffers) captured graphs read: never freed


def _collect(rt: Runtime) -> None:
    """Outside capture: put an event behind every reader of each newly retired table; release the
    tables whose events have all completed."""
    while _RETIRED:
        retired = _RETIRED.popleft()
        events = []
        for stream in retired[2].values():
            event = rt.event()
            event.record(stream)
            events.append(event)
        _DRAINING.append((retired, events))
    for _ in range(len(_DRAINING)):
        retired, events = _DRAINING.popleft()
        if not all(e.query() for e in events):
            _DRAINING.append((retired, events))


def retiring() -> int:
    """How many released tables still wait for their readers (for tests and debugging)."""
    return len(_RETIRED) + len(_DRAINING)


def graph_tables() -> int:
    """How many tables (and staging buffers) captured graphs hold for the life of the process."""
    return len(_IN_GRAPHS)


# ---------------------------------------------------------------------------------- capture reserve
class _Reserve:
    """Pinned memory set aside outside capture and handed out, never reused, to tables first built
    during a capture (pinned allocation is not capture-safe)."""

    def __init__(self) -> None:
        self.chunk: torch.Tensor | None = None
        self.used = 0

    @property
    def free(self) -> int:
        return 0 if self.chunk is None else self.chunk.numel() - self.used

    def ensure(self, rt: Runtime, nbytes: int) -> None:
        """At least ``nbytes`` free (outside capture). The rest of a replaced chunk is abandoned; its
        slices stay valid, held by the tables made from them."""
        if self.free < nbytes:
            self.chunk, self.used = rt.pinned(2 * max(nbytes, CAPTURE_RESERVE_BYTES)), 0

    def take(self, nbytes: int) -> torch.Tensor:
        if self.free < nbytes:
            raise RuntimeError(
                f"kernels: a CUDA graph capture needs {nbytes} bytes of pinned memory for a new kernel table "
                f"and {self.free} are set aside; call overlap_kernels.table_memory.reserve({nbytes}) before capturing, "
                "or run the op once before capturing"
            )
        assert self.chunk is not None
        piece = self.chunk[self.used : self.used + nbytes]
        self.used += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        return piece


_RESERVE = _Reserve()


def reserve(nbytes: int) -> None:
    """Set aside at least ``nbytes`` of pinned memory for tables built during the next capture (call
    outside capture; the ops keep ``CAPTURE_RESERVE_BYTES`` set aside on their own)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"reserve: nbytes must be a non-negative int, got {nbytes!r}")
    _RESERVE.ensure(RUNTIME, nbytes)
