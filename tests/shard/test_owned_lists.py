"""The runtime's copy-ins over lists it owns ([Note: lists the runtime owns] in
``overlap_kernels/prepared_launch.py``): a group's prepared launches over its shards and its unsharded
gradients are keyed on their addresses alone, without the guard. Each test changes one thing that
the key or the group's re-read covers between two training steps, on 2 gloo ranks, and checks the
whole run (losses, final parameters) bit for bit against the same run with every launch built
from scratch (``prepared_launch.uncached()``), and that the owned launches were used (and missed
where memory moved). Kernel-level cases (same address, other dtype, strides) are in
tests/packing/test_prepared_launch.py.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import pytest
import torch
from torch import nn

import overlap
from overlap_kernels import _jit, prepared_launch
from models import bits
from overlap.param_group import widest_dtype
from overlap.sharding import sharded_states

STEPS, CHANGE_AT = 5, 2

ranks_launch_triton = pytest.mark.skipif(
    not _jit.INTERPRET, reason="the gloo ranks' CPU tensors go through the Triton kernels (and so through "
                               "prepared launches) only under TRITON_INTERPRET=1, which the suite leaves unset "
                               "where a GPU is visible: there they take the torch fallback")


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


def _assert_same_run(cached: dict[str, Any], uncached: dict[str, Any], label: str) -> None:
    """Losses and final parameters bit for bit."""
    assert torch.equal(bits(cached["losses"]), bits(uncached["losses"])), (label, cached["losses"], uncached["losses"])
    for name, value in uncached["params"].items():
        assert torch.equal(bits(cached["params"][name]), bits(value)), (label, name)


@ranks_launch_triton
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_change_between_steps_trains_bitwise_as_the_uncached_path(distributed, change: str) -> None:
    for seen in distributed(_rank, 2, change):
        uncached, cached = seen["uncached"], seen["cached"]
        _assert_same_run(cached, uncached, change)
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
    grads, missing = group._take_unsharded_grads((0, 1))
    assert missing == (0, 1)
    assert [g.dtype for g in grads] == [torch.float64, torch.float32]
    assert all(not g.any() for g in grads)


# ------------------------------------------------------------- gradients at new addresses every step
# On CPU autograd hands a group's unsharded gradients over at new addresses every step, so the
# reduce-scatter copy-in's owned launch misses every step; each miss reads the new list's
# contiguity (its dtypes: the group read them already) and makes its launch from the previous one
# with a new pointer table ([Note: a miss of a prepared launch] in overlap_kernels/prepared_launch.py). Here
# every step's gradients are kept alive, so no address set can come back.
MISS_STEPS = 6


class _MixedDtypes(nn.Module):
    """A group whose gradients mix float32 and float64: two dtype groups in the pointer table."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 9)
        self.scale = nn.Parameter(torch.rand(9, dtype=torch.float64) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale.to(x.dtype)


def _miss_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mixed dtypes":
        model = nn.Sequential(_MixedDtypes(), nn.Linear(9, 5))
        overlap.shard(model[0])
        overlap.shard(model)
        return model
    return _model()


def _not_contiguous(grad: torch.Tensor) -> torch.Tensor:
    """``grad``'s values in a tensor of its shape that is not contiguous (a user-assigned ``.grad``
    can be; the copy-in must not read it as if it were)."""
    wide = torch.zeros(*grad.shape[:-1], 2 * grad.shape[-1], dtype=grad.dtype)
    out = wide[..., : grad.shape[-1]].copy_(grad)
    assert not out.is_contiguous() or grad.numel() <= 1
    return out


def _train_missing(rank: int, kind: str, cached: bool) -> dict[str, Any]:
    model = _miss_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = [s.group for s in sharded_states(model) if s.group is not None]
    kept: list[list[torch.Tensor]] = []  # every step's gradients, so no address set repeats
    step_at = [0]
    for group in groups:
        take = group._take_unsharded_grads

        def keep(indices: tuple[int, ...], take: Callable[..., Any] = take) -> tuple[list[torch.Tensor], Any]:
            grads, missing = take(indices)
            if kind == "a gradient not contiguous" and step_at[0] == CHANGE_AT:
                grads[0] = _not_contiguous(grads[0])
            kept.append(list(grads))
            return grads, missing

        group._take_unsharded_grads = keep  # type: ignore[method-assign]
    losses = []
    moved = []
    original_moved = prepared_launch._launch.PreparedLaunch.moved

    def counted(self: Any, addresses: tuple[int, ...]) -> Any:
        moved.append(addresses)
        return original_moved(self, addresses)

    prepared_launch._launch.PreparedLaunch.moved = counted  # type: ignore[method-assign]
    try:
        with contextlib.nullcontext() if cached else prepared_launch.uncached():
            for step in range(MISS_STEPS):
                step_at[0] = step
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
                loss = model(x).square().sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach().double())
    finally:
        prepared_launch._launch.PreparedLaunch.moved = original_moved  # type: ignore[method-assign]
    launches = [sum(len(f.launches) for _, f in g._owned_grads._fingerprints.values()) for g in groups]
    return {"losses": torch.stack(losses),
            "params": {n: p.detach().full_tensor().double() for n, p in model.named_parameters()},
            "grad launches": launches, "moved": len(moved), "groups": len(groups)}


def _rank_missing(rank: int, world: int, kind: str) -> dict[str, Any]:
    return {"uncached": _train_missing(rank, kind, cached=False), "cached": _train_missing(rank, kind, cached=True)}


@ranks_launch_triton
@pytest.mark.parametrize("kind", ["plain", "mixed dtypes", "a gradient not contiguous"])
def test_gradients_at_new_addresses_every_step_train_bitwise_as_the_uncached_path(distributed, kind: str) -> None:
    for seen in distributed(_rank_missing, 2, kind):
        uncached, cached = seen["uncached"], seen["cached"]
        _assert_same_run(cached, uncached, kind)
        assert uncached["grad launches"] == [0] * uncached["groups"] and uncached["moved"] == 0
        # one launch per step and group (a new address set each step), all but each group's first
        # made from the one before; the step whose list is not contiguous goes the uncached path
        made = MISS_STEPS - (kind == "a gradient not contiguous")
        assert cached["grad launches"] == [made] * cached["groups"], cached["grad launches"]
        assert cached["moved"] >= (made - 1) * cached["groups"], cached["moved"]


def test_the_reduce_dtype_is_the_fold_over_every_gradient() -> None:
    """``widest_dtype`` promotes once per distinct dtype (the group reads a few hundred): the same
    dtype as promoting along the whole list, whatever the mix and order (bf16 with fp16 is fp32)."""
    floats = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    rng = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 300):
        for _ in range(50):
            dtypes = tuple(floats[i] for i in torch.randint(0, 4, (n,), generator=rng).tolist())
            assert widest_dtype(dtypes) == functools.reduce(torch.promote_types, dtypes), dtypes
