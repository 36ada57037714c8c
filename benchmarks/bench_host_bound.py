"""A host-bound training step: plain vs ``overlap.shard`` vs torch FSDP2 at world size 1, and where
the host time goes.

On a GPU, a step is host-bound when Python issues kernels more slowly than the GPU runs them; then
no overlap can help, and every microsecond of runtime bookkeeping lengthens the step. The configs:

* ``small``: ``--blocks`` (48) blocks of LayerNorm + Linear(d, 4d) + GELU + Linear(4d, d), d = 256,
  a batch of 4 x 128 tokens: host-bound on a GPU (the figure of issue 28: plain 22-24 ms,
  overlap.shard 51-56 ms, FSDP2 103-105 ms on one H200);
* ``gpu-bound``: 8 such blocks at d = 2048: the GPU is the bottleneck (CUDA only; on CPU a step
  takes seconds and says nothing about host cost).

On CPU the small config shrinks to d = 32 and 32 tokens, so that its step is the host's
bookkeeping and dispatch rather than arithmetic (at d = 256 a 2-core box spends seconds per step in
the matmuls, in every mode alike): there the table reports host costs only.

Each step is ``zero_grad(set_to_none=True)``, forward, ``sum()``, backward and AdamW's step (the
default implementation: foreach on CUDA, per-tensor on CPU), fp32, over a 1-rank process group
(NCCL on CUDA, gloo on CPU). The modes are timed interleaved (A B C A B C ..., order rotated each
round), ``--steps`` steps per sample, medians over ``--repeats`` rounds:

* CUDA: "step ms" is the wall time of the steps with one device synchronize at the end; "host ms"
  the time until the host had issued them (before that synchronize). Where host ms ~ step ms, the
  GPU waited for the host;
* CPU: the CPU computes as well, so step ms is host ms; the table says so.

A second table times ``opt.step()`` alone over the small config's parameters, per optimizer of
``OPTIMIZER_ROWS`` (AdamW and SGD with momentum, foreach and fused) and mode, the same interleaved way:
issue 28 asks for overlap.shard's step at <= 1.2x plain, on CPU and CUDA. Its last mode steps
overlap.shard's own optimizer with the steady-state gathering off (``TORCHS_LOOP``: torch's
``_init_group`` loop, as before it), so that what the gathering buys is read on the same tensors. On CPU set
``OMP_NUM_THREADS=1`` on a shared small box: the fused CPU kernels' thread barriers stall whenever a
core is busy (fused AdamW measured 718 ms per step with threads under load, 0.4 ms without).

A third table splits the small config's step into its phases (``zero_grad``, the forward with the
loss's ``sum()``, backward, the optimizer step), host ms each, the same interleaved way, with one
more mode: ``NOOP_HOOKS``, the plain model carrying the kinds of hooks the runtime registers, each
doing nothing. Its phases above plain's are torch's hook mechanism; overlap.shard's above it are the
runtime's own work (the last column, µs per block). On CPU an instruction of the runtime's takes
2-3x the time of one of plain's (Python calls and attribute reads, against plain's count that
includes the CPU kernels' dense loops: benchmarks/RESULTS.md), so a phase's time, not its
instruction count (``bench_host_instructions.py``), is what a GPU host would see grow.

Then ``torch.profiler`` (CPU activity) records ``--profile-steps`` steps of each sharded mode of the
``small`` config and prints its top host costs: self CPU µs per step of the top ``--top`` ops. A
last table (``differing_host_costs``) profiles plain and overlap.shard again with ``record_shapes``
and takes the ops whose host time grows most from plain to overlap.shard. For each of their costliest
(input shapes, input strides, thread) variants it gives the calls per step and µs per call in both
modes, so a GPU run shows whether an op costs more per call on the same inputs, on other inputs or
on another thread (input strides need torch 2.13 or newer, else "-"). The runtime's regions are
named per module (``overlap::pre_forward (blocks.3)``); both profile tables add them up per kind
(``overlap::pre_forward (every module)``), so that a cost paid once per block ranks by its total.

``--statistic min`` reports the fastest sample of each mode instead of the median (on a box
loaded by other work the minimum is the least disturbed; ratios stay within one table).

    python benchmarks/bench_host_bound.py [--blocks 48] [--steps 5] [--repeats 7] [--top 12]
                                          [--statistic median|min] [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import contextlib
import re
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from _common import parse, parser  # first: sys.path
from report import emit
from torch import nn

from bench_runtime_cost import OPTIMIZERS, _opt_step
from overlap import local_optimizer_step
from overlap.demo.training import shard_for_mode

MODES = {"plain": None, "overlap.shard": "overlap", "torch FSDP2": "fsdp2"}  # label -> shard_for_mode's mode
CONFIGS = {"small": (256, 4 * 128), "gpu-bound": (2048, 4 * 128)}  # name -> (d, tokens) on CUDA
CPU_SMALL = (32, 32)  # (d, tokens) of the small config on CPU: host work, not arithmetic
GPU_BOUND_BLOCKS = 8
DIFFERING_OPS = 6  # ops in the by-inputs table
STEP_MARK = "bench_host_bound::step"  # the profiler range around each profiled step


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


@contextlib.contextmanager
def single_rank_group(device: torch.device) -> Iterator[None]:
    """A 1-rank default process group (NCCL on CUDA, gloo on CPU) over an in-memory store."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_model(mode: str, blocks: int, d: int, tokens: int,
               device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    """``mode``'s model (same seed in every mode) and its input batch."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(d) for _ in range(blocks)]).to(device)
    if MODES[mode] is not None:
        shard_for_mode(MODES[mode], model, list(model))
    return model, torch.randn(tokens, d, device=device, generator=torch.Generator(device).manual_seed(1))


def make_step(mode: str, blocks: int, d: int, tokens: int, device: torch.device) -> Callable[[], None]:
    """One training step of ``mode`` on a freshly built model (same seed in every mode): its
    ``make_phases`` in order."""
    phases = make_phases(mode, blocks, d, tokens, device)

    def step() -> None:
        for phase in phases:
            phase()

    return step


OPTIMIZER_ROWS = ("AdamW foreach=True", "AdamW fused=True", "SGD momentum foreach=True", "SGD momentum fused=True")
"""The optimizers of the step-alone table (``bench_runtime_cost.OPTIMIZERS``' labels): foreach is
what the default picks on CUDA; fused SGD has no DTensor strategy in torch, so FSDP2's row is "-"."""


def make_optimizer_step(mode: str, label: str, blocks: int, d: int, tokens: int,
                        device: torch.device) -> Callable[[], None]:
    """``opt.step`` of ``label``'s optimizer over ``mode``'s parameters, after one backward and one
    step (gradients and optimizer state in place); raises if ``mode`` cannot run that optimizer."""
    model, x = make_model(mode, blocks, d, tokens, device)
    step = _opt_step(model, x, *OPTIMIZERS[label])
    step()  # raises here where the mode cannot run it; creates the state
    return step


TORCHS_LOOP = "overlap.shard, torch's _init_group loop"
"""The extra mode of the step-alone table: overlap.shard's own optimizer and tensors, stepped with
its steady-state gathering off (torch's ``_init_group`` loop, as before it): what the gathering buys."""


def with_torchs_init_group_loop(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` run with ``overlap.local_optimizer_step``'s steady-state gatherings off."""
    def run() -> None:
        saved = dict(local_optimizer_step._STEADY_GATHERS)
        local_optimizer_step._STEADY_GATHERS.update(dict.fromkeys(saved))
        try:
            step()
        finally:
            local_optimizer_step._STEADY_GATHERS.update(saved)

    return run


NOOP_HOOKS = "plain + no-op hooks"
"""The phase table's control mode: the plain model with the kinds of hooks ``overlap.shard`` puts on a
block, each doing nothing: a forward pre-hook taking kwargs (prepended) and a forward hook per block,
the forward hook registering a pre-hook on the output's autograd node each forward, and a
post-accumulate-grad hook per parameter. Its phases above plain's are torch's hook mechanism."""

PHASES = ("zero_grad", "forward", "backward", "optimizer step")
"""The phase table's rows, in step order (forward includes the loss's ``sum()``)."""

STEP_SUM = "the phases summed"
"""The phase table's last row: each mode's phase values added up."""


class _NoopNodeHook:
    """A node pre-hook that does nothing (the runtime's is an object too: ``_OutputHook``)."""

    __slots__ = ()

    def __call__(self, *_: object) -> None:
        return None


_NOOP_NODE_HOOK = _NoopNodeHook()


def _noop_pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
    return None


def _noop_post_forward(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    if output.grad_fn is not None:
        output.grad_fn.register_prehook(_NOOP_NODE_HOOK)


def _noop_grad_hook(param: torch.Tensor) -> None:
    return None


def add_noop_hooks(model: nn.Module) -> None:
    """``NOOP_HOOKS``' hooks on every block of ``model`` (an ``nn.Sequential`` of blocks)."""
    for block in model:
        block.register_forward_pre_hook(_noop_pre_forward, with_kwargs=True, prepend=True)
        block.register_forward_hook(_noop_post_forward)
        for param in block.parameters():
            param.register_post_accumulate_grad_hook(_noop_grad_hook)


def make_phases(mode: str, blocks: int, d: int, tokens: int, device: torch.device) -> list[Callable[[], None]]:
    """``mode``'s step as its ``PHASES``, called in order (``NOOP_HOOKS``: plain with the no-op hooks)."""
    model, x = make_model("plain" if mode == NOOP_HOOKS else mode, blocks, d, tokens, device)
    if mode == NOOP_HOOKS:
        add_noop_hooks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss: list[torch.Tensor] = []
    return [lambda: opt.zero_grad(set_to_none=True), lambda: loss.append(model(x).sum()),
            lambda: loss.pop().backward(), opt.step]


def timed_phases(phases: list[Callable[[], None]], steps: int, device: torch.device) -> list[float]:
    """Host seconds per step of each phase over ``steps`` steps (a device synchronize after each
    step, outside the timing: a host-bound step's GPU waits for the host anyway)."""
    totals = [0.0] * len(phases)
    clock = time.perf_counter
    for _ in range(steps):
        for i, phase in enumerate(phases):
            start = clock()
            phase()
            totals[i] += clock() - start
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return [t / steps for t in totals]


def phase_rows(blocks: int, d: int, tokens: int, device: torch.device, steps: int, repeats: int,
               statistic: str = "median") -> list[list[str]]:
    """Per phase and mode (plain, ``NOOP_HOOKS``, the sharded modes): host ms, vs plain, and µs per
    block over ``NOOP_HOOKS`` (for the sharded modes: their own work above torch's hook mechanism)."""
    modes = ["plain", NOOP_HOOKS, *[m for m in MODES if m != "plain"]]
    parts = {mode: make_phases(mode, blocks, d, tokens, device) for mode in modes}
    samples = interleaved(parts, steps, repeats, device, timer=timed_phases)
    reduce = STATISTICS[statistic]
    value = {m: [reduce([s[i] for s in samples[m]]) for i in range(len(PHASES))] for m in modes}

    def ms(mode: str, i: Optional[int]) -> float:  # i None: the phases summed
        return 1e3 * (sum(value[mode]) if i is None else value[mode][i])

    rows = []
    for i, phase in [*enumerate(PHASES), (None, STEP_SUM)]:
        for mode in modes:
            over = "-" if mode in ("plain", NOOP_HOOKS) else f"{1e3 * (ms(mode, i) - ms(NOOP_HOOKS, i)) / blocks:+.1f}"
            rows.append([phase, mode, f"{ms(mode, i):.3f}", f"{ms(mode, i) / ms('plain', i):.2f}x", over])
    return rows


STATISTICS = {"median": statistics.median, "min": min}
"""--statistic: how the samples of a mode become its number."""


def optimizer_rows(blocks: int, d: int, tokens: int, device: torch.device, steps: int,
                   repeats: int, statistic: str = "median") -> list[list[object]]:
    """Per optimizer of ``OPTIMIZER_ROWS``: each mode's ``opt.step`` alone, interleaved; host and
    wall µs per step, and wall vs plain (issue 28's goal: <= 1.2x plain for overlap.shard)."""
    rows: list[list[object]] = []
    for label in OPTIMIZER_ROWS:
        fns, refused = {}, {}
        for mode in MODES:
            try:
                fns[mode] = make_optimizer_step(mode, label, blocks, d, tokens, device)
            except Exception as e:  # noqa: BLE001 -- torch has no DTensor strategy for it: say so
                refused[mode] = f"- ({type(e).__name__})"
        if "overlap.shard" in fns:
            fns[TORCHS_LOOP] = with_torchs_init_group_loop(fns["overlap.shard"])
        samples = interleaved(fns, steps, repeats, device)
        reduce = STATISTICS[statistic]
        plain = reduce([w for _, w in samples["plain"]])
        for mode in [*MODES, TORCHS_LOOP]:
            if mode in refused or mode not in fns:
                rows.append([label, mode, refused.get(mode, "-"), "-", "-"])
                continue
            host = reduce([h for h, _ in samples[mode]])
            wall = reduce([w for _, w in samples[mode]])
            rows.append([label, mode, f"{1e6 * wall:.0f}", f"{1e6 * host:.0f}", f"{wall / plain:.2f}x"])
        del fns
    return rows


def timed(step: Callable[[], None], steps: int, device: torch.device) -> tuple[float, float]:
    """(host s, wall s) per step of ``steps`` steps: until the host returned, until the device did."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    host = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return host / steps, (time.perf_counter() - start) / steps


def interleaved(fns: dict[str, Any], steps: int, repeats: int, device: torch.device,
                timer: Callable[[Any, int, torch.device], Any] = timed) -> dict[str, list[Any]]:
    """``timer(fns[name], steps, device)`` per name, ``repeats`` rounds in an order rotated each round,
    after a 2-step warm-up of each (the first step records schedules, compiles kernels)."""
    for fn in fns.values():
        timer(fn, 2, device)
    names = list(fns)
    samples: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(timer(fns[name], steps, device))
    return samples


_PER_MODULE_REGION = re.compile(r"^(overlap::\S+) \(.+\)$")


def op_kind(name: str) -> str:
    """A profiler event's name with a runtime region's module left out (``overlap::pre_forward
    (blocks.3)`` -> ``overlap::pre_forward (every module)``), other names as they are."""
    found = _PER_MODULE_REGION.match(name)
    return f"{found.group(1)} (every module)" if found else name


def top_host_costs(step: Callable[[], None], steps: int, top: int) -> list[tuple[str, float, float]]:
    """(op, self CPU µs per step, calls per step) of the ``top`` ops by self CPU time over ``steps``
    profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    totals: dict[str, list[float]] = {}
    for e in prof.key_averages():
        total = totals.setdefault(op_kind(e.key), [0.0, 0.0])
        total[0] += e.self_cpu_time_total
        total[1] += e.count
    ranked = sorted(totals.items(), key=lambda item: item[1][0], reverse=True)[:top]
    return [(name, us / steps, count / steps) for name, (us, count) in ranked]


InputsKey = tuple[str, str, str, str]
"""(op, input shapes, input strides, thread) of ``host_cost_by_inputs``."""


def host_cost_by_inputs(step: Callable[[], None], steps: int) -> dict[InputsKey, tuple[float, float]]:
    """Self CPU µs per step and calls per step of every op over ``steps`` profiled steps, per
    (op, input shapes, input strides, thread): "main" is the thread that called ``step``, "other"
    the autograd engine's device threads (a CUDA backward runs there). A separate profile from
    ``top_host_costs``: recording shapes costs host time of its own."""
    from torch.profiler import ProfilerActivity, profile, record_function

    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            with record_function(STEP_MARK):
                step()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    main_thread = next(e.thread for e in events if e.name == STEP_MARK)  # the profiler's id of this thread
    costs: dict[InputsKey, list[float]] = {}
    for e in events:
        if e.name == STEP_MARK:
            continue
        strides = getattr(e, "structured_input_strides", None)  # not on every torch version
        key = (op_kind(e.name), str(e.input_shapes), "-" if strides is None else str(strides),
               "main" if e.thread == main_thread else "other")
        cost = costs.setdefault(key, [0.0, 0.0])
        cost[0] += e.self_cpu_time_total / steps
        cost[1] += 1 / steps
    return {k: (us, calls) for k, (us, calls) in costs.items()}


def differing_host_costs(plain: dict[InputsKey, tuple[float, float]], other: dict[InputsKey, tuple[float, float]],
                         top: int) -> list[list[str]]:
    """Rows of the ``top`` ops whose self CPU per step grows most from ``plain`` to ``other``, each
    op's input variants below it: where a mode's extra host time goes, and whether its calls differ
    from plain's in shapes, strides or thread (on the H100, overlap.shard's ``aten::mm`` took 54 µs
    of host time per call against plain's 20; issue 28)."""
    def by_op(costs: dict[InputsKey, tuple[float, float]]) -> dict[str, float]:
        totals: dict[str, float] = {}
        for (name, *_), (us, _) in costs.items():
            totals[name] = totals.get(name, 0.0) + us
        return totals

    plain_ops, other_ops = by_op(plain), by_op(other)
    growth = sorted(other_ops, key=lambda n: other_ops[n] - plain_ops.get(n, 0.0), reverse=True)[:top]
    rows = []
    for name in growth:
        keys = sorted({k for k in (*plain, *other) if k[0] == name},
                      key=lambda k: other.get(k, (0.0, 0.0))[0] + plain.get(k, (0.0, 0.0))[0], reverse=True)
        for shapes, strides, thread in (k[1:] for k in keys[:4]):  # the costliest variants
            key = (name, shapes, strides, thread)
            p_us, p_calls = plain.get(key, (0.0, 0.0))
            o_us, o_calls = other.get(key, (0.0, 0.0))
            rows.append([name, shapes, strides, thread, f"{p_calls:g}", f"{p_us / p_calls:.1f}" if p_calls else "-",
                         f"{o_calls:g}", f"{o_us / o_calls:.1f}" if o_calls else "-"])
    return rows


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--blocks", type=int, default=48, help="blocks of the small config (default 48)")
    p.add_argument("--steps", type=int, default=5, help="steps per sample (default 5)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds; medians (default 7)")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per sharded mode (default 3)")
    p.add_argument("--top", type=int, default=12, help="ops in the profile table (default 12)")
    p.add_argument("--statistic", choices=tuple(STATISTICS), default="median",
                   help="each mode's number: the median of its samples, or the fastest (default median)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parse(p, argv)
    for name in ("blocks", "steps", "repeats", "profile_steps", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu)")
    configs = ["small", "gpu-bound"] if device.type == "cuda" else ["small"]

    rows, profiles, by_inputs = [], {}, {}
    with single_rank_group(device):
        for config in configs:
            d, tokens = CONFIGS[config] if device.type == "cuda" else CPU_SMALL
            blocks = args.blocks if config == "small" else GPU_BOUND_BLOCKS
            fns = {mode: make_step(mode, blocks, d, tokens, device) for mode in MODES}
            samples = interleaved(fns, args.steps, args.repeats, device)
            reduce = STATISTICS[args.statistic]
            plain = reduce([w for _, w in samples["plain"]])
            for mode in MODES:
                host = reduce([h for h, _ in samples[mode]])
                wall = reduce([w for _, w in samples[mode]])
                rows.append([f"{config}: {blocks} x d={d}", mode, f"{1e3 * wall:.2f}", f"{1e3 * host:.2f}",
                             f"{wall / plain:.2f}x"])
            if config == "small":
                profiles = {mode: top_host_costs(fns[mode], args.profile_steps, args.top) for mode in MODES}
                by_inputs = {mode: host_cost_by_inputs(fns[mode], args.profile_steps)
                             for mode in ("plain", "overlap.shard")}
            del fns

    where = ("CUDA, NCCL 1-rank group; step = wall with one sync per sample, host = until issued"
             if device.type == "cuda" else "CPU, gloo 1-rank group; the CPU computes too: step ms = host ms")
    tokens = CONFIGS["small"][1] if device.type == "cuda" else CPU_SMALL[1]
    stat = "medians" if args.statistic == "median" else "fastest"
    emit(f"Host-bound training step (LayerNorm + Linear d->4d->d blocks, AdamW, fp32, batch {tokens} "
         f"tokens), world size 1 — {where}; {stat} of {args.repeats} interleaved rounds of {args.steps} steps",
         ["config", "mode", "step ms", "host ms", "step vs plain"], rows, args.markdown)
    d, tokens_small = CONFIGS["small"] if device.type == "cuda" else CPU_SMALL
    with single_rank_group(device):
        opt_rows = optimizer_rows(args.blocks, d, tokens_small, device, args.steps, args.repeats, args.statistic)
    params = args.blocks * sum(1 for _ in Block(1).parameters())
    emit(f"Optimizer step alone over the small config's {params} parameters ({args.blocks} blocks, "
         f"d={d}), world size 1 — {where}; {stat} of {args.repeats} interleaved rounds of {args.steps} steps",
         ["optimizer", "mode", "step µs", "host µs", "step vs plain"], opt_rows, args.markdown)
    with single_rank_group(device):
        rows_by_phase = phase_rows(args.blocks, d, tokens_small, device, args.steps, args.repeats, args.statistic)
    emit(f"The small config's step by phase ({args.blocks} blocks, d={d}), host ms, world size 1 — {where}; {stat} "
         f"of {args.repeats} interleaved rounds of {args.steps} steps; '{NOOP_HOOKS}': plain with the runtime's "
         f"kinds of hooks doing nothing (torch's hook mechanism)",
         ["phase", "mode", "host ms", "vs plain", f"µs per block over '{NOOP_HOOKS}'"], rows_by_phase, args.markdown)
    prof_rows = [[mode, name, f"{us:.0f}", f"{calls:g}"] for mode, ops in profiles.items() for name, us, calls in ops]
    emit(f"Top host costs of the small config ({args.blocks} blocks): torch.profiler self CPU µs per step, "
         f"{args.profile_steps} profiled steps per mode", ["mode", "op", "self CPU µs per step", "calls per step"],
         prof_rows, args.markdown)
    emit(f"Where overlap.shard's host time grows over plain's, by op and inputs (small config, "
         f"{args.blocks} blocks): torch.profiler with record_shapes, {args.profile_steps} profiled steps per "
         f"mode; the {DIFFERING_OPS} ops that grow most, each with its costliest input variants; thread: main "
         f"= the caller's, other = autograd's device threads",
         ["op", "input shapes", "input strides", "thread", "plain calls per step", "plain self µs per call",
          "overlap calls per step", "overlap self µs per call"],
         differing_host_costs(by_inputs["plain"], by_inputs["overlap.shard"], DIFFERING_OPS), args.markdown)


if __name__ == "__main__":
    main()
