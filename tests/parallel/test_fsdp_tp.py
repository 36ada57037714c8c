"""2-D parallelism: ``overlap.shard`` over the data-parallel dim of a mesh whose other dim carries
tensor parallelism, side by side with torch's FSDP2 (``fully_shard``) on the same torch TP model,
and against the unsharded model.

Four ranks, mesh ``("dp", "tp") = (2, 2)``. The model is a stack of sequence-parallel blocks from
``tp_blocks.py`` (an MLP and an attention block, each with a ``SequenceParallel`` norm) plus a plain
output head that only data parallelism shards. Each dp rank takes half of the global batch; the two
tp ranks of a dp group take the two halves of the sequence of that half. Variants, all built from
the same weights and stepped twice with SGD (momentum) on the same data:

* ``fsdp2``: torch's ``parallelize_module`` then ``fully_shard(mesh["dp"])`` per block and root;
* ``torch_tp+shard``: the same TP, then ``overlap.shard(mesh=mesh["dp"])`` per block and root;
* ``tp+shard``: ``overlap.tensor_parallel(mesh["tp"], chunks=2)`` then ``overlap.shard``;
* ``fsdp2`` and ``torch_tp+shard`` again with mixed precision (bf16 step, fp32 reduction);
* the unsharded model on the whole batch, with loss ``sum(y * dy) / dp``: what the sharded runs
  optimize (each tp rank's loss is its sequence slice's sum, gradients average over dp).

Checks: ``torch_tp+shard`` has FSDP2's parameters (state-dict keys, placements on the joined
``(dp, tp)`` mesh, local shapes) and its gradients and updated parameters bitwise (the same TP ops
and the same two-rank sums; with mixed precision too, on torch 2.11-2.13 up to ``BF16_TOL`` where
FSDP2 reduces over tp in bf16); the other sharded runs are within 1e-5 (abs + rel to the largest value)
of the unsharded model (the rowwise matmuls' inner sums are split over tp ranks, and the chunked
variant runs one GEMM per chunk); ``clip_grad_norm_`` gives FSDP2's total norm; ``get_state_dict``
gives full tensors equal to the unsharded model's, ``overlap.full_state_dict`` the same full tensors,
and ``overlap.load_full_state_dict`` of them into another 2-D model gives them back; a DCP checkpoint of ours loads into the FSDP2 model.
HSDP + TP (mesh (replicate, shard, tp) = (2, 1, 2): the replicas' all-reduce and the 3-D spec, with a
shard dim of one rank, all 4 ranks allow) against FSDP2 bitwise. The finite check over the dp
groups, slices of the mesh: a NaN in one dp rank's inputs is named by its global rank on every rank.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

import overlap
from scheduler.torch_versions import TORCH_VERSION
from tp_blocks import make_block, plan_for

pytestmark = pytest.mark.torch_kernels  # long training loops: packing by the torch fallback (conftest)

BATCH, SEQ, DIM, HIDDEN, HEADS = 4, 8, 16, 32, 4
TOL = (1e-5, 1e-5)  # (atol, rtol): see the module docstring
# With bf16 parameters and fp32 reduction, a norm replicated over tp gets a Partial() gradient that is
# all-reduced over tp before the dp reduce-scatter. Since torch 2.15 FSDP2 accumulates it in fp32
# first (the unsharded parameter's grad_dtype), as overlap.shard does on every torch; before, FSDP2
# all-reduced it in bf16. There the two runs differ by that bf16 rounding, in the norms' first-step
# gradients and through them in every parameter after the steps: at most a few bf16 ulps, 2**-6 of
# the tensor's largest magnitude (measured on torch 2.13: <= 0.0031, head.weight).
FSDP2_TP_GRADS_IN_REDUCE_DTYPE = TORCH_VERSION >= (2, 15)
BF16_TOL = (0.0, 2.0**-6)
STEPS = 2


class Stack(nn.Module):
    """Residual sequence-parallel blocks and an output head; activations between blocks are this
    rank's sequence slice (torch's TP styles return local tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([make_block("sp_mlp", True, seed=1, dim=DIM, hidden=HIDDEN, heads=HEADS),
                                     make_block("sp_attention", True, seed=2, dim=DIM, hidden=HIDDEN, heads=HEADS)])
        torch.manual_seed(3)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            out = block(x)
            x = x + (out.to_local() if isinstance(out, DTensor) else out)
        return self.head(x)


def _plan() -> dict:
    plan = {f"blocks.0.{k}": v for k, v in plan_for("sp_mlp").items()}
    plan.update({f"blocks.1.{k}": v for k, v in plan_for("sp_attention").items()})
    plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1))
    return plan


def _build(variant: str, ref: nn.Module, mesh: Any) -> nn.Module:
    """``variant``: ``fsdp2``, ``torch_tp+shard`` or ``tp+shard``; a ``:bf16`` suffix adds mixed
    precision (bf16 parameters in the step, fp32 reduction)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    variant, _, precision = variant.partition(":")
    bf16 = precision == "bf16"
    model = copy.deepcopy(ref)
    if variant == "tp+shard":
        overlap.tensor_parallel(model, mesh["tp"], _plan(), chunks=2)
    else:
        parallelize_module(model, mesh["tp"], _plan())
    for module in (*model.blocks, model):
        if variant == "fsdp2":
            policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
            fully_shard(module, mesh=mesh["dp"], mp_policy=policy)
        else:
            mp = overlap.MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None
            overlap.shard(module, mesh=mesh["dp"], mp=mp)
    return model


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, SEQ, DIM, generator=gen), torch.randn(BATCH, SEQ, DIM, generator=gen)


def _local_part(t: torch.Tensor, dp: int, dp_rank: int, tp: int, tp_rank: int) -> torch.Tensor:
    rows, cols = BATCH // dp, SEQ // tp
    return t[dp_rank * rows:(dp_rank + 1) * rows, tp_rank * cols:(tp_rank + 1) * cols]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(what: str, got: torch.Tensor, want: torch.Tensor, tol: Any) -> list[str]:
    if got.shape != want.shape:
        return [f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"]
    diff = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    if tol is None:
        return [] if torch.equal(got, want) else [f"{what}: not bitwise equal (max abs diff {diff:.3g})"]
    bound = tol[0] + tol[1] * want.float().abs().max().item()
    return [f"{what}: max abs diff {diff:.3g} > {bound:.3g}"] if diff > bound else []


def _train(model: nn.Module, parts: Any, divide: int) -> dict[str, Any]:
    """``STEPS`` SGD steps on the loss ``sum(y * dy) / divide``; the first step's gradients (full),
    the last step's clip total norm and the final parameters (full)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out: dict[str, Any] = {}
    for step in range(STEPS):
        x, dy = (parts(t) for t in _data(step))
        loss = (model(x) * dy).sum() / divide
        loss.backward()
        if step == 0:
            out["grads"] = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)  # measures, clips nothing
        out["norm"] = _full(norm)
        opt.step()
        opt.zero_grad()
    out["params"] = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return out


def _compare_with_fsdp2_and_unsharded(results: dict[str, Any]) -> list[str]:
    """``torch_tp+shard`` is FSDP2 on the same torch TP bitwise (bf16: but for FSDP2's bf16 tp
    reduction before torch 2.15, ``BF16_TOL``); ``fsdp2`` and ``tp+shard`` match the unsharded model
    (``TOL``): first-step gradients, final parameters, clip norms."""
    problems: list[str] = []
    want = results["fsdp2"]
    for what in ("grads", "params"):
        for n, value in results["torch_tp+shard"][what].items():
            problems += _close(f"torch_tp+shard {what} {n} vs FSDP2", value, want[what][n], None)
    problems += _close("torch_tp+shard clip_grad_norm_ vs FSDP2", results["torch_tp+shard"]["norm"], want["norm"], None)
    ours_bf16, theirs_bf16 = results["torch_tp+shard:bf16"], results["fsdp2:bf16"]
    for what in ("grads", "params"):
        for n, value in ours_bf16[what].items():
            # bitwise, but for what FSDP2 before torch 2.15 reduces over tp in bf16 (BF16_TOL)
            tol = None if FSDP2_TP_GRADS_IN_REDUCE_DTYPE or (what == "grads" and "norm" not in n) else BF16_TOL
            problems += _close(f"torch_tp+shard bf16 {what} {n} vs FSDP2 bf16", value, theirs_bf16[what][n], tol)
    for variant in ("fsdp2", "tp+shard"):
        for what in ("grads", "params"):
            for n, value in results[variant][what].items():
                problems += _close(f"{variant} {what} {n} vs unsharded", value, results["unsharded"][what][n], TOL)
        problems += _close(f"{variant} clip_grad_norm_ vs unsharded", results[variant]["norm"],
                           results["unsharded"]["norm"], TOL)
    return problems


def _fsdp_tp_rank(rank: int, world: int, path: str) -> list[str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dp, tp = 2, world // 2
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_coordinate()
    ref = Stack()
    problems: list[str] = []
    # data parallelism averages the gradients over dp: the unsharded loss is the sum over dp ranks / dp
    results = {"unsharded": _train(copy.deepcopy(ref), lambda t: t, dp)}
    models = {}
    for variant in ("fsdp2", "torch_tp+shard", "tp+shard", "fsdp2:bf16", "torch_tp+shard:bf16"):
        models[variant] = _build(variant, ref, mesh)
        results[variant] = _train(models[variant], lambda t: _local_part(t, dp, dp_rank, tp, tp_rank), 1)

    theirs, ours = models["fsdp2"], models["torch_tp+shard"]
    sd_t, sd_o = get_model_state_dict(theirs), get_model_state_dict(ours)
    if list(sd_t) != list(sd_o):
        problems.append(f"state-dict keys {list(sd_o)} != FSDP2's {list(sd_t)}")
    for k in sd_t:
        t, o = sd_t[k], sd_o[k]
        if (not isinstance(o, DTensor) or o.placements != t.placements or o.shape != t.shape
                or o.device_mesh.mesh_dim_names != t.device_mesh.mesh_dim_names
                or o.to_local().shape != t.to_local().shape):
            problems.append(f"{k}: {getattr(o, 'placements', type(o).__name__)} local "
                            f"{tuple(o.to_local().shape)}; FSDP2: {t.placements} local {tuple(t.to_local().shape)}")
    problems += _compare_with_fsdp2_and_unsharded(results)
    sd_o_tp = get_model_state_dict(models["tp+shard"])
    for k, v in sd_o_tp.items():
        problems += _close(f"tp+shard state dict {k} vs unsharded", _full(v), results["unsharded"]["params"][k], TOL)
    full = overlap.full_state_dict(models["tp+shard"], rank0_only=False)
    for k, v in full.items():
        problems += _close(f"overlap.full_state_dict {k} vs get_model_state_dict", v, _full(sd_o_tp[k]), None)
    overlap.load_full_state_dict(models["torch_tp+shard"], full)  # into another 2-D model: its parts
    for k, v in overlap.full_state_dict(models["torch_tp+shard"], rank0_only=False).items():
        problems += _close(f"overlap.load_full_state_dict round trip {k}", v, full[k], None)

    problems += _hsdp_with_tp(ref)

    dcp.save(get_model_state_dict(models["tp+shard"]), checkpoint_id=path)
    fresh = _build("fsdp2", Stack().apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None), mesh)
    loaded = get_model_state_dict(fresh)
    dcp.load(loaded, checkpoint_id=path)
    for k, v in loaded.items():
        problems += _close(f"DCP of tp+shard loaded into FSDP2 {k}", v.full_tensor(),
                           results["tp+shard"]["params"][k], None)
    problems += _non_finite_names_global_ranks(models["torch_tp+shard"], mesh, dp_rank, tp, tp_rank)
    return problems


def _non_finite_names_global_ranks(model: nn.Module, mesh: Any, dp_rank: int, tp: int, tp_rank: int) -> list[str]:
    """The finite check (``overlap.check_finite``) over a dp group that is a slice of the mesh (global
    ranks {0, 2} and {1, 3}: a group rank is not the global one): a NaN in dp rank 1's inputs makes
    every rank raise ``NonFiniteError`` naming the global rank of its dp group's second member."""
    x, dy = (_local_part(t, 2, dp_rank, tp, tp_rank) for t in _data(9))
    if dp_rank == 1:
        x = x.clone()
        x[0, 0, 0] = float("nan")
    want = [int(mesh["dp"].mesh[1])]
    with overlap.check_finite():
        try:
            (model(x) * dy).sum().backward()
        except overlap.NonFiniteError as e:
            return [] if list(e.ranks) == want else [f"NonFiniteError names ranks {list(e.ranks)}, not {want}"]
    return ["no NonFiniteError for a NaN in dp rank 1's inputs"]


def _hsdp_with_tp(ref: nn.Module) -> list[str]:
    """HSDP + TP on the 3-D mesh (replicate, shard, tp) = (2, 1, 2): torch TP, then ``overlap.shard``
    or FSDP2 over ``mesh["replicate", "shard"]``: the same placements, gradients and updates, bitwise."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    replica, _, tp_rank = mesh.get_coordinate()
    results, placements = {}, {}
    for variant in ("fsdp2", "overlap"):
        model = parallelize_module(copy.deepcopy(ref), mesh["tp"], _plan())
        for module in (*model.blocks, model):
            if variant == "fsdp2":
                fully_shard(module, mesh=mesh["replicate", "shard"])
            else:
                overlap.shard(module, mesh=mesh["replicate", "shard"])
        placements[variant] = {n: p.placements for n, p in model.named_parameters()}
        results[variant] = _train(model, lambda t: _local_part(t, 2, replica, 2, tp_rank), 1)
    problems = [f"HSDP + TP placements {placements['overlap']} != FSDP2's {placements['fsdp2']}"
                ] if placements["overlap"] != placements["fsdp2"] else []
    for what in ("grads", "params"):
        for n, value in results["overlap"][what].items():
            problems += _close(f"HSDP + TP {what} {n} vs FSDP2", value, results["fsdp2"][what][n], None)
    return problems


@pytest.mark.timeout(300)
def test_fsdp_with_tensor_parallel_four_ranks(distributed: Any, tmp_path: Any) -> None:
    """overlap.shard over dp on torch TP is FSDP2 bitwise; over overlap.tensor_parallel it matches
    the unsharded model; specs, clip norms, state dicts and DCP as FSDP2's."""
    results = distributed(_fsdp_tp_rank, 4, str(tmp_path / "ckpt"), timeout=280)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems)


def _one_dp_rank(rank: int, world: int) -> list[str]:
    """Mesh ``("dp", "tp") = (1, world)``: one data-parallel rank, so ``overlap.shard`` hands each
    gradient to its shard without packing ([Note: world size 1] in ``overlap/param_group.py``), here
    tensor-parallel gradients: a norm's ``Partial()`` one all-reduced over tp first, bf16 ones cast."""
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    _, tp_rank = mesh.get_coordinate()
    ref = Stack()
    results = {"unsharded": _train(copy.deepcopy(ref), lambda t: t, 1)}
    for variant in ("fsdp2", "torch_tp+shard", "tp+shard", "fsdp2:bf16", "torch_tp+shard:bf16"):
        results[variant] = _train(_build(variant, ref, mesh), lambda t: _local_part(t, 1, 0, world, tp_rank), 1)
    return _compare_with_fsdp2_and_unsharded(results)


@pytest.mark.timeout(200)
def test_one_data_parallel_rank_with_tensor_parallel(distributed: Any) -> None:
    """overlap.shard over a dp dim of one rank on torch TP is FSDP2 bitwise, fp32 and bf16; over
    overlap.tensor_parallel it matches the unsharded model."""
    results = distributed(_one_dp_rank, 2, timeout=180)
    for rank, problems in enumerate(results):
        assert problems == [], f"rank {rank}: " + "\n".join(problems)
