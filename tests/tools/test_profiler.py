"""overlap.profile(): records of every collective, exposed time against the emulated link's known
times, the sharded runtime's collectives, trace / plot files, the off path, and bad input.

Timing tolerance (the issue's spec): on the emulated link a collective's communication time is known
(``link.transfer_seconds``); with host work of known length between issue and first use (a sleep,
timed by the test itself with ``perf_counter`` since a loaded machine oversleeps), the exposed time
is ``max(0, comm - work)`` and the efficiency ``1 - exposed / comm``. Measured exposed time and
efficiency must be within 15% of those values; where the expected value is 0, within 15% of the
communication time (resp. 0.15). Slack comes from the host (launch, thread wake-ups), typically
< 2 ms of the ~210 ms collective (10-25 ms with both cores busy elsewhere).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlap
from overlap import inflight_work, regions
from overlap.inflight_work import InflightWork
from overlap.profiler import ProfileResult, RankProfile, Report, merge
from overlap.profiler.records import covered, union
from scheduler.torch_versions import DIST_ALL_GATHER

# One all-gather of 2 x 128 Ki float32 (1 MiB out, 512 KiB on the wire per rank) over a 0.02 Gbit/s
# link: 10 µs + 524288 B / 2.5e6 B/s = 209.7 ms; long, so that a loaded machine's few ms of jitter
# stay well inside the tolerance.
ROWS = 128 * 1024
LINK = (0.02, 10.0)
# (name, host sleep between issue and first use as a share of the comm time)
CASES = (("hidden", 1.5), ("half", 0.5), ("exposed", 0.0))


# ----------------------------------------------------------------------------- helpers
class _TimerWork(dist.Work):
    """A work that completes ``seconds`` after it is made (no process group needed)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        timer = threading.Timer(seconds, self._future.set_result, (None,))
        timer.daemon = True
        timer.start()

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()


def _work(kind: str = "all_gather", nbytes: int = 64, work: Any = None) -> InflightWork:
    return inflight_work.track(InflightWork(kind, nbytes, [torch.empty(4)], work=work, group="g0"))


def _off() -> bool:
    return inflight_work._recorder is None and not regions._tracking


# ----------------------------------------------------------------------------- timing on the link
def _timing_rank(rank: int, world: int) -> dict[str, Any]:
    from overlap.testing import current_link

    link = current_link()
    assert link is not None
    comm = link.transfer_seconds(ROWS * 4 * world * (world - 1) / world)
    x = torch.full((ROWS,), float(rank))
    work = []
    with overlap.profile() as prof:
        for _, share in CASES:
            dist.barrier()
            start = time.perf_counter()
            gathered = overlap.all_gather(x)
            if share:
                time.sleep(share * comm)  # the compute the gather can hide behind
            work.append(time.perf_counter() - start)
            total = float(gathered.sum())  # first use: waits here
            prof.step()
    assert total == ROWS * sum(range(world))
    report = prof.report(show=False)
    return {"comm": comm, "work": work, "report": report, "profile": prof.rank_profile(),
            "group": dist.group.WORLD.group_name}


def test_exposed_time_and_efficiency_match_the_emulated_link(distributed, tmp_path) -> None:
    results = distributed(_timing_rank, 2, link=LINK, timeout=60)
    for rank, res in enumerate(results):
        comm, report, profile = res["comm"], res["report"], res["profile"]
        assert isinstance(report, Report) and isinstance(profile, RankProfile)
        assert profile.rank == rank and profile.world_size == 2
        assert [s.step for s in report.steps] == [0, 1, 2]  # the trailing empty step is dropped
        assert len(profile.collectives) == 3
        for (name, share), work, step, record in zip(CASES, res["work"], report.steps, profile.collectives):
            expected_exposed = max(0.0, comm - work)
            efficiency = 1.0 - expected_exposed / comm
            tolerance = 0.15 * (expected_exposed if expected_exposed > 0 else comm)
            where = f"rank {rank}, case {name!r}"
            assert record.kind == "all_gather" and record.nbytes == ROWS * 4 * 2, where
            assert record.group == res["group"] and record.step == step.step and record.end_measured, where
            assert record.duration == pytest.approx(comm, rel=0.15), where
            assert abs(record.exposed - expected_exposed) <= tolerance, (where, record.exposed, expected_exposed)
            assert abs(1e-3 * step.exposed_ms - expected_exposed) <= tolerance, (where, step)
            efficiency_tolerance = 0.15 * efficiency if efficiency > 0.15 else 0.15
            assert abs(step.efficiency - efficiency) <= efficiency_tolerance, (where, step.efficiency, efficiency)
            assert abs(record.efficiency - step.efficiency) < 1e-9, where  # one collective per step
            assert record.compute is not None and record.compute >= share * comm, where
            assert record.gbps == pytest.approx(record.nbytes / record.duration / 1e9)
        assert report.total.count == 3 and report.total.nbytes == 3 * ROWS * 4 * 2

    merged = merge(*(r["profile"] for r in results))
    trace = tmp_path / "trace.json"
    assert merged.export_chrome_trace(trace) == str(trace)
    _check_trace(json.loads(trace.read_text()), ranks=[0, 1], comm_events_per_rank=3)
    png = tmp_path / "timeline.png"
    merged.plot(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def _check_trace(doc: dict[str, Any], ranks: list[int], comm_events_per_rank: int) -> None:
    """Chrome trace format: events with ph/pid/tid (and ts for timed ones); per rank a process with a
    'compute' track and a 'comm' track, comm slices on the comm track, steps on the compute track."""
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert {"ph", "name", "pid", "tid"} <= e.keys(), e
        if e["ph"] in ("X", "i"):
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
    for rank in ranks:
        tracks = {e["args"]["name"]: e["tid"] for e in events
                  if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == rank}
        assert set(tracks) == {"compute", "comm"}, tracks
        names = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name" and e["pid"] == rank]
        assert names == [f"rank {rank}"]
        comm = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e.get("cat") == "comm"]
        assert len(comm) == comm_events_per_rank and all(e["tid"] == tracks["comm"] for e in comm)
        steps = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e.get("cat") == "step"]
        assert steps and all(e["tid"] == tracks["compute"] for e in steps)


# ----------------------------------------------------------------------------- the sharded runtime
def _sharded_rank(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    from overlap.testing import current_link

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3)])
    for block in model:  # a fixed depth: prefetch="auto"'s first steps would agree their choice on the link too
        overlap.shard(block, prefetch=1)
    overlap.shard(model, prefetch=1)
    x = torch.randn(8, 16)
    model(x).sum().backward()  # the first step agrees the order across ranks (not profiled)
    link = current_link()
    assert link is not None
    link.reset_stats()
    with overlap.profile() as prof:
        for _ in range(2):
            with prof.label("train"):
                model(x).sum().backward()
            prof.step()
    carried = dict(link.stats().by_op)
    merged = prof.gather()
    files = {}
    if rank == 0:
        assert merged is not None and [r.rank for r in merged.ranks] == [0, 1]
        files = {"trace": prof.export_chrome_trace(f"{out_dir}/shard.json"), "png": prof.plot(f"{out_dir}/shard.png")}
        prof.report(show=False)
    else:
        assert merged is None
    group = model[0]._overlap_state.group
    return {"collectives": prof.collectives, "carried": carried, "files": files,
            "gather_bytes": group.all_gather_bytes(), "group": dist.group.WORLD.group_name}


def test_sharded_runtime_collectives_are_recorded(distributed, tmp_path) -> None:
    results = distributed(_sharded_rank, 2, str(tmp_path), link=(1000.0, 0.0), timeout=60)
    for rank, res in enumerate(results):
        records = res["collectives"]
        kinds = [c.kind for c in records]
        # Every gather and reduce-scatter the link carried was recorded, and only those.
        assert kinds.count("all_gather") == res["carried"].get(DIST_ALL_GATHER, 0) > 0
        # On gloo the runtime's reduce-scatters travel as all-to-alls ([Note: gloo's reduce-scatter
        # cannot say it is done] in overlap/collectives.py).
        assert kinds.count("reduce_scatter") == res["carried"].get("all_to_all_single", 0) > 0
        assert set(kinds) == {"all_gather", "reduce_scatter"}
        assert {c.step for c in records} == {0, 1}
        per_step = [[c.kind for c in records if c.step == s] for s in (0, 1)]
        assert per_step[0] == per_step[1], "both steps issue the same collectives"
        labels = {c.label for c in records}
        # Runtime regions carry the block's fqn (model[i]: "i"); the root's carry none. Blocks 2 and 1
        # are kept unsharded into backward ([Note: kept for backward]), so block 1's pre-backward
        # issues the first re-gather (block 0's).
        assert {"train/overlap::pre_forward", "train/overlap::pre_forward (0)", "train/overlap::pre_backward (1)",
                *(f"train/overlap::reduce_scatter ({i})" for i in range(3))} <= labels, labels
        for c in records:
            assert any(part.startswith("overlap::") for part in c.label.split("/")), c.label  # a runtime region
            assert c.group == res["group"] and c.rank == rank
            assert c.wait_start is not None and c.wait_end is not None, "the runtime waits every collective"
            assert c.issued <= c.start <= c.end and 0.0 <= c.exposed <= c.duration + 1e-9
            if c.kind == "all_gather":
                assert c.nbytes == res["gather_bytes"]
    files = results[0]["files"]
    _check_trace(json.loads(open(files["trace"]).read()), ranks=[0, 1],
                 comm_events_per_rank=len(results[0]["collectives"]))
    with open(files["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- one process, no group
def test_no_records_when_not_profiling() -> None:
    assert _off()
    work = _work()
    assert work._record is None
    with overlap.profile() as prof:
        inside = _work()
        assert inside._record is not None and not _off()
    after = _work()
    assert after._record is None and _off()
    assert len(prof.collectives) == 1
    for w in (work, inside, after):
        w.wait()


def test_work_without_signal_completes_at_issue_and_labels_nest() -> None:
    with overlap.profile() as prof:
        with prof.label("outer"), prof.label("inner"):
            w = _work("all_reduce", 128)
        w.wait()
    (c,) = prof.collectives
    assert (c.kind, c.nbytes, c.group, c.label, c.step) == ("all_reduce", 128, "g0", "outer/inner", 0)
    assert c.end == c.start and c.duration == 0.0 and c.efficiency == 1.0 and c.gbps == 0.0
    assert c.wait_label == "" and c.wait_start is not None


def test_a_recording_starts_with_no_regions_and_a_region_removes_only_its_own_entry() -> None:
    """``overlap.regions``' label stack across a new recording: a region entered under an earlier
    recording and still open is not among the new recording's current regions (its entry time
    predates it), and when it ends it leaves the entries of regions entered since in place."""
    previous = regions.track_labels(True)
    try:
        outer = regions.region("outer")
        outer.__enter__()
        regions.track_labels(False)
        regions.track_labels(True)
        assert regions.current_regions() == ()
        with regions.region("inner"):
            outer.__exit__(None, None, None)
            assert [name for name, _ in regions.current_regions()] == ["inner"]
        assert regions.current_regions() == ()
    finally:
        regions.track_labels(previous)


def test_a_tracked_region_is_recorded_by_torch_profiler_too() -> None:
    """While ``overlap.profile`` keeps its label stack, a region is also a ``record_function`` range
    in a torch.profiler trace taken at the same time."""
    previous = regions.track_labels(True)
    try:
        with torch.profiler.profile() as traced, regions.region("overlap::a_tracked_region"):
            torch.ones(2).add_(1)
    finally:
        regions.track_labels(previous)
    assert "overlap::a_tracked_region" in {event.name for event in traced.events()}


def test_first_wait_is_timed_once() -> None:
    with overlap.profile() as prof:
        w = _work(work=_TimerWork(0.02))
        w.synchronize()  # synchronize -> wait: one stall, not two
        first = (w._record.wait_start, w._record.wait_end)
        w.wait()  # a later wait changes nothing
    (c,) = prof.collectives
    assert (c.wait_start, c.wait_end) == tuple(t - prof._t0 for t in first)
    assert c.end_measured and c.start <= c.end <= c.wait_end
    assert len(prof.rank_profile().stalls) == 1


def test_steps_and_report_data() -> None:
    with overlap.profile() as prof:
        for step in range(3):
            for _ in range(step + 1):
                _work("all_gather", 100).wait()
            prof.step()
    report = prof.report(show=False)
    assert [(s.step, s.count, s.nbytes) for s in report.steps] == [(0, 1, 100), (1, 2, 200), (2, 3, 300)]
    assert all(s.wall_ms >= s.compute_ms >= 0 for s in report.steps)
    (row,) = report.rows
    assert (row.kind, row.count, row.nbytes) == ("all_gather", 6, 600)
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data and data["total"]["count"] == 6
    assert "all_gather" in report.table() and "per step" in report.table()


def test_warmup_steps_are_recorded_but_not_reported() -> None:
    """[Note: warm-up steps of a profile]: a gather issued at the end of the warm-up step and waited in
    the next is on the link and stalls that step, but only the next step's own collectives are in the
    figures. Started without the warm-up step, the profile never sees that gather: its time on the
    link reads as idle and its wait as nobody's stall."""
    def steps(prof: Any, warmup: int) -> None:
        if warmup:
            _work("all_gather", 100).wait()
        ahead = _work("all_gather", 50, work=_TimerWork(0.05))  # the next step's gather, issued at a step's end
        if warmup:
            prof.step()
        ahead.wait()
        _work("reduce_scatter", 200).wait()
        prof.step()

    with overlap.profile(warmup=1) as prof:
        steps(prof, 1)
    rp = prof.rank_profile()
    assert rp.warmup_steps == 1 and [s.step for s in rp.steps] == [1]
    assert [c.nbytes for c in rp.collectives] == [100, 50, 200] and [c.nbytes for c in rp.reported_collectives] == [200]
    report = prof.report(show=False)
    assert [(s.step, s.count, s.nbytes) for s in report.steps] == [(1, 1, 200)]
    assert [(r.kind, r.count) for r in report.rows] == [("reduce_scatter", 1)] and report.total.count == 1
    (warm,) = report.steps
    assert warm.stalled_ms > 30 and warm.link_idle_ms < warm.wall_ms - 30, warm

    ahead = _work("all_gather", 50, work=_TimerWork(0.05))  # issued before the profile starts
    with overlap.profile() as cold_prof:
        ahead.wait()
        _work("reduce_scatter", 200).wait()
        cold_prof.step()
    (cold,) = cold_prof.report(show=False).steps
    assert cold.stalled_ms < 1 and cold.link_idle_ms > 30, cold  # the 50 ms wait on it: no stall


def test_profiled_steps_runs_the_warmup_step_first() -> None:
    """``overlap.testing.profiled_steps``: ``warmup + steps`` calls, each ended by ``prof.step()``, the
    first ``warmup`` recorded and not reported."""
    from overlap.testing import PROFILE_WARMUP_STEPS, profiled_steps

    calls = []

    def step() -> None:
        calls.append(len(calls))
        _work("all_gather", 10 * len(calls)).wait()

    prof = profiled_steps(step, 2)
    assert calls == list(range(PROFILE_WARMUP_STEPS + 2)) and not prof.recording and _off()
    report = prof.report(show=False)
    assert [(s.step, s.nbytes) for s in report.steps] == [(PROFILE_WARMUP_STEPS + i, 10 * (PROFILE_WARMUP_STEPS + i + 1))
                                                         for i in range(2)]
    assert len(prof.collectives) == PROFILE_WARMUP_STEPS + 2 and report.total.count == 2


def test_report_prints_the_table(capsys) -> None:
    with overlap.profile() as prof:
        _work().wait()
    report = prof.report()
    assert capsys.readouterr().out.strip() == report.table().strip()


def test_exception_inside_stops_recording_and_propagates() -> None:
    prof = overlap.profile()
    with pytest.raises(KeyError, match="boom"):
        with prof:
            _work().wait()
            raise KeyError("boom")
    assert _off() and not prof.recording
    assert len(prof.collectives) == 1 and len(prof.rank_profile().steps) == 1
    with pytest.raises(RuntimeError, match="already recorded"):
        with prof:
            pass


def test_profilers_do_not_nest() -> None:
    with overlap.profile() as outer:
        with pytest.raises(RuntimeError, match="do not nest"):
            with overlap.profile():
                pass
        _work().wait()  # the outer one still records
    assert len(outer.collectives) == 1 and _off()


def test_disabled_profiler_records_nothing() -> None:
    with overlap.profile(enabled=False) as prof:
        _work().wait()
        prof.step()
        assert _off()
    assert prof.collectives == [] and prof.report(show=False).total.count == 0


def test_step_outside_the_block_raises() -> None:
    prof = overlap.profile()
    with pytest.raises(RuntimeError, match="inside"):
        prof.step()


def test_single_rank_trace_without_process_group(tmp_path) -> None:
    with overlap.profile() as prof:
        _work(work=_TimerWork(0.005)).wait()
    doc = json.loads(open(prof.export_chrome_trace(tmp_path / "t.json")).read())
    _check_trace(doc, ranks=[0], comm_events_per_rank=1)


def test_intervals() -> None:
    merged = union([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0), (5.0, 5.0)])
    assert merged == [(0.0, 2.0), (3.0, 4.0)]
    assert covered(merged, 1.5, 3.5) == pytest.approx(1.0)
    assert covered(merged, -1.0, 10.0) == pytest.approx(3.0)
    assert covered(merged, 2.0, 3.0) == 0.0 and covered([], 0.0, 1.0) == 0.0


# ----------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument(tmp_path) -> None:
    with pytest.raises(TypeError, match="enabled"):
        overlap.profile(enabled="yes")  # type: ignore[arg-type]
    for warmup in (-1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="warmup must be an int >= 0"):
            overlap.profile(warmup=warmup)  # type: ignore[arg-type]
    with overlap.profile() as prof:
        _work().wait()
        with pytest.raises(TypeError, match="label name"):
            prof.label(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="path"):
        prof.export_chrome_trace(123)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="path"):
        prof.export_chrome_trace("")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OSError, match="export_chrome_trace cannot write path="):
        prof.export_chrome_trace(blocker / "trace.json")  # a directory that is a file
    with pytest.raises(OSError, match="plot cannot write path="):
        prof.plot(tmp_path / "missing_dir" / "t.png")
    with pytest.raises(TypeError, match="file"):
        prof.report(file=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="show"):
        prof.report(show="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"profiles\[1\]"):
        merge(prof, "rank 1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank\(s\) \[0\]"):
        merge(prof, prof.result)
    assert isinstance(merge(prof), ProfileResult)
    with pytest.raises(RuntimeError, match="process group"):
        prof.gather()


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch) -> None:
    with overlap.profile() as prof:
        _work().wait()
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'triton-overlap\[plot\]'"):
        prof.plot(tmp_path / "t.png")


# ----------------------------------------------------------------------------- region names
class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


# Last in this file: the module-scoped 1-rank group stays until the file's tests are done.
def test_runtime_regions_carry_the_module_fqn(single_rank_group) -> None:
    model = _Blocks()
    for block in model.blocks:
        overlap.shard(block)
    assert model.blocks[1]._overlap_state.regions.pre_forward == "overlap::pre_forward"  # no root yet
    overlap.shard(model)
    regions = model.blocks[1]._overlap_state.regions  # named once, at shard time
    assert regions.pre_forward == "overlap::pre_forward (blocks.1)"
    assert model.blocks[1]._overlap_state.group.regions is regions
    assert model._overlap_state.regions.pre_forward == "overlap::pre_forward"  # the root: no name
    x = torch.randn(4, 8)
    model(x).sum().backward()  # the first step agrees the forward order
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as torch_prof:
        model(x).sum().backward()
    names = {e.name for e in torch_prof.events() if e.name.startswith("overlap::")}
    assert {"overlap::pre_forward", "overlap::end_backward",
            "overlap::pre_forward (blocks.0)", "overlap::post_forward (blocks.1)",
            "overlap::pre_backward (blocks.1)", "overlap::reduce_scatter (blocks.0)"} <= names, names
    assert all(n.endswith(("(blocks.0)", "(blocks.1)")) for n in names if "(" in n), names
    assert model.blocks[1]._overlap_state.regions is regions


def test_the_links_clock_is_put_on_the_profilers_by_one_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulated link's ``time.monotonic()`` spans go onto the profiler's ``perf_counter`` clock by one
    offset per process: 0.0 where the two are one clock, else the tightest bracketed read (here both
    are in fact one clock, so that read must land within a few µs of 0, whatever its sign)."""
    from overlap.profiler import recorder

    same = time.get_clock_info("perf_counter").implementation == time.get_clock_info("monotonic").implementation
    recorder._monotonic_offset.cache_clear()
    try:
        if same:
            assert recorder._monotonic_offset() == 0.0
        recorder._monotonic_offset.cache_clear()
        monkeypatch.setattr(recorder.time, "get_clock_info", lambda name: type("Info", (), {"implementation": name})())
        offset = recorder._monotonic_offset()
        if same:
            assert abs(offset) < 50e-6, offset
        assert recorder._monotonic_offset() is offset  # read once
    finally:
        recorder._monotonic_offset.cache_clear()
