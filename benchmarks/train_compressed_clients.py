"""Compressed (int8) vs exact training of the client models: loss curves, final loss, gradient error per step.

On ``--world-size`` gloo ranks, each client model of tests/clients (nanoGPT-style ``GPT`` and the
torchtitan-style Llama 3 ``Transformer``, their default small configs) is built from the tests' seed,
sharded with ``overlap.shard`` block by block then at the root, and trained ``--steps`` steps with the
tests' AdamW on the tests' batches (``models.make_batch``: counting sequences with 10% noise), twice:
exact, and with ``compress=overlap.Compression()`` (int8 all-gathers and int8 all-to-all reductions,
block 256). The compressed run measures the relative error of its reduced gradients every step
(``overlap.set_measure_gradient_error``: an extra exact reduce-scatter to compare with, which changes
no gradient), over every rank's shards. Reports the final loss of both runs (global mean over the
ranks), the relative difference (the issue's goal: within 1%), the mean over the last 10 steps, and
the gradient error (median and max over steps); ``--plot`` draws both loss curves per client.

    python benchmarks/train_compressed_clients.py [--steps 300] [--plot docs/compressed_training.png]

Losses are deterministic (the same on any machine with the same torch): timings are not measured.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

from _common import TESTS, add_steps, add_world_size, parse, parser  # first: sys.path

from overlap.testing import run_distributed
from report import emit

sys.path.append(os.path.join(TESTS, "clients"))
from client_zoo import GLOBAL_BATCH  # noqa: E402
from compressed_training import CLIENTS, EVAL_BATCHES, train_clients  # noqa: E402


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    return train_clients(rank, world, args.clients, args.steps)


def _plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.0), dpi=80, squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        ax.plot(r["exact"]["loss"], label="exact", linewidth=1.2)
        ax.plot(r["int8"]["loss"], label="int8 gather + reduce", linewidth=1.0, linestyle="--")
        ax.text(0.02, 0.04, f"held-out loss: exact {r['exact']['eval']:.3f}, int8 {r['int8']['eval']:.3f}",
                transform=ax.transAxes, fontsize=8)
        ax.set_title(f"{name}, 2 gloo ranks")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    add_world_size(p)
    add_steps(p, 300, "training steps per run")
    p.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS),
                   help=f"client models (default: {' '.join(CLIENTS)})")
    p.add_argument("--plot", default=None, help="write both loss curves per client to this PNG (needs matplotlib)")
    args = parse(p, argv)
    if GLOBAL_BATCH % args.world_size:
        p.error(f"--world-size must divide the global batch of {GLOBAL_BATCH}, got {args.world_size}")
    results = run_distributed(_rank, args.world_size, args, timeout=3600)[0]
    rows = []
    for name, r in results.items():
        exact = r["exact"]
        for mode in ("int8", "bf16 reduce"):
            run = r[mode]
            final = abs(run["loss"][-1] - exact["loss"][-1]) / exact["loss"][-1]
            last50 = _rel(statistics.mean(run["loss"][-50:]), statistics.mean(exact["loss"][-50:]))
            held_out = _rel(run["eval"], exact["eval"])
            errors = run["gradient_error"]
            rows.append([name, mode, f"{exact['loss'][-1]:.4f}", f"{run['loss'][-1]:.4f}", f"{100 * final:.2f}%",
                         f"{100 * last50:+.2f}%", f"{exact['eval']:.4f}", f"{run['eval']:.4f}", f"{100 * held_out:+.2f}%",
                         f"{100 * statistics.median(errors):.2f}% / {100 * max(errors):.2f}%" if errors else "-"])
    emit(f"Compressed training of the client models, {args.world_size} CPU ranks (gloo), {args.steps} steps, "
         f"AdamW lr 1e-2, fp32; int8 = overlap.Compression() (gather and reduce, block 256); bf16 reduce = "
         f"exact collectives, gradients reduced in bfloat16 (control: a smaller perturbation); "
         f"held-out = mean loss of the final weights over {EVAL_BATCHES} unseen batches",
         ["client", "run", "final loss exact", "final loss run", "|final diff|", "last-50 mean diff",
          "held-out exact", "held-out run", "held-out diff", "grad error median / max"], rows, args.markdown)
    if args.plot:
        _plot(results, args.plot)
        print(f"wrote {args.plot}")


def _rel(value: float, reference: float) -> float:
    return (value - reference) / reference


if __name__ == "__main__":
    main()
