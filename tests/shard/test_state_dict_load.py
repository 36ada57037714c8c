"""``overlap.load_full_state_dict`` against the path it replaced for the runtime's own parameters
(``distribute_tensor`` per sharded entry, then ``load_state_dict``; see [Note: loading a full tensor
without distribute_tensor] in ``overlap/state_dict.py``), on a small model with what client models
bring: tied weights (two keys, one parameter), a weight of 2 rows (ranks 2 and 3 of 4 hold none), a
1-row parameter (only rank 0 holds a row: nanoGPT's ``logit_scale``), a 0-dim parameter, float and
integer buffers, parameters no group owns (the root is not sharded) and, in the ``tp`` mesh, a
tensor-parallel parameter in a group with plain ones.

Four ranks; meshes: full sharding, HSDP ``(2, 2)``, and ``(dp, tp) = (2, 2)`` with torch's
``ColwiseParallel``. Each mesh loads four kinds of values: plain tensors (the unsharded model's
``state_dict()``), its ``nn.Parameter``s (``keep_vars=True``), bf16 copies (a cast on load), and the
dict after torch's ``set_model_state_dict(..., full_state_dict=True)`` loaded it into another model
(it leaves DTensors in the dict: the client tests' sequence that d68e12d broke). Checks, per rank and
entry: the local tensor bit for bit the reference path's, the full state dict bit for bit the values
(cast to the model's dtype). A DTensor on other placements, or for a plain entry, is refused naming
the key, before anything is written.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import overlap
from models import bits, load_by_distribute_tensor

MESHES = ("full", "hsdp", "tp")
KINDS = ("tensors", "parameters", "bf16", "after_set_model_state_dict")


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.narrow = nn.Linear(3, 2)  # 2 rows: on 4 ranks, ranks 2 and 3 hold none
        self.wide = nn.Linear(2, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # tied: keys head.weight and embed.weight, one parameter
        self.temperature = nn.Parameter(torch.ones(1) * 0.7)  # 1 row: rank 0 holds it, the others none
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim: replicated
        self.register_buffer("counts", torch.zeros(3))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _Body()
        self.proj = nn.Linear(3, 4)  # column-parallel on the tp mesh
        self.free = nn.Linear(3, 3)  # the root is not sharded: no group owns it
        self.register_buffer("steps", torch.tensor(0, dtype=torch.int64))


def _full_values(seed: int) -> dict[str, torch.Tensor]:
    """An unsharded model's state dict, every entry drawn from ``seed`` (tied keys share a value)."""
    torch.manual_seed(seed)
    model = _Model()
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.copy_(torch.randint(-1000, 1000, t.shape) if not t.is_floating_point() else torch.randn(t.shape))
    return model.state_dict(keep_vars=True)


def _sharded(mesh_kind: str, rank: int) -> nn.Module:
    torch.manual_seed(0)
    model = _Model()
    if mesh_kind == "full":
        mesh = None
    elif mesh_kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2))
    else:
        joined = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, joined["tp"], {"proj": ColwiseParallel()})
        mesh = joined["dp"]
    for module in (model.body.narrow, model.body, model.proj):
        overlap.shard(module, mesh=mesh)
    return model


def _values_of(kind: str, mesh_kind: str, rank: int) -> dict[str, Any]:
    values = _full_values(seed=1)
    if kind == "tensors":
        return {k: v.detach() for k, v in values.items()}
    if kind == "parameters":
        return dict(values)
    if kind == "bf16":
        return {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach() for k, v in values.items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    loaded = {k: v.detach() for k, v in values.items()}
    set_model_state_dict(_sharded(mesh_kind, rank), loaded, options=StateDictOptions(full_state_dict=True))
    return loaded


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _load_rank(rank: int, world: int, mesh_kind: str) -> dict[str, Any]:
    problems: list[str] = []
    local_shapes: set[tuple[str, tuple[int, ...]]] = set()
    dtensor_values: dict[str, int] = {}
    for kind in KINDS:
        values = _values_of(kind, mesh_kind, rank)
        dtensor_values[kind] = sum(isinstance(v, DTensor) for v in values.values())
        model, reference = _sharded(mesh_kind, rank), _sharded(mesh_kind, rank)
        overlap.load_full_state_dict(model, values)
        load_by_distribute_tensor(reference, values)
        want = reference.state_dict()
        for key, got in model.state_dict().items():
            if not torch.equal(bits(_local(got)), bits(_local(want[key]))):
                problems.append(f"{mesh_kind}/{kind} rank {rank}: {key} differs from distribute_tensor's")
            local_shapes.add((key, tuple(_local(got).shape)))
        for key, got in overlap.full_state_dict(model, rank0_only=False).items():
            value = _full_values(seed=1)[key].detach().to(got.dtype)
            if kind == "bf16" and value.is_floating_point():
                value = value.to(torch.bfloat16).to(got.dtype)
            if not torch.equal(bits(got), bits(value)):
                problems.append(f"{mesh_kind}/{kind} rank {rank}: full {key} is not the value loaded")
    return {"problems": problems, "local_shapes": local_shapes, "dtensor_values": dtensor_values}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh_kind", MESHES)
def test_local_tensors_are_distribute_tensors(distributed: Callable[..., list[Any]], mesh_kind: str) -> None:
    results = distributed(_load_rank, 4, mesh_kind, timeout=220)
    assert [p for r in results for p in r["problems"]] == []
    # the kinds hand what they say: DTensors only after set_model_state_dict
    assert results[0]["dtensor_values"]["tensors"] == 0
    assert results[0]["dtensor_values"]["after_set_model_state_dict"] > 0
    shapes = [r["local_shapes"] for r in results]
    if mesh_kind == "full":  # ranks without rows were loaded, and the 1-row parameter's rank alone holds it
        assert ("body.narrow.weight", (0, 3)) in shapes[3]
        assert ("body.temperature", (1,)) in shapes[0] and ("body.temperature", (0,)) in shapes[1]


def _refusal_rank(rank: int, world: int) -> list[str]:
    problems = []
    model = _sharded("full", rank)
    before = {k: _local(v).clone() for k, v in model.state_dict().items()}
    mesh = model.body.wide.weight.device_mesh
    replicated = distribute_tensor(torch.randn(3, 2), mesh, [Replicate()], src_data_rank=None)
    for key, value, says in [
        ("body.wide.weight", replicated, "'body.wide.weight' is a DTensor with placements (Replicate(),)"),
        ("body.counts", distribute_tensor(torch.zeros(3), mesh, [Replicate()], src_data_rank=None),
         "'body.counts' is a DTensor with placements (Replicate(),)"),
    ]:
        values = {k: v.detach() for k, v in _full_values(seed=1).items()}
        values[key] = value
        try:
            overlap.load_full_state_dict(model, values)
            problems.append(f"{key}: a DTensor on other placements was loaded")
        except ValueError as e:
            if says not in str(e) or "pass the full tensor" not in str(e):
                problems.append(f"{key}: the error does not say what is wrong: {e}")
        for k, v in model.state_dict().items():
            if not torch.equal(bits(_local(v)), bits(before[k])):
                problems.append(f"{key}: refused, but {k} was written")
    return problems


def test_dtensors_on_other_placements_are_refused_before_anything_is_written(
        distributed: Callable[..., list[Any]]) -> None:
    assert [p for r in distributed(_refusal_rank, 4) for p in r] == []
