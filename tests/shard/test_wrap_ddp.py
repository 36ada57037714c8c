"""``overlap.wrap`` inside a model that torch's DDP data-parallelizes, and wrap's refusal to untie.

The documented way (``overlap.exclude_from_ddp(model)`` before ``DistributedDataParallel(model)``):
DDP replicates and all-reduces the plain parameters, the runtime shards and reduce-scatters the
wrapped layer's. Training must match the unsharded single-process model on the global batch.
Tolerance: 1e-5 relative on losses and parameters after 5 SGD steps (fp32; DDP's bucketed
all-reduce and the reduce-scatter sum the ranks' gradients in another order than one process does).
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import overlap

STEPS = 5
RTOL = 1e-5


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.mid = nn.Linear(12, 12)  # the wrapped layer
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(8, 6, generator=g) for _ in range(STEPS)]


def _train(model: nn.Module, batches: list[torch.Tensor], rank: int, world: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in batches:
        loss = model(x.chunk(world)[rank]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _ddp_rank(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = _Net()
    with torch.no_grad():  # rank-dependent start: DDP's start-up broadcast must fix the plain ones
        model.inp.weight.add_(rank)
    model.mid = overlap.wrap(model.mid)
    ignored = overlap.exclude_from_ddp(model)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    losses = _train(ddp, _batches(), rank, world)
    for loss in losses:
        dist.all_reduce(loss)
    return {"losses": [float(l) / world for l in losses], "ignored": sorted(ignored),
            "full": overlap.full_state_dict(model, rank0_only=False)}


def test_wrap_inside_ddp_trains_like_the_unsharded_model(distributed) -> None:
    torch.manual_seed(0)
    ref = _Net()
    want_losses = _train(ref, _batches(), 0, 1)
    for r in distributed(_ddp_rank, 2):
        assert r["ignored"] == ["mid.module.bias", "mid.module.weight"]
        torch.testing.assert_close(r["losses"], [float(l) for l in want_losses], rtol=RTOL, atol=0)
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(r["full"][key], value, rtol=RTOL, atol=1e-7, msg=key)


def _tied_rank(rank: int, world: int) -> str:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    before = model.head.weight
    try:
        overlap.wrap(model.head)
    except ValueError as e:
        assert model.head.weight is before and model.emb.weight is before  # nothing changed
        return str(e)
    return "no error"


def test_wrap_refuses_a_tied_parameter(distributed) -> None:
    for message in distributed(_tied_rank, 2):
        assert "wrap: parameters ['weight'] of Linear are also registered in modules outside it (Embedding)" in message
        assert "overlap.shard" in message


def _untied_rank(rank: int, world: int) -> bool:
    layer = nn.Linear(4, 4)
    copy_of = copy.deepcopy(layer)  # equal values, other objects: not a tie
    wrapped = overlap.wrap(layer)
    return torch.equal(wrapped(torch.ones(2, 4)), copy_of(torch.ones(2, 4)))


def test_wrap_accepts_a_layer_whose_parameters_are_only_its_own(distributed) -> None:
    assert distributed(_untied_rank, 2) == [True, True]


def test_exclude_from_ddp_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="exclude_from_ddp: model must be a torch.nn.Module"):
        overlap.exclude_from_ddp("model")
    with pytest.raises(ValueError, match="has no module sharded by overlap"):
        overlap.exclude_from_ddp(nn.Linear(2, 2))


def test_a_wrapped_layers_state_dict_is_the_layers_own(single_rank_group) -> None:
    """``wrap(layer).state_dict()`` has the layer's own keys (no ``module.`` prefix), and
    ``load_state_dict`` takes them: one wrapped layer's state dict loads into another wrapped layer,
    which then gives the first one's (and its unsharded twin's) output bitwise. Fails if either
    hook that maps the keys is missing."""
    torch.manual_seed(0)
    plain = nn.Linear(4, 3)
    torch.manual_seed(0)
    source = overlap.wrap(nn.Linear(4, 3))
    torch.manual_seed(1)
    target = overlap.wrap(nn.Linear(4, 3))
    state = source.state_dict()
    assert sorted(state) == sorted(plain.state_dict()) == ["bias", "weight"]
    target.load_state_dict(state)
    x = torch.randn(2, 4)
    assert torch.equal(target(x), plain(x))


def test_exclude_from_ddp_keeps_what_ddp_was_told_to_ignore_before(single_rank_group) -> None:
    """``exclude_from_ddp`` adds the sharded parameters to the names DDP ignores: a name the model
    was given before (torch's ``_set_params_and_buffers_to_ignore_for_model``) stays ignored. Fails
    if the earlier list is replaced."""
    from torch.nn.parallel import DistributedDataParallel

    model = _Net()
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["inp.bias"])
    model.mid = overlap.wrap(model.mid)
    overlap.exclude_from_ddp(model)
    ddp = DistributedDataParallel(model)
    assert ddp.parameters_to_ignore == {"inp.bias", "mid.module.bias", "mid.module.weight"}
