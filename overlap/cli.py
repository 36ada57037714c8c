"""``python -m overlap``: the command line (``demo``)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _finite_float(strictly_positive: bool):
    """An argparse type: a finite float > 0 (``strictly_positive``) or >= 0."""
    bound = "> 0" if strictly_positive else ">= 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}") from None
        if not (value > 0 if strictly_positive else value >= 0) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    return parse


def max_world_size() -> int:
    """The most CPU ranks the demo spawns on this machine (gloo ranks share the cores)."""
    return 4 * (os.cpu_count() or 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m overlap", description="triton-overlap command line.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="gather sharded layer weights with and without overlap on spawned CPU ranks; print the table",
        description="Spawns CPU ranks (gloo) behind an emulated link and runs the same sharded forward "
                    "three ways — compute only, gathers with no overlap, gathers overlapped with compute "
                    "(overlap.all_gather, waited at first use) — then prints step time, compute time, "
                    "comm time, exposed comm and the share of comm hidden.",
    )
    demo.add_argument("--world-size", type=_positive_int, default=2, help="ranks to spawn (default 2)")
    demo.add_argument("--steps", type=_positive_int, default=6, help="timed steps per mode (default 6)")
    demo.add_argument("--layers", type=_positive_int, default=8, help="sharded layers per step (default 8)")
    demo.add_argument("--hidden", type=_positive_int, default=512,
                      help="layer width; each weight is hidden x hidden fp32 (default 512)")
    demo.add_argument("--link-gbps", type=_finite_float(strictly_positive=True), default=None,
                      help="emulated link bandwidth in gigabits/s (default: chosen so comm time ~ compute time)")
    demo.add_argument("--latency-us", type=_finite_float(strictly_positive=False), default=20.0,
                      help="emulated per-collective latency in microseconds (default 20)")
    return parser


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from overlap.demo import DemoConfig, format_table, run_demo
    from overlap.device_info import device_info

    limit = max_world_size()
    if args.world_size > limit:
        parser.error(f"--world-size {args.world_size} is more CPU ranks than this machine can run "
                     f"({os.cpu_count()} cores: at most {limit})")
    if args.hidden % args.world_size:
        parser.error(f"--hidden {args.hidden} must be divisible by --world-size {args.world_size}")
    cfg = DemoConfig(world_size=args.world_size, steps=args.steps, layers=args.layers, hidden=args.hidden,
                     link_gbps=args.link_gbps, latency_us=args.latency_us)
    print(f"overlap demo: {cfg.world_size} CPU ranks (gloo), {cfg.layers} sharded layers of "
          f"{cfg.hidden}x{cfg.hidden} fp32, {cfg.steps} timed steps per mode ...", flush=True)
    print(device_info().describe(), flush=True)
    results = run_demo(cfg)
    print(f"emulated link: {results['link_gbps']:.3g} Gbit/s, {cfg.latency_us:g} µs latency per collective; "
          f"medians over steps, slowest rank\n")
    print(format_table(results))
    if not all(results[m]["same"] for m in ("no overlap", "overlap")):
        print("\nERROR: the modes disagree with the compute-only result", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args, parser)
    parser.error(f"unknown command {args.command!r}")  # unreachable: argparse checks choices
    return 2
