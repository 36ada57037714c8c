"""What the benchmarks share besides the table they print (``report.py``) and per-call timing
(``timing.py``): the command line, the sharded-MLP workload, and process-group helpers.

Import it before ``overlap``, ``overlap_kernels`` or ``scheduler``: it puts this checkout's root first on
``sys.path``, so ``python benchmarks/x.py`` measures the code beside it rather than whichever copy is
installed, and ``tests/`` last, for ``compiled_step`` (the compiled FSDP-style step the tests check,
which is not part of the installed package).

Command line: :func:`parser` (description and ``--help`` text from the benchmark's docstring), then
the flags several benchmarks share (:func:`add_world_size`, :func:`add_steps`, :func:`add_mlp`,
:func:`add_link`; :func:`mlp_parser` is all of them, for the sharded-MLP benchmarks), the
benchmark's own, then :func:`parse`, which adds ``--markdown``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any, Callable, TYPE_CHECKING, Iterator, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if TESTS not in sys.path:
    sys.path.append(TESTS)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

if TYPE_CHECKING:
    from overlap.demo.training import TrainStep
    from overlap.testing import PairedTimes


# ------------------------------------------------------------------------------------ command line
def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: ``doc``'s first line is the description, the rest (what is measured,
    how, the usual command) is printed after the options by ``--help``."""
    lines = doc.splitlines()
    return argparse.ArgumentParser(description=lines[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="\n".join(lines[2:]))


def add_world_size(p: argparse.ArgumentParser, default: int = 2, help: str = "gloo ranks") -> None:
    """``--world-size N``."""
    p.add_argument("--world-size", type=int, default=default, help=f"{help} (default {default})")


def add_steps(p: argparse.ArgumentParser, steps: int, steps_help: str, warmup: Optional[int] = None,
              warmup_help: str = "") -> None:
    """``--steps`` and, if ``warmup`` is given, ``--warmup``; what a step is differs per benchmark."""
    p.add_argument("--steps", type=int, default=steps, help=f"{steps_help} (default {steps})")
    if warmup is not None:
        p.add_argument("--warmup", type=int, default=warmup, help=f"{warmup_help} (default {warmup})")


def add_mlp(p: argparse.ArgumentParser, blocks: int = 8, dim: int = 256, batch: int = 256) -> None:
    """``--blocks``, ``--dim``, ``--batch``: the MLP's shape and the rows each rank trains on."""
    p.add_argument("--blocks", type=int, default=blocks, help=f"MLP blocks (default {blocks})")
    p.add_argument("--dim", type=int, default=dim, help=f"MLP width (default {dim})")
    p.add_argument("--batch", type=int, default=batch, help=f"rows per rank (default {batch})")


def add_link(p: argparse.ArgumentParser, gbps_default: Optional[str] = "comm ~ compute") -> None:
    """The emulated link: ``--link-gbps`` (unless ``gbps_default`` is None; its help names what the
    default ``None`` means) and ``--latency-us``."""
    if gbps_default is not None:
        p.add_argument("--link-gbps", type=float, default=None,
                       help=f"emulated link bandwidth in Gbit/s (default: {gbps_default})")
    p.add_argument("--latency-us", type=float, default=20.0, help="link latency per collective (default 20)")


def mlp_parser(doc: str, steps: int, steps_help: str, warmup: Optional[int] = None, warmup_help: str = "",
               gbps_default: Optional[str] = "comm ~ compute") -> argparse.ArgumentParser:
    """The command line of the benchmarks that train :func:`mlp_step` on gloo ranks behind the link
    (``bench_train``, ``bench_backward_tail``, ``bench_profiler``): ``--world-size``, ``--steps``
    [``--warmup``], ``--blocks``, ``--dim``, ``--batch``, ``[--link-gbps]``, ``--latency-us``."""
    p = parser(doc)
    add_world_size(p)
    add_steps(p, steps, steps_help, warmup, warmup_help)
    add_mlp(p)
    add_link(p, gbps_default)
    return p


def parse(p: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Add ``--markdown`` (last, as every benchmark has it) and parse ``argv``."""
    p.add_argument("--markdown", default=None, help="append the printed tables to this markdown file")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------- the workload
def mlp(blocks: int, dim: int) -> nn.Sequential:
    """``blocks`` blocks ``Linear(dim, 2 dim) -> GELU -> Linear(2 dim, dim)``; the same weights on
    every rank and for every call (seed 0)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                           for _ in range(blocks)])


def rank_input(rows: int, dim: int, rank: int) -> torch.Tensor:
    """This rank's ``(rows, dim)`` input (seeded by the rank: each rank trains on other data)."""
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(rank))


def mlp_step(mode: str, blocks: int, dim: int, x: torch.Tensor, optimizer_in_backward: bool = False,
             prefetch: int | str = 1) -> TrainStep:
    """A fresh :func:`mlp` sharded block by block, then the root, for ``mode``
    (``overlap.demo.training.MODES``; ``prefetch`` for ``overlap.shard``), and its training step: loss
    ``mean(model(x) ** 2)``, AdamW (stepped per group in backward with ``optimizer_in_backward``, an
    ``overlap`` mode only). The step's ``model`` attribute is the sharded model."""
    from overlap.demo.training import TrainStep, make_optimizer, shard_for_mode

    model = mlp(blocks, dim)
    context = shard_for_mode(mode, model, list(model), prefetch=prefetch)
    optimizer = make_optimizer(model, 1e-3, optimizer_in_backward)
    step = TrainStep(lambda _: model(x).square().mean(), optimizer, context)
    step.model = model  # type: ignore[attr-defined]
    return step


def interleaved_rounds(steps: dict[str, Callable[[], torch.Tensor]], warmup: int, timed: int
                       ) -> dict[str, dict[str, list]]:
    """Run every step of ``steps`` (label -> a training step returning its loss) in turn, round by
    round, ``warmup`` untimed rounds then ``timed`` timed ones: per label, its host seconds per timed
    round (``"step"``) and its losses of every round (``"losses"``)."""
    out: dict[str, dict[str, list]] = {label: {"step": [], "losses": []} for label in steps}
    for i in range(warmup + timed):
        for label, step in steps.items():
            start = time.perf_counter()
            loss = step()
            elapsed = time.perf_counter() - start
            out[label]["losses"].append(loss)
            if i >= warmup:
                out[label]["step"].append(elapsed)
    return out


def slowest_rank_medians(results: Sequence[dict], labels: Sequence[str], timed: int) -> dict[str, float]:
    """Per label, the median over the timed rounds of the slowest rank's step seconds
    (``results``: each rank's :func:`interleaved_rounds` entries by label)."""
    return {label: statistics.median(max(r[label]["step"][i] for r in results) for i in range(timed))
            for label in labels}


def same_losses(results: Sequence[dict], a: str, b: str) -> bool:
    """Whether labels ``a`` and ``b`` had bitwise equal losses on every rank."""
    return all(torch.equal(torch.stack(r[a]["losses"]), torch.stack(r[b]["losses"])) for r in results)


# ------------------------------------------------------------------------------------ paired steps
# Inductor's own comm passes, as torch 2.13 documents them: reordering for compute/comm overlap with
# the pass list its config recommends, and FX bucketing of all-gathers and reduce-scatters. (Its
# newer overlap scheduler, ``aten_distributed_optimizations.enable_overlap_scheduling``, estimates
# collectives from the GPU's memory bandwidth and fails to compile without a GPU driver.)
INDUCTOR_COMM_PASSES: dict[str, Any] = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["reorder_communication_preserving_peak_memory",
                                                "sink_waits_iterative",
                                                "reorder_communication_preserving_peak_memory"],
    "bucket_all_gathers_fx": "all",
    "bucket_reduce_scatters_fx": "all",
}
PAIRED_HEADER = ["step ms", "compute side ms (no link delay)", "comm ms on the link", "exposed comm ms"]
"""The columns of :func:`paired_cells`."""


def paired_cells(m: "PairedTimes") -> list[str]:
    """A mode's ``overlap.testing.paired_steps`` figures in ms: step (linked), compute side
    (unlinked), the link's busy time and the exposed communication (:data:`PAIRED_HEADER`)."""
    return [f"{1e3 * v:.1f}" for v in (m.linked, m.unlinked, m.comm, m.exposed)]


# ---------------------------------------------------------------------------------- process groups
from overlap.testing import over_ranks  # noqa: E402,F401 (the benchmarks' one "max over ranks")


@contextlib.contextmanager
def single_rank_group() -> Iterator[None]:
    """A 1-rank gloo default process group in this process (in-memory store), destroyed on exit."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
