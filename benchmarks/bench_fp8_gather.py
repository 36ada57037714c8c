"""fp8 vs int8 compressed all-gathers: the error of the gathered parameters, of the gradients, and the loss vs exact.

On ``--world-size`` gloo ranks, the tests' ``TinyLM`` (``tests/models.py``, seed and batches of the
tests; ``--dim`` / ``--layers`` to grow it) is sharded with ``overlap.shard`` block by block then at
the root and trained ``--steps`` steps with the tests' AdamW (lr 1e-2), fp32, once per mode: exact;
``Compression(gather=F, reduce=None)`` for F in int8 and fp8 (only the gather is quantized, so every
difference from exact comes from it); and ``Compression(gather=F, reduce="int8")``. Block
``--block``. Every step of a compressed run measures, on its own current parameters:

* parameter error: ``||gathered - full|| / ||full||`` over all parameters, where ``gathered`` is
  what the quantized all-gather makes of the full parameters (the public kernel ops, per parameter:
  the blocks the runtime uses, tests/shard/test_compression.py checks it gathers exactly these);
* gradient error: ``||grad - exact grad|| / ||exact grad||``, ``grad`` the run's reduced gradient,
  ``exact grad`` that of an unsharded copy holding the same full parameters on the same global batch.

Reported: median and max of both over the steps, the final global loss and its difference from the
exact run's, the mean over the last 10 steps, and the held-out loss of the final weights (exact
forward, ``EVAL_BATCHES`` unseen batches: less batch noise than one step's loss). A second table
quantizes synthetic blocks (``--synthetic-blocks`` blocks of ``--block``) in both formats: Gaussian
values (like weights) and values whose magnitudes span decades (log-normal, sigma 2: like
activations' gradients), relative RMS error of the round trip.

    python benchmarks/bench_fp8_gather.py [--steps 100] [--markdown benchmarks/RESULTS.md]

Losses and errors are deterministic for a given torch (no timings are measured).
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any, Optional

from _common import add_steps, add_world_size, parse, parser  # first: sys.path
import torch

import overlap
from overlap_kernels import ShardLayout
from overlap_kernels._launch import torch_fallback_on_cpu
from overlap_kernels.quantized_all_gather_copy_out import quantized_all_gather_copy_out
from overlap_kernels.quantized_copy_in import quantized_all_gather_copy_in
from overlap_kernels.quantized_layout import QuantizedLayout
from models import SEED, TinyLM, global_mean, local_batch, make_batch, make_optimizer
from overlap.testing import run_distributed
from report import emit

EVAL_BATCHES = 16
EVAL_SEED = 10_000

MODES: dict[str, tuple[Optional[str], Optional[str]]] = {
    "exact": (None, None),
    "int8 gather": ("int8", None),
    "fp8 gather": ("fp8", None),
    "int8 gather + int8 reduce": ("int8", "int8"),
    "fp8 gather + int8 reduce": ("fp8", "int8"),
}


def _model(args: argparse.Namespace, compress: Optional[overlap.Compression]) -> TinyLM:
    torch.manual_seed(SEED)
    model = TinyLM(dim=args.dim, layers=args.layers)
    for block in model.blocks:  # FSDP2's depth, as in this table's earlier rows: the formats are the subject
        overlap.shard(block, compress=compress, prefetch=1)
    return overlap.shard(model, compress=compress, prefetch=1)


def _gathered(full: torch.Tensor, world: int, block: int, format: str) -> torch.Tensor:
    """What a ``format`` all-gather over ``world`` ranks makes of the full parameter ``full``."""
    qlayout = QuantizedLayout(ShardLayout([tuple(full.shape)], world), block, format)
    buffer = torch.cat([quantized_all_gather_copy_in([qlayout.layout.shard(full, r)], qlayout, r)[0]
                        for r in range(world)])
    return quantized_all_gather_copy_out(buffer, qlayout)[0]


def _relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((g - w).double().square().sum()) for g, w in zip(got, want))
    den = sum(float(w.double().square().sum()) for w in want)
    return (num / den) ** 0.5


def _run(rank: int, world: int, args: argparse.Namespace, gather: Optional[str], reduce: Optional[str],
         ) -> dict[str, Any]:
    compress = overlap.Compression(gather=gather, reduce=reduce, block=args.block) if gather or reduce else None
    model = _model(args, compress)
    opt = make_optimizer(model.parameters())
    plain = TinyLM(dim=args.dim, layers=args.layers)
    out: dict[str, Any] = {"loss": [], "param_error": [], "grad_error": []}
    for step in range(args.steps):
        batch = make_batch(step)
        if compress is not None:
            full = {k: v.detach().full_tensor() for k, v in model.named_parameters()}
            out["param_error"].append(_relative([_gathered(t, world, args.block, gather) for t in full.values()],
                                                list(full.values())) if gather else 0.0)
            plain.load_state_dict(full, strict=False)
            plain.zero_grad(set_to_none=True)
            plain.loss(batch).backward()
            exact_grads = dict(plain.named_parameters())
        loss = model.loss(local_batch(batch, rank, world))
        loss.backward()
        if compress is not None:
            names = [k for k, _ in model.named_parameters()]
            grads = [p.grad.full_tensor() for _, p in model.named_parameters()]
            out["grad_error"].append(_relative(grads, [exact_grads[k].grad for k in names]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["loss"].append(global_mean(loss))
    full = {k: v.detach().full_tensor() for k, v in model.named_parameters()}
    plain.load_state_dict(full, strict=False)
    with torch.no_grad():
        out["held_out"] = statistics.mean(float(plain.loss(make_batch(EVAL_SEED + i))) for i in range(EVAL_BATCHES))
    return out


def _synthetic(args: argparse.Namespace) -> list[list[str]]:
    """Round-trip relative RMS error of synthetic blocks in both formats (one rank, torch path)."""
    gen = torch.Generator().manual_seed(0)
    n = args.synthetic_blocks * args.block
    gauss = torch.randn(n, generator=gen)
    spread = torch.randn(n, generator=gen).sign() * torch.exp(2.0 * torch.randn(n, generator=gen))
    rows = []
    for name, x in (("Gaussian", gauss), ("log-normal magnitudes, sigma 2", spread)):
        errors = []
        for format in ("int8", "fp8"):
            with torch_fallback_on_cpu():
                y = _gathered(x, 1, args.block, format)
            small = x.abs() < x.abs().median()
            errors += [f"{100 * _relative([y], [x]):.3f}%",
                       f"{100 * float(((y - x)[small] / x[small]).abs().median()):.3f}%"]
        rows.append([name, *errors])
    return rows


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    with torch_fallback_on_cpu():  # the torch path: bitwise the kernels' result (tested), without the interpreter
        return {mode: _run(rank, world, args, *formats) for mode, formats in MODES.items()}


def main(argv: Optional[list[str]] = None) -> None:
    p = parser(__doc__)
    add_world_size(p)
    add_steps(p, 100, "training steps per run")
    p.add_argument("--block", type=int, default=256, help="elements per scale (default 256)")
    p.add_argument("--dim", type=int, default=30, help="TinyLM width (default 30, the tests')")
    p.add_argument("--layers", type=int, default=2, help="TinyLM blocks (default 2)")
    p.add_argument("--synthetic-blocks", type=int, default=64, help="blocks per synthetic table row (default 64)")
    args = parse(p, argv)
    results = run_distributed(_rank, args.world_size, args, timeout=3600)[0]
    exact = results["exact"]["loss"]
    rows = []
    for mode, r in results.items():
        loss = r["loss"]
        diff = (loss[-1] - exact[-1]) / exact[-1]
        last10 = (statistics.mean(loss[-10:]) - statistics.mean(exact[-10:])) / statistics.mean(exact[-10:])
        pe, ge = r["param_error"], r["grad_error"]
        held = (r["held_out"] - results["exact"]["held_out"]) / results["exact"]["held_out"]
        rows.append([mode, f"{loss[0]:.4f}", f"{loss[-1]:.4f}", f"{100 * diff:+.3f}%", f"{100 * last10:+.3f}%",
                     f"{r['held_out']:.4f} ({100 * held:+.3f}%)",
                     f"{100 * statistics.median(pe):.3f}% / {100 * max(pe):.3f}%" if pe and max(pe) else "-",
                     f"{100 * statistics.median(ge):.3f}% / {100 * max(ge):.3f}%" if ge else "-"])
    emit(f"fp8 vs int8 compressed all-gathers: TinyLM (dim {args.dim}, {args.layers} layers), {args.world_size} "
         f"CPU ranks (gloo), {args.steps} steps, AdamW lr 1e-2, fp32, block {args.block}; errors per step on the "
         f"run's own parameters (median / max over steps)",
         ["run", "first loss", "final loss", "final vs exact", "last-10 mean vs exact", "held-out (vs exact)",
          "gathered param rel. error", "grad rel. error vs exact grad"], rows, args.markdown)
    emit(f"int8 vs fp8 round trip of synthetic blocks ({args.synthetic_blocks} blocks of {args.block}, one rank)",
         ["values", "int8 rel. RMS error", "int8 median rel. error, smaller half", "fp8 rel. RMS error",
          "fp8 median rel. error, smaller half"], _synthetic(args), args.markdown)


if __name__ == "__main__":
    main()
