"""The sharding runtime's own CPU cost per block: overlap.shard vs torch FSDP2 on tiny blocks, world size 1.

What is measured. One process joins a 1-rank gloo group (an in-memory store,
``init_process_group("gloo", rank=0, world_size=1)``), so no collective moves data: what a sharded
step takes beyond the same model unsharded is the runtime's own bookkeeping (hooks, DTensor
wrapping, packing, casts, state machines). The model is ``--blocks`` tiny blocks, each
``nn.Linear(16, 16)`` + tanh, on a batch of 8 rows. Three parameter setups, each in three modes:

* setups: fp32 parameters; bf16 parameters (the model built in bfloat16); fp32 parameters with
  mixed precision (``overlap.MixedPrecision`` / FSDP2 ``MixedPrecisionPolicy`` with
  ``param_dtype=torch.bfloat16``), whose unsharded baseline is the bf16 model (the same math);
* modes: the plain unsharded model (baseline); ``overlap.shard`` on each block, then the root;
  torch FSDP2 ``fully_shard`` on each block, then the root (both over the 1-rank group, other
  options default: ``overlap.demo.training.shard_for_mode``).

Table 1, forward + backward: one step is ``zero_grad(set_to_none=True)``, forward, ``sum()``,
backward. "Runtime cost per block" is (mode's step - plain step of the same round) / blocks,
median over rounds; the ratio is overlap's cost over FSDP2's. Both runtimes shortcut world size 1
differently: without a cast overlap's unsharded parameters alias the shards (no packing), FSDP2
skips its all-gather and copies (casts) each shard into its unsharded parameter; with
``param_dtype`` overlap runs its full pack / unpack path (all-gather copy-in and copy-out in forward
and again in backward, reduce-scatter copy-in and epilogue), so that row prices its packing too.

Table 2, optimizer step: a torch optimizer over each model's parameters (plain tensors, or the
sharded DTensors of overlap and FSDP2), timed on ``opt.step()`` alone after one backward has left
gradients in place; ratio overlap / FSDP2. Optimizers (``OPTIMIZERS``): AdamW with the default
``foreach=None`` (on CPU torch then picks the per-tensor loop: its foreach default covers CUDA-like
devices only), ``foreach=False``, ``foreach=True`` (what the default gives on GPUs) and
``fused=True``; SGD with momentum 0.9, default, ``foreach=True`` and ``fused=True`` (fused SGD has
no DTensor strategy in torch: FSDP2's step and the DTensor path raise, so that row has plain and
overlap.shard only; "-" in the others). overlap.shard runs twice: as shipped (its steps run
on the local tensors, ``overlap/local_optimizer_step.py``) and with that turned off
(``overlap.set_local_optimizer_step(False)`` around the step: torch's DTensor path, what FSDP2 runs).

Where the time goes (issue 28, part 2). Each runtime entry point wrapped in ``time.perf_counter``
(inclusive µs per block, median step; the wrappers add about 0.4 µs per call), 2026-11-26, before
(a6653c1) and after (84d015a), run back to back:

==============================================  ============  ============
item                                            fp32          fp32 + MP
==============================================  ============  ============
pre-forward hook                                28.7 -> 16.3  46.6 -> 20.8
  of it, hooks on the inputs' gradients         16.6 ->  7.2  16.6 ->  5.4
gathers, forward and backward (MP: a cast)      10.3 ->  7.6  39.3 -> 19.6
post-forward hook                                9.2 ->  8.8  10.5 ->  7.7
pre-backward hook                               16.4 ->  9.5  31.7 -> 13.8
gradient hooks and the reduction                40.1 -> 22.8  49.5 -> 25.7
  of it, gradients to the sharded DTensors      29.3 -> 14.8  37.1 -> 17.6
end of backward (per block)                      3.1 ->  2.4   2.9 ->  1.6
zero_grad over the plain model's                 4.7 ->  3.3   3.0 ->  1.6
==============================================  ============  ============

What the DTensor switch (5a16e24) had added was spread thin rather than one dispatch: a gradient
DTensor built through ``DTensor.__init__``'s Dynamo and export wrappers (3.4 µs, now 1.0 with
``__new__`` alone), a no-op ``view`` of each moved gradient, ``torch.no_grad()`` and
``_unsafe_preserve_version_counter`` objects per call (1.8 µs each, now the switches they wrap),
pytree traversals of every block's arguments and outputs (6.7 µs), and a copy of the rest of the
forward order per block (quadratic in blocks). No step dispatches through DTensor: autograd
accumulates into the plain unsharded parameters. What is left beyond these entry points is torch's
own hook dispatch (hooks of the same kinds that do nothing cost about 14 µs per block) and, with
mixed precision, the two casts and frees per step that ``reshard_after_forward`` asks for
(``_cast_into_unsharded``: a resize, a version-preserving ``_foreach_copy_`` cast) and the fp32
gradient each reduction allocates.

Mixed precision, fourth pass (2026-11-27, a03c96b -> block-cost2): what the MP row pays beyond fp32,
each piece stubbed out in the same process as the whole step (µs per block, fastest of 60-150
interleaved rounds, thread time, loaded box: about ±3 µs): the two cast gathers ~10 (of it the
shards' ``requires_grad`` pass ~2), the gradient move with its cast and the later free 30 vs fp32's
18, the input cast 1-2; shared by every row, the input-gradient tensor hooks 10-14 and the
``torch._dynamo.disable`` wrappers of the forward hooks 4-10. Removed: the input tensor hooks of a
chain of blocks (watched inside the previous block's output pre-hook), backward's ``requires_grad``
pass, the already-cast input's ``_cast_floating``, per-parameter steps in the gradient move.

How it is timed. All models are built first; then each round times every mode once for ``--steps``
calls (``timing.seconds_per_call``), the modes interleaved (A B C A B C ..., the order rotated each
round), so that load from other processes on the box hits all modes alike; figures are medians over
``--repeats`` rounds. ``TRITON_INTERPRET`` is left unset: on CPU the packing runs its torch fallback.
``--statistic min`` reports each mode's fastest round instead (costs: fastest mode round minus
fastest plain round): on a box loaded by other processes (load average several times the cores)
medians of these sub-millisecond calls scatter by 2x between runs, while the fastest of many rounds
is the run the load left alone; use it with many ``--repeats``.

    python benchmarks/bench_runtime_cost.py [--blocks 64] [--steps 10] [--repeats 31] [--statistic median]
                                            [--markdown benchmarks/RESULTS.md]
"""
from __future__ import annotations

import os
import statistics
import sys
from typing import Any, Callable, Optional

import torch
from torch import nn

from _common import parse, parser, single_rank_group  # first: sys.path
import overlap
from overlap.demo.training import shard_for_mode
from report import emit
from timing import seconds_per_call

WIDTH, BATCH = 16, 8
# setup -> (parameter dtype, compute dtype under mixed precision or None)
SETUPS = {"fp32": (torch.float32, None), "bf16 params": (torch.bfloat16, None),
          "fp32 + MP bf16": (torch.float32, torch.bfloat16)}
MODES = ("plain", "overlap.shard", "torch FSDP2")
_TRAINING_MODES = {"overlap.shard": "overlap", "torch FSDP2": "fsdp2"}  # overlap.demo.training's names
DTENSOR_PATH = "overlap.shard, DTensor path"  # the optimizer table's extra mode: the local step turned off
OPT_MODES = ("plain", "overlap.shard", DTENSOR_PATH, "torch FSDP2")
# label -> (optimizer class, its arguments besides the parameters)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdamW default (per-tensor on CPU)": (torch.optim.AdamW, {"lr": 1e-4}),
    "AdamW foreach=False": (torch.optim.AdamW, {"lr": 1e-4, "foreach": False}),
    "AdamW foreach=True": (torch.optim.AdamW, {"lr": 1e-4, "foreach": True}),
    "AdamW fused=True": (torch.optim.AdamW, {"lr": 1e-4, "fused": True}),
    "SGD momentum default (per-tensor on CPU)": (torch.optim.SGD, {"lr": 1e-4, "momentum": 0.9}),
    "SGD momentum foreach=True": (torch.optim.SGD, {"lr": 1e-4, "momentum": 0.9, "foreach": True}),
    "SGD momentum fused=True": (torch.optim.SGD, {"lr": 1e-4, "momentum": 0.9, "fused": True}),
}
NO_DTENSOR_PATH = {"SGD momentum fused=True"}  # torch has no DTensor strategy for aten._fused_sgd_: those raise


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def _model(blocks: int, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(blocks)]).to(dtype)


def _shard(mode: str, model: nn.Sequential, mp_dtype: Optional[torch.dtype]) -> nn.Sequential:
    """``model`` sharded in place for ``mode`` (each block, then the root), computing in ``mp_dtype``
    (bfloat16 or None: the parameters' dtype)."""
    if mode != "plain":
        assert mp_dtype in (None, torch.bfloat16), mp_dtype
        shard_for_mode(_TRAINING_MODES[mode], model, list(model), bf16=mp_dtype is not None)
    return model


def _fwd_bwd(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
    return step


def _opt_step(model: nn.Module, x: torch.Tensor, optimizer: type[torch.optim.Optimizer], kwargs: dict[str, Any],
              local_step: bool = True) -> Callable[[], None]:
    """``opt.step`` of a new ``optimizer`` over ``model``'s parameters after one backward; with
    ``local_step=False`` the step runs with overlap's local optimizer step turned off."""
    opt = optimizer(model.parameters(), **kwargs)
    model(x).sum().backward()
    if local_step:
        return opt.step

    def dtensor_step() -> None:
        previous = overlap.set_local_optimizer_step(False)
        try:
            opt.step()
        finally:
            overlap.set_local_optimizer_step(previous)
    return dtensor_step


def _interleaved(fns: dict[str, Callable[[], None]], steps: int, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Per-call seconds of each ``fns`` entry, one sample per round, the entries interleaved and
    their order rotated each round."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(seconds_per_call(fns[name], steps, repeats=1, warmup=0))
    return samples


def _paired_cost(samples: dict[str, list[float]], mode: str, base: str, statistic: str = "median") -> float:
    """Median over rounds of (mode - base) in the same round, seconds; with ``statistic="min"`` the
    fastest round of ``mode`` minus the fastest of ``base``."""
    if statistic == "min":
        return min(samples[mode]) - min(samples[base])
    return statistics.median(m - b for m, b in zip(samples[mode], samples[base]))


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--blocks", type=int, default=64, help="tiny Linear+tanh blocks (default 64)")
    p.add_argument("--steps", type=int, default=10, help="timed calls per mode per round (default 10)")
    p.add_argument("--repeats", type=int, default=31, help="interleaved rounds; figures are medians (default 31)")
    p.add_argument("--statistic", choices=("median", "min"), default="median",
                   help="over rounds: median (default), or min: each mode's fastest round (a loaded box)")
    args = parse(p, argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("note: TRITON_INTERPRET is set; unset it to time the CPU torch fallback", file=sys.stderr)

    with single_rank_group():
        fwd: dict[str, Callable[[], None]] = {}
        opt: dict[str, Callable[[], None]] = {}
        for setup, (dtype, mp_dtype) in SETUPS.items():
            x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
            for mode in MODES:
                # The mixed-precision baseline is the bf16 model: the same math, no runtime.
                model_dtype = mp_dtype if mode == "plain" and mp_dtype is not None else dtype
                xin = x.to(model_dtype)
                fwd[f"{setup}|{mode}"] = _fwd_bwd(_shard(mode, _model(args.blocks, model_dtype), mp_dtype), xin)
                if mp_dtype is None:  # under MP the optimizer sees the same fp32 shards as "fp32"
                    for impl, (optimizer, kwargs) in OPTIMIZERS.items():
                        if impl in NO_DTENSOR_PATH and mode == "torch FSDP2":
                            continue
                        model = _shard(mode, _model(args.blocks, dtype), None)
                        opt[f"{setup}, {impl}|{mode}"] = _opt_step(model, xin, optimizer, kwargs)
                        if mode == "overlap.shard" and impl not in NO_DTENSOR_PATH:
                            model = _shard(mode, _model(args.blocks, dtype), None)
                            opt[f"{setup}, {impl}|{DTENSOR_PATH}"] = _opt_step(model, xin, optimizer, kwargs,
                                                                                local_step=False)
        warmup = max(3, args.steps // 2)
        fwd_s = _interleaved(fwd, args.steps, args.repeats, warmup)
        opt_s = _interleaved(opt, args.steps, args.repeats, warmup)

    n, med = args.blocks, (min if args.statistic == "min" else statistics.median)
    over = "fastest" if args.statistic == "min" else "medians"
    rows = []
    for setup, (_, mp_dtype) in SETUPS.items():
        cost = {mode: _paired_cost(fwd_s, f"{setup}|{mode}", f"{setup}|plain", args.statistic) for mode in MODES[1:]}
        for mode in MODES:
            t = med(fwd_s[f"{setup}|{mode}"])
            label = mode + (" (bf16 model)" if mode == "plain" and mp_dtype is not None else "")
            per_block = "-" if mode == "plain" else f"{1e6 * cost[mode] / n:.1f}"
            ratio = f"{cost['overlap.shard'] / cost['torch FSDP2']:.2f}x" if mode == "overlap.shard" else "-"
            rows.append([setup, label, f"{1e3 * t:.2f}", per_block, ratio])
    emit(f"Runtime CPU cost per block: zero_grad + fwd + bwd of {n} blocks Linear({WIDTH}, {WIDTH}) + tanh, batch "
         f"{BATCH}, world size 1 (1-rank gloo); {over} of {args.repeats} interleaved rounds of {args.steps} steps",
         ["params", "mode", "ms per step", "runtime cost per block µs (step - plain) / blocks",
          "cost overlap / FSDP2"], rows, args.markdown)

    rows = []
    for setup in dict.fromkeys(key.split("|")[0] for key in opt_s):
        t = {mode: med(opt_s[f"{setup}|{mode}"]) for mode in OPT_MODES if f"{setup}|{mode}" in opt_s}
        for mode in OPT_MODES:
            if mode not in t:
                rows.append([setup, mode, "- (raises)", "-", "-"])
                continue
            fsdp2 = t.get("torch FSDP2")
            ratio = f"{t[mode] / fsdp2:.2f}x" if mode.startswith("overlap.shard") and fsdp2 else "-"
            rows.append([setup, mode, f"{1e6 * t[mode]:.0f}", f"{t[mode] / t['plain']:.2f}x", ratio])
    emit(f"Optimizer step: torch.optim.AdamW and SGD over the {2 * n} parameters of {n} Linear({WIDTH}, {WIDTH}) "
         f"blocks (plain tensors vs sharded DTensors), world size 1; {over} of {args.repeats} interleaved rounds "
         f"of {args.steps} steps", ["params, optimizer", "mode", "µs per step", "vs plain", "overlap / FSDP2"],
         rows, args.markdown)


if __name__ == "__main__":
    main()
