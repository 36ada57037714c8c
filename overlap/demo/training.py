"""Side-by-side training of one model under several sharding runtimes (the demo and the benchmarks).

A *mode* names how a model's blocks and root are sharded and how a step runs:

====================  ===========================================================================
mode                  what it is
====================  ===========================================================================
``overlap``           ``overlap.shard`` on each block, then the root (this runtime)
``no-overlap``        the same, every step inside ``overlap.no_overlap(model)``: each collective
                      completes before anything else runs (the baseline overlap is measured from)
``fsdp2``             torch FSDP2 ``fully_shard`` on each block, then the root, default settings
``fsdp2-prefetch``    FSDP2 with explicit forward / backward prefetch of one block
====================  ===========================================================================

:class:`TrainStep` is one optimizer step as a callable (for ``overlap.testing.paired_steps``); it
records each step's loss. :func:`calibrate_link` sizes the emulated link so that one step's
communication takes about as long as its compute side (:func:`measure_traffic` counts what a step
sends, :func:`calibrated_gbps` does the arithmetic).

All ranks must call these functions alike (same modes, same order): they issue collectives.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["MODES", "TrainStep", "calibrate_link", "calibrated_gbps", "measure_traffic", "make_optimizer",
           "schedule_steps", "shard_for_mode"]

MODES: tuple[str, ...] = ("overlap", "no-overlap", "fsdp2", "fsdp2-prefetch")


def _shard_overlap(model: nn.Module, blocks: Sequence[nn.Module], bf16: bool, mesh: object,
                   prefetch: Union[int, str], compress: object = None) -> None:
    import overlap

    mp = overlap.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    for block in blocks:
        overlap.shard(block, mp=mp, mesh=mesh, prefetch=prefetch, compress=compress)
    overlap.shard(model, mp=mp, mesh=mesh, prefetch=prefetch, compress=compress)


def _shard_fsdp2(model: nn.Module, blocks: Sequence[nn.Module], bf16: bool, explicit_prefetch: bool,
                 mesh: object) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if explicit_prefetch:
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])  # type: ignore[operator]
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])  # type: ignore[operator]


def shard_for_mode(mode: str, model: nn.Module, blocks: Sequence[nn.Module], *,
                   bf16: bool = False, mesh: object = None,
                   prefetch: Union[int, str] = 1, compress: object = None) -> Callable[[], ContextManager[object]]:
    """Shard ``model`` in place for ``mode`` (one of :data:`MODES`): each of ``blocks``, then the root.

    ``model`` must already be on its device, with a default process group initialized. ``bf16``
    computes with bfloat16 parameters. ``mesh``: a DeviceMesh to shard over (2-D: hybrid sharding,
    dim 0 replicates, dim 1 shards); default every rank. ``prefetch``: ``overlap.shard``'s (the
    ``overlap`` modes only); ``compress``: ``overlap.shard``'s (an ``overlap.Compression``, the
    ``overlap`` modes only). Returns the factory of the context every forward + backward of
    this mode must run in (``overlap.no_overlap`` for ``no-overlap``, a no-op otherwise).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode.startswith("fsdp2"):
        _shard_fsdp2(model, blocks, bf16, explicit_prefetch=mode == "fsdp2-prefetch", mesh=mesh)
        return contextlib.nullcontext
    _shard_overlap(model, blocks, bf16, mesh, prefetch, compress)
    if mode == "no-overlap":
        import overlap

        return lambda: overlap.no_overlap(model)
    return contextlib.nullcontext


def make_optimizer(model: nn.Module, lr: float, in_backward: bool = False) -> torch.optim.Optimizer:
    """AdamW(``lr``) over ``model``'s parameters; ``in_backward``: one per ``overlap.shard`` group,
    each stepped in backward as soon as its gradients land (``overlap.optimizer_in_backward``: the
    plain step's numerics; ``model`` must be sharded with ``overlap``)."""
    if in_backward:
        import overlap

        return overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=lr)  # type: ignore[return-value]
    return torch.optim.AdamW(model.parameters(), lr=lr)


class TrainStep:
    """One training step as a callable: ``loss_fn(step_index)`` (forward) and backward inside
    ``context()``, then ``optimizer.step()`` and ``zero_grad()``.

    ``losses`` holds each step's loss (detached, this rank's), in order; ``on_step()`` (if given) is
    called after each step. On CUDA the step ends with a device synchronize, so host timers around a
    call measure the step's work.
    """

    def __init__(self, loss_fn: Callable[[int], torch.Tensor], optimizer: torch.optim.Optimizer,
                 context: Callable[[], ContextManager[object]] = contextlib.nullcontext,
                 device: torch.device | None = None, on_step: Callable[[], None] | None = None) -> None:
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.context = context
        self.device = device
        self.on_step = on_step
        self.losses: list[torch.Tensor] = []

    def __call__(self) -> None:
        with self.context():
            loss = self.loss_fn(len(self.losses))
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.losses.append(loss.detach())
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.on_step is not None:
            self.on_step()


def measure_traffic(step: Callable[[], object]) -> tuple[int, int]:
    """Run ``step`` once behind a link too fast to delay anything; return what it sent:
    ``(collectives, wire bytes received per rank)`` (``overlap.testing.emulated_link`` counts them)."""
    from overlap.testing import emulated_link

    with emulated_link(1e6, 0.0) as link:
        step()
    stats = link.stats()
    return stats.count, stats.wire_bytes


def calibrated_gbps(compute_s: float, collectives: int, wire_bytes: float, latency_us: float) -> float:
    """The link bandwidth (Gbit/s) at which ``collectives`` collectives moving ``wire_bytes`` take
    ``compute_s`` seconds, latency included (at least 1 ms is left for the bytes).

    Raises ``ValueError`` when there is nothing to carry (``wire_bytes <= 0``).
    """
    if wire_bytes <= 0:
        raise ValueError(f"nothing to calibrate the link on: a step moved {wire_bytes} bytes")
    transfer = max(compute_s - collectives * latency_us * 1e-6, 1e-3)
    return wire_bytes * 8 / transfer / 1e9


def calibrate_link(step: Callable[[], object], latency_us: float, steps: int = 3, warmup: int = 2) -> float:
    """The link bandwidth (Gbit/s) at which one ``step``'s communication takes about as long as its
    compute side: the median of ``steps`` runs without link delay (after ``warmup`` untimed ones),
    then one more run counts what it sends (:func:`measure_traffic`), then :func:`calibrated_gbps`.

    ``warmup`` must cover the steps that are slower than the ones the link is calibrated for: a
    step with ``prefetch="auto"`` records its costs and runs its trial in its first
    ``schedule_steps()`` steps (1.2-1.8x a settled step on the 2-core box, torch 2.13 and 2.14),
    so the demo warms its probe up through all of them (a link calibrated on those steps made the
    demo's comm 1.5-2.1x its compute instead of about equal)."""
    from overlap.testing import interleaved_steps

    (compute,) = interleaved_steps(step, steps, [None], warmup=warmup)
    return calibrated_gbps(compute, *measure_traffic(step), latency_us)


def schedule_steps() -> int:
    """The most steps ``overlap.shard(prefetch="auto")`` takes to settle its schedule: the steps that
    record costs (``scheduler.cost_samples.COST_SAMPLES``), the longest trial of the choice
    (``scheduler.schedule_trial``: with gather-ahead, an untimed step before each timed one) and the
    step at whose start the verdict is applied. Benchmarks run this many untimed steps of every mode
    behind the link before timing (the same count in every mode, so losses compare step by step)."""
    from scheduler.cost_samples import COST_SAMPLES
    from scheduler.schedule_trial import TRIAL_ROUNDS, trial_steps

    return COST_SAMPLES + len(trial_steps(TRIAL_ROUNDS, settle=1)) + 1
