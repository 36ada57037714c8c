"""Compressed collectives in ``overlap.shard`` (``compress=overlap.Compression(...)``, [Note: compressed
collectives] in ``overlap/compression.py``) on 2 gloo ranks.

Levels, as elsewhere: the gathered parameters are exactly what the kernels' public ops make of the
unsharded model's parameters (bitwise); reduced gradients are within the stated per-block bound of
the exact average; training tracks exact training (the bound below, measured); the bytes on the
emulated link meet the issue's goals; checkpoints, ``no_sync`` and optimizer-in-backward work and
stay exact where they should; unsupported combinations fail naming ``compress``.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import overlap
from overlap_kernels import ShardLayout
from overlap_kernels.block_quantization import error_bound
from overlap_kernels.quantized_all_gather_copy_out import quantized_all_gather_copy_out
from overlap_kernels.quantized_copy_in import quantized_all_gather_copy_in
from overlap_kernels.quantized_layout import QuantizedLayout
from models import COUNTING_LINK, SEED, LR, TinyLM, block_absmax, local_batch, make_batch, make_optimizer, train_ranks

INT8 = overlap.Compression()  # gather and reduce int8, block 256
FP8_GATHER = overlap.Compression(gather="fp8", reduce=None)  # e4m3 gathers, exact reductions
FP8 = overlap.Compression(gather="fp8", reduce="fp8")  # e4m3 gathers and reductions
FP8_REDUCE = overlap.Compression(gather=None, reduce="fp8")  # exact gathers, e4m3 reductions

# [Note: compressed training tolerance] TinyLM, 2 ranks, AdamW lr 1e-2, 100 steps, fp32, measured at
# block 256: the final global loss differs from exact training's by 0.07% (gather and reduce),
# 0.14% (reduce only), 0.5% (gather only), 0.2% at block 32; single steps differ by up to 2.3%
# (training noise: the runs diverge and re-converge). The goal is 1% at the end.
FINAL_LOSS_RTOL = 0.01
TRAIN_STEPS = 100

# [Note: fp8 gather training tolerance] The same TinyLM run with gather="fp8" (reduce exact):
# e4m3 keeps 3 mantissa bits per element, so the gathered parameters are 2.5% off per step
# (relative norm, median) against int8's 0.5% at block 256 (these weights are Gaussian-like within
# a block: int8's even steps fit them better), and the gradients 5.9% (int8: 1.1%; max 13% / 2.2%).
# Measured (benchmarks/bench_fp8_gather.py, RESULTS.md): the final step's loss +4.5% from exact
# (that one batch's loss is noisy), the mean over the last 10 steps +0.69%, the held-out loss
# +1.05%. The test bounds the last-10 mean.
FP8_LAST10_RTOL = 0.02


def _tiny_lm(compress: overlap.Compression | None) -> TinyLM:
    torch.manual_seed(SEED)
    model = TinyLM()
    for block in model.blocks:
        overlap.shard(block, compress=compress)
    overlap.shard(model, compress=compress)
    return model


def _mlp(compress: overlap.Compression | None, **kw: Any) -> nn.Module:
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(33, 70), nn.Tanh(), nn.Linear(70, 5))
    return overlap.shard(model, compress=compress, **kw)


# ------------------------------------------------------------------------------- training tracks
def _train_both(rank: int, world: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    return {"exact": train_ranks(_tiny_lm(None), rank, world, steps=TRAIN_STEPS),
            "int8": train_ranks(_tiny_lm(INT8), rank, world, steps=TRAIN_STEPS),
            "fp8 gather": train_ranks(_tiny_lm(FP8_GATHER), rank, world, steps=TRAIN_STEPS),
            "fp8 reduce": train_ranks(_tiny_lm(FP8_REDUCE), rank, world, steps=TRAIN_STEPS)}


@pytest.mark.torch_kernels
def test_compressed_training_tracks_exact_training(distributed) -> None:
    """[Note: compressed training tolerance]: the final loss within 1% of exact training's, and the
    loss falls as much (it learns, it does not merely stay near the start); with fp8 gathers, [Note:
    fp8 gather training tolerance]: the mean loss of the last 10 steps within 2% of exact's; with fp8
    reductions (exact gathers) the final loss within 1% (measured: +0.02%, the last-10 mean -0.30%)."""
    result = distributed(_train_both, 2)[0]
    exact, int8, fp8 = result["exact"], result["int8"], result["fp8 gather"]
    fp8_reduce = result["fp8 reduce"]
    assert abs(int8[-1] - exact[-1]) <= FINAL_LOSS_RTOL * exact[-1], (int8[-1], exact[-1])
    assert int8[-1] < 0.6 * int8[0] and exact[-1] < 0.6 * exact[0]
    last10, exact10 = sum(fp8[-10:]) / 10, sum(exact[-10:]) / 10
    assert abs(last10 - exact10) <= FP8_LAST10_RTOL * exact10, (last10, exact10)
    assert fp8[-1] < 0.6 * fp8[0] and fp8 != exact  # it learns, and it was quantized
    assert abs(fp8_reduce[-1] - exact[-1]) <= FINAL_LOSS_RTOL * exact[-1], (fp8_reduce[-1], exact[-1])
    assert fp8_reduce[-1] < 0.6 * fp8_reduce[0] and fp8_reduce != exact


# ---------------------------------------------------------------------- what the collectives carry
def _gathered_and_reduced(rank: int, world: int, gather: str, reduce: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    plain = _mlp(None)  # the same initial values, unsharded: its full parameters are the reference
    full = [p.full_tensor().detach() for p in plain.parameters()]
    model = _mlp(overlap.Compression(gather=gather))
    model.unshard()
    gathered = [u.detach().clone() for u in model._overlap_state.group.unsharded]
    # the reference: each rank's public copy-in, the all-gather simulated, the public copy-out
    layout = ShardLayout([tuple(t.shape) for t in full], world)
    qlayout = QuantizedLayout(layout, INT8.block, gather)
    buffer = torch.cat([quantized_all_gather_copy_in([layout.shard(t, r) for t in full], qlayout, r)[0]
                        for r in range(world)])
    expected = quantized_all_gather_copy_out(buffer, qlayout)
    model.reshard()

    # reduce only: the forward sees exact parameters, so each rank's gradient is the plain model's
    reduce_only = _mlp(overlap.Compression(gather=None, reduce=reduce))
    x = torch.randn(2 * world, 33, generator=torch.Generator().manual_seed(5))
    reduce_only(x.chunk(world)[rank]).square().sum().backward()
    got = [p.grad.to_local().clone() for p in reduce_only.parameters()]
    torch.manual_seed(SEED)
    reference = nn.Sequential(nn.Linear(33, 70), nn.Tanh(), nn.Linear(70, 5))
    per_rank = []
    for r in range(world):
        reference.zero_grad()
        reference(x.chunk(world)[r]).square().sum().backward()
        per_rank.append([p.grad.clone() for p in reference.parameters()])
    return {"gathered": gathered, "expected": expected, "got": got, "per_rank": per_rank, "full": full}


@pytest.mark.torch_kernels
@pytest.mark.parametrize("gather, reduce", [("int8", "int8"), ("fp8", "int8"), ("int8", "fp8")])
def test_gather_carries_the_quantized_shards_and_reduce_stays_within_its_bound(distributed, gather, reduce) -> None:
    """The unsharded parameters are bitwise what the public ops make of the full parameters (in the
    gather's format, and not the exact ones); each reduced gradient element is within ``sum_r
    bound_r / w`` (+ float32 rounding of the sum and the average) of the exact average, [Note: the
    per-block error bound] of the reduce's format summed over the ranks: int8's ``absmax_r / 254``,
    fp8's ``|x_r| / 17 + absmax_r / 458752``. Each format's bound is one the other format's errors
    break on these gradients (checked: fp8 codes fail int8's bound on a block's largest elements,
    int8 codes fail fp8's on its smallest), so the reduction did use ``reduce``'s codes."""
    world = 2
    other = {"int8": "fp8", "fp8": "int8"}[reduce]
    for rank, r in enumerate(distributed(_gathered_and_reduced, world, gather, reduce)):
        for got, want in zip(r["gathered"], r["expected"]):
            assert torch.equal(got, want)
        assert not all(torch.equal(g, f) for g, f in zip(r["gathered"], r["full"]))
        layout = ShardLayout([tuple(g.shape) for g in r["per_rank"][0]], world)
        outside_other = False
        for i, got in enumerate(r["got"]):
            shards = [layout.shard(g[i], rank) for g in r["per_rank"]]
            exact = sum(shards) / world
            slack = sum(s.abs() for s in shards) * 2**-22 + 1e-30
            error = (got - exact).abs()
            bounds = {f: sum(error_bound(block_absmax(s, INT8.block), s, f) for s in shards) / world
                      for f in (reduce, other)}
            assert (error <= bounds[reduce] + slack).all(), i
            outside_other |= bool((error > bounds[other] + slack).any())
            assert not torch.equal(got, exact)  # it was quantized (a test that can fail)
        assert outside_other, f"the {reduce} reduction's errors all fit {other}'s bound too"


def _link_bytes(rank: int, world: int, compress: overlap.Compression | None) -> dict[str, int]:
    from overlap.testing import current_link

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    mp = overlap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        overlap.shard(layer, mp=mp, compress=compress, reshard_after_forward=False)
    overlap.shard(model, mp=mp, compress=compress, reshard_after_forward=False)
    x = torch.randn(8, 256)
    link = current_link()
    link.reset_stats()
    loss = model(x).float().square().mean()
    gather = link.stats()
    link.reset_stats()
    loss.backward()
    reduce = link.stats()
    return {"gather": gather.wire_bytes, "gathers": gather.count, "reduce": reduce.wire_bytes, "reduces": reduce.count}


@pytest.mark.torch_kernels
def test_bytes_on_the_link_meet_the_goals(distributed) -> None:
    """Emulated link, counted: int8 gathers carry <= 0.53x of bf16 gathers' bytes, int8 reductions
    <= 0.28x of fp32 reductions' (mixed precision bf16 / fp32 for the exact run), with the same
    number of collectives; fp8 gathers and reductions carry exactly int8's bytes."""
    exact = distributed(_link_bytes, 2, None, link=COUNTING_LINK)[0]
    int8 = distributed(_link_bytes, 2, INT8, link=COUNTING_LINK)[0]
    fp8 = distributed(_link_bytes, 2, FP8, link=COUNTING_LINK)[0]
    assert fp8 == int8  # a byte per element and a scale per block, whatever the code means
    assert exact["gathers"] == int8["gathers"] and exact["reduces"] == int8["reduces"] == 2  # one per layer
    assert int8["gather"] <= 0.53 * exact["gather"], (int8, exact)
    assert int8["reduce"] <= 0.28 * exact["reduce"], (int8, exact)


# ------------------------------------------------------------------ checkpoints, no_sync, in-backward
def _checkpoint(rank: int, world: int, path: str, compress: overlap.Compression) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    model = _tiny_lm(compress)
    train_ranks(model, rank, world, steps=3)
    shards = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    full = overlap.full_state_dict(model, rank0_only=False)
    exact_full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    dcp.save(model.state_dict(), checkpoint_id=path)
    fresh = _tiny_lm(compress)
    target = fresh.state_dict()
    dcp.load(target, checkpoint_id=path)
    fresh.load_state_dict(target)
    loaded = {k: v.to_local().clone() for k, v in fresh.state_dict().items()}
    return {"full_exact": all(torch.equal(full[k], exact_full[k]) for k in exact_full),
            "loaded_exact": all(torch.equal(shards[k], loaded[k]) for k in shards)}


@pytest.mark.torch_kernels
@pytest.mark.parametrize("compress", [INT8, FP8], ids=["int8", "fp8"])
def test_checkpoints_are_exact(distributed, tmp_path, compress) -> None:
    """State dicts and DCP carry the exact shards: the full state dict is the exact all-gather of them
    (not the quantized one), and a DCP save / load round trip gives them back bit for bit."""
    for r in distributed(_checkpoint, 2, str(tmp_path / "ckpt"), compress):
        assert r["full_exact"] and r["loaded_exact"], r


def _no_sync_in_backward(rank: int, world: int, compress: overlap.Compression) -> dict[str, Any]:
    from overlap.testing import current_link

    torch.set_num_threads(1)
    out = {}
    for mode in ("plain", "in_backward"):
        model = _tiny_lm(compress)
        if mode == "plain":
            opt = make_optimizer(model.parameters())
        else:
            opt = overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=LR, betas=(0.9, 0.95), eps=1e-8,
                                                weight_decay=0.1, foreach=False)
        reductions = []
        for step in range(3):
            parts = local_batch(make_batch(step), rank, world).chunk(2)
            current_link().reset_stats()
            with overlap.no_sync(model):
                model.loss(parts[0]).backward()
            reductions.append(current_link().stats().by_op.get("all_to_all", 0))
            model.loss(parts[1]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[mode] = {"params": {k: v.to_local().clone() for k, v in model.state_dict().items()},
                     "reductions_under_no_sync": reductions}
    return out


@pytest.mark.torch_kernels
@pytest.mark.parametrize("compress", [INT8, FP8], ids=["int8", "fp8"])
def test_no_sync_and_optimizer_in_backward(distributed, compress) -> None:
    """Two micro-batches per step, the first under ``no_sync`` (nothing reduced there), then the
    compressed reduction: optimizer-in-backward gives bitwise the plain loop's parameters."""
    for r in distributed(_no_sync_in_backward, 2, compress, link=COUNTING_LINK):
        plain, in_backward = r["plain"], r["in_backward"]
        assert plain["reductions_under_no_sync"] == in_backward["reductions_under_no_sync"] == [0, 0, 0]
        for k, v in plain["params"].items():
            assert torch.equal(v, in_backward["params"][k]), k


# ------------------------------------------------------------------------------ kernels, errors
def _triton_vs_torch(rank: int, world: int, mesh_shape: tuple[int, int] | None = None,
                     compress: overlap.Compression = INT8) -> dict[str, Any]:
    """Two compressed steps on the Triton kernels, then on the torch fallback; ``mesh_shape``: over a
    (replicate, shard) mesh of that shape (HSDP, tests/shard/test_hsdp_compression.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    from overlap_kernels._launch import torch_fallback_on_cpu

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if mesh_shape else None
    out = {}
    for name in ("triton", "torch"):
        with torch_fallback_on_cpu() if name == "torch" else _nothing():
            model = _mlp(compress, mesh=mesh)
            opt = make_optimizer(model.parameters())
            for step in range(2):
                x = torch.randn(4, 33, generator=torch.Generator().manual_seed(step + 10 * rank))
                model(x).square().sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            out[name] = [p.to_local().clone() for p in model.parameters()]
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("gather, reduce", [("int8", "int8"), ("fp8", "int8"), ("fp8", "fp8")])
def test_runtime_on_triton_kernels_equals_the_torch_fallback(distributed, gather, reduce) -> None:
    """Two compressed steps with the Triton kernels (interpreter on CPU) and with the torch fallback
    (torch's own float8_e4m3fn casts for fp8): bitwise the same parameters."""
    from overlap_kernels import _launch

    if not _launch.triton_enabled(torch.device("cpu")):
        pytest.skip("Triton runs CPU tensors only under TRITON_INTERPRET=1 (conftest sets it without a GPU)")
    for r in distributed(_triton_vs_torch, 2, None, overlap.Compression(gather=gather, reduce=reduce)):
        assert all(torch.equal(a, b) for a, b in zip(r["triton"], r["torch"]))


def _nan_parameter(rank: int, world: int, gather: str) -> str:
    model = _mlp(overlap.Compression(gather=gather))
    if rank == 1:
        with torch.no_grad():
            model[0].weight.to_local()[0, 3] = float("nan")
    try:
        model(torch.ones(2, 33))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.torch_kernels
@pytest.mark.parametrize("gather", ["int8", "fp8"])
def test_a_nan_parameter_is_an_error_on_every_rank(distributed, gather) -> None:
    for message in distributed(_nan_parameter, 2, gather):
        assert f"compressed ({gather}) all-gather" in message and "ranks [1]" in message, message


def _nan_gradient(rank: int, world: int, reduce: str) -> dict[str, Any]:
    """One backward of the MLP with ``reduce`` compressed (exact gather) where rank 1's unsharded
    gradient of ``0.weight`` gets a NaN at flat element 3 (rank 0's slot, its first block): the
    reduced gradients with the finite check off, and the error with it on."""
    torch.set_num_threads(1)

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[3] = float("nan")
        return grad

    def hook_unsharded(module: nn.Module, args: Any) -> None:  # the unsharded parameter while forward runs
        if rank == 1:
            module.weight.register_hook(poison)

    out: dict[str, Any] = {}
    for check in (False, True):
        model = _mlp(overlap.Compression(gather=None, reduce=reduce))
        model[0].register_forward_pre_hook(hook_unsharded)
        try:
            with overlap.check_finite(check):
                model(torch.ones(2, 33)).square().sum().backward()
        except overlap.NonFiniteError as e:
            out["error"] = list(e.ranks)
            continue
        out["grads"] = [p.grad.to_local().clone() for p in model.parameters()]
    return out


@pytest.mark.torch_kernels
@pytest.mark.parametrize("reduce", ["int8", "fp8"])
def test_a_nan_gradient_reaches_its_owner_as_a_nan_block(distributed, reduce) -> None:
    """[Note: compressed collectives]'s non-finite rule for reductions: a NaN in one rank's gradient
    makes its whole block (and only it) NaN at the slot's owner, never a finite value; other ranks'
    slots stay finite. With ``overlap.check_finite`` on, every rank raises ``NonFiniteError`` naming
    the producing rank."""
    results = distributed(_nan_gradient, 2, reduce)
    for rank, r in enumerate(results):
        assert r.get("error") == [1], (rank, r.get("error"))
        weight, *others = r["grads"]
        assert all(bool(torch.isfinite(g).all()) for g in others), rank
        flat = weight.reshape(-1)
        if rank == 0:  # the owner of element 3: its first block (256 elements) is NaN, every element
            assert bool(torch.isnan(flat[:INT8.block]).all()) and bool(torch.isfinite(flat[INT8.block:]).all())
        else:
            assert bool(torch.isfinite(flat).all())


# ------------------------------------------------------------------- fully_shard (FSDP2's spelling)
def _fully_shard_vs_shard(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for api in ("shard", "fully_shard"):
        torch.manual_seed(SEED)
        model = TinyLM()
        wrap = (lambda m: overlap.shard(m, compress=INT8)) if api == "shard" else \
            (lambda m: overlap.fully_shard(m, compress=INT8))
        for block in model.blocks:
            wrap(block)
        wrap(model)
        out[api] = train_ranks(model, rank, world, steps=4)
        out[api + " params"] = [p.to_local().detach().clone() for p in model.parameters()]
    return out


@pytest.mark.torch_kernels
def test_fully_shard_takes_compress(distributed) -> None:
    """``overlap.fully_shard(..., compress=)`` is ``overlap.shard``'s compressed runtime: the same
    losses and parameters, bitwise, after 4 steps (the same kernels on the same values)."""
    for r in distributed(_fully_shard_vs_shard, 2):
        assert r["fully_shard"] == r["shard"]
        assert all(torch.equal(a, b) for a, b in zip(r["fully_shard params"], r["shard params"]))


def test_bad_compress_arguments_name_compress(single_rank_group) -> None:
    with pytest.raises(TypeError, match="compress must be None or an overlap.Compression, got str"):
        overlap.shard(nn.Linear(2, 2), compress="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Compression.gather must be None or one of \('int8', 'fp8'\), got 'fp4'"):
        overlap.Compression(gather="fp4")
    with pytest.raises(ValueError, match=r"Compression.reduce must be None or one of \('int8', 'fp8'\), got 'fp4'"):
        overlap.Compression(reduce="fp4")
    assert overlap.Compression(gather="fp8").gather == "fp8"
    assert overlap.Compression(reduce="fp8").reduce == "fp8"
    with pytest.raises(ValueError, match=r"Compression.block must be one of \(32, 64"):
        overlap.Compression(block=100)
    embedding = nn.Embedding(4, 2).to(torch.float64)
    with pytest.raises(TypeError, match="compress needs float32, bfloat16 or float16 parameters; 'weight'"):
        overlap.shard(embedding, compress=INT8)
    assert not isinstance(embedding, overlap.ShardedModule)  # refused before anything changed
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(TypeError, match="fully_shard: compress must be None or an overlap.Compression, got str"):
        overlap.fully_shard(nn.Linear(2, 2), compress="int8")  # type: ignore[arg-type]
    embedding = nn.Embedding(4, 2).to(torch.float64)
    with pytest.raises(TypeError, match="fully_shard: compress needs float32, bfloat16 or float16 parameters"):
        overlap.fully_shard(embedding, mesh=mesh, compress=INT8)  # HSDP checks alike
    assert not isinstance(embedding, overlap.ShardedModule)
    # a 2-D mesh takes a compressed gather and reduce (tests/shard/test_hsdp_compression.py)
    overlap.shard(nn.Linear(2, 2), mesh=mesh, compress=INT8)
    # compression off (both None) is exact sharding, accepted anywhere
    overlap.shard(nn.Linear(2, 2), mesh=mesh, compress=overlap.Compression(gather=None, reduce=None))
