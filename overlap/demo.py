"""The demo (``python -m overlap demo``): layer-by-layer parameter gathers hidden behind compute.

Every rank holds a dim-0 shard of each layer's weight, as in FSDP. A forward step gathers each
layer's weight and multiplies by it, three ways, side by side in one run:

* **compute only** — the full weights are already local: the time the math alone takes;
* **no overlap** — gather layer ``i``, wait, compute layer ``i``: communication is fully exposed;
* **overlap** — ``overlap.all_gather`` of layer ``i + 1`` is issued before layer ``i`` computes and
  waits only at its first use, so the link works while the CPU computes.

The ranks run on gloo behind the emulated link (``overlap.testing.emulated_link``), whose bandwidth
is chosen, unless given, so that a step's communication takes about as long as its compute: the
case where overlap matters most. All three modes must produce bitwise the same activations; the
demo checks it and says so.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["DemoConfig", "run_demo", "format_table"]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """What the demo runs: ranks, steps, model size and link (``link_gbps=None``: calibrated)."""

    world_size: int = 2
    steps: int = 6
    layers: int = 8
    hidden: int = 512
    batch: int = 256
    link_gbps: float | None = None
    latency_us: float = 20.0


def _weights(cfg: DemoConfig, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Full weights (same on every rank) and this rank's dim-0 shards of them."""
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(cfg.hidden, cfg.hidden, generator=g) / cfg.hidden**0.5 for _ in range(cfg.layers)]
    return full, [w.chunk(cfg.world_size)[rank].contiguous() for w in full]


def _layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def _compute_only(x: torch.Tensor, full: list[torch.Tensor], shards: list[torch.Tensor]) -> torch.Tensor:
    for w in full:
        x = _layer(x, w)
    return x


def _no_overlap(x: torch.Tensor, full: list[torch.Tensor], shards: list[torch.Tensor]) -> torch.Tensor:
    import overlap

    for shard in shards:
        x = _layer(x, overlap.wait(overlap.all_gather(shard)))
    return x


def _overlapped(x: torch.Tensor, full: list[torch.Tensor], shards: list[torch.Tensor]) -> torch.Tensor:
    import overlap

    pending = overlap.all_gather(shards[0])
    for i in range(len(shards)):
        following = overlap.all_gather(shards[i + 1]) if i + 1 < len(shards) else None
        x = _layer(x, pending)  # the first use of `pending` waits for its gather, only now
        pending = following
    return x


_MODES: dict[str, Callable[..., torch.Tensor]] = {
    "compute only": _compute_only,
    "no overlap": _no_overlap,
    "overlap": _overlapped,
}


def _timed_steps(step: Callable[[], torch.Tensor], steps: int) -> tuple[list[float], torch.Tensor]:
    out = step()  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - start)
    return times, out


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rank_main(rank: int, world_size: int, cfg: DemoConfig) -> dict[str, Any]:
    from overlap.testing import emulated_link

    torch.manual_seed(1234)
    x = torch.randn(cfg.batch, cfg.hidden)
    full, shards = _weights(cfg, rank)
    results: dict[str, Any] = {}
    compute_times, reference = _timed_steps(lambda: _compute_only(x, full, shards), cfg.steps)
    compute_s = _slowest(statistics.median(compute_times))
    wire_bytes = cfg.layers * full[0].numel() * full[0].element_size() * (world_size - 1) / world_size
    gbps = cfg.link_gbps
    if gbps is None:  # the link carries one step's gathers in about one step's compute
        gbps = wire_bytes * 8 / max(compute_s - cfg.layers * cfg.latency_us * 1e-6, 1e-4) / 1e9
    results["compute only"] = {"step": compute_s, "comm": 0.0, "same": True}
    with emulated_link(gbps, cfg.latency_us) as link:
        for mode in ("no overlap", "overlap"):
            link.reset_stats()
            times, out = _timed_steps(lambda: _MODES[mode](x, full, shards), cfg.steps)
            comm = link.stats().emulated_seconds / (cfg.steps + 1)
            results[mode] = {"step": _slowest(statistics.median(times)), "comm": _slowest(comm),
                             "same": bool(torch.equal(out, reference))}
    results["link_gbps"] = gbps
    return results


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the demo on ``cfg.world_size`` spawned gloo ranks; return rank 0's figures."""
    from overlap.testing import run_distributed

    return run_distributed(_rank_main, cfg.world_size, cfg, timeout=600)[0]


def format_table(results: dict[str, Any]) -> str:
    """The side-by-side table: step, compute, comm, exposed comm and overlap per mode."""
    compute = results["compute only"]["step"]
    comm = results["overlap"]["comm"]
    header = ("mode", "step ms", "compute ms", "comm ms", "exposed comm ms", "comm hidden", "same result")
    rows = []
    for mode in ("compute only", "no overlap", "overlap"):
        r = results[mode]
        exposed = max(0.0, r["step"] - compute)
        hidden = f"{100 * max(0.0, 1 - exposed / r['comm']):.0f}%" if r["comm"] else "-"
        rows.append((mode, f"{1e3 * r['step']:.1f}", f"{1e3 * compute:.1f}", f"{1e3 * r['comm']:.1f}",
                     f"{1e3 * exposed:.1f}", hidden, "yes" if r["same"] else "NO"))
    rows.append(("ideal max(compute, comm)", f"{1e3 * max(compute, comm):.1f}", f"{1e3 * compute:.1f}",
                 f"{1e3 * comm:.1f}", f"{1e3 * max(0.0, comm - compute):.1f}", "", ""))
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
