"""Cost of desync detection per collective: debug mode off vs on, this checkout vs a baseline commit.

Each rank times issue + wait of one small all-reduce (and all-gather) in blocks that alternate debug
mode off and on (``overlap.set_debug``), and reports medians (``--stat min``: the fastest block); the
difference is what the debug check (one 256-byte-per-rank gather on the side channel) adds to each
collective. Also, timed in rank 0 (best of 5 x 100,000 calls): the lines ``_issue`` runs for desync
detection with debug mode off (the sequence number and one boolean check), and the timeout lookup
of every host wait (``errors.timeout_for``, which applies the bounded default).

``--baseline REF`` measures the same in the runtime of git commit ``REF`` too (its ``overlap/``,
``scheduler/`` and ``overlap_kernels/``, ``kernels/`` before 2026-12-03, extracted with ``git
archive`` into a temporary folder, run with this script), alternating this checkout and the
baseline ``--rounds`` times, in one run, so both see the same machine load; the table shows each
figure for both and their ratio. ``--baseline HEAD`` on a clean checkout compares the code with
itself: the spread it shows is the noise floor of the box.

    python benchmarks/bench_desync.py [--world-size 2] [--numel 1024] [--iters 300] [--baseline b01283f] [--stat min] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import timeit

from _common import ROOT, add_world_size, parse, parser  # first: sys.path

if "--tree" in sys.argv:  # a baseline's runtime, extracted by the parent run: import it instead of ROOT's
    sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1])

import torch  # noqa: E402

import overlap  # noqa: E402
from overlap import desync, errors  # noqa: E402
from overlap.testing import run_distributed  # noqa: E402
from report import emit  # noqa: E402
from timing import seconds_per_call  # noqa: E402

CALLS = ("all_reduce", "all_gather")


def _rank(rank: int, world: int, numel: int, iters: int, blocks: int, stat: str = "median") -> dict[str, float]:
    torch.set_num_threads(1)
    x = torch.randn(numel)
    calls = {
        "all_reduce": lambda: overlap.wait(overlap.all_reduce(x)),
        "all_gather": lambda: overlap.wait(overlap.all_gather(x)),
    }
    samples: dict[str, list[float]] = {f"{name} {mode}": [] for name in calls for mode in ("off", "on")}
    for block in range(blocks + 1):  # block 0 warms up (and builds the side channel)
        for mode in ("off", "on"):
            overlap.set_debug(mode == "on")
            for name, call in calls.items():
                us = 1e6 * seconds_per_call(call, iters, repeats=1, warmup=0)
                if block:
                    samples[f"{name} {mode}"].append(us)
    reduce = min if stat == "min" else statistics.median
    out = {k: reduce(v) for k, v in samples.items()}
    overlap.set_debug(False)  # the host lines, in a rank (torch.distributed initialized, as in use)
    out["prologue"] = min(timeit.repeat(_issue_prologue, number=100_000, repeat=5)) / 100_000 * 1e6
    out["timeout_for"] = min(timeit.repeat(lambda: errors.timeout_for(""), number=100_000, repeat=5)) / 100_000 * 1e6
    overlap.set_debug(None)
    return out


if hasattr(desync, "SWITCH"):
    def _issue_prologue() -> None:
        """What ``_issue`` runs for desync detection with debug mode off."""
        seq = desync.next_seq("bench")
        if desync.SWITCH.on:
            desync.check("all_reduce", seq, "bench", ())
else:  # a baseline's runtime from before ``desync.SWITCH``: its ``_issue`` read ``desync.enabled``
    def _issue_prologue() -> None:
        """What ``_issue`` runs for desync detection with debug mode off."""
        seq = desync.next_seq("bench")
        if desync.enabled:
            desync.check("all_reduce", seq, "bench", ())


def _measure(args) -> dict[str, float]:  # noqa: ANN001 (the parsed arguments)
    """This process's runtime (ROOT's, or ``--tree``'s): the slowest rank's medians."""
    results = run_distributed(_rank, args.world_size, args.numel, args.iters, args.blocks, args.stat, timeout=600)
    return {k: max(r[k] for r in results) for k in results[0]}


def _run_tree(tree: str | None, args) -> dict[str, float]:  # noqa: ANN001
    """This script in a child process on ``tree``'s runtime (None: this checkout's)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        command = [sys.executable, os.path.abspath(__file__), "--world-size", str(args.world_size), "--numel",
                   str(args.numel), "--iters", str(args.iters), "--blocks", str(args.blocks), "--stat", args.stat,
                   "--json", f.name]
        if tree is not None:
            command += ["--tree", tree]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return json.load(open(f.name))


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    add_world_size(p)  # was --world, which still parses (argparse takes unique prefixes)
    p.add_argument("--numel", type=int, default=1024, help="float32 elements per collective (default 1024)")
    p.add_argument("--iters", type=int, default=300, help="collectives per timing block (default 300)")
    p.add_argument("--blocks", type=int, default=5, help="timed blocks per mode, alternating (default 5)")
    p.add_argument("--baseline", default=None, help="git commit to compare with, side by side (default: none)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of this checkout and the baseline (default 2)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="over blocks and runs: median (default), or min (the fastest: on a loaded box, where "
                        "other work only adds time)")
    p.add_argument("--json", default=None, help=argparse_suppress())
    p.add_argument("--tree", default=None, help=argparse_suppress())
    args = parse(p, argv)

    if args.json:  # a child run: measure and hand the figures back
        json.dump(_measure(args), open(args.json, "w"))
        return
    if args.baseline is None:
        runs = {"this": [_measure(args)]}
    else:
        runs = {"this": [], "baseline": []}
        with tempfile.TemporaryDirectory(prefix="bench-desync-") as tree:
            tops = subprocess.run(["git", "ls-tree", "--name-only", args.baseline], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout.split()
            # the kernels' package was kernels/ before 2026-12-03: a baseline has one name or the other
            packages = [p for p in ("overlap", "scheduler", "overlap_kernels", "kernels") if p in tops]
            archive = subprocess.run(["git", "archive", args.baseline, *packages], cwd=ROOT,
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
            for _ in range(args.rounds):
                runs["baseline"].append(_run_tree(tree, args))
                runs["this"].append(_run_tree(None, args))
    reduce = min if args.stat == "min" else statistics.median
    med = {name: {k: reduce(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    rows = []

    def row(what: str, key: str, digits: int = 1) -> None:
        this = med["this"][key]
        cells = [what, f"{this:.{digits}f}"]
        if "baseline" in med:
            base = med["baseline"][key]
            cells = [what, f"{base:.{digits}f}", f"{this:.{digits}f}", f"{this / base:.2f}x"]
        rows.append(cells)

    for name in CALLS:
        for mode in ("off", "on"):
            row(f"{name} of {args.numel} float32, issue + wait, debug {mode}", f"{name} {mode}")
        for m in med.values():
            m[f"{name} added"] = m[f"{name} on"] - m[f"{name} off"]
        row(f"{name}: added by debug mode", f"{name} added")
    row("`_issue`'s desync lines with debug off (seq + check)", "prologue", 3)
    row("timeout lookup of a host wait (`errors.timeout_for`)", "timeout_for", 3)
    header = ["what (µs)", f"baseline {args.baseline}", "this checkout", "this / baseline"] if args.baseline \
        else ["what (µs)", "this checkout"]
    emit(f"Desync detection: cost per collective, debug mode off vs on ({args.world_size} gloo ranks; {args.stat} of "
         f"{args.blocks} alternating blocks of {args.iters}, slowest rank"
         + (f"; {args.rounds} alternating runs of each tree, {args.stat})" if args.baseline else ")"),
         header, rows, args.markdown)


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
