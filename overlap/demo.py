"""The demo (``python -m overlap demo``): layer-by-layer parameter gathers hidden behind compute.

Every rank holds a dim-0 shard of each layer's weight, as in FSDP. A forward step gathers each
layer's weight and multiplies by it, three ways, side by side in one run:

* **compute only** — the full weights are already local: the time the math alone takes;
* **no overlap** — gather layer ``i``, wait, compute layer ``i``: communication is fully exposed;
* **overlap** — ``overlap.all_gather`` of layer ``i + 1`` is issued before layer ``i`` computes and
  waits only at its first use, so the link works while the CPU computes.

The ranks run on gloo. Each mode alternates steps without and with the emulated link's delay
(``overlap.testing.paired_steps``): the first kind is the mode's *compute side* (the math, packing
and gloo's own host work), and what the second takes beyond it is exposed communication. The link's
bandwidth is chosen, unless given, so that a step's communication takes about as long as its
compute side: the case where overlap matters most. All modes must produce bitwise the same
activations; the demo checks it and says so.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

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


def _rank_main(rank: int, world_size: int, cfg: DemoConfig) -> dict[str, Any]:
    from overlap.testing import paired_steps

    torch.manual_seed(1234)
    x = torch.randn(cfg.batch, cfg.hidden)
    full, shards = _weights(cfg, rank)
    reference = _compute_only(x, full, shards)
    # The math alone, and the overlap mode's compute side (math + packing + gloo's host work).
    math = paired_steps(lambda: _compute_only(x, full, shards), cfg.steps, 1e9, 0.0).unlinked
    compute = paired_steps(lambda: _overlapped(x, full, shards), cfg.steps, 1e9, 0.0).unlinked
    wire_bytes = cfg.layers * full[0].numel() * full[0].element_size() * (world_size - 1) / world_size
    gbps = cfg.link_gbps
    if gbps is None:  # the link carries one step's gathers in about one step's compute side
        gbps = wire_bytes * 8 / max(compute - cfg.layers * cfg.latency_us * 1e-6, 1e-4) / 1e9
    results: dict[str, Any] = {"link_gbps": gbps, "math": math}
    for mode in ("no overlap", "overlap"):
        outputs: list[torch.Tensor] = []
        times = paired_steps(lambda: outputs.append(_MODES[mode](x, full, shards)), cfg.steps, gbps, cfg.latency_us)
        results[mode] = {"times": times, "same": all(torch.equal(out, reference) for out in outputs)}
    return results


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the demo on ``cfg.world_size`` spawned gloo ranks; return rank 0's figures."""
    from overlap.testing import run_distributed

    return run_distributed(_rank_main, cfg.world_size, cfg, timeout=600)[0]


FOOTNOTE = (
    "compute side: the same step with no link delay (math, packing, gloo's host work); exposed comm: step minus\n"
    "compute side. 'no overlap' waits for gloo's real transfer inside its compute side too, so its exposed figure\n"
    "undercounts what it waits; step / ideal compares every mode with max(compute side of overlap, comm)."
)


def format_table(results: dict[str, Any]) -> str:
    """The side-by-side table: step, compute side, comm, exposed comm, share hidden, step / ideal."""
    ideal = max(results["overlap"]["times"].unlinked, results["overlap"]["times"].comm)
    header = ("mode", "step ms", "compute side ms", "comm ms", "exposed comm ms", "comm hidden", "step / ideal",
              "same result")
    math = results["math"]
    rows = [("math only (weights local)", f"{1e3 * math:.1f}", f"{1e3 * math:.1f}", "0.0", "0.0", "-", "-", "yes")]
    for mode in ("no overlap", "overlap"):
        t = results[mode]["times"]
        rows.append((mode, f"{1e3 * t.linked:.1f}", f"{1e3 * t.unlinked:.1f}", f"{1e3 * t.comm:.1f}",
                     f"{1e3 * t.exposed:.1f}", f"{100 * t.hidden_share:.0f}%", f"{t.linked / ideal:.2f}",
                     "yes" if results[mode]["same"] else "NO"))
    t = results["overlap"]["times"]
    rows.append(("ideal max(compute, comm)", f"{1e3 * ideal:.1f}", f"{1e3 * t.unlinked:.1f}", f"{1e3 * t.comm:.1f}",
                 f"{1e3 * max(0.0, t.comm - t.unlinked):.1f}", "100%", "1.00", ""))
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n\n" + FOOTNOTE
