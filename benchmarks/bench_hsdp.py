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

With ``--compression`` it runs instead the HSDP modes side by side with compressed collectives
(issue 30) at a comm-bound link: both tiers at ``--link-scale`` (default 0.25) of the calibrated
bandwidths. Modes: ``overlap.shard`` HSDP exact, with ``Compression(gather=None, reduce="int8")``
(the sum over the replicas, the inter-node tier, compressed), with ``Compression()`` (the shard
group's gathers compressed too), and FSDP2 HSDP. Rounds interleave the modes (rotating which goes
first), each mode one step without the link delay and one with it; medians over rounds of the
slowest rank; bytes per tier are what the emulated link counted on rank 0's groups in a linked step.

With ``--hook`` it runs the same way (both tiers at ``--link-scale``, default 1) native HSDP beside
HSDP built by hand: sharded over the shard dim only, with a ``set_all_reduce_hook`` on every module
that sums each reduction's output over the replicas and divides, for both runtimes. On CPU the
runtime runs such hooks at the end of backward ([Note: the all-reduce hook]); FSDP2 runs them
inline in backward, blocking on gloo.

With ``--accumulation`` it runs instead HSDP gradient accumulation, ``--micro-batches`` (default 4)
backwards per optimizer step, three ways for each runtime (``overlap.shard`` and FSDP2): every
micro-batch reduced in full (``synced``), all but the last under ``set_requires_all_reduce(False)``
(``partial``: reduce-scattered within the node, summed over the nodes once per step) and all but the
last under ``set_requires_gradient_sync(False)`` (``no_sync``: nothing reduced until the last;
unsharded gradients held meanwhile), at the calibrated link (``--link-scale`` scales it). Rounds
interleave the modes; bytes per tier as for ``--compression``; "bitwise FSDP2" compares the two
runtimes' parameters after the run, recipe by recipe; "held" is what overlap.shard holds towards the
next reduction just before the last micro-batch (unsharded gradients, partial sums), read from its
groups (FSDP2's is not read: its internals differ between torch versions).

    python benchmarks/bench_hsdp.py [--steps 6] [--markdown benchmarks/RESULTS.md]
    python benchmarks/bench_hsdp.py --compression [--link-scale 0.25] [--steps 6]
    python benchmarks/bench_hsdp.py --accumulation [--micro-batches 4] [--link-scale 1] [--steps 6]
    python benchmarks/bench_hsdp.py --hook [--link-scale 1] [--steps 6]
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Any

from _common import add_link, add_mlp, add_steps, mlp, parse, parser, rank_input  # first: sys.path
from overlap.demo.training import TrainStep, calibrate_link, shard_for_mode
from overlap.testing import EmulatedLink, PairedTimes, interleaved_steps, over_ranks, paired_steps, run_distributed
from report import emit

# Display name -> (overlap.demo.training mode, HSDP?)
MODES = {"overlap.shard, full sharding": ("overlap", False), "overlap.shard, HSDP": ("overlap", True),
         "torch FSDP2, full sharding": ("fsdp2", False), "torch FSDP2, HSDP": ("fsdp2", True)}
FREE = (1e6, 0.0)  # a link that costs nothing (Gbit/s, µs)
# --compression and --hook: display name -> (overlap.demo.training mode, overlap.Compression keywords or None,
# the replica tier by set_all_reduce_hook?); all HSDP. The first mode is the table's "exact", the last FSDP2's.
COMPRESSED_MODES = {"overlap.shard HSDP, exact": ("overlap", None, False),
                    "overlap.shard HSDP, int8 replica sum": ("overlap", {"gather": None, "reduce": "int8"}, False),
                    "overlap.shard HSDP, int8 gather + replica sum": ("overlap", {}, False),
                    "torch FSDP2 HSDP": ("fsdp2", None, False)}
HOOK_MODES = {"overlap.shard HSDP, exact": ("overlap", None, False),
              "overlap.shard, replica sum by set_all_reduce_hook": ("overlap", None, True),
              "torch FSDP2, replica sum by set_all_reduce_hook": ("fsdp2", None, True),
              "torch FSDP2 HSDP": ("fsdp2", None, False)}


def _step(mode: str, hsdp: bool, args: argparse.Namespace, x: Any, compress: Any = None,
          hook: bool = False) -> TrainStep:
    """One mode's training step. ``hook``: HSDP built by hand, sharded over the mesh's shard dim only,
    with a ``set_all_reduce_hook`` on every module that sums over the replicas and divides."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import overlap

    shape = (args.nodes, args.gpus_per_node) if hsdp else (args.nodes * args.gpus_per_node,)
    names = ("replicate", "shard") if hsdp else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = mlp(args.blocks, args.dim)
    context = shard_for_mode(mode, model, list(model), mesh=mesh["shard"] if hook else mesh,
                             compress=overlap.Compression(**compress) if compress is not None else None)
    if hook:
        replicas = mesh.get_group("replicate")

        def over_replicas(output: torch.Tensor) -> None:
            torch.distributed.all_reduce(output, group=replicas)
            output.div_(args.nodes)

        for module in [*model, model]:
            module.set_all_reduce_hook(over_replicas)
    step = TrainStep(lambda _: model(x).square().mean(), torch.optim.AdamW(model.parameters(), lr=1e-3), context)
    step.mesh = mesh  # type: ignore[attr-defined]
    step.model = model  # type: ignore[attr-defined]
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


def _scaled_two_tier_link(args: argparse.Namespace, x: Any) -> tuple[EmulatedLink, float, float]:
    """(link, inter-node Gbit/s, calibrated Gbit/s): both tiers at ``--link-scale`` of the calibrated
    bandwidths (``--link-gbps``, else the fully sharded step's comm on the slow tier ~ its compute,
    as the default tables), the intra-node tier ``--inter-slowdown`` times faster."""
    calibrated = args.link_gbps
    if calibrated is None:
        calibrated = calibrate_link(_step("overlap", False, args, x), args.latency_us)
    inter = calibrated * args.link_scale
    link = EmulatedLink(inter * args.inter_slowdown, args.latency_us, gpus_per_node=args.gpus_per_node,
                        inter_node=(inter, args.latency_us))
    return link, inter, calibrated


def _bytes_per_tier(link: EmulatedLink, mesh: Any) -> dict[str, float]:
    """Wire bytes ``link`` counted since its last reset on ``mesh``'s shard and replicate groups."""
    by_group = link.stats_by_group()
    groups = {tier: mesh.get_group(tier).group_name for tier in ("shard", "replicate")}
    return {tier: by_group[g].wire_bytes if g in by_group else 0 for tier, g in groups.items()}


def _compressed_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import statistics
    import time

    import torch.distributed as dist

    x = rank_input(args.batch, args.dim, rank)
    link, inter, calibrated = _scaled_two_tier_link(args, x)
    modes = HOOK_MODES if args.hook else COMPRESSED_MODES
    steps = {name: _step(mode, True, args, x, compress, hook) for name, (mode, compress, hook) in modes.items()}
    for step in steps.values():  # warm-up: two steps without the link, one with
        step(), step()
        with link:
            step()
    names = list(modes)
    times: dict[str, dict[str, list[float]]] = {n: {"unlinked": [], "linked": [], "comm": []} for n in names}
    tiers: dict[str, dict[str, float]] = {}
    for round_ in range(args.steps):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            for linked in (False, True):
                dist.barrier()
                link.reset_stats()
                start = time.perf_counter()
                with link if linked else contextlib.nullcontext():
                    steps[name]()
                times[name]["linked" if linked else "unlinked"].append(time.perf_counter() - start)
                if linked:
                    times[name]["comm"].append(link.stats().emulated_seconds)
                    tiers[name] = _bytes_per_tier(link, steps[name].mesh)  # type: ignore[attr-defined]
    out: dict[str, Any] = {"intra": inter * args.inter_slowdown, "inter": inter, "calibrated": calibrated}
    for name in names:
        t = times[name]
        out[name] = PairedTimes(over_ranks(statistics.median(t["unlinked"])), over_ranks(statistics.median(t["linked"])),
                                over_ranks(statistics.median(t["comm"])))
        out[name + " bytes"] = tiers[name]
    return out


ACCUMULATION_RECIPES = ("synced", "partial", "no_sync")


def _held_between_micro_batches(model: Any) -> int:
    """Bytes overlap.shard holds towards the next reduction, between two micro-batches: the
    unsharded gradients (``no_sync``) and the partial sums over the replicas (``partial``)."""
    from overlap.sharding import sharded_states

    total = 0
    for state in sharded_states(model):
        group = state.group
        if group is None:
            continue
        if group._partial is not None:
            total += group._partial[1].numel() * group._partial[1].element_size()
        total += sum(p.grad.numel() * p.grad.element_size() for p in group.unsharded or () if p.grad is not None)
    return total


def _accumulation_rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import statistics
    import time

    import torch
    import torch.distributed as dist

    x = rank_input(args.batch, args.dim, rank)
    link, inter, calibrated = _scaled_two_tier_link(args, x)
    steps: dict[str, Any] = {}
    for runtime, mode in (("overlap.shard", "overlap"), ("torch FSDP2", "fsdp2")):
        for recipe in ACCUMULATION_RECIPES:
            steps[f"{runtime}, {recipe}"] = (_step(mode, True, args, x), recipe)
    names = list(steps)

    held: dict[str, int] = {}

    def run(name: str) -> None:
        step, recipe = steps[name]
        model = step.model  # type: ignore[attr-defined]
        for micro in range(args.micro_batches):
            last = micro == args.micro_batches - 1
            if recipe == "partial":
                model.set_requires_all_reduce(last)
            elif recipe == "no_sync":
                model.set_requires_gradient_sync(last)
            step.loss_fn(micro).backward()
            if micro == args.micro_batches - 2 and name.startswith("overlap"):
                held[name] = _held_between_micro_batches(model)
        step.optimizer.step()
        step.optimizer.zero_grad()

    for name in names:  # warm-up: one step without the link, one with
        run(name)
        with link:
            run(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    tiers: dict[str, dict[str, float]] = {}
    for round_ in range(args.steps):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            dist.barrier()
            link.reset_stats()
            start = time.perf_counter()
            with link:
                run(name)
            times[name].append(time.perf_counter() - start)
            tiers[name] = _bytes_per_tier(link, steps[name][0].mesh)
    out: dict[str, Any] = {"inter": inter, "calibrated": calibrated}
    for name in names:
        out[name] = over_ranks(statistics.median(times[name]))
        out[name + " bytes"] = tiers[name]
        out[name + " held"] = over_ranks(float(held.get(name, -1)))
    for recipe in ACCUMULATION_RECIPES:
        ours, theirs = (steps[f"{runtime}, {recipe}"][0].model for runtime in ("overlap.shard", "torch FSDP2"))
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(ours.parameters(), theirs.parameters()))
        out[recipe + " bitwise"] = over_ranks(float(not same)) == 0.0
    return out


def _accumulation_main(args: argparse.Namespace) -> None:
    world = args.nodes * args.gpus_per_node
    r = run_distributed(_accumulation_rank, world, args, timeout=1800)[0]
    rows = []
    for runtime in ("overlap.shard", "torch FSDP2"):
        synced, synced_bytes = r[f"{runtime}, synced"], r[f"{runtime}, synced bytes"]
        for recipe in ACCUMULATION_RECIPES:
            name = f"{runtime}, {recipe}"
            b = r[name + " bytes"]
            rows.append([name, f"{1e3 * r[name]:.1f}", f"{r[name] / synced:.2f}x",
                         f"{b['shard'] / 1e6:.2f} ({b['shard'] / synced_bytes['shard']:.2f}x)",
                         f"{b['replicate'] / 1e6:.2f} ({b['replicate'] / synced_bytes['replicate']:.2f}x)",
                         f"{r[f'overlap.shard, {recipe}'] / r[f'torch FSDP2, {recipe}']:.2f}x",
                         "yes" if r[recipe + " bitwise"] else "no",
                         f"{r[name + ' held'] / 1e6:.2f}" if r[name + " held"] >= 0 else "-"])
    link = (f"{args.nodes} nodes x {args.gpus_per_node} CPU ranks (gloo); emulated link "
            f"{r['inter'] * args.inter_slowdown:.3g} Gbit/s within a node, {r['inter']:.3g} Gbit/s across nodes "
            f"({args.link_scale:g}x the calibrated {r['calibrated']:.3g}), {args.latency_us:g} µs per collective")
    emit(f"HSDP gradient accumulation, {args.micro_batches} micro-batches per step, {args.blocks} MLP blocks of "
         f"width {args.dim}, batch {args.batch}, AdamW, fp32; {link}; medians of {args.steps} interleaved rounds, "
         "slowest rank",
         ["runtime, recipe", "step ms (link)", "step vs synced", "MB per step, shard tier (vs synced)",
          "MB per step, replica tier (vs synced)", "overlap.shard / FSDP2 step", "bitwise FSDP2",
          "MB held between micro-batches (largest rank)"],
         rows, args.markdown)


def _compression_main(args: argparse.Namespace) -> None:
    world = args.nodes * args.gpus_per_node
    r = run_distributed(_compressed_rank, world, args, timeout=1800)[0]
    exact, fsdp2 = r["overlap.shard HSDP, exact"], r["torch FSDP2 HSDP"]
    exact_bytes = r["overlap.shard HSDP, exact bytes"]
    rows = []
    for name in HOOK_MODES if args.hook else COMPRESSED_MODES:
        m: PairedTimes = r[name]
        b = r[name + " bytes"]
        rows.append([name, f"{1e3 * m.linked:.1f}", f"{1e3 * m.unlinked:.1f}", f"{1e3 * m.comm:.1f}",
                     f"{1e3 * m.exposed:.1f}", f"{b['shard'] / 1e6:.2f} ({b['shard'] / exact_bytes['shard']:.3f}x)",
                     f"{b['replicate'] / 1e6:.2f} ({b['replicate'] / exact_bytes['replicate']:.3f}x)",
                     f"{m.linked / exact.linked:.2f}x", f"{m.linked / fsdp2.linked:.2f}x"])
    link = (f"{args.nodes} nodes x {args.gpus_per_node} CPU ranks (gloo); emulated link {r['intra']:.3g} Gbit/s "
            f"within a node, {r['inter']:.3g} Gbit/s across nodes ({args.link_scale:g}x the calibrated "
            f"{r['calibrated']:.3g}), {args.latency_us:g} µs per collective")
    what = ("HSDP, native and with the replica sum by set_all_reduce_hook" if args.hook
            else "HSDP with compressed collectives at a comm-bound link")
    emit(f"{what}, {args.blocks} MLP blocks of width {args.dim}, "
         f"batch {args.batch}, AdamW, fp32; {link}; medians of {args.steps} interleaved rounds, slowest rank",
         ["mode", "step ms (link)", "compute side ms", "comm ms on the links", "exposed comm ms",
          "MB per step, shard tier (vs exact)", "MB per step, replica tier (vs exact)",
          "step vs exact HSDP", "step vs FSDP2 HSDP"], rows, args.markdown)


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
    p.add_argument("--compression", action="store_true",
                   help="run the HSDP modes with compressed collectives side by side instead (see above)")
    p.add_argument("--link-scale", type=float, default=None,
                   help="with --compression or --accumulation: both tiers' bandwidth as a share of the calibrated "
                        "ones (default 0.25 with --compression, 1 with --accumulation)")
    p.add_argument("--accumulation", action="store_true",
                   help="run HSDP gradient accumulation side by side instead: synced, partial, no_sync (see above)")
    p.add_argument("--hook", action="store_true",
                   help="run native HSDP beside HSDP built with set_all_reduce_hook instead (see above)")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="with --accumulation: backwards per optimizer step (default 4)")
    args = parse(p, argv)
    if args.compression + args.accumulation + args.hook > 1:
        p.error("--compression, --accumulation and --hook: choose one")
    if args.micro_batches < 1:
        p.error(f"--micro-batches must be >= 1, got {args.micro_batches}")
    if args.link_scale is not None and not args.link_scale > 0:
        p.error(f"--link-scale must be > 0, got {args.link_scale}")
    if args.compression or args.hook:
        args.link_scale = (0.25 if args.compression else 1.0) if args.link_scale is None else args.link_scale
        _compression_main(args)
        return
    if args.accumulation:
        args.link_scale = 1.0 if args.link_scale is None else args.link_scale
        _accumulation_main(args)
        return

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
