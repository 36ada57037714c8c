"""The profiler's files: a Chrome trace (JSON, for Perfetto / chrome://tracing) and a PNG timeline.

Contract: functions of a sequence of ``RankProfile`` (``overlap.profiler.records``) and a path;
each writes one file and returns the path as a str. Ranks are put on one timeline by their
``epoch`` (the earliest is 0). Trace layout: one process per rank (pid = rank); thread 0 is the
host (``step N`` spans, ``issue <what>`` instants, ``wait <what>`` spans), threads 1.. one per
process group (a span per collective, named ``<what>``, with its exposed parts as ``exposed``
spans); ``<what>`` is the collective's kind and, for the sharded runtime's, the module it carries
(``CollectiveRecord.what``: ``all_gather blocks.1``). A path that is
not a non-empty str / ``os.PathLike`` raises ``TypeError`` / ``ValueError``; a failed write raises
``OSError`` naming the path. ``plot`` needs matplotlib (``pip install 'triton-overlap[plot]'``).
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence, Union

from overlap.profiler.records import IDLE_CAUSES, RankProfile, covered_pieces, link_idle

__all__ = ["PathArg", "export_chrome_trace", "plot", "timeline_origin", "trace_events"]

PathArg = Union[str, "os.PathLike[str]"]

_IDLE_COLORS = ("#bdbdbd", "#fdae6b", "#9e9ac8", "#ffe082")  # per IDLE_CAUSES entry, on the comm row of plot()


def timeline_origin(ranks: Sequence[RankProfile]) -> float:
    """The earliest ``epoch`` of ``ranks``: time 0 of the common timeline."""
    return min(r.epoch for r in ranks) if ranks else 0.0


def trace_events(ranks: Sequence[RankProfile]) -> list[dict[str, Any]]:
    """The Chrome trace events (pid = rank; tid 0 = compute, tid 1.. = comm per process group)."""
    origin = timeline_origin(ranks)
    events: list[dict[str, Any]] = []
    for rp in ranks:
        shift = rp.epoch - origin

        def us(t: float) -> float:
            return round((shift + t) * 1e6, 3)

        pid = rp.rank
        groups = sorted({c.group for c in rp.collectives}) or [""]
        tids = {g: 1 + i for i, g in enumerate(groups)}
        events += [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}},
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": 0}},
        ]
        for g, tid in tids.items():
            name = "comm" if len(tids) == 1 else f"comm ({g or 'unnamed group'})"
            events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}},
                       {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}]
        for s in rp.steps:
            events.append({"ph": "X", "name": f"step {s.step}", "cat": "step", "pid": pid, "tid": 0,
                           "ts": us(s.start), "dur": round((s.end - s.start) * 1e6, 3)})
        stalls = rp.stalls
        for c in rp.collectives:
            args = {"bytes": c.nbytes, "group": c.group, "module": c.module, "label": c.label, "step": c.step,
                    "exposed_ms": round(1e3 * c.exposed, 4), "hidden_ms": round(1e3 * c.hidden, 4),
                    "GB/s": round(c.gbps, 4), "end_measured": c.end_measured}
            tid = tids[c.group]
            events.append({"ph": "X", "name": c.what, "cat": "comm", "pid": pid, "tid": tid,
                           "ts": us(c.start), "dur": round(c.duration * 1e6, 3), "args": args})
            for a, b in covered_pieces(stalls, c.start, c.end):
                events.append({"ph": "X", "name": "exposed", "cat": "exposed", "pid": pid, "tid": tid,
                               "ts": us(a), "dur": round((b - a) * 1e6, 3)})
            events.append({"ph": "i", "name": f"issue {c.what}", "cat": "issue", "s": "t", "pid": pid,
                           "tid": 0, "ts": us(c.issued), "args": {"label": c.label}})
            if c.wait_start is not None and c.wait_end is not None:
                events.append({"ph": "X", "name": f"wait {c.what}", "cat": "wait", "pid": pid, "tid": 0,
                               "ts": us(c.wait_start), "dur": round((c.wait_end - c.wait_start) * 1e6, 3),
                               "args": {"label": c.wait_label, "exposed_ms": round(1e3 * c.exposed, 4)}})
    return events


def export_chrome_trace(ranks: Sequence[RankProfile], path: PathArg) -> str:
    """Write the Chrome trace JSON (Perfetto / chrome://tracing open it) to ``path``; returns it."""
    target = _check_path(path, "export_chrome_trace")
    doc = {"traceEvents": trace_events(ranks), "displayTimeUnit": "ms",
           "otherData": {"source": "overlap.profile", "ranks": [r.rank for r in ranks],
                         "epoch_origin": timeline_origin(ranks)}}
    _write(target, "export_chrome_trace", lambda f: json.dump(doc, f), "w")
    return target


def plot(ranks: Sequence[RankProfile], path: PathArg) -> str:
    """Write a PNG timeline: per rank, compute (host busy, stalls marked) under comm bars (exposed
    parts marked, and the link's idle time while compute ran, coloured by cause). Needs matplotlib (``pip install 'triton-overlap[plot]'``); returns the path."""
    target = _check_path(path, "plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("overlap.profile: plot() needs matplotlib; install it with "
                          "pip install 'triton-overlap[plot]'") from e
    origin = timeline_origin(ranks)
    fig = Figure(figsize=(12, 1.6 + 1.1 * max(1, len(ranks))), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ticks, names = [], []
    for row, rp in enumerate(ranks):
        shift = rp.epoch - origin
        base = 2 * (len(ranks) - 1 - row)
        ms = [(1e3 * (shift + s.start), 1e3 * (s.end - s.start)) for s in rp.steps]
        ax.broken_barh(ms, (base + 0.1, 0.8), facecolors="#9ecae1", edgecolor="white")
        stalls = rp.stalls
        ax.broken_barh([(1e3 * (shift + a), 1e3 * (b - a)) for a, b in stalls], (base + 0.1, 0.8),
                       facecolors="#d62728", alpha=0.8)
        comm = [(1e3 * (shift + c.start), 1e3 * c.duration) for c in rp.collectives]
        ax.broken_barh(comm, (base + 1.1, 0.8), facecolors="#74c476", edgecolor="#31a354")
        exposed = [(1e3 * (shift + a), 1e3 * (b - a)) for c in rp.collectives
                   for a, b in covered_pieces(stalls, c.start, c.end)]
        ax.broken_barh(exposed, (base + 1.1, 0.8), facecolors="#d62728", hatch="//", alpha=0.8)
        idle = [piece for s in rp.steps for piece in link_idle(rp, s.start, s.end)]
        for cause, color in zip(IDLE_CAUSES, _IDLE_COLORS):
            ax.broken_barh([(1e3 * (shift + a), 1e3 * (b - a)) for a, b, c in idle if c == cause],
                           (base + 1.1, 0.8), facecolors=color, alpha=0.5)
        ticks += [base + 0.5, base + 1.5]
        names += [f"rank {rp.rank} compute", f"rank {rp.rank} comm"]
    ax.set_yticks(ticks)
    ax.set_yticklabels(names)
    ax.set_xlabel("ms")
    ax.set_title("overlap.profile timeline: comm over compute; red = exposed (host stalled in a wait); "
                 "light = link idle while compute ran")
    ax.legend(handles=[Patch(color="#9ecae1", label="compute (step)"), Patch(color="#74c476", label="comm"),
                       Patch(color="#d62728", label="exposed / stalled")]
              + [Patch(color=c, alpha=0.5, label=f"link idle: {cause}") for cause, c in zip(IDLE_CAUSES, _IDLE_COLORS)],
              loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    _write(target, "plot", lambda f: fig.savefig(f, format="png"), "wb")
    return target


def _check_path(path: object, caller: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"overlap.profile: {caller} path must be a str or os.PathLike, got {type(path).__name__}")
    target = os.fspath(path)
    if not isinstance(target, str) or not target:
        raise ValueError(f"overlap.profile: {caller} path must be a non-empty file path, got {path!r}")
    return target


def _write(target: str, caller: str, write: Any, mode: str) -> None:
    try:
        with open(target, mode) as f:
            write(f)
    except OSError as e:
        message = f"overlap.profile: {caller} cannot write path={target!r}: {e.strerror or e}"
        raise (OSError(e.errno, message) if e.errno is not None else OSError(message)) from e
