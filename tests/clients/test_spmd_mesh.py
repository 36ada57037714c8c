"""FSDP2's full-SPMD-mesh mode, ``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``
(torch 2.13+, torchtitan's full-DTensor path), under ``overlap.fully_shard``, side by side with FSDP2.

Every parameter is a DTensor on the whole mesh: ``Replicate()`` on the data-parallel dims, torchtitan's
tensor-parallel placements on a ``tp`` dim (colwise ``Shard(0)``, rowwise ``Shard(1)`` with a
replicated bias, a replicated norm); the batch is a DTensor sharded over the data-parallel dims.
Four gloo ranks, two AdamW steps with ``clip_grad_norm_``, on the meshes torchtitan builds:
(dp 2, tp 2); HSDP (replicate 2, shard 2); two shard dims flattened (dp 2, cp 2, the sequence
sharded over cp); (dp 2, tp 2) in bf16 mixed precision with fp32 reductions; and (dp 1, tp 4), the
size-1 shard dim torchtitan keeps for tensor parallelism alone. The sharded
parameters' specs (placements, mesh dims, local shapes), the gradients' placements, the losses, the
gradient norms and the parameters are bitwise FSDP2's. Then torch's full state dict,
``overlap.full_state_dict`` / ``overlap.load_full_state_dict``, and DCP both ways between the runtimes. See [Note: sharding on a full SPMD mesh] in ``overlap/spmd_mesh.py``.
"""
from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from torch import nn

import overlap
from models import assert_refused, refusal
from scheduler.torch_versions import TORCH_VERSION

pytestmark = [pytest.mark.torch_kernels,  # training loops: packing by the torch fallback (conftest)
              pytest.mark.skipif(TORCH_VERSION < (2, 13), reason="dp_mesh_dims (DataParallelMeshDims) is torch 2.13's")]

WIDTH, STEPS = 8, 2
# Before torch 2.15 FSDP2 all-reduces a replicated tensor-parallel parameter's Partial() gradient
# over tp in bf16; this runtime does it in reduce_dtype, as FSDP2 from 2.15 ([Note: sharding
# tensor-parallel parameters]). There the bf16 run differs by that rounding: a few bf16 ulps of the
# tensor's largest magnitude, as in tests/parallel/test_fsdp_tp.py.
BF16_BITWISE = TORCH_VERSION >= (2, 15)
BF16_TOL = 2.0 ** -6

# mesh shape and names, DataParallelMeshDims(shard, replicate), the batch's placement per mesh dim
# (("S", d): Shard(d), "R": Replicate()), mixed precision
MESHES: dict[str, tuple[tuple[int, ...], tuple[str, ...], Any, Any, tuple[Any, ...], bool]] = {
    "dp_tp": ((2, 2), ("dp", "tp"), "dp", None, (("S", 0), "R"), False),
    "hsdp": ((2, 2), ("replicate", "shard"), "shard", "replicate", (("S", 0), ("S", 0)), False),
    "dp_cp_flattened": ((2, 2), ("dp", "cp"), ("dp", "cp"), None, (("S", 0), ("S", 1)), False),
    "dp_tp_bf16": ((2, 2), ("dp", "tp"), "dp", None, (("S", 0), "R"), True),
    "dp1_tp4": ((1, 4), ("dp", "tp"), "dp", None, (("S", 0), "R"), False),  # torchtitan keeps dp_shard at size 1
}

TP_PLACEMENTS = {"up.weight": ("S", 0), "up.bias": ("S", 0), "down.weight": ("S", 1), "down.bias": "R",
                 "norm.weight": "R", "norm.bias": "R"}


def _placement(code: Any) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if code == "R" else Shard(code[1])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH), nn.LayerNorm(WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + self.down(torch.relu(self.up(h))))


def _model(mesh: Any, tp_dims: tuple[int, ...]) -> nn.Module:
    """Two blocks, every parameter distributed on ``mesh``: ``TP_PLACEMENTS`` on ``tp_dims``,
    Replicate on the others (the data-parallel dims)."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    for block in model:
        for name, p in list(block.named_parameters()):
            owner, attr = name.rsplit(".", 1)
            placements = [_placement(TP_PLACEMENTS[name] if i in tp_dims else "R") for i in range(mesh.ndim)]
            block.get_submodule(owner).register_parameter(
                attr, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    return model


def _shard(model: nn.Module, runtime: str, mesh: Any, dims: Any, bf16: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shard = overlap.fully_shard if runtime == "overlap" else fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in model:
        shard(block, mesh=mesh, dp_mesh_dims=dims, mp_policy=mp)
    shard(model, mesh=mesh, dp_mesh_dims=dims, mp_policy=mp)


def _batch(mesh: Any, batch_placements: tuple[Any, ...], step: int) -> Any:
    from torch.distributed.tensor import distribute_tensor

    x = torch.randn(4, 4, WIDTH, generator=torch.Generator().manual_seed(100 + step))
    return distribute_tensor(x, mesh, [_placement(c) for c in batch_placements])


def _spec(p: Any) -> tuple:
    return (tuple(p.placements), p.device_mesh.mesh_dim_names, tuple(p.to_local().shape), p.dtype)


def _train(model: nn.Module, mesh: Any, batch_placements: tuple[Any, ...], steps: int = STEPS) -> dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms, grad_specs = [], [], {}
    for step in range(steps):
        loss = model(_batch(mesh, batch_placements, step)).float().square().mean()
        loss.backward()
        grad_specs = {n: _spec(p.grad) for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor())
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().detach())
    return {"losses": torch.stack(losses), "norms": torch.stack(norms), "grad_specs": grad_specs,
            "specs": {n: _spec(p) for n, p in model.named_parameters()},
            "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()}}


def _runs(rank: int, world: int) -> dict[str, dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims

    torch.set_num_threads(1)
    out: dict[str, dict[str, Any]] = {}
    meshes: dict[tuple, Any] = {}  # one per shape and names: FSDP2 wants the parameters' mesh object itself
    for name, (shape, names, shard, replicate, batch, bf16) in MESHES.items():
        mesh = meshes.get((shape, names))
        if mesh is None:
            mesh = meshes[shape, names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dims = DataParallelMeshDims(shard=shard, replicate=replicate)
        dp_names = (shard,) if isinstance(shard, str) else shard
        dp_names += (replicate,) if replicate else ()
        tp_dims = tuple(i for i, n in enumerate(names) if n not in dp_names)
        for runtime in ("fsdp2", "overlap"):
            model = _model(mesh, tp_dims)
            _shard(model, runtime, mesh, dims, bf16)
            out[f"{name} {runtime}"] = _train(model, mesh, batch)
    return out


def _within_bf16_tol(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    scale = theirs.float().abs().max()
    return bool(((ours.float() - theirs.float()).abs() <= BF16_TOL * scale).all())


def test_full_spmd_mesh_trains_bitwise_as_under_fsdp2(distributed) -> None:
    """Fails if the sharded spec differs from FSDP2's (a ``Shard(0)`` where the TP dim makes it
    ``_StridedShard``, the flattened mesh), if a gradient is all-reduced over a data-parallel dim
    before its reduce-scatter (redistributed to the parameter's ``Replicate()`` there), or if a
    replicated parameter's reduction dtype counts the data-parallel dims."""
    for rank, res in enumerate(distributed(_runs, 4, timeout=300)):
        for name in MESHES:
            ours, theirs = res[f"{name} overlap"], res[f"{name} fsdp2"]
            assert ours["specs"] == theirs["specs"], (rank, name, ours["specs"], theirs["specs"])
            assert ours["grad_specs"] == theirs["grad_specs"], (rank, name)
            same = torch.equal if BF16_BITWISE or not MESHES[name][-1] else _within_bf16_tol
            assert same(ours["losses"], theirs["losses"]), (rank, name, ours["losses"], theirs["losses"])
            assert same(ours["norms"], theirs["norms"]), (rank, name, ours["norms"], theirs["norms"])
            for param, value in theirs["params"].items():
                assert same(ours["params"][param], value), (rank, name, param)
        # the meshes the parameters end on: the full mesh, or the flattened shard dims' in their place
        assert res["dp_tp overlap"]["specs"]["0.up.weight"][:2] == (
            (torch.distributed.tensor.placement_types._StridedShard(0, split_factor=2),
             torch.distributed.tensor.Shard(0)), ("dp", "tp"))
        assert res["dp_cp_flattened overlap"]["specs"]["0.up.weight"][1] == ("dp_cp",)


def _state_dicts(rank: int, world: int, directory: str) -> dict[str, Any]:
    """After training, torch's full state dict under each runtime, ``overlap.full_state_dict``, and
    DCP: each runtime's checkpoint loaded into a fresh model of the other."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = DataParallelMeshDims(shard="dp")
    full = StateDictOptions(full_state_dict=True)
    out: dict[str, Any] = {}
    trained = {}
    for runtime in ("fsdp2", "overlap"):
        model = _model(mesh, (1,))
        _shard(model, runtime, mesh, dims, False)
        _train(model, mesh, (("S", 0), "R"), steps=1)
        trained[runtime] = model
        out[f"{runtime} full"] = get_model_state_dict(model, options=full)
        dcp.save(get_model_state_dict(model), checkpoint_id=f"{directory}/{runtime}")
    out["overlap.full_state_dict"] = overlap.full_state_dict(trained["overlap"], rank0_only=False)
    model = _model(mesh, (1,))
    _shard(model, "overlap", mesh, dims, False)
    overlap.load_full_state_dict(model, out["fsdp2 full"])
    out["overlap.load_full_state_dict of fsdp2's"] = get_model_state_dict(model, options=full)
    for saved, loader in (("overlap", "fsdp2"), ("fsdp2", "overlap")):
        model = _model(mesh, (1,))
        _shard(model, loader, mesh, dims, False)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=f"{directory}/{saved}")
        set_model_state_dict(model, state)
        out[f"{loader} loads {saved}"] = get_model_state_dict(model, options=full)
        # and it trains on from there as the runtime that saved it does
        out[f"{loader} loads {saved} loss"] = model(_batch(mesh, (("S", 0), "R"), 7)).square().mean().full_tensor()
        out[f"{saved} loss"] = trained[saved](_batch(mesh, (("S", 0), "R"), 7)).square().mean().full_tensor()
    return out


def test_full_spmd_mesh_state_dicts_and_dcp_match_fsdp2(distributed) -> None:
    """Fails if a sharded spec makes DCP or torch's state-dict utilities see other shards than FSDP2's."""
    with tempfile.TemporaryDirectory() as directory:
        results = distributed(_state_dicts, 4, directory, timeout=300)
    for rank, res in enumerate(results):
        reference = res["fsdp2 full"]
        for key in ("overlap full", "overlap.full_state_dict", "fsdp2 loads overlap", "overlap loads fsdp2",
                    "overlap.load_full_state_dict of fsdp2's"):
            assert res[key].keys() == reference.keys(), (rank, key)
            for name, value in reference.items():
                assert torch.equal(res[key][name], value), (rank, key, name)
        for saved, loader in (("overlap", "fsdp2"), ("fsdp2", "overlap")):
            assert torch.equal(res[f"{loader} loads {saved} loss"], res[f"{saved} loss"]), (rank, saved)


def _refusals(rank: int, world: int) -> dict[str, str]:
    """Each bad ``dp_mesh_dims`` call's exception (type and message), and whether the module was left
    unsharded with its parameters as they were."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    other = init_device_mesh("cpu", (2,), mesh_dim_names=("data",))
    unnamed = init_device_mesh("cpu", (2,))

    def dtensor_linear(on: Any, placement: Any) -> nn.Module:
        linear = nn.Linear(4, 4)
        for name, p in list(linear.named_parameters()):
            linear.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), on, [placement])))
        return linear

    from torch.distributed.tensor import Replicate

    cases = {
        "a dim not in the mesh": (lambda: dtensor_linear(mesh, Replicate()), mesh, DataParallelMeshDims(shard="fsdp")),
        "replicate only": (lambda: dtensor_linear(mesh, Replicate()), mesh, DataParallelMeshDims(replicate="dp")),
        "a plain parameter": (lambda: nn.Linear(4, 4), mesh, DataParallelMeshDims(shard="dp")),
        "sharded on a data-parallel dim": (lambda: dtensor_linear(mesh, Shard(0)), mesh, DataParallelMeshDims(shard="dp")),
        "another mesh": (lambda: dtensor_linear(other, Replicate()), mesh, DataParallelMeshDims(shard="dp")),
        "an unnamed mesh": (lambda: dtensor_linear(unnamed, Replicate()), unnamed, DataParallelMeshDims(shard="dp")),
        "not a DataParallelMeshDims": (lambda: dtensor_linear(mesh, Replicate()), mesh, {"shard": "dp"}),
    }
    out = {}
    for name, (make, on, dims) in cases.items():
        module = make()
        out[name] = refusal(lambda: overlap.fully_shard(module, mesh=on, dp_mesh_dims=dims), module)
    return out


REFUSALS = {
    "a dim not in the mesh": ("ValueError", "dp_mesh_dims names mesh dim 'fsdp'"),
    "replicate only": ("NotImplementedError", "DataParallelMeshDims(shard=...)"),
    "a plain parameter": ("ValueError", "'weight' is a plain tensor"),
    "sharded on a data-parallel dim": ("ValueError", "'weight' must be Replicate() on data-parallel mesh dim 'dp'"),
    "another mesh": ("ValueError", "pass the mesh its parameters were distributed on"),
    "an unnamed mesh": ("ValueError", "mesh must have mesh_dim_names"),
    "not a DataParallelMeshDims": ("TypeError", "dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims"),
}


def test_full_spmd_mesh_refusals_name_the_argument_and_change_nothing(distributed) -> None:
    for rank, res in enumerate(distributed(_refusals, 2)):
        for name, (kind, message) in REFUSALS.items():
            assert_refused(res[name], kind, message, (rank, name))
