"""Cross-stream buffer lifetime, CUDA graph capture and the one-device-per-rank check, on CPU.

The CUDA paths of ``overlap.inflight_work`` run here against fakes: a fake stream logs its waits
and event records, a fake event completes when the test says so, ``torch.cuda.current_stream`` is
patched to return the stream the "consumer" runs on. Buffers are CPU tensors watched through weak
references: a buffer is released when the runtime's last reference to it is gone.
Checked: buffers waited on their issue stream drop at once; waited on another stream they stay held
until an event recorded on that stream *after* the result's copy-out has completed (never before
the ordering exists); a sweep releases them then; a tensor handed to ``keep`` follows them;
capture and device errors name the fix.
The real thing (NCCL, streams, the caching allocator) is in tests/collectives/test_collectives_cuda.py.
"""
from __future__ import annotations

import gc
import weakref
from typing import Callable, Optional

import pytest
import torch

import overlap
from overlap import inflight_work, streams
from overlap.inflight_work import InflightWork, ResultCompletion
from overlap.streams import StreamCaptureError


CUDA0 = torch.device("cuda", 0)


class FakeEvent:
    """A CUDA event stand-in: ``query()`` is False until the test calls ``complete()``."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.done = log, name, False

    def query(self) -> bool:
        self.log.append(f"query {self.name}")
        return self.done

    def complete(self) -> None:
        self.done = True

    def synchronize(self) -> None:
        self.log.append(f"synchronize {self.name}")
        self.done = True


class FakeStream:
    """A CUDA stream stand-in that logs ``wait_event`` and ``record_event`` into a shared log."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name
        self.recorded: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(f"{self.name} waits {event.name}")

    def record_event(self) -> FakeEvent:
        event = FakeEvent(self.log, f"{self.name}.e{len(self.recorded)}")
        self.log.append(f"{self.name} records {event.name}")
        self.recorded.append(event)
        return event


class Scene:
    """An issue stream, a consumer stream, the stream that is current, and a shared log."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[str] = []
        self.issue = FakeStream(self.log, "issue")
        self.other = FakeStream(self.log, "other")
        self.current = self.issue
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)

    def work(self, *buffers: torch.Tensor, kind: str = "all_gather") -> tuple[InflightWork, FakeEvent]:
        """A tracked CUDA work on the issue stream whose collective completes with the returned event."""
        done = FakeEvent(self.log, "collective")
        work = InflightWork(kind, sum(b.numel() * b.element_size() for b in buffers), buffers, event=done,
                            device=CUDA0, group="g", seq=0, issue_stream=self.issue)
        return inflight_work.track(work), done

    def finish(self, reads: torch.Tensor, name: str = "finish") -> Callable[[], None]:
        """A first-use step that reads ``reads`` (a view of a buffer) on the current stream."""
        def run() -> None:
            self.log.append(f"{self.current.name} runs {name} on {tuple(reads.shape)}")
        return run


@pytest.fixture
def scene(monkeypatch: pytest.MonkeyPatch):
    inflight_work._inflight.clear()
    inflight_work._deferred.clear()
    yield Scene(monkeypatch)
    inflight_work._inflight.clear()
    inflight_work._deferred.clear()


def _alive(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is not None


def _buffer(numel: int = 16) -> tuple[weakref.ref, torch.Tensor]:
    """A buffer and a weak reference to it (views keep their base alive: drop them too)."""
    buffer = torch.zeros(numel)
    return weakref.ref(buffer), buffer


def test_wait_on_the_issue_stream_releases_at_once(scene: Scene) -> None:
    ref, buffer = _buffer()
    work, _ = scene.work(buffer)
    del buffer
    work.wait()
    assert not _alive(ref), "a wait on the issue stream orders its later allocations: nothing to hold"
    assert not work.pending and inflight_work._deferred == []
    assert scene.log == ["issue waits collective"], "no event recorded, nothing deferred"


def test_wait_on_another_stream_holds_buffers_until_the_consumer_event(scene: Scene) -> None:
    ref, buffer = _buffer()
    view = buffer[:8]
    work, collective = scene.work(buffer)
    completion = ResultCompletion(work, scene.finish(view))
    del buffer, view
    scene.current = scene.other
    completion.wait()
    # The consumer's stream waited on the collective, ran the copy-out, then recorded the event that
    # the release waits for: in that order, so the event covers the copy-out's reads.
    assert scene.log[-3:] == ["other waits collective", "other runs finish on (8,)", "other records other.e0"]
    assert not work.pending and work not in overlap.inflight(), "the wait is done: not in flight any more"
    assert _alive(ref), "released while the issue stream could still reuse the block under the copy-out"
    collective.complete()  # the collective alone finishing is not the ordering that matters
    inflight_work.sweep()
    assert _alive(ref), "released before the consumer stream passed its copy-out"
    scene.other.recorded[0].complete()
    inflight_work.sweep()
    assert not _alive(ref), "the consumer event completed: the sweep must release the buffers"
    assert inflight_work._deferred == []


def test_a_kept_tensor_is_released_with_the_buffers(scene: Scene) -> None:
    """``InflightWork.keep``: a tensor read just before the collective on its stream (HSDP's partial
    sum, added into the all-reduce's buffer) follows the buffers' rule, not its own last reference."""
    ref, buffer = _buffer()
    kept_ref, kept = _buffer()
    work, _ = scene.work(buffer)
    work.keep(kept)
    del buffer, kept
    assert _alive(kept_ref), "dropped by the caller while the stream may still read it"
    scene.current = scene.other
    work.wait()
    inflight_work.sweep()
    assert _alive(kept_ref) and _alive(ref), "released before the consumer stream's event"
    scene.other.recorded[0].complete()
    inflight_work.sweep()
    assert not _alive(kept_ref) and not _alive(ref)
    work.keep(torch.zeros(4))  # after the release: nothing to hold
    assert not work.pending


def test_later_results_of_a_coalesced_work_keep_their_views(scene: Scene) -> None:
    """The first result is used on the issue stream (buffers dropped at once); the second on another
    stream: the view its copy-out reads keeps the block alive until that stream's event completes."""
    ref, buffer = _buffer()
    view = buffer[:8]
    work, _ = scene.work(buffer, kind="all_gather_coalesced")
    first = ResultCompletion(work, scene.finish(buffer[:2], "finish 0"))
    second = ResultCompletion(work, scene.finish(view, "finish 1"))
    del buffer, view
    first.wait()
    assert _alive(ref), "the second result's copy-out still needs the buffer"
    scene.current = scene.other
    second.wait()
    assert scene.log[-2:] == ["other runs finish 1 on (8,)", "other records other.e0"]
    inflight_work.sweep()
    assert _alive(ref), "released before the consumer stream passed the second copy-out"
    scene.other.recorded[0].complete()
    inflight_work.sweep()
    assert not _alive(ref)


def test_wait_all_on_another_stream_defers_every_release(scene: Scene) -> None:
    refs, events = [], []
    for _ in range(3):
        ref, buffer = _buffer()
        work, done = scene.work(buffer)
        refs.append(ref)
        events.append(done)
        del buffer, work
    scene.current = scene.other
    overlap.wait_all()
    assert overlap.inflight() == [] and len(inflight_work._deferred) == 3
    for done in events:
        done.complete()
    inflight_work.sweep()
    assert all(_alive(r) for r in refs), "the consumer stream's events have not completed"
    for event in scene.other.recorded:
        event.complete()
    inflight_work.sweep()
    assert not any(_alive(r) for r in refs)


def test_synchronize_from_another_stream_still_defers(scene: Scene) -> None:
    """A host wait finishes the collective, but the runtime may read the buffer on its stream after
    it: the release still waits for the consumer stream's event."""
    ref, buffer = _buffer()
    work, _ = scene.work(buffer, kind="reduce_scatter")
    del buffer
    scene.current = scene.other
    work.synchronize()
    assert "synchronize collective" in scene.log and _alive(ref)
    scene.other.recorded[0].complete()
    inflight_work.sweep()
    assert not _alive(ref)


def test_an_unwaited_finished_collective_is_released_by_a_sweep(scene: Scene) -> None:
    ref, buffer = _buffer()
    work, collective = scene.work(buffer)
    del buffer
    inflight_work.sweep()
    assert _alive(ref) and work.pending, "still in flight"
    collective.complete()
    inflight_work.sweep()
    assert not _alive(ref) and not work.pending and inflight_work._deferred == []


def test_a_failing_copy_out_keeps_the_buffers(scene: Scene) -> None:
    ref, buffer = _buffer()
    work, _ = scene.work(buffer)
    del buffer

    def broken() -> None:
        raise RuntimeError("copy-out failed")

    scene.current = scene.other
    with pytest.raises(RuntimeError, match="copy-out failed"):
        work.wait(broken)
    assert _alive(ref) and work.pending, "a wait that did not complete must not release the buffers"


# ----------------------------------------------------------------------------- CUDA graph capture


@pytest.fixture
def capturing(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """``capturing(True)``: the current stream reports an ongoing CUDA graph capture."""
    state = {"on": False}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["on"])
    return lambda on: state.__setitem__("on", on)


def test_waits_during_capture_raise_and_name_the_fix(scene: Scene, capturing: Callable[[bool], None]) -> None:
    ref, buffer = _buffer()
    work, _ = scene.work(buffer)
    del buffer
    capturing(True)
    before = list(scene.log)
    for wait, what in ((work.wait, "the wait for all_gather #0 on group 'g'"),
                       (work.synchronize, "a host wait (synchronize) for all_gather #0 on group 'g'"),
                       (overlap.wait_all, "the wait for all_gather #0")):
        with pytest.raises(StreamCaptureError) as info:
            wait()
        message = str(info.value)
        assert what in message and "during CUDA graph capture" in message, message
        assert "overlap.wait_all() before torch.cuda.graph" in message, message
    inflight_work.sweep()  # must not query events while capturing
    assert scene.log == before, "nothing may touch a stream or an event during capture"
    assert work.pending and _alive(ref)
    capturing(False)
    work.wait()
    assert not _alive(ref)


def test_issuing_during_capture_raises_before_any_collective(single_rank_group, capturing) -> None:
    capturing(True)
    x = torch.arange(6.0).view(3, 2)
    calls: list[Callable[[], object]] = [
        lambda: overlap.all_gather(x), lambda: overlap.reduce_scatter(x), lambda: overlap.all_reduce(x),
        lambda: overlap.all_to_all(x), lambda: overlap.broadcast(x),
        lambda: overlap.all_gather_coalesced([x]), lambda: overlap.reduce_scatter_coalesced([x]),
    ]
    for call, kind in zip(calls, ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
                                  "all_gather_coalesced", "reduce_scatter_coalesced")):
        with pytest.raises(StreamCaptureError, match=rf"overlap\.{kind} issued during CUDA graph capture"):
            call()
    assert overlap.inflight() == [], "a refused collective must not be issued or tracked"
    capturing(False)
    assert torch.equal(overlap.wait(overlap.all_gather(x)), x), "after capture, collectives work again"


def _cuda_initialized_around_the_capture_check(rank: int, world: int) -> tuple[bool, object, bool]:
    before = torch.cuda.is_initialized()
    answer = streams.capturing()
    streams.check_not_capturing("anything")
    return before, answer, torch.cuda.is_initialized()


def test_capture_check_does_not_initialize_cuda() -> None:
    """While CUDA is not initialized, ``capturing`` answers without calling into CUDA (which would
    initialize it, or raise on a CPU-only build). In a rank forked from the harness's fork server
    (which never initializes CUDA: its ranks could not use it), so that it holds on a machine with a
    GPU too (where another test of this process may have initialized CUDA), without the start-up of a
    fresh interpreter."""
    from overlap.testing import run_distributed

    ((before, answer, after),) = run_distributed(_cuda_initialized_around_the_capture_check, 1)
    assert not before, "CUDA was initialized before the check: the test checks nothing"
    assert answer is False
    assert not after, "the capture check initialized CUDA"


# ----------------------------------------------------------------------------- one device per rank


@pytest.fixture
def cuda_devices(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int], None]:
    """``cuda_devices(current, count)``: pretend ``count`` devices are visible, ``current`` is current."""
    def set_devices(current: int, count: int) -> None:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return set_devices


def test_device_check_accepts_the_current_device(cuda_devices, monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_devices(1, 4)
    streams.check_device(torch.device("cuda", 1), "overlap.all_gather")
    streams.check_device(torch.device("cuda"), "overlap.all_gather")  # no index: the current device
    streams.check_device(torch.device("cuda", 1), "overlap.all_gather", bound=torch.device("cuda", 1))
    monkeypatch.setenv("LOCAL_RANK", "1")
    streams.check_device(torch.device("cuda", 1), "overlap.all_gather")
    cuda_devices(0, 1)  # one device visible per rank (CUDA_VISIBLE_DEVICES): LOCAL_RANK says nothing
    monkeypatch.setenv("LOCAL_RANK", "3")
    streams.check_device(torch.device("cuda", 0), "overlap.all_gather")


@pytest.mark.parametrize("case, expected", [
    ("tensor elsewhere", r"tensor on cuda:2 but the current CUDA device is cuda:0.*torch\.cuda\.set_device\(local_rank\)"),
    ("bound elsewhere", r"bound to cuda:3 \(init_process_group\(device_id=\.\.\.\)\): call torch\.cuda\.set_device\(3\)"),
    ("local rank elsewhere", r"LOCAL_RANK is 2: call torch\.cuda\.set_device\(2\).*device_id=torch\.device\('cuda', 0\)"),
])
def test_device_check_names_the_fix(cuda_devices, monkeypatch: pytest.MonkeyPatch, case: str, expected: str) -> None:
    cuda_devices(0, 4)
    device, bound = torch.device("cuda", 0), None
    if case == "tensor elsewhere":
        device = torch.device("cuda", 2)
    elif case == "bound elsewhere":
        bound = torch.device("cuda", 3)
    else:
        monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match=expected):
        streams.check_device(device, "overlap.all_gather", bound)


def test_a_bound_device_overrides_local_rank(cuda_devices, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that maps itself to another device than LOCAL_RANK says so with ``device_id``."""
    cuda_devices(0, 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    streams.check_device(torch.device("cuda", 0), "overlap.all_gather", bound=torch.device("cuda", 0))


def test_issue_checks_the_device_before_issuing(single_rank_group, cuda_devices, monkeypatch) -> None:
    """``_issue`` runs the device check (with the group's bound device) before anything else."""
    from overlap import collectives

    cuda_devices(0, 2)
    monkeypatch.setattr(collectives, "_bound_device", lambda group: torch.device("cuda", 1))
    launched: list[bool] = []

    def launch(async_op: bool) -> Optional[torch.distributed.Work]:
        launched.append(async_op)
        return None

    with pytest.raises(RuntimeError, match=r"bound to cuda:1.*set_device\(1\)"):
        collectives._issue("all_gather", torch.device("cuda", 0), launch, (torch.empty(1),), 4, "0")
    assert launched == [] and overlap.inflight() == []
