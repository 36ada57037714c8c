"""Compressed collectives (``overlap.Compression()``: int8 gathers and reductions) train the client
models like exact collectives (issue 30): 2 gloo ranks, the nanoGPT-style and Llama-style clients,
side by side from the same weights (``compressed_training.py``).

[Note: what "within 1%" compares]
The final *training-batch* loss is a poor yardstick on these tiny models: one batch is 6 sequences
of 8 tokens, the loss jumps by +-20% from step to step, and any perturbation moves the trajectory
(over 300 steps, reducing the exact run's gradients in bf16 instead, a smaller perturbation than
int8's, moved nanoGPT's final batch loss by 5.9%). The checks compare the held-out loss of the final
weights (mean over 16 unseen batches, weights unsharded exactly). At the tests' constant lr 1e-2 one
seed's held-out difference says nothing on nanoGPT: a one-ulp nudge of the initial weights moves it
by up to 3.8%, int8 by up to 5.7% either way ([Note: the noise floor of the client runs] in
``compressed_training.py``). So the 300-step test (``-m slow``) trains nanoGPT's own recipe
(``warmup-cosine``), where the floor is below 2e-5 % and int8 measured within 0.19% of exact on each
of seeds 0-8: it checks seeds 0-2, each within the issue's 1%, and their mean within 1% by
``seed_spread.goal_verdict`` (mean plus two standard errors). The relative gradient error per step
was 0.7-1.5% (median ~0.95%); the bound 2% leaves room for other seeds and torch versions, and a
zero error would mean nothing was quantized.

The default suite trains 20 steps at the constant lr, still in the fast early descent, where the
runs part further: held-out difference measured at 10 / 20 / 30 steps: nanoGPT -0.93% / -3.78% /
-1.85% (int8 *below* exact), Llama +0.04% / -0.02% / -0.04%. So the short test allows 5% for
nanoGPT (the measured 3.8% plus margin) and 1% for Llama: it checks that compressed training runs
and learns, the 1% goal is the 300-step test's.
"""
from __future__ import annotations

import pytest

from compressed_training import train_clients
from seed_spread import GOAL, goal_verdict, spread

SHORT_RUN_RTOL = {"nanogpt": 0.05, "llama3": 0.01}  # 20 steps: see the module docstring
MAX_GRADIENT_ERROR = 0.02
DEFAULT_STEPS = 20  # the default suite's budget (<= ~30 steps)
SLOW_STEPS = 300
SLOW_SEEDS = (0, 1, 2)
SLOW_SCHEDULE = "warmup-cosine"  # [Note: what "within 1%" compares]


def _check(results: dict, steps: int, rtol: dict[str, float]) -> None:
    for name, r in results.items():
        exact, int8 = r["exact"], r["int8"]
        assert len(int8["loss"]) == len(int8["gradient_error"]) == steps
        assert abs(int8["eval"] - exact["eval"]) <= rtol[name] * exact["eval"], (name, int8["eval"], exact["eval"])
        assert all(0 < e < MAX_GRADIENT_ERROR for e in int8["gradient_error"]), (name, int8["gradient_error"])
        assert exact["eval"] < 0.95 * exact["loss"][0] and int8["eval"] < 0.95 * int8["loss"][0]  # both learned


@pytest.mark.torch_kernels
def test_compressed_training_tracks_exact_on_the_clients(distributed) -> None:
    """A short run of both clients (the default suite): held-out loss within ``SHORT_RUN_RTOL``,
    gradient error per step in (0, 2%), and both runs learned."""
    results = distributed(train_clients, 2, ("nanogpt", "llama3"), DEFAULT_STEPS, ("exact", "int8"))[0]
    _check(results, DEFAULT_STEPS, SHORT_RUN_RTOL)


@pytest.mark.slow
@pytest.mark.torch_kernels
def test_compressed_training_300_steps(distributed) -> None:
    """The issue's run: 300 steps of both clients under nanoGPT's recipe, seeds 0-2: each seed's
    held-out loss within 1% of exact's, the same checks as above, and the mean over the seeds within
    1% with two standard errors to spare."""
    diffs: dict[str, list[float]] = {}
    for seed in SLOW_SEEDS:
        results = distributed(train_clients, 2, ("nanogpt", "llama3"), SLOW_STEPS, ("exact", "int8"), seed,
                              SLOW_SCHEDULE, timeout=900)[0]
        _check(results, SLOW_STEPS, {name: GOAL for name in results})
        for name, r in results.items():
            diffs.setdefault(name, []).append((r["int8"]["eval"] - r["exact"]["eval"]) / r["exact"]["eval"])
    for name, d in diffs.items():
        assert goal_verdict(spread(d)) == "yes", (name, d)
