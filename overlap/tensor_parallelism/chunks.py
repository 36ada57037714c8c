"""How many chunks a decomposed collective matmul is cut into, from costs measured on this machine.

[Note: choosing the chunk count]
A layer's collective matmul is modelled, forward and backward, for every count ``c`` from 1 to
``MAX_CHUNKS``, from four figures:

* ``G(n)``: the seconds of this layer's GEMM on ``n`` rows (``n x in`` by ``in x out``), an affine
  fit ``a + b n`` through two timed GEMMs at the layer's shape, the whole operand and a
  ``MAX_CHUNKS``-th of it, so a small chunk's lower efficiency and its launch cost are in ``a``;
* ``O``: the host cost of one more chunk (allocating and filling its buffer, issuing its collective,
  waiting it once it is done, placing its pieces), timed as the difference between one and
  ``MAX_CHUNKS`` chunks of a tiny all-gather through the same code, divided by ``MAX_CHUNKS - 1``;
  the time the transfers take is left out (polled until done, untimed): on a loaded machine it
  holds the other rank's scheduling delays, which a link slower than gloo's loopback hides;
* ``t(b)``: the link's time for a collective of ``b`` bytes per rank, ``L + b s``. Behind an
  emulated link (``overlap.testing.current_link()``) ``L`` and ``s`` are the link's (its group
  tier). Without one they are timed: ``L`` the tiny all-gather's wall time less its host time, ``s``
  one all-gather of ``CALIBRATION_BYTES`` per rank less the tiny one, per byte. Timing calibration
  collectives rather than the first real one keeps the layer's own path untouched and gives the
  figures before the first choice is made.

Each collective matmul is a two-stage pipeline of ``c`` chunks, the link one stage and the host's
GEMMs (plus ``O`` per chunk) the other, all chunks issued in order (FIFO on the group's link):

* transfer then compute (a gather feeding matmuls): ``t = head; t = max(t, (k + 1) t_c) + g_c`` for
  ``k < c``, where ``t_c = t(B / c)`` and ``g_c`` the chunk's GEMMs plus ``O``; ``head`` is what
  needs no wait (this rank's own rows, ``G(N / w)``, for ``c > 1``);
* compute then transfer (matmuls feeding a reduce-scatter or all-reduce): chunk ``k``'s GEMM ends
  at ``(k + 1) g_c``, its collective at ``max(link free, that) + t_c``; a ``tail`` of compute that
  needs none of it (the weight gradient) runs beside the last transfers: ``max(link, host + tail)``.

``c = 1`` is the same pipeline with one chunk and no head: ``t(B) + G(N) + O`` for a gather, what
torch's ``parallelize_module`` does. Per layer kind (``N`` the GEMM's rows, ``w`` ranks):

===============  ==============================================  ===================================
kind             forward                                         backward
===============  ==============================================  ===================================
gather           transfer then compute, head ``G(N/w)``,         compute then transfer (input
(colwise, seq)   ``g_c = G(N (w-1) / (w c)) + O``                grad ``G(N/c) + O``), tail ``G(N)``
scatter          compute then transfer, ``G(N/c) + O``           transfer then compute, head
(rowwise, seq)                                                   ``2 G(N/w)``, ``2 G(N (w-1)/(w c)) + O``
all_reduce       compute then transfer, ``G(N/c) + O``           ``2 G(N)``, local
all_reduce_grad  ``G(N)``, local                                 compute then transfer, tail ``G(N)``
===============  ==============================================  ===================================

The model proposes, a trial decides where the model is unsure. The model's best count ``c*``
(least modelled time), where it saves less than ``TRUSTED_SAVING`` (25%) of ``c = 1``'s modelled
time, is tried against ``c = 1`` directly: both run the layer's own collective matmul, forward and
backward, on synthetic operands of the layer's shapes, behind the link in force (``chunk_trial``),
one untimed pass each, then up to ``TRIAL_ROUNDS`` rounds taking turns. Each timing is maxed over
the group (agreed), and ``c*`` is kept only if it was faster than ``c = 1`` in every round and,
in the quietest round (the least time of its two passes together), took less than
``1 - TRIAL_MARGIN`` (95%) of ``c = 1``'s time; else 1. The quietest paired round, not each
count's least time nor a median: a loaded machine only adds time and a slow spell hits one pass
of a round (30.8 / 81 / 186 ms at 1 and 116 / 139 / 27.1 ms at 4 chunks in one trial at dim 128 x
512 tokens: the least of each says 12% faster, the quietest round 3.8x slower). Every round:
at dim 64 x 128 tokens on a quieter box a trial whose quietest round had 2 chunks 11% faster, but
one round 5% slower, chose a split whose step ran 9% slower than ``c = 1``'s (and 4 chunks 67%
slower): where the layer is this small, a lost round is the signal to keep torch's order.

Why a trial: the model misses costs that grow with the count and that no figure above isolates
(the transfers' own CPU on gloo, the other rank's scheduling delay at every extra wait, a small
chunk's worse GEMM), and where it promises little they decide. At dim 128 x 512 tokens the model
promised 2-13%; the decomposed step took 1.33x ``chunks=1``'s time on a quiet box (6 / 5 chunks,
c446b6e) and 0.58-0.96x of it on a loaded one (2-6 chunks, 2026-11-26).

Its cost: ``(rounds + 1) (T(1) + T(c*))`` of the layer's modelled time ``T``; rounds are cut so
that stays within ``TRIAL_BUDGET_S``, and a trial whose real time (maxed over the group after each
round) has passed it stops there (a loaded machine runs slower than modelled). Where the model
promises ``TRUSTED_SAVING`` or more, or not one round fits, the layer hides enough that the
per-chunk costs the model misses (a few per cent of such a layer) cannot undo it, while a single
noisy round could: the model's count is taken if it beats ``c = 1`` by more than ``MARGIN`` of its
time. Where the model's best is 1 nothing is tried. Never more chunks than leave ``MIN_ROWS`` rows
of the chunked dimension per chunk, nor than the rows there are.

When. The figures are measured at a layer's first call (under ``torch.no_grad``, inside
``overlap::tp_calibrate``) and cached per process: ``O`` and ``s`` per (device type, group), ``G``
per (device type, dtype, rows rounded up to a power of two, in, out), timed at the rounded rows.
Cost on the 2-core box: about 0.1 s per group (some 30 small all-gathers and two of 1 MiB), and
per GEMM shape two GEMMs of the whole operand and six of an 8th (about 1.6 s at 4096 x 1024 ->
2048). A trial (``overlap::tp_trial``) runs at the first call of a workload behind a given link
(the choice is cached per workload, group and link figures): 0.05-0.3 s per layer at the two
small grid points, about 1 s at dim 256 x 2048 tokens (stopped by the agreed elapsed time).
Under ``torch.compile`` tracing or CUDA graph capture nothing is measured or tried: a cached
choice is used, else the count is 1.

Every rank the same (contract 3). Each rank's measurements differ (a loaded core, another GPU
clock), so every measured vector is agreed before use: its elementwise max over the layer's
group (an ``overlap.agreement`` exchange), right after the measurement, which every rank makes at
the same call (the cache keys are built from global sizes only). The slowest rank's figures are the ones that set the step time.
The count is then a pure function of agreed figures, agreed trial timings, global sizes and the
active link (entered by every rank alike), identical on every rank; whether a trial runs, how many
rounds (an agreed elapsed time after each) and its collectives follow from the same, so every rank
tries alike. It is recomputed per call, so steps behind and outside an emulated link may run
different counts.

``chunks=`` of ``overlap.tensor_parallel`` overrides all of this (``chunks=1`` is torch's
undecomposed collective-then-matmul, bitwise).

The Inductor hook (``scheduler/collective_matmul.py``) shares ``MIN_ROWS`` but not the rest: it
takes the count it is given (``collective_matmul_chunks``, where None means no split) and lowers it
until the cut dim divides, since a compiled chunk has a static shape. It does not choose from
measurements: a count chosen at compile time would be baked into graphs that Inductor caches by the
pass's uuid, and reused behind another link.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from overlap.groups import GroupInfo
from overlap.regions import region
from overlap.tensor_parallelism.chunk_trial import trial_seconds
from overlap.tensor_parallelism.collective_matmul import SeqLayout, _ChunkedGather
from overlap_kernels.layout import next_power_of_two
from scheduler.collective_matmul import MIN_ROWS

__all__ = ["CALIBRATION_BYTES", "KINDS", "MARGIN", "MAX_CHUNKS", "MIN_ROWS", "TRIAL_BUDGET_S", "TRIAL_MARGIN",
           "TRIAL_ROUNDS", "TRUSTED_SAVING", "GemmCost", "HostCost", "Workload", "best_chunks", "check_chunks",
           "choose_chunks", "explain", "measure_gemm", "measure_host_cost", "modelled_seconds", "modelled_table",
           "reset_measurements", "settled_chunks", "trial_rounds", "trial_seconds"]

MAX_CHUNKS = 8
MARGIN = 0.1  # the share of c = 1's modelled time a count must save to be chosen without a trial
TRIAL_MARGIN = 0.05  # the share of c = 1's timed seconds the tried count must save (in the quietest round)
TRUSTED_SAVING = 0.25  # a modelled saving of at least this share is taken without a trial
TRIAL_ROUNDS = 3  # timed rounds of a trial (after one untimed), at most
TRIAL_BUDGET_S = 1.0  # a trial's modelled seconds at most; costlier layers take the model's choice
CALIBRATION_BYTES = 1 << 20  # per rank, for the link's seconds per byte where no emulated link says
KINDS = ("gather", "scatter", "all_reduce", "all_reduce_grad")
_TINY = 64  # elements per rank of the all-gathers that time the per-chunk host cost
_REPEATS = 3  # timings per figure; the least is kept (a loaded machine only adds time)
_POLL_S = 1.0  # the longest a calibration all-gather is polled for completion


def check_chunks(chunks: object, arg: str = "chunks") -> Optional[int]:
    """``chunks`` if it is None (choose per call) or an int >= 1; else ``TypeError`` / ``ValueError``
    naming ``arg``."""
    if chunks is None:
        return None
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"{arg} must be None (chosen from measured costs) or an int >= 1, got {type(chunks).__name__} {chunks!r}")
    if chunks < 1:
        raise ValueError(f"{arg} must be None (chosen from measured costs) or an int >= 1, got {chunks!r}")
    return chunks


@dataclass(frozen=True)
class Workload:
    """One collective matmul, in global sizes (the same on every rank): its ``kind`` (``KINDS``), the
    rows of the chunked dimension on the widest rank (``rows``: caps the count), the rows of the
    layer's whole GEMM (``gemm_rows``), its ``in_features`` and local ``out_features``, the bytes
    each rank receives (``wire_bytes``), and ``dtype`` / ``device_type``."""

    kind: str
    rows: int
    gemm_rows: int
    in_features: int
    out_features: int
    wire_bytes: float
    dtype: torch.dtype = torch.float32
    device_type: str = "cpu"


@dataclass(frozen=True)
class HostCost:
    """A group's agreed figures: ``per_chunk_s`` (``O``), and for where no emulated link is active the
    real link's ``latency_s`` (``L``) and ``seconds_per_byte`` (``s``)."""

    per_chunk_s: float
    latency_s: float
    seconds_per_byte: float


@dataclass(frozen=True)
class GemmCost:
    """``G(n) = fixed_s + per_row_s * n``: a GEMM's agreed seconds on ``n`` rows at one layer shape."""

    fixed_s: float
    per_row_s: float

    def __call__(self, rows: float) -> float:
        return self.fixed_s + self.per_row_s * rows if rows > 0 else 0.0

    @classmethod
    def fit(cls, rows: int, whole_s: float, part_s: float) -> "GemmCost":
        """The line through ``(rows, whole_s)`` and ``(rows // MAX_CHUNKS, part_s)`` (what
        :func:`measure_gemm` times), neither part below 0."""
        small = max(1, rows // MAX_CHUNKS)
        per_row = max(0.0, (whole_s - part_s) / (rows - small)) if rows > small else 0.0
        return cls(max(0.0, part_s - per_row * small), per_row)


# ------------------------------------------------------------------------ the model
def _transfer_then_compute(c: int, link_chunk: float, head: float, compute_chunk: float) -> float:
    t = head
    for k in range(c):
        t = max(t, (k + 1) * link_chunk) + compute_chunk
    return t


def _compute_then_transfer(c: int, compute_chunk: float, link_chunk: float, tail: float) -> float:
    host = link = 0.0
    for _ in range(c):
        host += compute_chunk
        link = max(link, host) + link_chunk
    return max(link, host + tail)


def modelled_seconds(work: Workload, c: int, gemm: GemmCost, per_chunk_s: float, latency_s: float,
                     seconds_per_byte: float, world: int) -> float:
    """The modelled forward + backward seconds of ``work`` cut into ``c`` chunks (the table of
    [Note: choosing the chunk count])."""
    n, o = float(work.gemm_rows), per_chunk_s
    t_c = latency_s + work.wire_bytes / c * seconds_per_byte
    own = n / world if c > 1 else 0.0  # rows that need no wait (c = 1 waits for the whole operand first)
    rest = (n - own) / c
    if work.kind == "gather":
        return (_transfer_then_compute(c, t_c, gemm(own), gemm(rest) + o)
                + _compute_then_transfer(c, gemm(n / c) + o, t_c, gemm(n)))
    if work.kind == "scatter":
        return (_compute_then_transfer(c, gemm(n / c) + o, t_c, 0.0)
                + _transfer_then_compute(c, t_c, 2 * gemm(own), 2 * gemm(rest) + o))
    if work.kind == "all_reduce":
        return _compute_then_transfer(c, gemm(n / c) + o, t_c, 0.0) + 2 * gemm(n)
    if work.kind == "all_reduce_grad":
        return gemm(n) + _compute_then_transfer(c, gemm(n / c) + o, t_c, gemm(n))
    raise ValueError(f"Workload.kind must be one of {KINDS}, got {work.kind!r}")


def _cap(work: Workload) -> int:
    """The most chunks ``work`` may be cut into: ``MAX_CHUNKS``, ``MIN_ROWS`` rows a chunk, the rows."""
    return max(1, min(MAX_CHUNKS, work.rows // MIN_ROWS))


def modelled_table(work: Workload, gemm: GemmCost, per_chunk_s: float, latency_s: float, seconds_per_byte: float,
                   world: int) -> dict[int, float]:
    """Every allowed count of ``work`` -> its modelled seconds (:func:`modelled_seconds`)."""
    return {c: modelled_seconds(work, c, gemm, per_chunk_s, latency_s, seconds_per_byte, world)
            for c in range(1, _cap(work) + 1)}


def best_chunks(work: Workload, gemm: GemmCost, per_chunk_s: float, latency_s: float, seconds_per_byte: float,
                world: int) -> int:
    """The count with the least modelled time if it saves more than ``MARGIN`` of ``c = 1``'s, else 1
    (the choice where no trial is affordable)."""
    times = modelled_table(work, gemm, per_chunk_s, latency_s, seconds_per_byte, world)
    best = _least(times)
    return best if times[best] < (1.0 - MARGIN) * times[1] else 1


def _least(times: dict[int, float]) -> int:
    return min(times, key=lambda c: (times[c], c))


def trial_rounds(times: dict[int, float]) -> int:
    """How many timed rounds a trial of ``times``' best count against 1 gets: ``TRIAL_ROUNDS``, fewer
    so that its modelled seconds (one untimed round more) stay within ``TRIAL_BUDGET_S``; 0 where
    not even one fits, where the best count is 1 (nothing to try), or where it saves at least
    ``TRUSTED_SAVING`` of 1's time (taken as modelled)."""
    best = _least(times)
    if best == 1 or times[best] <= (1.0 - TRUSTED_SAVING) * times[1]:
        return 0
    per_round = times[1] + times[best]
    return max(0, min(TRIAL_ROUNDS, int(TRIAL_BUDGET_S / per_round) - 1)) if per_round > 0 else TRIAL_ROUNDS


def settled_chunks(candidate: int, trial: "list[list[float]]") -> int:
    """The count a trial settles on: ``candidate`` if it was faster than ``chunks=1`` in every round
    and, in the quietest round (the least seconds of its two passes together), took less than
    ``1 - TRIAL_MARGIN`` of ``chunks=1``'s seconds (each round's ``[chunks=1, candidate]`` already
    maxed over ranks); else 1. A loaded machine only adds time and a slow spell mostly falls on
    one pass: the least disturbed round holds the truest pair; a round the candidate lost (noise,
    or a real per-chunk cost) keeps the undecomposed order, the side that cannot lose to it."""
    if not trial:
        raise ValueError("trial must hold at least one round of [chunks=1, candidate] seconds")
    one, tried = min(trial, key=sum)
    every_round = all(t < o for o, t in trial)
    return candidate if every_round and tried < (1.0 - TRIAL_MARGIN) * one else 1


# ------------------------------------------------------------------------ measuring, agreeing
_host: dict[tuple[str, str], HostCost] = {}
_gemm: dict[tuple, GemmCost] = {}
_chosen: dict[tuple, int] = {}
_trials: dict[tuple, dict[str, object]] = {}


def reset_measurements() -> None:
    """Forget every measured figure (the next choice measures again, on every rank alike)."""
    _host.clear()
    _gemm.clear()
    _chosen.clear()
    _trials.clear()


def _can_measure(device_type: str) -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (device_type == "cuda" and torch.cuda.is_current_stream_capturing())


def _least_seconds(fn: Callable[[], object], device_type: str, repeats: int = _REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device_type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device_type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _agreed(values: "tuple[float, ...]", info: GroupInfo) -> list[float]:
    """``values`` maxed elementwise over ``info``'s group: an agreement of ``overlap.agreement``
    (bounded, numbered, checked in debug mode like every other), never delayed by an emulated link."""
    from overlap import agreement
    from overlap.testing.emulated_link.active import passing_through  # light: no torch patching on import

    with passing_through():
        every_rank = agreement.exchange(info, "tp chunk costs", [float(v) for v in values])
    return [max(column) for column in zip(*every_rank)]


def _gather_seconds(n: int, chunks: int, info: GroupInfo, device: torch.device) -> tuple[float, float]:
    """``(host seconds, wall seconds)`` of an all-gather of ``n`` elements per rank cut into
    ``chunks`` chunks, through the same code as a decomposed layer's (buffers filled, all issued,
    then waited and placed chunk by chunk). The host seconds leave out the time the transfers
    take: the chunks are polled until done, untimed, before they are waited."""
    x = torch.ones((n, 1), device=device)
    start = time.perf_counter()
    gather = _ChunkedGather(x, SeqLayout([n] * info.size, 0, chunks, info.rank), info)
    issued = time.perf_counter()
    # a backend whose works report completion only once waited (gloo's reduce-scatter does) stops
    # the polling at the deadline: the transfer's remainder then counts as host time (more, not less)
    while time.perf_counter() - issued < _POLL_S and not all(work.is_done() for _, _, work in gather.inflight):
        time.sleep(0)
    landed = time.perf_counter()
    gather.place_all(gather.new_full(x))
    end = time.perf_counter()
    return (issued - start) + (end - landed), end - start


def measure_host_cost(info: GroupInfo, device: torch.device) -> tuple[float, float, float]:
    """This rank's ``(per-chunk host seconds O, the real link's seconds per collective L and per
    byte s)``, unagreed; collectives on ``info``'s group that every rank must make together (see
    [Note: choosing the chunk count])."""
    from overlap.testing.emulated_link.active import passing_through

    tiny, big = _TINY * MAX_CHUNKS, CALIBRATION_BYTES // 4
    with passing_through():
        _gather_seconds(tiny, MAX_CHUNKS, info, device)  # first use of the path and the group: untimed
        one = [_gather_seconds(tiny, 1, info, device) for _ in range(_REPEATS)]
        many = [_gather_seconds(tiny, MAX_CHUNKS, info, device) for _ in range(_REPEATS)]
        large = min(_gather_seconds(big, 1, info, device)[1] for _ in range(2))
    host_one, wall_one = min(h for h, _ in one), min(w for _, w in one)
    per_chunk = max(0.0, (min(h for h, _ in many) - host_one) / (MAX_CHUNKS - 1))
    latency = max(0.0, wall_one - host_one)
    return per_chunk, latency, max(0.0, large - wall_one) / (CALIBRATION_BYTES * (info.size - 1))


def measure_gemm(rows: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[float, float]:
    """This rank's seconds of ``linear`` at ``rows`` and at ``rows // MAX_CHUNKS`` rows, unagreed."""
    small = max(1, rows // MAX_CHUNKS)
    w = torch.randn(out_features, in_features, device=device).to(dtype)
    xs = torch.randn(rows, in_features, device=device).to(dtype)
    with torch.no_grad():
        # the 8th is timed more often: one slow timing of it alone makes the fit's fixed cost
        # (every chunk's) large (512 x 2048, load 8: 76 ms, and the model kept 1 chunk)
        return (_least_seconds(lambda: F.linear(xs, w), device.type, 2),
                _least_seconds(lambda: F.linear(xs[:small], w), device.type, 2 * _REPEATS))


def _host_cost(info: GroupInfo, device: torch.device) -> Optional[HostCost]:
    key = (device.type, info.pg.group_name)
    if key not in _host and _can_measure(device.type):
        with region("overlap::tp_calibrate"):
            _host[key] = HostCost(*_agreed(measure_host_cost(info, device), info))
    return _host.get(key)


def _bucket(rows: int) -> int:
    return next_power_of_two(rows)


def _gemm_cost(work: Workload, info: GroupInfo, device: torch.device) -> Optional[GemmCost]:
    rows = _bucket(work.gemm_rows)
    key = (work.device_type, work.dtype, rows, work.in_features, work.out_features)
    if key not in _gemm and _can_measure(device.type):
        with region("overlap::tp_calibrate"):
            whole, part = _agreed(measure_gemm(rows, work.in_features, work.out_features, work.dtype, device), info)
        _gemm[key] = GemmCost.fit(rows, whole, part)
    return _gemm.get(key)


def _link_figures(info: GroupInfo, host: HostCost) -> tuple[float, float]:
    """``(L, s)``: the active emulated link's for ``info``'s group, else the measured ones."""
    from overlap.testing.emulated_link.active import current_link  # light: no torch patching on import

    link = current_link()
    if link is None:
        return host.latency_s, host.seconds_per_byte
    gbps, latency_us = link.tier(info.pg)
    return latency_us * 1e-6, 8.0 / (gbps * 1e9)


def explain(work: Workload, info: GroupInfo) -> Optional[dict[str, object]]:
    """What the choice of ``work`` on ``info``'s group rests on, from the figures measured so far
    (None where nothing is measured yet): the agreed figures, the link's ``(L, s)`` in force, the
    modelled seconds of every allowed count, and the trial if one was run (its candidate, agreed
    ``[chunks=1, candidate]`` seconds per round, the count it settled on, its wall seconds).
    Measures nothing, issues nothing."""
    host = _host.get((work.device_type, info.pg.group_name))
    gemm = _gemm.get((work.device_type, work.dtype, _bucket(work.gemm_rows), work.in_features, work.out_features))
    if host is None or gemm is None:
        return None
    latency, per_byte = _link_figures(info, host)
    return {"host": host, "gemm": gemm, "latency_s": latency, "seconds_per_byte": per_byte,
            "modelled": modelled_table(work, gemm, host.per_chunk_s, latency, per_byte, info.size),
            "trial": _trials.get((work, info.pg.group_name, latency, per_byte))}


def choose_chunks(work: Workload, info: GroupInfo, override: Optional[int] = None,
                  device: Optional[torch.device] = None) -> int:
    """The chunk count of ``work`` on ``info``'s group: ``override`` (``chunks=``) capped at the rows,
    else chosen from measured, agreed costs (measured here at the first call of a group and of a
    GEMM shape: every rank of the group must call alike). See [Note: choosing the chunk count]."""
    if override is not None:
        return max(1, min(override, work.rows)) if work.rows > 0 else 1
    if info.size == 1 or _cap(work) == 1:
        return 1
    device = device if device is not None else torch.device(work.device_type)
    host = _host_cost(info, device)
    gemm = _gemm_cost(work, info, device) if host is not None else None
    if host is None or gemm is None:
        return 1  # nothing measured and nothing measurable here (compiling, capturing): torch's order
    latency, per_byte = _link_figures(info, host)
    key = (work, info.pg.group_name, latency, per_byte)
    if key not in _chosen:  # the model is pure Python (~50 µs), a trial some passes: once per workload and link
        times = modelled_table(work, gemm, host.per_chunk_s, latency, per_byte, info.size)
        rounds = trial_rounds(times)
        if rounds == 0:
            _chosen[key] = best_chunks(work, gemm, host.per_chunk_s, latency, per_byte, info.size)
        elif not _can_measure(device.type):
            return 1  # a trial is due and cannot run here (compiling, capturing): torch's order, not cached
        else:
            _chosen[key] = _tried(work, _least(times), rounds, info, device, key)
    return _chosen[key]


def _tried(work: Workload, candidate: int, rounds: int, info: GroupInfo, device: torch.device, key: tuple) -> int:
    """The count a trial of ``candidate`` against 1 settles on (agreed: each timing maxed over the
    group); the trial's figures are kept for :func:`explain`."""
    start = time.perf_counter()
    with region("overlap::tp_trial"):
        mine = trial_seconds(work, (1, candidate), info, device, rounds,
                             lambda elapsed: _agreed((elapsed,), info)[0] < TRIAL_BUDGET_S)
        flat = _agreed(tuple(t for r in mine for t in r), info)
    trial = [flat[i:i + 2] for i in range(0, len(flat), 2)]
    chosen = settled_chunks(candidate, trial)
    _trials[key] = {"candidate": candidate, "rounds": trial, "chosen": chosen,
                    "cost_s": time.perf_counter() - start}
    return chosen
