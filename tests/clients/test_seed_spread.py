"""The pieces of the seed sweep (``benchmarks/train_compressed_clients.py --seeds``): the one-ulp
nudge of the noise floor's run, the learning-rate schedules, and the statistics and verdicts over
seeds ([Note: the noise floor of the client runs] in ``compressed_training.py``)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from compressed_training import MIN_LR_FACTOR, WARMUP, lr_factor, nudge_by_one_ulp, train
from client_zoo import NANOGPT
from seed_spread import Spread, floor_verdict, goal_verdict, spread


def test_the_floor_moves_every_weight_by_exactly_one_ulp_up() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7))
    with torch.no_grad():
        model[0].weight[0, :3] = torch.tensor([0.0, -1.0, 2.0**-126])  # zero, negative, a normal's edge
    before = [p.detach().clone() for p in model.parameters()]
    nudge_by_one_ulp(model)
    for old, new in zip(before, model.parameters()):
        assert (new > old).all()
        # one ulp: the next float32 up, no float32 between them
        assert torch.equal(new, torch.nextafter(old, torch.full_like(old, math.inf)))
        assert torch.equal(torch.nextafter(new, torch.full_like(new, -math.inf)), old)


def test_lr_factor_constant_and_warmup_cosine() -> None:
    steps = 300
    assert all(lr_factor("constant", s, steps) == 1.0 for s in range(steps))
    f = [lr_factor("warmup-cosine", s, steps) for s in range(steps)]
    warmup = round(WARMUP * steps)
    assert f[0] == pytest.approx(1 / warmup) and f[warmup - 1] == pytest.approx(1.0) and f[warmup] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(f[:warmup - 1], f[1:warmup]))  # rises through the warmup
    assert all(a >= b for a, b in zip(f[warmup:], f[warmup + 1:]))  # then only falls
    assert f[-1] == pytest.approx(MIN_LR_FACTOR)
    assert f[warmup + (steps - 1 - warmup) // 2] == pytest.approx((1 + MIN_LR_FACTOR) / 2, abs=0.01)  # cosine midpoint


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(mode="int4"), "mode must be one of"),
    (dict(schedule="linear"), "schedule must be one of"),
    (dict(seed=9), "seed must be an int in 0..8"),
    (dict(eval_batches=0), "eval_batches must be an int in 1..1000"),
])
def test_train_refuses_bad_arguments_before_it_builds(kwargs: dict, message: str) -> None:
    args = dict(mode="exact", schedule="constant", seed=0, eval_batches=16) | kwargs
    with pytest.raises(ValueError, match=message):
        train(NANOGPT, args["mode"], 1, 0, 1, args["seed"], args["schedule"], args["eval_batches"])


def test_spread_statistics() -> None:
    s = spread([0.01, -0.03, 0.02, 0.0])
    assert s.n == 4 and s.mean == pytest.approx(0.0)
    assert s.sem == pytest.approx(math.sqrt((0.01**2 + 0.03**2 + 0.02**2) / 3) / 2)
    assert s.rms == pytest.approx(math.sqrt((0.01**2 + 0.03**2 + 0.02**2) / 4))
    assert s.largest == pytest.approx(0.03)
    for bad in ([0.01], [], [0.0, math.nan], [math.inf, 0.0]):
        with pytest.raises(ValueError, match="at least two finite values"):
            spread(bad)


@pytest.mark.parametrize(("mean", "sem", "verdict"), [
    (0.002, 0.001, "yes"),        # 0.2% + 2 x 0.1% <= 1%
    (-0.009, 0.0004, "yes"),      # either sign
    (0.005, 0.003, "undecided"),  # 0.5% + 0.6% > 1% > 0.5% - 0.6%
    (0.0, 0.02, "undecided"),     # mean 0, but 2 s.e. reach 4%
    (-0.02, 0.004, "no"),         # 2% - 0.8% > 1%
])
def test_goal_verdict(mean: float, sem: float, verdict: str) -> None:
    assert goal_verdict(Spread(n=9, mean=mean, sem=sem, rms=abs(mean), largest=abs(mean))) == verdict


def test_floor_verdict() -> None:
    floor = Spread(n=9, mean=0.0, sem=0.01, rms=0.02, largest=0.05)
    assert floor_verdict(Spread(9, 0.0, 0.01, 0.015, 0.03), floor) == "inside"
    assert floor_verdict(Spread(9, 0.0, 0.01, 0.02, 0.03), floor) == "inside"
    assert floor_verdict(Spread(9, 0.0, 0.01, 0.05, 0.09), floor) == "outside (2.5x)"
    assert floor_verdict(Spread(9, 0.0, 0.0, 0.01, 0.01), Spread(9, 0.0, 0.0, 0.0, 0.0)) == "outside (the floor is 0)"
