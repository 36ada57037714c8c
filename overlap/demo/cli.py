"""``python -m overlap``: the command line (``demo``, ``check-gpu``).

Exit codes: 0 success; 1 the demo ran but its losses disagree, or a GPU check failed; 2 bad input
(argparse's usage and a message, before any training starts), or no GPU for ``check-gpu``.
"""
from __future__ import annotations

import argparse
import inspect
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

if TYPE_CHECKING:
    from overlap.demo.run import DemoConfig, DemoResult

__all__ = ["main", "build_parser", "max_world_size"]

DEFAULT_OUT = "overlap-demo-out"


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _finite_float(strictly_positive: bool) -> Callable[[str], float]:
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


def _comma_separated(text: str, allowed: Sequence[str], what: str, also: str = "") -> tuple[str, ...]:
    """``text``'s comma-separated names, each of ``allowed`` (duplicates once, in order), else an
    argparse error naming the first unknown ``what`` and the choices (``also``: a further choice)."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {unknown[0]!r}: give a comma-separated list of {', '.join(allowed)}{also}")
    return tuple(dict.fromkeys(names))


def _compare(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated modes of ``overlap.demo.run.COMPARABLE``, or ``none``."""
    from overlap.demo.run import COMPARABLE

    if text.strip() == "none":
        return ()
    return _comma_separated(text, COMPARABLE, "mode", ", or none")


def _compress(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated formats of ``overlap.demo.run.COMPRESSIONS``; a former
    format (``fp8``) is an error saying what to give instead."""
    from overlap.demo.run import COMPRESSIONS, RENAMED_COMPRESSIONS

    renamed = [name.strip() for name in text.split(",") if name.strip() in RENAMED_COMPRESSIONS]
    if renamed:
        raise argparse.ArgumentTypeError(RENAMED_COMPRESSIONS[renamed[0]])
    return _comma_separated(text, tuple(COMPRESSIONS), "format")


def _mesh(text: str) -> tuple[int, int]:
    """``NODESxPER_NODE``, e.g. ``2x2``: each a whole number >= 1."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"must be NODESxRANKS_PER_NODE with whole numbers >= 1, e.g. 2x2; got {text!r}")
    return int(parts[0]), int(parts[1])


def _prefetch(text: str) -> Union[int, str]:
    """``auto`` or a whole number >= 0 (``overlap.shard``'s ``prefetch``)."""
    if text.strip() == "auto":
        return "auto"
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"must be auto or a whole number >= 0, got {text!r}")
    return int(text)


def max_world_size() -> int:
    """The most CPU ranks the demo spawns on this machine (gloo ranks share the cores)."""
    return 4 * (os.cpu_count() or 1)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m overlap`` parser (sub-commands ``demo``, ``check-gpu`` and ``build-native``)."""
    from overlap.demo.run import COMPARABLE, FSDP2_LOSS_RTOL, MODEL_SIZES

    parser = argparse.ArgumentParser(prog="python -m overlap", description="triton-overlap command line.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sizes = "; ".join(f"{name}: {s.layers} blocks of width {s.dim}, {s.batch}x{s.seq} tokens per rank"
                      for name, s in MODEL_SIZES.items())
    demo = commands.add_parser(
        "demo",
        help="train a small transformer with overlap.shard beside no-overlap and torch FSDP2; print the table",
        description=(
            "Trains a small transformer (AdamW) with overlap.shard on several ranks, side by side with the "
            "same runtime with overlap off (overlap.no_overlap) and torch FSDP2 (fully_shard), behind an "
            "emulated link whose bandwidth makes one step's communication take about as long as its compute. "
            "Prints step time, tokens/s, compute, comm, exposed comm and the share of comm hidden per mode, "
            "checks that the losses agree (overlap vs no-overlap bitwise, FSDP2 within a relative "
            f"{FSDP2_LOSS_RTOL:g}), and writes a Chrome trace and a PNG timeline of a few profiled steps. "
            "Spawns its ranks (gloo on CPU; NCCL with one GPU per rank); under torchrun it runs in-process "
            "on the ranks torchrun started. Exit codes: 0 ok, 1 losses disagree, 2 bad input."),
    )
    demo.add_argument("--world-size", type=_int_at_least(2), default=None, metavar="N",
                      help="ranks to spawn, >= 2 (default 2; under torchrun, WORLD_SIZE and this must agree)")
    demo.add_argument("--steps", type=_int_at_least(1), default=5, metavar="S",
                      help="timed steps per mode: S without and S with the link's delay, after one warm-up step "
                           "behind the link, each after an untimed step of its kind; figures are medians (default 5)")
    demo.add_argument("--model", choices=tuple(MODEL_SIZES), default="small",
                      help=f"model size (default small). {sizes}")
    demo.add_argument("--compare", type=_compare, default=None, metavar="MODES",
                      help=f"comma-separated modes to run beside overlap.shard: {', '.join(COMPARABLE)} "
                           "(no-overlap = overlap.no_overlap), or none (default: both)")
    demo.add_argument("--link-gbps", type=_finite_float(strictly_positive=True), default=None, metavar="B",
                      help="emulated link bandwidth in gigabits/s (default: calibrated so one step's comm "
                           "takes about as long as overlap.shard's compute)")
    demo.add_argument("--latency-us", type=_finite_float(strictly_positive=False), default=20.0, metavar="US",
                      help="emulated latency per collective in microseconds (default 20)")
    demo.add_argument("--profile-steps", type=_int_at_least(0), default=2, metavar="P",
                      help="steps of overlap.shard (and no-overlap) run under overlap.profile() after the timed "
                           "ones, for the trace and timeline, after one warm-up step it records but does not "
                           "report (default 2; 0: no profile, nothing written)")
    demo.add_argument("--prefetch", type=_prefetch, default="auto", metavar="D",
                      help="overlap.shard's prefetch: auto (default: the depth chosen from the first steps' "
                           "measured costs, then verified by a timed trial against depth 1 with nothing gathered "
                           "ahead, all behind the link) or a fixed depth >= 0; no-overlap "
                           "runs at the depth overlap.shard used, so both move the same bytes")
    demo.add_argument("--split-first-block", action="store_true",
                      help="shard the first block's MLP (blocks.0.up, blocks.0.down) as groups of their own, in "
                           "every mode: a smaller first group, so a shorter chain at the step's end (its "
                           "reduce-scatter, step and next-step gather)")
    demo.add_argument("--mesh", type=_mesh, default=None, metavar="NxG",
                      help="emulate N nodes of G ranks (N*G ranks; --world-size may be left out): overlap.shard and "
                           "FSDP2 each run fully sharded and as HSDP on the (replicate, shard) mesh (N, G), behind "
                           "a two-tier link whose inter-node tier is the calibrated one and the intra-node tier "
                           "8x faster (e.g. --mesh 2x2)")
    demo.add_argument("--parallel", choices=("fsdp", "tp"), default="fsdp",
                      help="fsdp (default): the FSDP comparison above. tp: tensor parallelism over every rank instead "
                           "(Megatron's plan on the same model, q/k/v split): overlap.tensor_parallel with its "
                           "collective matmuls decomposed, the same with chunks=1, and torch's parallelize_module, "
                           "side by side behind the link (--compare and --mesh choose FSDP modes: not with tp)")
    demo.add_argument("--compress", type=_compress, default=(), metavar="FORMATS",
                      help="also run overlap.shard with compressed collectives beside the exact run, one run per "
                           "comma-separated format: int8 = overlap.Compression() (int8 all-gathers and int8 "
                           "reductions); fp8-gather = Compression(gather='fp8', reduce='int8') (e4m3 all-gathers, "
                           "int8 reductions); fp8-reduce = Compression(gather='int8', reduce='fp8') (int8 "
                           "all-gathers, e4m3 reductions); fp8-both = Compression(gather='fp8', reduce='fp8'); "
                           "block 256; e.g. int8,fp8-gather. Each final loss must be within 1%% of exact")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                      help="auto (default): cuda (NCCL, one GPU per rank) when there are enough GPUs for the ranks, "
                           "else cpu (gloo)")
    demo.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                      help=f"folder for trace-<mode>.json and timeline-<mode>.png (created; default ./{DEFAULT_OUT})")
    check = commands.add_parser(
        "check-gpu",
        help="prove this machine's GPU: the GPU tests, the packing ops, training, streams, CUDA graphs; one table",
        description=(
            "Runs, on the current CUDA device with the installed torch and Triton (no network): pytest -m gpu, "
            "the six packing/chunk ops against their references over drawn cases, world-size-1 NCCL training "
            "against the unsharded model and FSDP2, a collective beside compute, a CUDA-graph capture and "
            "replay of the packing ops, and benchmarks/bench_kernels.py --device cuda --quick and "
            "benchmarks/bench_host_bound.py (appended to benchmarks/RESULTS.md). Prints one table. Exit codes: 0 every check that ran passed, 1 a check "
            "failed, 2 no CUDA device."),
    )
    check.add_argument("--skip-bench", action="store_true",
                       help="leave out the benchmarks (and RESULTS.md untouched)")
    check.add_argument("--suite", action="store_true",
                       help="also run the default test suite on this machine (pytest tests, one xdist worker per "
                            "core but two), last, as a row of its own (about 5 more minutes on 16 cores)")
    check.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                       help="write each subprocess row's whole output (the GPU tests, the benchmarks, the "
                            "suite) to DIR/<row>.log (created), e.g. DIR/default-suite.log")
    commands.add_parser(
        "build-native",
        help="build the packing launcher's native passes now, once per torch build, and say where (or why not)",
        description=(
            "Compiles overlap_kernels/native_passes.cpp against the installed torch into its cache "
            "(OVERLAP_NATIVE_CACHE, default ~/.cache/triton-overlap/native), as the first launch on the Triton "
            "path otherwise does (11-14 s on a 2-core box): in a container image, or before a job, so that no "
            "rank builds during its first step. Prints the status and the built file. Exit codes: 0 built or "
            "already cached, 1 not available here (the reason is printed; the packing ops then run the same "
            "passes in Python: slower, same results)."),
    )
    return parser


def _build_native() -> int:
    """``build-native``: build (or find) the native passes; 0 when they are usable, else 1."""
    from overlap_kernels import native_passes

    module = native_passes.loaded()
    print(f"native passes: {native_passes.status()}")
    if module is None:
        return 1
    print(f"built: {module.__file__}")
    return 0


def _torchrun_env(parser: argparse.ArgumentParser) -> Optional[tuple[int, int, int]]:
    """(rank, world size, local rank) when started by torchrun (RANK and WORLD_SIZE set), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    values = [os.environ.get(name, "0") for name in names]
    if not all(v.isdigit() for v in values):
        parser.error("torchrun's " + ", ".join(f"{n}={v!r}" for n, v in zip(names, values)) + " must be whole numbers")
    rank, world_size, local_rank = (int(v) for v in values)
    return rank, world_size, local_rank


def _unwritable(out: str) -> Optional[str]:
    """Why the folder ``out`` cannot be written (created if missing), or None if it can."""
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from overlap.demo.run import MODE_NAMES, DemoConfig, format_report, run_demo, write_outputs
    from overlap.device_info import device_info

    launched = _torchrun_env(parser)
    if args.parallel == "tp" and (args.compare is not None or args.mesh is not None):
        parser.error("--parallel tp runs its own modes (overlap.tensor_parallel, chunks=1, torch TP): "
                     "--compare and --mesh choose FSDP modes; leave them out")
    if args.compress and (args.parallel == "tp" or args.mesh is not None):
        parser.error("--compress runs a fully sharded FSDP mode: not with --parallel tp or --mesh")
    if args.compare is None:
        from overlap.demo.run import COMPARABLE

        args.compare = COMPARABLE
    if args.mesh is not None:
        ranks = args.mesh[0] * args.mesh[1]
        if args.world_size is not None and args.world_size != ranks:
            parser.error(f"--mesh {args.mesh[0]}x{args.mesh[1]} has {ranks} ranks but --world-size is {args.world_size}")
        if ranks < 2:
            parser.error(f"--mesh {args.mesh[0]}x{args.mesh[1]}: the demo needs >= 2 ranks")
        args.world_size = ranks
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and not gpus:
        parser.error("--device cuda: no CUDA device is visible")
    if args.device == "auto":  # NCCL needs one GPU per rank: too few GPUs for a spawned run -> CPU
        wanted = 1 if launched is not None else (args.world_size or 2)
        device = "cuda" if gpus >= wanted else "cpu"
    else:
        device = args.device
    if launched is not None:
        rank, world_size, local_rank = launched
        if args.world_size is not None and args.world_size != world_size:
            parser.error(f"--world-size {args.world_size} disagrees with torchrun's WORLD_SIZE={world_size}")
        if world_size < 2:
            parser.error(f"--world-size: the demo needs >= 2 ranks, torchrun started {world_size}")
        if device == "cuda" and local_rank >= gpus:
            parser.error(f"--device cuda: LOCAL_RANK={local_rank} has no GPU of its own ({gpus} visible)")
    else:
        rank, local_rank = 0, 0
        world_size = 2 if args.world_size is None else args.world_size
        if device == "cuda" and world_size > gpus:
            parser.error(f"--world-size {world_size} is more ranks than this machine can run: NCCL needs one GPU "
                         f"per rank and {gpus} are visible")
        if device == "cpu" and world_size > max_world_size():
            parser.error(f"--world-size {world_size} is more CPU ranks than this machine can run "
                         f"({os.cpu_count()} cores: at most {max_world_size()})")
    if rank == 0:
        problem = _unwritable(args.out)
        if problem is not None:
            parser.error(f"--out {args.out!r} cannot be written: {problem}")
    cfg = DemoConfig(world_size=world_size, steps=args.steps, model=args.model, compare=args.compare,
                     link_gbps=args.link_gbps, latency_us=args.latency_us, profile_steps=args.profile_steps,
                     device=device, mesh=args.mesh, parallel=args.parallel, compress=args.compress,
                     prefetch=args.prefetch, split_first_block=args.split_first_block)
    if rank == 0:
        backend = "NCCL, one GPU per rank" if device == "cuda" else "gloo"
        how = "torchrun" if launched is not None else "spawned"
        print(f"overlap demo: {world_size} {how} ranks ({backend}), model {cfg.model}, AdamW; modes: "
              f"{', '.join(MODE_NAMES[m] for m in cfg.modes)}", flush=True)
        print(device_info().describe() + "\n", flush=True)
    if launched is None:
        result = run_demo(cfg)
    else:
        result = _in_process(cfg, rank, world_size, local_rank)
        if result is None:
            return 0
    print(format_report(result))
    for line in write_outputs(result, args.out):
        print(line)
    return 0 if result.losses_agree else 1


def _in_process(cfg: DemoConfig, rank: int, world_size: int, local_rank: int) -> Optional[DemoResult]:
    """Run :func:`overlap.demo.run.rank_main` on this torchrun rank (a process group is initialized here
    from torchrun's environment unless one exists); rank 0 gets the result, the others None."""
    import torch
    import torch.distributed as dist

    from overlap.demo.run import rank_main

    created = not dist.is_initialized()
    if created:
        if cfg.device == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            takes_device = "device_id" in inspect.signature(dist.init_process_group).parameters
            extra = {"device_id": device} if takes_device else {}
            dist.init_process_group("nccl", **extra)
        else:
            dist.init_process_group("gloo")
    elif cfg.device == "cuda":
        torch.cuda.set_device(local_rank)
    try:
        return rank_main(rank, world_size, cfg)
    finally:
        if created:
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command; returns the exit code (argparse
    exits with 2 on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args, parser)
    if args.command == "check-gpu":
        from overlap.testing import gpu_check

        return gpu_check.main(skip_bench=args.skip_bench, suite=args.suite, log_dir=args.log_dir)
    if args.command == "build-native":
        return _build_native()
    parser.error(f"unknown command {args.command!r}")  # unreachable: argparse checks choices
    return 2
