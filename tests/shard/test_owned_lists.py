"""The runtime's copy-ins over lists it owns ([Note: lists the runtime owns] in
``kernels/prepared_launch.py``): a group's prepared launches over its shards and its unsharded
gradients are keyed on their addresses alone, without the guard. Each test changes one thing that
the key or the group's re-read covers between two training steps, on 2 gloo ranks, and checks the
whole run (losses, final parameters) bit for bit against the same run with every launch built
from scratch (``prepared_launch.uncached()``), and that the owned launches were used (and missed
where memory moved). Kernel-level cases (same address, other dtype, strides) are in
tests/packing/test_prepared_launch.py.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import pytest
import torch
from torch import nn

import overlap
from kernels import prepared_launch
from models import bits
from overlap.sharding import sharded_states

STEPS, CHANGE_AT = 5, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))  # odd shapes: padding on 2 ranks
    overlap.shard(model[0])
    overlap.shard(model[2])
    overlap.shard(model)
    return model


def _first_shard(model: nn.Module) -> torch.Tensor:
    return model[0].weight._local_tensor  # type: ignore[union-attr]


def _load_state_dict(model: nn.Module) -> None:
    """A checkpoint load: new values copied into the shards in place (same addresses)."""
    state = {k: v * 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(state)


def _data_assigned(model: nn.Module) -> None:
    """A user's ``.data =`` on a shard's local tensor: other memory, same object."""
    local = _first_shard(model)
    local.data = local.detach() * -0.25


def _set_to_other_memory(model: nn.Module) -> None:
    local = _first_shard(model)
    with torch.no_grad():
        local.set_(local.clone() + 1.0)


def _to_empty_and_reload(model: nn.Module) -> None:
    """Every shard freed and allocated again (the allocator may hand out the same addresses), then
    refilled: ``module._apply`` swaps the parameters and the groups re-read them."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.to_empty(device="cpu")
    model.load_state_dict(state)


def _to_float64(model: nn.Module) -> None:
    """Another dtype for every shard (``module.to``: the groups re-read their dtypes)."""
    model.to(torch.float64)


CHANGES: dict[str, Callable[[nn.Module], None]] = {
    "state dict load": _load_state_dict,
    "data assigned": _data_assigned,
    "set_ to other memory": _set_to_other_memory,
    "to_empty and reload": _to_empty_and_reload,
    "dtype": _to_float64,
}


def _owned(model: nn.Module) -> int:
    return sum(len(s.group._owned_shards) + len(s.group._owned_grads)
               for s in sharded_states(model) if s.group is not None)


def _train(rank: int, change: str, cached: bool) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, owned_before_change = [], 0
    with contextlib.nullcontext() if cached else prepared_launch.uncached():
        for step in range(STEPS):
            if step == CHANGE_AT:
                owned_before_change = _owned(model)
                CHANGES[change](model)
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(x.to(model[0].weight.dtype)).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().double())
    return {"losses": torch.stack(losses),
            "params": {n: p.detach().full_tensor().double() for n, p in model.named_parameters()},
            "owned": (owned_before_change, _owned(model))}


def _rank(rank: int, world: int, change: str) -> dict[str, Any]:
    return {"uncached": _train(rank, change, cached=False), "cached": _train(rank, change, cached=True)}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_between_steps_trains_bitwise_as_the_uncached_path(distributed, change: str) -> None:
    for seen in distributed(_rank, 2, change):
        uncached, cached = seen["uncached"], seen["cached"]
        assert torch.equal(bits(cached["losses"]), bits(uncached["losses"])), (change, cached["losses"],
                                                                                  uncached["losses"])
        for name, value in uncached["params"].items():
            assert torch.equal(bits(cached["params"][name]), bits(value)), (change, name)
        assert uncached["owned"] == (0, 0), "the uncached run used owned launches"
        assert cached["owned"][0] > 0 and cached["owned"][1] > 0, ("the owned launches were not used", cached["owned"])


def test_a_missing_gradient_is_zeros_in_the_dtype_autograd_gives_it(single_rank_group,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The gradients' dtypes stay the group's per index (what a hit of the owned launch trusts): a
    missing gradient's zeros take the gradient's dtype, a tensor-parallel parameter's wider one
    included (``_tp_reduced_grad_dtype``, stood in for here on a plain parameter)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    overlap.shard(model)
    model(torch.randn(1, 3)).sum().backward()  # the unsharded parameters exist; their gradients moved on
    (group,) = [s.group for s in sharded_states(model) if s.group is not None]
    monkeypatch.setattr(group, "_tp_reduced_grad_dtype", lambda i: torch.float64 if i == 0 else None)
    grads = group._take_unsharded_grads((0, 1))
    assert [g.dtype for g in grads] == [torch.float64, torch.float32]
    assert all(not g.any() for g in grads)
