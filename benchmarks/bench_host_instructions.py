"""Host instructions per training-step phase: plain vs ``overlap.shard`` (and torch FSDP2), counted by
callgrind, so that a change of host cost can be read on a loaded box.

``bench_host_bound``'s CPU small config (``--blocks`` blocks of LayerNorm + Linear 32->128->32, 32
tokens, per-tensor AdamW, fp32, a 1-rank gloo group) runs ``--warmup`` steps, then ``--steps`` steps
in which one phase (``zero_grad(set_to_none=True)``, the forward with the loss's ``sum()``, the
backward, or ``opt.step()``) is called through ``functools.reduce``, the marker callgrind collects
inside (``--toggle-collect``). Each (mode, phase) is one run of this file under ``valgrind
--tool=callgrind``; ``--jobs`` run at once. The table gives millions of instructions per step and
the ratio to plain's same phase.

Why instructions: on a shared 2-core box a step's time drifts by up to 1.6x within minutes, while an
instruction count does not depend on load; it is exact from run to run (``PYTHONHASHSEED=0``,
``OMP_NUM_THREADS=1``). It is not time: an instruction of the runtime's (Python calls, attribute
reads, bindings) takes 2-3x the time of one of plain's, whose count includes the CPU kernels' dense
loops, so a step's time ratio is larger than its instruction ratio (measured, with cache misses and
the collector ruled out: benchmarks/RESULTS.md, 2026-12-06; ``bench_host_bound.py``'s phase table
times the same phases). A change that removes instructions from the runtime's path removes time;
the table says how much of the gap to plain it is.

Before the counted steps each child checks, once outside callgrind's collection, that nothing in
its phase calls ``functools.reduce`` itself (a nested call would stop the collection early); if
something does, it fails naming the phase rather than print a short count.

Needs ``valgrind`` on the PATH (Linux); a run takes about 2-3 minutes per (mode, phase) on the
2-core box.

    python benchmarks/bench_host_instructions.py [--modes plain overlap.shard] [--phases zero forward
                                                 backward optimizer] [--blocks 48] [--steps 10]
                                                 [--warmup 3] [--jobs 2] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from _common import parse, parser  # first: sys.path
from report import emit

from bench_host_bound import CPU_SMALL, MODES, make_phases, single_rank_group

PHASES = ("zero", "forward", "backward", "optimizer")  # the names of bench_host_bound.PHASES here
MARKER = "functools_reduce"  # the C function of functools.reduce: callgrind collects inside it only
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def _marked(fn: Callable[[], object]) -> object:
    """``fn()`` called inside ``functools.reduce``: what callgrind counts."""
    return functools.reduce(lambda _, f: f(), [fn], None)


def _calls_the_marker(fn: Callable[[], object]) -> bool:
    """Does ``fn()`` call ``functools.reduce`` (which would toggle callgrind's collection off early)?"""
    seen = []

    def watch(frame: object, event: str, arg: object) -> None:
        if event == "c_call" and arg is functools.reduce:
            seen.append(frame)

    sys.setprofile(watch)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return bool(seen)


def child(mode: str, phase: str, blocks: int, steps: int, warmup: int) -> None:
    """Run ``warmup`` steps, check the phase, then ``steps`` steps with ``phase`` marked."""
    d, tokens = CPU_SMALL
    device = torch.device("cpu")
    with single_rank_group(device):
        parts = dict(zip(PHASES, make_phases(mode, blocks, d, tokens, device)))  # bench_host_bound's step, in order
        for i in range(warmup + 1 + steps):
            for name, fn in parts.items():
                if i == warmup and name == phase:
                    if _calls_the_marker(fn):
                        raise SystemExit(f"phase {phase!r} calls functools.reduce itself: its count would stop early")
                elif i > warmup and name == phase:
                    _marked(fn)
                else:
                    fn()


def count(mode: str, phase: str, blocks: int, steps: int, warmup: int) -> float:
    """Millions of instructions per step of ``phase`` in ``mode`` (one callgrind run)."""
    with tempfile.TemporaryDirectory() as tmp:
        command = ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={MARKER}",
                   f"--callgrind-out-file={os.path.join(tmp, 'out')}", sys.executable, os.path.abspath(__file__),
                   "--child", mode, phase, str(blocks), str(steps), str(warmup)]
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{mode} {phase}: callgrind run failed ({done.returncode}): {done.stderr[-2000:]}")
    return int(found.group(1)) / steps / 1e6


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        mode, phase, blocks, steps, warmup = argv[1:6]
        child(mode, phase, int(blocks), int(steps), int(warmup))
        return
    p = parser(__doc__)
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=["plain", "overlap.shard"],
                   help="modes to count (default plain and overlap.shard; plain is the ratios' base)")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES), help="phases to count (default all)")
    p.add_argument("--blocks", type=int, default=48, help="blocks (default 48)")
    p.add_argument("--steps", type=int, default=10, help="counted steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="uncounted steps first (default 3)")
    p.add_argument("--jobs", type=int, default=2, help="callgrind runs at once (default 2)")
    args = parse(p, argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on the PATH: this benchmark counts instructions with callgrind")
    if "plain" not in args.modes:
        args.modes.insert(0, "plain")
    runs = [(mode, phase) for mode in args.modes for phase in args.phases]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        counts = dict(zip(runs, pool.map(lambda run: count(*run, args.blocks, args.steps, args.warmup), runs)))
    rows = []
    for phase in args.phases:
        for mode in args.modes:
            value = counts[(mode, phase)]
            rows.append([phase, mode, f"{value:.2f}", f"{value / counts[('plain', phase)]:.3f}x"])
    for mode in args.modes:
        total = sum(counts[(mode, phase)] for phase in args.phases)
        plain = sum(counts[("plain", phase)] for phase in args.phases)
        rows.append(["the phases above", mode, f"{total:.2f}", f"{total / plain:.3f}x"])
    d, tokens = CPU_SMALL
    emit(f"Host instructions per step by phase (callgrind), {args.blocks} blocks of LayerNorm + Linear "
         f"{d}->{4 * d}->{d}, {tokens} tokens, per-tensor AdamW, fp32, world size 1 (gloo); "
         f"{args.steps} counted steps after {args.warmup}",
         ["phase", "mode", "M instructions per step", "vs plain"], rows, args.markdown)


if __name__ == "__main__":
    main()
