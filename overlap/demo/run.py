"""The demo (``python -m overlap demo``): train a small transformer with ``overlap.shard`` and compare.

One run, side by side on the same ranks, from the same initial weights and on the same batches:

* ``overlap.shard`` (this runtime: each block's gather in flight while the blocks before it compute,
  ``prefetch="auto"`` by default, whose depth is chosen from the first steps' costs and verified by a
  timed trial against the simple schedule, all run behind the link before timing
  (:func:`~overlap.demo.training.schedule_steps` untimed steps in every mode), and
  which keeps the last groups of forward unsharded for backward; gradients reduce-scattered while
  the rest of backward runs, each group's optimizer step run in backward as soon as its gradients
  land: ``overlap.optimizer_in_backward``);
* ``overlap.no_overlap`` (the same runtime at the same depth, so the same bytes, with every
  collective completed before anything else runs: what overlap is measured from);
* torch FSDP2 (``fully_shard``, default settings).

Each mode trains :class:`~overlap.demo.model.TransformerLM` (head untied; embedding, each block and
head sharded on their own, then the root: its ``shard_units``) with AdamW; its steps alternate without
and with the emulated link's delay (``overlap.testing.paired_steps``): the first kind is the mode's
*compute side* (math, packing, the runtime's and gloo's own host work) and what the second takes
beyond it is *exposed communication*. Each timed step follows an untimed one of its own kind
(:data:`SETTLE_STEPS`), since gather-ahead leaves the next step's first gathers in flight. The link's bandwidth is chosen, unless given, so that one
step's communication takes about as long as this runtime's compute side: where overlap matters most.

After the timed steps, :data:`MEMORY_STEPS` more steps of each sharded mode (``overlap.shard`` and
FSDP2 alike) run under :class:`~overlap.demo.unsharded_peak.UnshardedPeak`, which counts the most
bytes of unsharded parameters held at once, the same way for both runtimes: what prefetching and
gathering ahead cost in memory, on CPU too. Then a few more steps of each ``overlap.shard`` mode run
under ``overlap.profile()``
(so profiling does not skew the timings), the first of them a warm-up step it records but does not
report (:data:`PROFILE_WARMUP_STEPS`); every rank's records are merged on rank 0, which returns
them for the Chrome trace and the PNG timeline (:func:`write_outputs`).

Losses are checked: ``overlap.shard`` and ``overlap.no_overlap`` must agree bitwise (turning overlap
off changes when collectives are waited for, never what is computed), torch FSDP2 within
:data:`FSDP2_LOSS_RTOL`.

Launch: :func:`run_demo` spawns the ranks (gloo on CPU, NCCL with one GPU per rank);
:func:`rank_main` is the per-rank body, also called in-process under ``torchrun``.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from overlap.demo.model import MODEL_SIZES, TransformerLM, token_batch
from overlap.demo.training import TrainStep, calibrate_link, make_optimizer, schedule_steps, shard_for_mode
from overlap.testing.exposed import PROFILE_WARMUP_STEPS, PairedTimes, profiled_steps

__all__ = [
    "COMPARABLE", "DemoConfig", "DemoResult", "FSDP2_LOSS_RTOL", "MODE_NAMES", "ModeResult", "format_report",
    "module_of", "rank_main", "run_demo", "write_outputs",
]

# [Note: demo loss tolerance] FSDP2 and overlap.shard compute the same fp32 math, but nothing obliges
# them to reduce gradients in the same order (flat buffers per group vs FSDP2's own; NCCL picks ring or
# tree per message size), and AdamW carries any rounding difference forward. Measured on CPU/gloo
# (tiny and small models, worlds 2 and 3, up to 11 steps): deviation 0, the losses are bitwise equal.
# The tolerance allows float32 rounding of the reduction order: a few ulps (~1e-7) per step, grown by
# AdamW over the demo's few steps, with a wide margin.
FSDP2_LOSS_RTOL = 1e-4
COMPRESSIONS: dict[str, dict[str, str]] = {
    "int8": dict(gather="int8", reduce="int8"),
    "fp8-gather": dict(gather="fp8", reduce="int8"),
    "fp8-reduce": dict(gather="int8", reduce="fp8"),
    "fp8-both": dict(gather="fp8", reduce="fp8"),
}
"""``--compress`` format -> its ``overlap.Compression`` arguments (block 256): ``int8`` sends the
all-gathers and the reductions as int8 (``Compression()``); each ``fp8-*`` sends e4m3 codes for the
collective(s) it names and int8 for the other. int8 reductions track exact training closer than
e4m3 ones ([Note: compressed collectives]). A bare ``fp8`` is no format: it once meant
``fp8-gather`` (``RENAMED_COMPRESSIONS``)."""
RENAMED_COMPRESSIONS: dict[str, str] = {
    "fp8": "'fp8' is not a format: give fp8-gather (e4m3 all-gathers, int8 reductions: what 'fp8' ran before), "
           "fp8-reduce (int8 all-gathers, e4m3 reductions) or fp8-both",
}
"""Former ``--compress`` formats -> the error that says what to give instead."""
COMPRESSED_MODES: dict[str, str] = {fmt: f"overlap-{fmt}" for fmt in COMPRESSIONS}
"""``--compress`` format -> the mode that runs ``overlap.shard`` with :data:`COMPRESSIONS` [format]."""
COMPRESSED_LOSS_RTOL = 0.01
"""``--compress``: each compressed run's final global loss within 1% of the exact run's (the goal
of issue 30; tests/shard/test_compression.py measures 0.07% after 100 TinyLM steps for int8,
benchmarks/bench_fp8_gather.py +0.7% for the last 10 of 100 steps' mean with fp8 gathers)."""

MODE_NAMES: dict[str, str] = {
    "overlap": "overlap.shard",
    "overlap-hsdp": "overlap.shard, HSDP",
    "overlap-int8": "overlap.shard, int8 gather + int8 reduce",
    "overlap-fp8-gather": "overlap.shard, fp8 gather + int8 reduce",
    "overlap-fp8-reduce": "overlap.shard, int8 gather + fp8 reduce",
    "overlap-fp8-both": "overlap.shard, fp8 gather + fp8 reduce",
    "no-overlap": "no overlap (overlap.no_overlap)",
    "fsdp2": "torch FSDP2 (fully_shard)",
    "fsdp2-hsdp": "torch FSDP2, HSDP",
    "tp": "overlap.tensor_parallel",
    "tp-chunks1": "overlap.tensor_parallel, chunks=1",
    "tp-torch": "torch TP (parallelize_module)",
}
HSDP_SUFFIX = "-hsdp"
"""A mode name ending in it shards over the ``--mesh`` (replicate, shard) mesh instead of every rank."""
INTER_NODE_SLOWDOWN = 8.0
"""With ``--mesh``: the intra-node link is this many times faster than the (calibrated) inter-node one."""
COMPARABLE: tuple[str, ...] = ("no-overlap", "fsdp2")
"""Modes ``--compare`` may name; ``overlap`` always runs."""
TP_MODES: tuple[str, ...] = ("tp", "tp-chunks1", "tp-torch")
"""``--parallel tp``: the decomposed collective matmuls (chunks chosen), the same undecomposed
(torch's order: one collective, one matmul) and torch's ``parallelize_module``, one plan."""
PROFILED: tuple[str, ...] = ("overlap", "no-overlap", "tp", "tp-chunks1")
"""Modes whose collectives ``overlap.profile()`` sees (FSDP2's are torch's own)."""
CALIBRATION_STEPS = 3
"""Timed steps of the calibration probe (their median is the compute the link is sized to), after
as many untimed ones as its mode runs before its own timed steps."""
SETTLE_STEPS = 1
"""Untimed steps behind the same link before each timed one (``paired_steps``' ``settle``): gathers
issued at the end of backward (gather-ahead) land in the next step, so a timed linked step must
follow a linked one, and a timed step without the link must not wait out a linked step's gathers."""

MEMORY_STEPS = 2
"""Untimed steps behind the link, after the timed ones, over which each sharded mode's peak
unsharded bytes are counted (the count is exact per step and the schedule program order, so the
same every step after the first; two cover a step boundary with gathers issued ahead)."""

_SEED = 1234


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """What the demo runs. ``link_gbps=None``: calibrated so comm ~ compute; ``compare``: modes of
    :data:`COMPARABLE` run beside ``overlap``; ``profile_steps``: profiled steps per profiled mode
    (0: no profile); ``device``: "cpu" or "cuda"; ``prefetch``: ``overlap.shard``'s (no-overlap runs
    at the depth it used)."""

    world_size: int = 2
    steps: int = 5
    model: str = "small"
    compare: tuple[str, ...] = COMPARABLE
    link_gbps: Optional[float] = None
    latency_us: float = 20.0
    profile_steps: int = 2
    warmup: int = 1
    device: str = "cpu"
    progress: bool = True
    mesh: Optional[tuple[int, int]] = None
    parallel: str = "fsdp"
    compress: tuple[str, ...] = ()
    """Formats of :data:`COMPRESSIONS` (``"int8"``, ``"fp8-gather"``, ``"fp8-reduce"``, ``"fp8-both"``):
    for each, also run ``overlap.shard`` with ``compress=overlap.Compression(**COMPRESSIONS[format])``
    right after the exact run (in that order), and check its final loss."""
    prefetch: Union[int, str] = "auto"
    split_first_block: bool = False
    """Shard the first block's MLP as groups of its own (``TransformerLM.shard_units``), every mode alike."""

    def __post_init__(self) -> None:
        if not isinstance(self.compress, tuple) or any(f not in COMPRESSED_MODES for f in self.compress):
            renamed = [RENAMED_COMPRESSIONS[f] for f in self.compress if f in RENAMED_COMPRESSIONS] \
                if isinstance(self.compress, tuple) else []
            raise ValueError(f"compress must be a tuple of formats from {tuple(COMPRESSED_MODES)}; "
                             f"got {self.compress!r}" + (f" ({renamed[0]})" if renamed else ""))
        if self.compress and (self.parallel == "tp" or self.mesh is not None):
            raise ValueError("compress runs a fully sharded FSDP mode: not with parallel='tp' or a mesh")
        if self.split_first_block and self.parallel == "tp":
            raise ValueError("split_first_block shards the FSDP modes' groups: not with parallel='tp'")
        if self.parallel not in ("fsdp", "tp"):
            raise ValueError(f"parallel must be 'fsdp' or 'tp'; got {self.parallel!r}")
        if self.parallel == "tp" and (self.mesh is not None or tuple(self.compare) != COMPARABLE):
            raise ValueError("parallel='tp' runs its own modes over every rank: leave mesh and compare at their "
                             "defaults (they choose FSDP modes)")
        if self.mesh is not None:
            nodes, per_node = self.mesh
            if nodes < 1 or per_node < 1 or nodes * per_node != self.world_size:
                raise ValueError(f"mesh {nodes}x{per_node} must have world_size={self.world_size} ranks "
                                 "(nodes x ranks per node, each >= 1)")
        if self.model not in MODEL_SIZES:
            raise ValueError(f"model must be one of {', '.join(MODEL_SIZES)}; got {self.model!r}")
        unknown = [m for m in self.compare if m not in COMPARABLE]
        if unknown:
            raise ValueError(f"compare: unknown mode(s) {unknown}; choose from {', '.join(COMPARABLE)}")
        if self.prefetch != "auto" and (isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int)
                                        or self.prefetch < 0):
            raise ValueError(f"prefetch must be 'auto' or an int >= 0; got {self.prefetch!r}")
        if self.steps < 1 or self.warmup < 0 or self.profile_steps < 0:
            raise ValueError("steps must be >= 1, warmup and profile_steps >= 0")

    @property
    def main_mode(self) -> str:
        """The mode the others are compared with: ``overlap`` (FSDP) or ``tp``."""
        return "tp" if self.parallel == "tp" else "overlap"

    @property
    def modes(self) -> tuple[str, ...]:
        """``overlap`` first, then the compared modes in :data:`COMPARABLE` order; with a ``mesh``,
        ``overlap`` and ``fsdp2`` each also run as HSDP, right after their fully sharded run. With
        ``parallel='tp'``: :data:`TP_MODES`."""
        if self.parallel == "tp":
            return TP_MODES
        modes = ("overlap", *(mode for f, mode in COMPRESSED_MODES.items() if f in self.compress),
                 *(m for m in COMPARABLE if m in self.compare))
        if self.mesh is None:
            return modes
        return tuple(x for m in modes for x in ((m, m + HSDP_SUFFIX) if m in ("overlap", "fsdp2") else (m,)))


@dataclasses.dataclass(frozen=True)
class ModeResult:
    """One mode: paired-step times (slowest rank), global loss per step, and the merged profile of
    its profiled steps (``overlap.profiler.ProfileResult``; None if not profiled)."""

    times: PairedTimes
    losses: tuple[float, ...]
    profile: Any = None
    depth: Optional[int] = None
    """``overlap.shard``'s prefetch depth (the one chosen with ``prefetch="auto"``); None for others."""
    gather_ahead: Optional[tuple[int, int]] = None
    """``overlap.shard``'s gather-ahead plan ``(count, lag)`` (``prefetch="auto"`` with the optimizer in
    backward); None where it does not apply."""
    unsharded_peak: Optional[int] = None
    """The most bytes of unsharded parameters held at once on any rank ([Note: counting unsharded
    bytes] in ``overlap/demo/unsharded_peak.py``); None for modes that do not shard (TP)."""
    largest_group: Optional[int] = None
    """The largest sharded group's unsharded bytes (what one unit of prefetch depth holds at most)."""
    modelled_peak: Optional[int] = None
    """What the gather-ahead chooser's memory model says ``overlap.shard`` holds at once
    (``overlap.demo.unsharded_peak.modelled_peak``; the most over ranks); None for other modes."""
    modelled_step: Optional[float] = None
    """Seconds per step the chooser's model gave ``overlap.shard``'s schedule (rank 0's, from its
    recorded steps' costs: ``modelled_step`` of the sharded model); None for other modes."""
    schedule: Any = None
    """``overlap.shard``'s ``schedule_decision`` with ``prefetch="auto"`` (a
    ``scheduler.schedule_trial.ScheduleDecision``: what runs and why, the model's choice kept by the
    trial or the simple plan); None for other modes or a fixed depth."""
    deferred_steps: Optional[list[str]] = None
    """``overlap.shard``'s groups whose optimizer step runs in the end-of-step chain (``deferred_steps``
    of the sharded model: [Note: deferred optimizer steps] in ``overlap/sharding.py``); None where it
    does not apply."""
    step_floor: Any = None
    """``overlap.shard``'s ``step_floor`` (a ``scheduler.step_floor.StepFloor``: the least step any exact
    schedule of its groups reaches, from rank 0's recorded costs); None where it does not apply."""


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """What rank 0 returns: the link used, per-mode results, and the loss checks.

    ``bitwise``: overlap and no-overlap losses identical on every rank (None if no-overlap did not
    run); with ``--parallel tp``: ``overlap.tensor_parallel`` with ``chunks=1`` and torch TP identical
    (they compute in the same order; with more than two ranks gloo's sums may associate differently,
    so this is reported, not required). ``fsdp2_dev``: max relative deviation of FSDP2's global losses
    from overlap's (None if FSDP2 did not run); with ``--parallel tp``: of every TP mode's from torch
    TP's. ``hsdp_dev``: the same for the HSDP modes (None without a mesh)."""

    config: DemoConfig
    world_size: int
    backend: str
    link_gbps: float
    calibrated: bool
    parameters: int
    tokens_per_step: int
    modes: dict[str, ModeResult]
    bitwise: Optional[bool]
    fsdp2_dev: Optional[float]
    hsdp_dev: Optional[float] = None
    compressed_dev: dict[str, float] = dataclasses.field(default_factory=dict)
    """``--compress``: per compressed mode, the relative deviation of its final global loss from the
    exact run's."""

    @property
    def losses_agree(self) -> bool:
        """Overlap vs no-overlap bitwise, and FSDP2 and the HSDP modes within :data:`FSDP2_LOSS_RTOL`
        (those that ran)."""
        bitwise_required = self.config.parallel == "fsdp"
        return (self.bitwise is not False or not bitwise_required) and all(
            dev is None or dev <= FSDP2_LOSS_RTOL for dev in (self.fsdp2_dev, self.hsdp_dev)) and (
            all(dev <= COMPRESSED_LOSS_RTOL for dev in self.compressed_dev.values()))


class _Progress:
    """One stderr line, redrawn per step on a terminal; elsewhere, one line per finished phase."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.phase = ""
        self.tty = enabled and sys.stderr.isatty()

    def start(self, phase: str) -> None:
        """Begin ``phase`` (off a terminal, the previous phase's line is written now)."""
        if self.enabled and self.phase and not self.tty:
            sys.stderr.write(f"  {self.phase}: done ({self.done}/{self.total} steps)\n")
        self.phase = phase
        self._draw()

    def advance(self) -> None:
        self.done += 1
        self._draw()

    def _draw(self) -> None:
        if self.tty:
            filled = round(24 * self.done / max(1, self.total))
            sys.stderr.write(f"\r\x1b[K[{'#' * filled}{'.' * (24 - filled)}] {self.done}/{self.total} steps  "
                             f"{self.phase}")
            sys.stderr.flush()

    def finish(self) -> None:
        """End the last phase; on a terminal the bar stays, marked done."""
        self.start("done")
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _global_losses(losses: list[torch.Tensor]) -> tuple[float, ...]:
    """Mean over ranks of each step's local loss (every rank trains on equal-size batches)."""
    t = torch.stack(losses).to(torch.float64)
    dist.all_reduce(t)
    return tuple((t / dist.get_world_size()).tolist())


def _over_ranks(value: int, op: dist.ReduceOp.RedOpType, device: torch.device) -> int:
    """``op`` (MIN, MAX) of an integer over the ranks."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op)
    return int(t.item())


def _max_over_ranks(value: int, device: torch.device) -> int:
    return _over_ranks(value, dist.ReduceOp.MAX, device)


def _all_true(flag: bool, device: torch.device) -> bool:
    return bool(_over_ranks(1 if flag else 0, dist.ReduceOp.MIN, device))


def rank_main(rank: int, world_size: int, cfg: DemoConfig) -> Optional[DemoResult]:
    """The demo on one rank of an initialized default process group; rank 0 returns the figures
    (other ranks None). Every rank must call it with the same ``cfg``."""
    from overlap.demo.unsharded_peak import UnshardedPeak, modelled_peak
    from overlap.testing import EmulatedLink, paired_steps

    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    size = MODEL_SIZES[cfg.model]
    calibrate = cfg.link_gbps is None
    schedule = schedule_steps()

    def settle(mode: str) -> int:
        """Untimed steps of ``mode`` behind the link before anything of it is timed: until
        ``prefetch="auto"`` has recorded its costs and run its trial (tensor parallelism: one)."""
        return 1 if mode in TP_MODES else schedule

    per_mode = max(0, cfg.warmup - 1) + 2 * cfg.steps * (1 + SETTLE_STEPS)
    total = (settle(cfg.main_mode) + CALIBRATION_STEPS + 1 if calibrate else 0)
    total += sum(per_mode + settle(m) for m in cfg.modes)
    total += (PROFILE_WARMUP_STEPS + cfg.profile_steps) * sum(m in PROFILED for m in cfg.modes)
    total += MEMORY_STEPS * sum(m not in TP_MODES for m in cfg.modes)
    progress = _Progress(total, enabled=cfg.progress and rank == 0)
    parameters = 0

    depth: Optional[int] = None  # overlap.shard's depth, once chosen: no-overlap runs at it (the same bytes)

    def build(mode: str) -> TrainStep:
        nonlocal parameters
        torch.manual_seed(_SEED)  # the same initial weights in every mode
        model = TransformerLM(size, split_qkv=cfg.parallel == "tp").to(device)
        parameters = sum(p.numel() for p in model.parameters())  # before sharding: the full count
        if mode in TP_MODES:
            return _tensor_parallel_step(mode, model, device, progress.advance)
        mesh = None
        if mode.endswith(HSDP_SUFFIX):
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, cfg.mesh, mesh_dim_names=("replicate", "shard"))
            mode = mode.removesuffix(HSDP_SUFFIX)
        compress = None
        if mode in COMPRESSED_MODES.values():
            import overlap

            fmt = next(f for f, m in COMPRESSED_MODES.items() if m == mode)
            mode, compress = "overlap", overlap.Compression(**COMPRESSIONS[fmt])
        prefetch = cfg.prefetch if mode == "overlap" or depth is None else depth
        context = shard_for_mode(mode, model, model.shard_units(cfg.split_first_block), mesh=mesh, prefetch=prefetch,
                                 compress=compress)
        # overlap.shard steps each group in backward as its gradients land (the plain step's numerics).
        optimizer = make_optimizer(model, 1e-3, in_backward=mode == "overlap")
        step = TrainStep(lambda i: model.loss(token_batch(size, i, rank).to(device)), optimizer, context,
                         device, progress.advance)
        step.model = model  # type: ignore[attr-defined]
        return step

    def link() -> EmulatedLink:
        """The link at ``gbps``; with a mesh, that is the inter-node tier (see [Note: two-tier links])."""
        if cfg.mesh is None:  # torch TP's collectives are functional ones (DTensor): modelled too
            return EmulatedLink(gbps, cfg.latency_us, functional=cfg.parallel == "tp")
        return EmulatedLink(gbps * INTER_NODE_SLOWDOWN, cfg.latency_us, gpus_per_node=cfg.mesh[1],
                            inter_node=(gbps, cfg.latency_us))

    gbps = cfg.link_gbps
    if gbps is None:
        progress.start(f"calibrating the link on {MODE_NAMES[cfg.main_mode]}'s compute side")
        probe = build(cfg.main_mode)
        gbps = calibrate_link(probe, cfg.latency_us, steps=CALIBRATION_STEPS, warmup=settle(cfg.main_mode))
        del probe
    modes: dict[str, ModeResult] = {}
    local: dict[str, list[torch.Tensor]] = {}
    for mode in cfg.modes:
        progress.start(MODE_NAMES[mode])
        step = build(mode)
        with link():  # behind the link: prefetch="auto" records its costs and runs its trial in these
            for _ in range(settle(mode)):
                step()
        times = paired_steps(step, cfg.steps, gbps, cfg.latency_us, warmup=max(0, cfg.warmup - 1), link=link(),
                             settle=SETTLE_STEPS)
        mode_depth = getattr(step.model, "prefetch_depth", None) if mode not in TP_MODES else None
        if mode == "overlap":
            depth = mode_depth
        local[mode] = list(step.losses)
        peak = largest = modelled = None
        if mode not in TP_MODES:
            progress.start(f"counting {MODE_NAMES[mode]}'s unsharded bytes")
            with link(), UnshardedPeak(step.model) as counter:  # type: ignore[attr-defined]
                for _ in range(MEMORY_STEPS):
                    step()
            peak, largest = _max_over_ranks(counter.peak, device), counter.largest_group
            modelled = modelled_peak(step.model)  # type: ignore[attr-defined]
            modelled = None if modelled is None else _max_over_ranks(modelled, device)
        merged = None
        if cfg.profile_steps and mode in PROFILED:
            progress.start(f"profiling {MODE_NAMES[mode]}")
            dist.barrier()
            with link():  # one more step first, recorded but not reported: [Note: warm-up steps of a profile]
                prof = profiled_steps(step, cfg.profile_steps)
            merged = prof.gather(dst=0)
        ahead = getattr(step.model, "gather_ahead", None) if mode not in TP_MODES else None
        modelled_step = getattr(step.model, "modelled_step", None) if mode not in TP_MODES else None
        decision = getattr(step.model, "schedule_decision", None) if mode not in TP_MODES else None
        deferred = getattr(step.model, "deferred_steps", None) if mode not in TP_MODES else None
        floor = getattr(step.model, "step_floor", None) if mode not in TP_MODES else None
        modes[mode] = ModeResult(times, _global_losses(local[mode]), merged, mode_depth, ahead, peak, largest,
                                 modelled, modelled_step, decision, deferred, floor)
        del step
    progress.finish()
    bitwise = None
    pair = ("tp-chunks1", "tp-torch") if cfg.parallel == "tp" else ("overlap", "no-overlap")
    if all(m in local for m in pair):
        bitwise = _all_true(torch.equal(torch.stack(local[pair[0]]), torch.stack(local[pair[1]])), device)
    fsdp2_dev = None
    if "fsdp2" in modes:
        ours, theirs = modes["overlap"].losses, modes["fsdp2"].losses
        fsdp2_dev = _max_rel_dev(ours, theirs)
    if cfg.parallel == "tp":
        fsdp2_dev = max(_max_rel_dev(modes[m].losses, modes["tp-torch"].losses) for m in ("tp", "tp-chunks1"))
    hsdp = [m for m in modes if m.endswith(HSDP_SUFFIX)]
    hsdp_dev = max((_max_rel_dev(modes["overlap"].losses, modes[m].losses) for m in hsdp), default=None)
    exact = modes["overlap"].losses[-1] if "overlap" in modes else None
    compressed_dev = {m: abs(modes[m].losses[-1] - exact) / abs(exact)
                      for m in COMPRESSED_MODES.values() if m in modes}
    if rank != 0:
        return None
    batches = 1 if cfg.parallel == "tp" else world_size  # tensor-parallel ranks share one batch
    return DemoResult(cfg, world_size, dist.get_backend(), gbps, calibrate, parameters,
                      batches * size.tokens_per_rank, modes, bitwise, fsdp2_dev, hsdp_dev, compressed_dev)


def _tensor_parallel_step(mode: str, model: TransformerLM, device: torch.device, on_step: Any) -> TrainStep:
    """``model`` parallelized over every rank by its Megatron plan (:data:`TP_MODES`), AdamW, every
    rank on the same batch (rank 0's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import overlap

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if mode == "tp-torch":
        parallelize_module(model, mesh, model.tensor_parallel_plan())
    else:
        overlap.tensor_parallel(model, mesh, model.tensor_parallel_plan(), chunks=1 if mode == "tp-chunks1" else None)
    size = model.size
    return TrainStep(lambda i: model.loss(token_batch(size, i, 0).to(device)), make_optimizer(model, 1e-3),
                     device=device, on_step=on_step)


def _max_rel_dev(ours: tuple[float, ...], theirs: tuple[float, ...]) -> float:
    return max(abs(a - b) / abs(a) if a else abs(b) for a, b in zip(ours, theirs))


def run_demo(cfg: DemoConfig, timeout: float = 3600.0) -> DemoResult:
    """Spawn ``cfg.world_size`` ranks (gloo on CPU; NCCL, one GPU per rank, for ``device="cuda"``),
    run :func:`rank_main` on each, return rank 0's result."""
    from overlap.testing import run_distributed

    backend = "nccl" if cfg.device == "cuda" else "gloo"
    result = run_distributed(rank_main, cfg.world_size, cfg, backend=backend, timeout=timeout)[0]
    assert result is not None
    return result


# ------------------------------------------------------------------------------------------ report
def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _profiled(profile: Any) -> tuple[str, str, str]:
    """(exposed ms per step, hidden share, link idle ms per step) over every rank's profiled steps,
    or dashes."""
    if profile is None:
        return "-", "-", "-"
    steps = profile.summary().steps
    if not steps:
        return "-", "-", "-"
    comm = sum(s.comm_ms for s in steps)
    exposed = sum(s.exposed_ms for s in steps)
    hidden = f"{100 * max(0.0, comm - exposed) / comm:.0f}%" if comm > 0 else "-"
    return f"{exposed / len(steps):.1f}", hidden, f"{sum(s.link_idle_ms for s in steps) / len(steps):.1f}"


def _idle_lines(result: DemoResult) -> list[str]:
    """Per profiled step and rank of the main mode: the link idle while compute ran, and why
    ([Note: link idle while compute ran] in ``overlap/profiler/records.py``)."""
    profile = result.modes[result.config.main_mode].profile
    steps = profile.summary().steps if profile is not None else []
    if not steps:
        return []
    lines = [f"link idle while compute ran ({MODE_NAMES[result.config.main_mode]}, profiled steps):"]
    for s in steps:
        causes = ", ".join(f"{cause} {ms:.1f} ms" for cause, ms in s.link_idle_causes) or "none"
        lines.append(f"  step {s.step} rank {s.rank}: {s.link_idle_ms:.1f} ms of {s.wall_ms:.1f} "
                     f"({100 * s.link_idle_share:.0f}%): {causes}")
        if s.link_idle_largest:
            lines.append(f"    longest: {s.describe_largest_idle()}")
    return lines + [""]


EXPOSED_SHOWN = 6
"""How many (collective, module) pairs the exposed-waits line lists, the most exposed first."""


def module_of(record: Any) -> str:
    """The module a collective (an ``overlap.profiler`` ``CollectiveRecord``) served: its ``module``
    (the runtime's collectives name it), else the one named in the region of its first wait
    (``overlap::pre_forward (blocks.0)``: a gather is waited where its module runs, whoever
    prefetched it), else in the region it was issued in, else ``"root"`` (the root's regions carry
    no name)."""
    if record.module:
        return record.module
    for label in (record.wait_label, record.label):
        if label.endswith(")") and " (" in label:
            return label[label.rindex(" (") + 2:-1]
    return "root"


def _exposed_lines(result: DemoResult) -> list[str]:
    """The main mode's exposed communication per step by collective kind and module, mean over its
    profiled steps and ranks, the most exposed first: where the exposed time of the table comes from
    (a gather issued at the end of the last profiled step and waited after it counts as not exposed)."""
    profile = result.modes[result.config.main_mode].profile
    ranks = profile.ranks if profile is not None else []
    steps = sum(len(r.steps) for r in ranks)
    if not steps:
        return []
    exposed: dict[tuple[str, str], float] = {}
    for rank in ranks:
        for c in rank.reported_collectives:
            key = (c.kind, module_of(c))
            exposed[key] = exposed.get(key, 0.0) + c.exposed
    shown = sorted(exposed.items(), key=lambda kv: -kv[1])[:EXPOSED_SHOWN]
    parts = [f"{kind} {module} {1e3 * seconds / steps:.1f}" for (kind, module), seconds in shown
             if 1e3 * seconds / steps >= 0.05]
    return [f"exposed waits per step by collective and module ({MODE_NAMES[result.config.main_mode]}, profiled "
            f"steps, mean over ranks, ms): {', '.join(parts) or 'none'}", ""]


HEADER: tuple[str, ...] = ("mode", "step ms", "tokens/s", "compute ms", "comm ms", "exposed comm ms",
                           "comm hidden", "profiled exposed ms", "profiled hidden", "profiled link idle ms",
                           "peak unsharded MB")
"""The columns of the table :func:`format_report` prints."""


def format_report(result: DemoResult) -> str:
    """The side-by-side table, its legend and the loss check, as text."""
    cfg = result.config
    rows = []
    for mode, m in result.modes.items():
        t = m.times
        rows.append((MODE_NAMES[mode], _ms(t.linked), f"{result.tokens_per_step / t.linked:,.0f}", _ms(t.unlinked),
                     _ms(t.comm), _ms(t.exposed), f"{100 * t.hidden_share:.0f}%", *_profiled(m.profile),
                     _mb(m.unsharded_peak)))
    ours = result.modes[cfg.main_mode].times
    ideal = max(ours.unlinked, ours.comm)
    rows.append(("ideal max(compute, comm)", _ms(ideal), f"{result.tokens_per_step / ideal:,.0f}", _ms(ours.unlinked),
                 _ms(ours.comm), _ms(max(0.0, ours.comm - ours.unlinked)), "100%", "", "", "", ""))
    how = (f"calibrated so one step's comm ~ {MODE_NAMES[cfg.main_mode]}'s compute" if result.calibrated
           else "from --link-gbps")
    size = MODEL_SIZES[cfg.model]
    link = f"emulated link: {result.link_gbps:.3g} Gbit/s ({how})"
    if cfg.mesh is not None:
        link = (f"emulated nodes: {cfg.mesh[0]} x {cfg.mesh[1]} ranks; HSDP mesh (replicate, shard) = {cfg.mesh}; "
                f"link across nodes {result.link_gbps:.3g} Gbit/s ({how}), within a node "
                f"{INTER_NODE_SLOWDOWN:g}x faster")
    if cfg.parallel == "tp":
        layout = (f"each block's q, k, v, up column-parallel and out, down row-parallel over the {result.world_size} "
                  f"ranks (Megatron's plan); {result.tokens_per_step:,} tokens per step, the same batch on every rank")
    else:
        split = "blocks.0's MLP, " if cfg.split_first_block else ""
        layout = (f"embedding, {split}each block and head sharded, then the root; {result.tokens_per_step:,} tokens per step "
                  f"over {result.world_size} ranks")
    lines = [
        f"model {cfg.model}: {result.parameters / 1e6:.3g} M parameters, {size.layers} blocks ({layout})",
        f"{link}, {cfg.latency_us:g} µs per collective; medians of {cfg.steps} steps, slowest rank",
        *_depth_lines(result),
        "",
        _table(HEADER, rows),
        "",
        "step: with the link's delay; compute: the same step without it (math, packing, host work); comm: the",
        "link's busy time per step; exposed: step - compute; comm hidden: share of the hideable comm (at most",
        "compute) that was hidden. These count waiting for gloo's own transfer as compute, which flatters no",
        "overlap. profiled: overlap.profile() over the profiled steps, per step (exposed: time a rank stalled",
        "in a wait while its collective ran, whatever it waited for; link idle: nothing of the rank on the link",
        "while it computed); torch's own collectives (FSDP2, torch TP) are not profiled. peak unsharded: the most",
        "bytes of unsharded parameters a rank held at once (from each gather's issue to its reshard; counted",
        f"the same way for FSDP2, over {MEMORY_STEPS} untimed steps; 1 MB = 2^20 bytes; gradients, activations and",
        "optimizer state not included).",
        *_memory_lines(result),
        "",
        *_idle_lines(result),
        *_exposed_lines(result),
        _loss_line(result),
    ]
    return "\n".join(lines)


def _mb(nbytes: Optional[int]) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.3g}"


def _memory_lines(result: DemoResult) -> list[str]:
    """overlap.shard's peak unsharded bytes against FSDP2's, in units of its largest group (issue 29's
    goal: at most FSDP2's plus one group per unit of prefetch depth)."""
    ours, fsdp2 = result.modes.get("overlap"), result.modes.get("fsdp2")
    lines = []
    if ours is not None and ours.modelled_peak is not None and ours.unsharded_peak is not None:
        verdict = "as counted" if ours.modelled_peak == ours.unsharded_peak else "NOT as counted"
        lines.append(f"peak unsharded modelled by the gather-ahead chooser (held_bytes at depth {ours.depth}): "
                     f"{_mb(ours.modelled_peak)} MB, {verdict}")
    if ours is None or fsdp2 is None or ours.unsharded_peak is None or fsdp2.unsharded_peak is None:
        return lines
    extra = ours.unsharded_peak - fsdp2.unsharded_peak
    groups = f" = {extra / ours.largest_group:.2f} x its largest group" if ours.largest_group else ""
    depth = (f" (prefetch depth {ours.depth}: issue 29's bound is {ours.depth} x)" if ours.depth is not None
             and ours.largest_group else "")
    return [f"peak unsharded: {MODE_NAMES['overlap']} {_mb(ours.unsharded_peak)} MB vs {MODE_NAMES['fsdp2']} "
            f"{_mb(fsdp2.unsharded_peak)} MB: {'+' if extra >= 0 else '-'}{_mb(abs(extra))} MB{groups}{depth}",
            *lines]


def _depth_lines(result: DemoResult) -> list[str]:
    ours = result.modes.get("overlap")
    if ours is None or ours.depth is None:
        return []
    how = ("chosen from the first steps' measured costs, then verified by a trial" if result.config.prefetch == "auto"
           else "--prefetch")
    lines = [f"overlap.shard prefetch depth {ours.depth} ({how}): up to {1 + ours.depth} groups unsharded at once, "
             f"the last {1 + ours.depth} of forward kept for backward"]
    if ours.gather_ahead is not None:
        count, lag = ours.gather_ahead
        lines.append(f"overlap.shard gather-ahead: the next forward's first {1 + ours.depth} gathers issued at the end "
                     f"of backward; {count} more issued in backward after their group's step"
                     + (f" (each after the reduce-scatter {lag} later)" if count else " (the model saw no gain)"))
    if ours.schedule is not None:
        lines.append(f"overlap.shard schedule: {ours.schedule}")
    if ours.deferred_steps is not None:
        lines.append("overlap.shard deferred optimizer steps: "
                     + (f"{', '.join(ours.deferred_steps)} stepped in the end-of-step chain, not right after their "
                        "reduce-scatter" if ours.deferred_steps else "none (no slack in the modelled end-of-step chain)"))
    if ours.modelled_step is not None:
        lines.append(f"overlap.shard modelled step {ours.modelled_step * 1e3:.1f} ms (the chooser's model, from the "
                     f"recorded steps' costs, rank 0) vs measured {ours.times.linked * 1e3:.1f} ms")
    if ours.step_floor is not None:
        lines.append(_floor_line(ours.step_floor))
    return lines


def _floor_line(floor: Any) -> str:
    """What bounds ``overlap.shard``'s step from below ([Note: the end-of-step chain's floor])."""
    ms = 1e3
    chain = (f"the end-of-step chain of the first {floor.chain} groups: {floor.chain_link * ms:.1f} ms of link beside "
             f"{floor.chain_host * ms:.1f} ms of host work, {floor.exposed * ms:.1f} ms exposed" if floor.chain
             else "no chain exposed")
    return (f"overlap.shard floor: no exact schedule of these groups on this link goes below "
            f"{floor.seconds * ms:.1f} ms per step = {floor.ratio():.2f}x max(compute {floor.compute * ms:.1f}, "
            f"comm {floor.link * ms:.1f}) (recorded costs, rank 0; {chain})")


def _loss_line(result: DemoResult) -> str:
    losses = result.modes[result.config.main_mode].losses
    lines = [f"losses over {len(losses)} steps (global mean {losses[0]:.4f} -> {losses[-1]:.4f}):"]
    if result.config.parallel == "tp":
        if result.bitwise is not None:
            lines.append("  chunks=1 vs torch TP: " + ("bitwise identical" if result.bitwise else
                                                       "not bitwise identical (allowed beyond 2 ranks)"))
        verdict = "agree" if result.fsdp2_dev is not None and result.fsdp2_dev <= FSDP2_LOSS_RTOL else "DISAGREE"
        lines.append(f"  overlap.tensor_parallel vs torch TP: {verdict}, max relative deviation "
                     f"{result.fsdp2_dev:.2g} (tolerance {FSDP2_LOSS_RTOL:g})")
        return "\n".join(lines)
    if result.bitwise is not None:
        lines.append("  overlap.shard vs no overlap: "
                     + ("bitwise identical" if result.bitwise else "DIFFER (they must be bitwise identical)"))
    if result.fsdp2_dev is not None:
        verdict = "agree" if result.fsdp2_dev <= FSDP2_LOSS_RTOL else "DISAGREE"
        lines.append(f"  overlap.shard vs torch FSDP2: {verdict}, max relative deviation {result.fsdp2_dev:.2g} "
                     f"(tolerance {FSDP2_LOSS_RTOL:g})")
    if result.hsdp_dev is not None:
        verdict = "agree" if result.hsdp_dev <= FSDP2_LOSS_RTOL else "DISAGREE"
        lines.append(f"  HSDP vs full sharding: {verdict}, max relative deviation {result.hsdp_dev:.2g} "
                     f"(tolerance {FSDP2_LOSS_RTOL:g})")
    for mode, dev in result.compressed_dev.items():
        verdict = "within" if dev <= COMPRESSED_LOSS_RTOL else "NOT within"
        lines.append(f"  {MODE_NAMES[mode].removeprefix('overlap.shard, ')} vs exact overlap.shard: final loss "
                     f"{result.modes[mode].losses[-1]:.4f} vs {losses[-1]:.4f}, relative deviation "
                     f"{dev:.2g}, {verdict} {COMPRESSED_LOSS_RTOL:g}")
    if len(lines) == 1:
        lines.append("  no other mode to compare with")
    return "\n".join(lines)


PLOT_HINT = "pip install 'triton-overlap[plot]'"


def write_outputs(result: DemoResult, out: str) -> list[str]:
    """Write each profiled mode's Chrome trace (``trace-<mode>.json``) and PNG timeline
    (``timeline-<mode>.png``, if matplotlib imports) into the folder ``out``; return lines saying what
    was written, or how to get the PNG."""
    from overlap.profiler import ProfileResult

    lines: list[str] = []
    profiled = {mode: m.profile for mode, m in result.modes.items() if isinstance(m.profile, ProfileResult)}
    if not profiled:
        return ["no profile recorded (--profile-steps 0): no trace or timeline written"]
    try:
        import matplotlib  # noqa: F401
        plot = True
    except ImportError:
        plot = False
    for mode, prof in profiled.items():
        trace = prof.export_chrome_trace(os.path.join(out, f"trace-{mode}.json"))
        lines.append(f"{MODE_NAMES[mode]}: Chrome trace {trace} (open in https://ui.perfetto.dev)")
        if plot:
            lines.append(f"{MODE_NAMES[mode]}: timeline {prof.plot(os.path.join(out, f'timeline-{mode}.png'))}")
    if not plot:
        lines.append(f"no PNG timeline: matplotlib is not installed ({PLOT_HINT} writes it)")
    return lines

