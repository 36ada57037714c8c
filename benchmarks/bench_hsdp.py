"""Full sharding vs hybrid sharding (HSDP) on a two-tier network, overlap.shard vs torch FSDP2, side by side.

4 gloo ranks as 2 nodes x 2 GPUs (``--nodes``, ``--gpus-per-node``), an MLP of ``--blocks`` blocks
trained with AdamW, behind the emulated link with two tiers: groups within a node at the intra-node
speed, groups spanning nodes ``--inter-slowdown`` (default 8) times slower. The inter-node bandwidth
is chosen (unless ``--link-gbps``) so that one fully sharded step's communication, all of it on the
slow tier, takes about as long as the step's compute side. Modes: ``overlap.shard`` and FSDP2
``fully_shard``, each over all ranks (full sharding) and over a ``(replicate, shard)`` mesh (HSDP).

Each mode alternates steps without and with the link delay (``overlap.testing.paired_steps``); HSDP
with ``overlap.shard`` also runs with the cross-replica link made free, and the difference is what
the cross-replica all-reduces exposed: "cross-replica hidden" is the share of that traffic (at most
the compute side) that ran under compute. The last table puts ``overlap.plan``'s predictions (its
step model fed with this run's measured compute side, parameter bytes and link speeds, one latency
per collective as the emulated link charges) beside the measured steps, with the error.

    python benchmarks/bench_hsdp.py [--steps 6] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
from typing import Any

from _common import add_link, add_mlp, add_steps, mlp, parse, parser, rank_input  # first: sys.path
from overlap.demo.training import TrainStep, calibrate_link, shard_for_mode
from overlap.testing import EmulatedLink, PairedTimes, interleaved_steps, paired_steps, run_distributed
from report import emit

# Display name -> (overlap.demo.training mode, HSDP?)
MODES = {"overlap.shard, full sharding": ("overlap", False), "overlap.shard, HSDP": ("overlap", True),
         "torch FSDP2, full sharding": ("fsdp2", False), "torch FSDP2, HSDP": ("fsdp2", True)}
FREE = (1e6, 0.0)  # a link that costs nothing (Gbit/s, µs)


def _step(mode: str, hsdp: bool, args: argparse.Namespace, x: Any) -> TrainStep:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    shape = (args.nodes, args.gpus_per_node) if hsdp else (args.nodes * args.gpus_per_node,)
    names = ("replicate", "shard") if hsdp else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = mlp(args.blocks, args.dim)
    context = shard_for_mode(mode, model, list(model), mesh=mesh)
    step = TrainStep(lambda _: model(x).square().mean(), torch.optim.AdamW(model.parameters(), lr=1e-3), context)
    step.mesh = mesh  # type: ignore[attr-defined]
    return step


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    x = rank_input(args.batch, args.dim, rank)
    inter = args.link_gbps
    if inter is None:  # the fully sharded step's comm, all on the slow tier, ~ its compute side
        inter = calibrate_link(_step("overlap", False, args, x), args.latency_us)
    intra = inter * args.inter_slowdown

    def link(free_replicas_of: Any = None) -> EmulatedLink:
        groups = {free_replicas_of.get_group("replicate"): FREE} if free_replicas_of is not None else None
        return EmulatedLink(intra, args.latency_us, gpus_per_node=args.gpus_per_node,
                            inter_node=(inter, args.latency_us), groups=groups)

    out: dict[str, Any] = {"intra": intra, "inter": inter}
    for name, (mode, hsdp) in MODES.items():
        step = _step(mode, hsdp, args, x)
        tiers = link()
        if mode == "overlap" and hsdp:  # also with the cross-replica link free, interleaved
            free = link(free_replicas_of=step.mesh)  # type: ignore[attr-defined]
            unlinked, out["replicas free"], linked = interleaved_steps(step, args.steps, [None, free, tiers], 2)
            replicate = step.mesh.get_group("replicate").group_name  # type: ignore[attr-defined]
            out["replica seconds"] = tiers.stats_by_group()[replicate].emulated_seconds / args.steps
            out[name] = PairedTimes(unlinked, linked, tiers.stats().emulated_seconds / args.steps)
        else:
            out[name] = paired_steps(step, args.steps, intra, args.latency_us, warmup=2, link=tiers)
    return out


def _predictions(r: dict[str, Any], args: argparse.Namespace) -> list[list[str]]:
    from overlap.plan import LinkCost, ModelCost, Topology, predict

    per_block_bytes = 4 * (2 * args.dim * args.dim + 2 * args.dim + args.dim * args.dim * 2 + args.dim)
    topology = Topology(args.nodes, args.gpus_per_node, LinkCost(r["intra"], args.latency_us, per_hop=False),
                        LinkCost(r["inter"], args.latency_us, per_hop=False))
    rows = []
    for name, strategy in (("overlap.shard, full sharding", "full"), ("overlap.shard, HSDP", "hsdp")):
        measured: PairedTimes = r[name]
        compute = ModelCost(args.blocks, per_block_bytes, measured.unlinked / (3 * args.blocks))
        p = predict(compute, topology, strategy)
        rows.append([name, f"{1e3 * measured.linked:.1f}", f"{1e3 * p.step_seconds:.1f}",
                     f"{100 * (p.step_seconds / measured.linked - 1):+.0f}%",
                     f"{1e3 * measured.exposed:.1f}", f"{1e3 * p.exposed_seconds:.1f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--gpus-per-node", type=int, default=2, help="ranks per emulated node (default 2)")
    p.add_argument("--inter-slowdown", type=float, default=8.0,
                   help="intra-node bandwidth / inter-node bandwidth (default 8)")
    add_steps(p, 6, "timed steps per mode")
    add_mlp(p)
    add_link(p, gbps_default="comm of a fully sharded step ~ compute, on the slow tier")
    args = parse(p, argv)

    world = args.nodes * args.gpus_per_node
    r = run_distributed(_rank, world, args, timeout=1200)[0]
    fsdp2_hsdp = r["torch FSDP2, HSDP"].linked
    rows = []
    for name in MODES:
        m: PairedTimes = r[name]
        rows.append([name, f"{1e3 * m.linked:.1f}", f"{1e3 * m.unlinked:.1f}", f"{1e3 * m.comm:.1f}",
                     f"{1e3 * m.exposed:.1f}", f"{100 * m.hidden_share:.0f}%", f"{m.linked / fsdp2_hsdp:.2f}x"])
    link = (f"{args.nodes} nodes x {args.gpus_per_node} CPU ranks (gloo); emulated link {r['intra']:.3g} Gbit/s "
            f"within a node, {r['inter']:.3g} Gbit/s across nodes, {args.latency_us:g} µs per collective")
    emit(f"Full sharding vs HSDP, {args.blocks} MLP blocks of width {args.dim}, AdamW; {link}; medians of "
         f"{args.steps} steps alternating without/with the link delay, slowest rank",
         ["mode", "step ms", "compute side ms", "comm ms on the links", "exposed comm ms",
          "hideable comm hidden", "step vs FSDP2 HSDP"], rows, args.markdown)

    hsdp, free = r["overlap.shard, HSDP"], r["replicas free"]
    exposed_ar = hsdp.linked - free  # signed: a negative value is the run-to-run noise
    hideable_ar = min(r["replica seconds"], hsdp.unlinked)
    hidden_ar = 1.0 - max(0.0, exposed_ar) / hideable_ar if hideable_ar > 0 else 0.0
    emit("Cross-replica all-reduces of overlap.shard HSDP: the step with them on the slow tier vs with them free",
         ["cross-replica link ms per step", "step ms (free)", "step ms (slow tier)", "exposed by them ms (signed)",
          "cross-replica hidden"],
         [[f"{1e3 * r['replica seconds']:.1f}", f"{1e3 * free:.1f}", f"{1e3 * hsdp.linked:.1f}",
           f"{1e3 * exposed_ar:.1f}", f"{100 * max(0.0, hidden_ar):.0f}%"]], args.markdown)

    emit("overlap.plan's step model vs the measured steps (compute side and link speeds from this run)",
         ["mode", "measured step ms", "predicted step ms", "error", "measured exposed ms", "predicted exposed ms"],
         _predictions(r, args), args.markdown)


if __name__ == "__main__":
    main()
