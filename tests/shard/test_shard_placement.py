"""FSDP2's ``shard_placement_fn`` returning ``Shard(d)`` for ``d`` > 0 under ``overlap.fully_shard``:
each rank holds ``torch.chunk(param, world, dim=d)[rank]`` (contiguous) and the all-gathers and
reduce-scatters carry those chunks ([Note: sharding on another dim] in ``overlap/dim_sharding.py``).

Side by side with FSDP2 (gloo): the matrices sharded on dim 1 (``Shard(1)``) or on their last dim
(``Shard(-1)``), the vectors on dim 0, three AdamW steps with ``clip_grad_norm_`` (not under TP), at 1, 2 and 4
ranks in fp32 and at 2 in bf16 mixed precision: the sharded parameters' placements, local shapes
and contiguity, the losses, the gradient norms and the parameters are bitwise FSDP2's, and
``overlap.full_state_dict`` / ``load_full_state_dict`` and DCP (each runtime loading the other's
checkpoint) agree with it. With tensor parallelism (dp 2, tp 2; torch's colwise / rowwise styles,
so a rowwise weight is ``_StridedShard(1)`` over dp): bitwise FSDP2's. Dims FSDP2 refuses to shard
unevenly are sharded here by ``torch.chunk``'s rule: at 2 ranks the run is bitwise the same model
sharded on dim 0 (a sum of two is the same sum in any layout), and at 4 ranks (a rank holding
nothing of a 5-column weight) the gathered weights and a forward are exactly the unsharded ones.
"""
from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import overlap
from models import assert_refused, assert_same_run, refusal

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

STEPS = 3


def _dim1(p: nn.Parameter) -> Any:
    return Shard(1) if p.ndim == 2 else None


def _last(p: nn.Parameter) -> Any:
    return Shard(-1)


def _model(width: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width),
                                         nn.LayerNorm(width)) for _ in range(2)])


def _shard(model: nn.Module, runtime: str, mesh: Any, placement_fn: Any, bf16: bool = False) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shard = overlap.fully_shard if runtime == "overlap" else fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in model:
        shard(block, mesh=mesh, shard_placement_fn=placement_fn, mp_policy=mp)
    shard(model, mesh=mesh, shard_placement_fn=placement_fn, mp_policy=mp)


def _train(model: nn.Module, width: int, data_rank: int, clip: bool = True) -> dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(STEPS):
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(100 * step + data_rank))
        loss = model(x).float().square().mean()
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor())
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "norms": torch.stack(norms) if norms else None,
            "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
            "specs": {n: (tuple(p.placements), tuple(p.to_local().shape), p.to_local().is_contiguous())
                      for n, p in model.named_parameters()},
            "full": {n: p.full_tensor() for n, p in model.named_parameters()}}


# (placement_fn, bf16) per case; widths even at every world size, as FSDP2 needs on dims > 0
CASES = {"dim1": (_dim1, False), "last": (_last, False), "dim1_bf16": (_dim1, True)}
WIDTH, HIDDEN = 8, 16


def _runs(rank: int, world: int, cases: tuple[str, ...]) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for case in cases:
        fn, bf16 = CASES[case]
        for runtime in ("fsdp2", "overlap"):
            model = _model(WIDTH, HIDDEN)
            _shard(model, runtime, mesh, fn, bf16)
            out[f"{case} {runtime}"] = run = _train(model, WIDTH, rank)
            if runtime == "overlap":
                run["full_state_dict"] = overlap.full_state_dict(model, rank0_only=False)
                overlap.load_full_state_dict(model, out[f"{case} fsdp2"]["full"])
                run["loaded"] = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("world, cases", [(1, ("dim1",)), (2, tuple(CASES)), (4, ("dim1",))])
def test_shard_on_another_dim_trains_bitwise_as_under_fsdp2(distributed, world: int, cases: tuple[str, ...]) -> None:
    """Fails if a chunk on another dim is gathered or reduced as dim-0 rows (wrong values), if the
    gathered chunks are not put back along their dim, or if the local shard is not FSDP2's chunk."""
    for rank, res in enumerate(distributed(_runs, world, cases)):
        for case in cases:
            ours, theirs = res[f"{case} overlap"], res[f"{case} fsdp2"]
            assert ours["specs"] == theirs["specs"], (rank, case, ours["specs"], theirs["specs"])
            assert_same_run(theirs, ours, (rank, case))
            assert torch.equal(ours["norms"], theirs["norms"]), (rank, case)
            for name, value in theirs["full"].items():
                assert torch.equal(ours["full_state_dict"][name], value), (rank, case, name)
                assert torch.equal(ours["loaded"][name], theirs["params"][name]), (rank, case, name)
        if world > 1:
            assert res["dim1 overlap"]["specs"]["0.0.weight"][0] == (Shard(1),)
        if "last" in cases:
            assert res["last overlap"]["specs"]["0.3.bias"][0] == (Shard(0),)  # Shard(-1) of a vector


def _uneven(rank: int, world: int) -> dict[str, Any]:
    """A 17-wide hidden layer: on 2 ranks, trained sharded on dim 1 and on dim 0 (no clipping, whose
    per-shard norms sum in another order); on 4 ranks, a 5-wide one whose fourth rank holds no
    column: the local shapes, the gathered weights and a forward against the unsharded model."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    if world == 2:
        for name, fn in (("dim1", _dim1), ("dim0", None)):
            model = _model(WIDTH, 17)
            _shard(model, "overlap", mesh, fn)
            out[name] = _train(model, WIDTH, rank, clip=False)
        return out
    plain = _model(WIDTH, 5)
    model = _model(WIDTH, 5)
    _shard(model, "overlap", mesh, _dim1)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(7))
    out["shapes"] = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    out["full"] = overlap.full_state_dict(model, rank0_only=False)
    out["plain"] = plain.state_dict()
    out["loss"], out["plain loss"] = model(x).square().mean().detach(), plain(x).square().mean().detach()
    return out


def test_uneven_chunks_on_another_dim(distributed) -> None:
    for rank, res in enumerate(distributed(_uneven, 2)):
        assert res["dim1"]["specs"]["0.0.weight"][:2] == ((Shard(1),), (17, 4))
        assert res["dim1"]["specs"]["0.2.weight"][:2] == ((Shard(1),), (8, 9 if rank == 0 else 8))
        assert torch.equal(res["dim0"]["losses"], res["dim1"]["losses"]), rank
        for name, value in res["dim0"]["full"].items():
            assert torch.equal(res["dim1"]["full"][name], value), (rank, name)
    for rank, res in enumerate(distributed(_uneven, 4)):
        assert res["shapes"]["0.2.weight"] == (8, (2, 2, 1, 0)[rank]), (rank, res["shapes"])
        for name, value in res["plain"].items():
            assert torch.equal(res["full"][name], value), (rank, name)
        assert torch.equal(res["loss"], res["plain loss"]), rank


def _tensor_parallel(rank: int, world: int, directory: str) -> dict[str, Any]:
    """(dp 2, tp 2): each block's first linear colwise and second rowwise over tp (torch's styles),
    its matrices sharded on dim 1 over dp; then DCP from each runtime into the other."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {}

    def build(runtime: str) -> nn.Module:
        model = _model(WIDTH, HIDDEN)
        for block in model:
            parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        _shard(model, runtime, mesh["dp"], _dim1)
        return model

    for runtime in ("fsdp2", "overlap"):
        model = build(runtime)
        out[runtime] = _train(model, WIDTH, rank // 2, clip=False)  # (the norms' grads are on dp alone)
        dcp.save(get_model_state_dict(model), checkpoint_id=f"{directory}/{runtime}")
    for saved, loader in (("overlap", "fsdp2"), ("fsdp2", "overlap")):
        model = build(loader)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=f"{directory}/{saved}")
        set_model_state_dict(model, state)
        out[f"{loader} loads {saved}"] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return out


def test_shard_on_another_dim_with_tensor_parallelism_matches_fsdp2(distributed) -> None:
    with tempfile.TemporaryDirectory() as directory:
        results = distributed(_tensor_parallel, 4, directory, timeout=300)
    for rank, res in enumerate(results):
        ours, theirs = res["overlap"], res["fsdp2"]
        assert ours["specs"] == theirs["specs"], (rank, ours["specs"], theirs["specs"])
        assert_same_run(theirs, ours, rank)
        for key in ("fsdp2 loads overlap", "overlap loads fsdp2"):
            for name, value in theirs["full"].items():
                assert torch.equal(res[key][name], value), (rank, key, name)
    assert results[0]["overlap"]["specs"]["0.2.weight"][0][0].__class__.__name__ == "_StridedShard"


def _refusals(rank: int, world: int) -> dict[str, str]:
    """What each refused ``shard_placement_fn`` raises, and whether the module stayed unsharded."""
    mesh = init_device_mesh("cpu", (world,))
    cases = {
        "not a Shard": (lambda p: Replicate(), None),
        "a dim past the last": (lambda p: Shard(p.ndim), None),
        "with compress": (_dim1, overlap.Compression()),
    }
    out = {}
    for name, (fn, compress) in cases.items():
        module = nn.Linear(4, 4)
        out[name] = refusal(lambda: overlap.fully_shard(module, mesh=mesh, shard_placement_fn=fn, compress=compress),
                            module)
    return out


REFUSALS = {
    "not a Shard": ("NotImplementedError", "return None or Shard(dim)"),
    "a dim past the last": ("ValueError", "the dim must be in [-2, 2)"),
    "with compress": ("NotImplementedError", "'weight' is sharded on dim 1 with compress="),
}


def test_placements_overlap_cannot_shard_are_refused_before_anything_changes(distributed) -> None:
    for rank, res in enumerate(distributed(_refusals, 2)):
        for name, (kind, message) in REFUSALS.items():
            assert_refused(res[name], kind, message, (rank, name))
