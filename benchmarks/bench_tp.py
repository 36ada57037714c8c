"""Tensor parallelism side by side: overlap.tensor_parallel vs torch's parallelize_module (eager and
compiled, with and without the Inductor hook) vs ideal.

On ``--world-size`` gloo ranks (default 2), a stack of ``--layers`` blocks with torch's own
sequence-parallel plan (``tests/tp_blocks.py``): the sequence-parallel MLP (norm ``SequenceParallel``,
w1 ``ColwiseParallel(input_layouts=Shard(1))``, gelu, w2 ``RowwiseParallel(output_layouts=Shard(1))``)
the sequence-parallel attention block (q, k, v projections colwise from the sequence-sharded
input, each gathering it, SDPA on the local heads, the output projection rowwise into the
sequence-sharded output), and the same attention with torchtitan's plan (the input gathered once in
the attention's ``PrepareModuleInput``, q/k/v colwise on the replicated DTensor, the output
projection rowwise into the sequence-sharded output; ``overlap.tensor_parallel`` leaves that gather
to q/k/v, decomposed, see ``overlap.tensor_parallelism.deferred_gather``), forward and backward (loss ``mean(y ** 2)``, no optimizer). Modes: torch ``parallelize_module``
(eager DTensor: each all-gather / reduce-scatter whole, before / after its matmul) and
``overlap.tensor_parallel`` with the same plan: chunks chosen per call from costs measured at the
first call ([Note: choosing the chunk count]; behind the link from the link's figures, without it
from a timed calibration collective, so this mode's compute side and linked steps may run
different chunk counts), ``chunks=1`` (torch's undecomposed order through this runtime's collectives) and
``chunks=4`` (the same chunks in both halves of each pair). Compiled: torch's ``parallelize_module``
model under ``torch.compile`` (Inductor; collectives whole, each waited right after it is issued)
the same with Inductor's own comm passes (``_common.INDUCTOR_COMM_PASSES``: reordering for
compute/comm overlap with the recommended pass list, FX bucketing), and the same compiled inside
``scheduler.inductor_overlap()`` (the hook splits each
``all_gather -> mm`` / ``mm -> reduce_scatter`` into ``--compiled-chunks`` chunks, default 2, and
moves every wait to its first use); each compiles at its first (warmup) step.

Each mode alternates steps without and with the emulated link's delay
(``overlap.testing.paired_steps``; the link models torch's functional collectives too, which
DTensor issues): the unlinked step is the mode's compute side, what a linked step takes beyond it
is exposed communication. The link bandwidth is chosen (unless ``--link-gbps``) so that one torch
step's communication takes about as long as torch's compute side. Reported per mode: medians of
the slowest rank, the ideal ``max(compute side, link busy time)`` of that mode, torch's linked step
over this mode's, and this mode's over its ideal.

``--grid``: the sequence-parallel MLP over ``GRID`` (dim 64 x 128 tokens to dim 1024 x 4096
tokens, hidden 4 dim, fewer blocks where a block is large), eager modes only (torch, the chosen
count, ``chunks=1``), each point calibrated to comm ~ torch's compute; the modes take turns step
pair by step pair (a loaded box's drifts fall on all alike); one table, a row per point, with
torch's compute side per block, the counts the default chose behind the link, and how: tried (the
model's count's time over 1's in the trial's quietest round, and its one-time cost) or taken from
the model ([Note: choosing the chunk count]). ``--counts C ...`` also times ``chunks=C`` at each point and
prints each count's linked step beside the chunk model's sum over the layers (the model covers
the collective matmuls only, so compare differences from ``chunks=1``), with the measured figures.

Not yet built: the GPU comparison against torch's async-TP.

    python benchmarks/bench_tp.py [--layers 2] [--steps 8] [--blocks sp_mlp ...] [--markdown benchmarks/RESULTS.md]
    python benchmarks/bench_tp.py --grid [POINT ...] [--steps 4] [--warmup 1] [--counts C ...] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
from typing import Any

from _common import INDUCTOR_COMM_PASSES, PAIRED_HEADER, add_link, add_steps, add_world_size, over_ranks, paired_cells, parse, parser  # first: sys.path
from overlap.demo.training import calibrated_gbps
from overlap.testing import EmulatedLink, PairedTimes, paired_steps, run_distributed
from report import emit

BLOCKS = {"sequence-parallel MLP": "sp_mlp", "sequence-parallel attention": "sp_attention",
          "attention, torchtitan's plan": "prepared_attn"}
MODES = ("torch parallelize_module", "overlap.tensor_parallel", "overlap.tensor_parallel, chunks=1",
         "overlap.tensor_parallel, chunks=4", "torch parallelize_module, compiled",
         "torch parallelize_module, compiled, Inductor's comm passes",
         "torch parallelize_module, compiled, inductor_overlap()")
COMPILED = {MODES[4]: "plain", MODES[5]: "inductor", MODES[6]: "hook"}  # mode -> what compiles it
CHUNKS = {MODES[1]: None, MODES[2]: 1, MODES[3]: 4}  # None: --chunks (default: chosen per call)
EAGER = MODES[:3]  # the modes of --grid
# --grid: (dim, batch, seq, blocks); hidden is 4 dim, tokens batch x seq
GRID = ((64, 1, 128, 4), (128, 2, 256, 4), (256, 4, 512, 2), (512, 2, 1024, 2), (1024, 2, 2048, 1))


def _model(block: str, mode: str, args: argparse.Namespace, mesh: Any) -> Any:
    import torch
    from torch.distributed.tensor.parallel import parallelize_module

    import overlap
    from tp_blocks import make_block, plan_for

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[make_block(block, True, seed=i, dim=args.dim, hidden=args.hidden, heads=args.heads)
                                  for i in range(args.layers)])
    plan = {f"*.{key}": style for key, style in plan_for(block).items()}  # fnmatch keys, as torch takes them
    if mode == MODES[0]:
        return parallelize_module(model, mesh, plan)
    if mode in COMPILED:
        import scheduler

        model = parallelize_module(model, mesh, plan)
        if COMPILED[mode] == "plain":
            return torch.compile(model)
        if COMPILED[mode] == "inductor":  # applied to every graph this compile makes, whenever it makes it
            return torch.compile(model, options=dict(INDUCTOR_COMM_PASSES))
        with scheduler.inductor_overlap(collective_matmul_chunks=args.compiled_chunks):
            return torch.compile(model)  # compiles at the first step, with the hook's pass
    return overlap.tensor_parallel(model, mesh, plan, chunks=_chunks_of(mode) or args.chunks)


def _chunks_of(mode: str) -> Any:
    """The ``chunks=`` of an ``overlap.tensor_parallel`` mode (``--counts`` adds ``..., chunks=C``)."""
    if mode in CHUNKS:
        return CHUNKS[mode]
    return int(mode.rsplit("chunks=", 1)[1])


def _step(model: Any, x: Any) -> Any:
    def step() -> None:
        model(x).square().mean().backward()
        for p in model.parameters():
            p.grad = None

    return step


def _traffic(step: Any) -> tuple[int, int]:
    """(collectives, wire bytes per rank) of one ``step``, functional collectives included."""
    with EmulatedLink(1e6, 0.0, functional=True) as link:
        step()
    stats = link.stats()
    return stats.count, stats.wire_bytes


def _recording_choices(works: dict[Any, Any]) -> dict[str, set[int]]:
    """The counts ``overlap.tensor_parallel``'s layers choose from now on (``chunks=None`` only), per
    layer kind, behind a link; each distinct workload chosen for behind a link goes into ``works``
    (workload -> group)."""
    from overlap.tensor_parallelism import layers
    from overlap.testing import current_link

    seen: dict[str, set[int]] = {}
    choose = layers.choose_chunks

    def recording(work: Any, info: Any, override: Any = None, *a: Any, **k: Any) -> int:
        chunks = choose(work, info, override, *a, **k)
        if current_link() is not None and override is None:
            seen.setdefault(work.kind, set()).add(chunks)
            works[work] = info
        return chunks

    layers.choose_chunks = recording
    return seen


def _modelled_per_count(works: dict[Any, Any], gbps: float, latency_us: float, per_step: int
                        ) -> tuple[dict[int, float], list[str]]:
    """The model's seconds per step for each count, behind a link of ``gbps`` / ``latency_us``: every
    recorded workload's modelled seconds times ``per_step`` (how often each runs in a step); and per
    workload how its count was chosen (``tried C``: C's time over 1's in the quietest round, the
    rounds, the cost; or ``model``)."""
    from overlap.tensor_parallelism.chunks import explain

    total: dict[int, float] = {}
    how: list[str] = []
    with EmulatedLink(gbps, latency_us, functional=True):
        for work, info in works.items():
            table = explain(work, info)
            if table is None:
                continue
            for c, seconds in table["modelled"].items():
                total[c] = total.get(c, 0.0) + per_step * seconds
            if info.rank == 0:
                print(f"{work}: {table['host']}, {table['gemm']}, L {table['latency_s']:.2e}, "
                      f"s {table['seconds_per_byte']:.2e}, modelled ms "
                      f"{ {c: round(1e3 * t, 2) for c, t in table['modelled'].items()} }", flush=True)
            trial = table["trial"]
            if trial is None:
                how.append(f"{work.kind} model")
            else:
                one, tried = min(trial["rounds"], key=sum)
                how.append(f"{work.kind} tried {trial['candidate']}: {tried / one:.2f}x of 1's time in the quietest "
                           f"of {len(trial['rounds'])} rounds ({trial['cost_s']:.2f} s)")
                if info.rank == 0:
                    print(f"{work.kind}: trial of {trial['candidate']} vs 1 -> {trial['chosen']}, "
                          f"rounds ms {[[round(1e3 * t, 2) for t in r] for r in trial['rounds']]}, "
                          f"cost {trial['cost_s']:.2f} s", flush=True)
    return total, how


def _taking_turns(steps: dict[str, Any], rounds: int, gbps: float, latency_us: float,
                  warmup: int) -> dict[str, PairedTimes]:
    """Each mode's paired steps (``overlap.testing.paired_steps``' figures), the modes taking turns
    round by round, one step without and one with the link each, so that a loaded machine's drifts
    fall on every mode alike; medians over rounds of the slowest rank's figures."""
    import statistics

    from overlap.testing import interleaved_steps

    links = {mode: EmulatedLink(gbps, latency_us, functional=True) for mode in steps}
    for mode, step in steps.items():  # behind the link too: a choice made behind it (a trial) is made here
        for _ in range(warmup):
            step()
            with links[mode]:
                step()
    figures: dict[str, list[list[float]]] = {mode: [[], [], []] for mode in steps}
    for _ in range(rounds):
        for mode, step in steps.items():
            unlinked, linked = interleaved_steps(step, 1, [None, links[mode]], warmup=0)
            comm = over_ranks(links[mode].stats().emulated_seconds)
            for out, value in zip(figures[mode], (unlinked, linked, comm)):
                out.append(value)
    return {mode: PairedTimes(*map(statistics.median, f)) for mode, f in figures.items()}


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh

    works: dict[Any, Any] = {}
    chosen = _recording_choices(works)

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(args.batch, args.seq // world, args.dim, generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {}
    # Each compiled mode is one more compile of the same Sequential.forward: past Dynamo's
    # recompile_limit (8) a mode would silently run eager, so start every block afresh and fail
    # rather than time an eager step as a compiled one.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for title, block in BLOCKS.items():
        if block not in args.blocks:
            continue
        torch._dynamo.reset()
        steps = {mode: _step(_model(block, mode, args, mesh), x) for mode in args.modes}
        gbps = args.link_gbps
        if gbps is None:  # one torch step's comm ~ torch's compute side
            compute = paired_steps(steps[MODES[0]], 3, 1e6, 0.0, warmup=args.warmup).unlinked
            gbps = calibrated_gbps(compute, *_traffic(steps[MODES[0]]), args.latency_us)
        out[title] = {"gbps": gbps}
        if args.grid is not None:
            out[title].update(_taking_turns(steps, args.steps, gbps, args.latency_us, args.warmup))
        for mode, step in steps.items() if args.grid is None else ():
            link = EmulatedLink(gbps, args.latency_us, functional=True)
            for _ in range(args.warmup):  # behind the link too: a choice made behind it (a trial) is made here
                with link:
                    step()
            out[title][mode] = paired_steps(step, args.steps, gbps, args.latency_us, warmup=args.warmup, link=link)
        out[title]["chosen"] = {kind: sorted(counts) for kind, counts in chosen.items()}
        out[title]["modelled"], out[title]["how"] = _modelled_per_count(works, gbps, args.latency_us, args.layers)
        works.clear()
        out[title]["compute per block"] = out[title][MODES[0]].unlinked / args.layers
        chosen.clear()
    return out


def _grid(args: argparse.Namespace) -> None:
    """One row per ``GRID`` point: the sequence-parallel MLP, eager modes."""
    rows = []
    for dim, batch, seq, layers in [GRID[i] for i in args.grid] if args.grid else GRID:
        point = argparse.Namespace(**{**vars(args), "dim": dim, "hidden": 4 * dim, "batch": batch, "seq": seq,
                                      "layers": layers, "blocks": ["sp_mlp"],
                                      "modes": EAGER + tuple(f"{MODES[1]}, chunks={c}" for c in args.counts)})
        res = run_distributed(_rank, args.world_size, point, timeout=1200)[0]["sequence-parallel MLP"]
        t, chosen, one = (res[mode] for mode in EAGER)
        if args.counts:  # measured vs modelled per count (the model covers the collective matmuls only)
            modelled = res["modelled"]
            for c in [1, *args.counts]:
                m = res[EAGER[2] if c == 1 else f"{MODES[1]}, chunks={c}"]
                print(f"  {dim} x {batch * seq} chunks={c}: linked step {1e3 * m.linked:.1f} ms "
                      f"(vs chunks=1 {1e3 * (m.linked - one.linked):+.1f}), modelled "
                      f"{1e3 * modelled.get(c, float('nan')):.1f} ms "
                      f"(vs 1 {1e3 * (modelled.get(c, float('nan')) - modelled.get(1, float('nan'))):+.1f})", flush=True)
        rows.append([f"{dim} x {batch * seq}", layers, f"{1e3 * res['compute per block']:.1f}",
                     f"{1e3 * t.comm:.1f}", f"{1e3 * t.linked:.1f}", f"{1e3 * chosen.linked:.1f}",
                     f"{1e3 * one.linked:.1f}", f"{t.linked / chosen.linked:.2f}x", f"{t.linked / one.linked:.2f}x",
                     ", ".join(f"{kind} {'/'.join(map(str, c))}" for kind, c in sorted(res["chosen"].items())),
                     "; ".join(res["how"])])
        print(rows[-1], flush=True)
    emit(f"Tensor parallelism grid, sequence-parallel MLP (hidden 4 dim) on {args.world_size} CPU ranks (gloo), "
         f"forward + backward; emulated link per point so that comm ~ torch's compute side, + {args.latency_us:g} µs; "
         f"medians of {args.steps} steps alternating without/with the link delay, slowest rank",
         ["dim x tokens", "blocks", "torch compute per block ms", "comm ms", "torch step ms", "chosen step ms",
          "chunks=1 step ms", "torch / chosen", "torch / chunks=1", "chosen counts (linked)",
          "how chosen (trial: the model's count's time over 1's in the quietest round, rounds, its cost)"], rows, args.markdown)


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    add_world_size(p)
    add_steps(p, 8, "timed step pairs per mode", 2, "untimed steps first, per mode (the first compiles, and measures "
              "the chunk costs)")
    p.add_argument("--layers", type=int, default=2, help="blocks in the stack (default 2)")
    p.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    p.add_argument("--hidden", type=int, default=1024, help="MLP hidden width (default 1024)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    p.add_argument("--seq", type=int, default=512, help="global sequence length (default 512)")
    p.add_argument("--chunks", type=int, default=None, help="overlap.tensor_parallel's chunks (default: chosen)")
    p.add_argument("--compiled-chunks", type=int, default=2,
                   help="chunks of the Inductor hook's all_gather -> mm / mm -> reduce_scatter split (default 2)")
    p.add_argument("--blocks", nargs="+", choices=list(BLOCKS.values()), default=list(BLOCKS.values()),
                   help="which blocks to time (default all)")
    p.add_argument("--grid", nargs="*", type=int, default=None, metavar="POINT",
                   help="the sequence-parallel MLP over GRID's sizes (or the points of these indices, to repeat "
                        "noisy cells), eager modes only (one table)")
    p.add_argument("--counts", nargs="*", type=int, default=[], metavar="C",
                   help="with --grid: also time chunks=C for each C, and print each count's measured step beside "
                        "the chunk model's (diagnosis of the choice)")
    add_link(p)
    args = parse(p, argv)
    if args.grid is not None:
        _grid(args)
        return
    args.modes = MODES
    r = run_distributed(_rank, args.world_size, args, timeout=1200)[0]
    for title in r:
        res = r[title]
        torch_linked = res[MODES[0]].linked
        rows = []
        for mode in args.modes:
            m: PairedTimes = res[mode]
            ideal = max(m.unlinked, m.comm)
            rows.append([mode, *paired_cells(m), f"{1e3 * ideal:.1f}", f"{torch_linked / m.linked:.2f}x",
                         f"{m.linked / ideal:.2f}x"])
        emit(f"Tensor parallelism, {title}: {args.layers} blocks, dim {args.dim}, batch {args.batch} x seq "
             f"{args.seq} on {args.world_size} CPU ranks (gloo), forward + backward; emulated link "
             f"{res['gbps']:.3g} Gbit/s + {args.latency_us:g} µs; medians of {args.steps} steps alternating "
             "without/with the link delay, slowest rank",
             ["mode", *PAIRED_HEADER, "ideal max(compute, comm) ms", "torch step / this step", "this step / ideal"],
             rows, args.markdown)


if __name__ == "__main__":
    main()
