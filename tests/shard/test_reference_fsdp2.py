"""The reference side of the sharded-training numerics tests, proven with torch's own FSDP2.

``test_shard_numerics.py`` checks ``overlap.shard`` against the single-process unsharded run
(``models.unsharded_losses``) and against FSDP2 (``models.fsdp2_losses``). Here the same comparisons
run with FSDP2 (``fully_shard`` on each block, then the root; gloo ranks on CPU) in place of
``overlap.shard``, so a failure over there is the runtime's and not the model's, the batch split's or
the comparison method's. Tolerances, and the measurements behind them, live in ``models.py``
([Note: tolerances]).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from models import (
    BF16_LOSS_RTOL,
    BF16_MIN_DEV,
    COUNTING_LINK,
    GLOBAL_BATCH,
    LOSS_RTOL,
    MICRO_BATCHES,
    PARAM_ATOL,
    PARAM_RTOL,
    STEP_ATOL,
    STEP_RTOL,
    TinyLM,
    accumulation_batches,
    accumulation_optimizer,
    fsdp2_losses,
    fsdp2_model,
    gradient_reductions,
    local_batch,
    make_batch,
    max_rel_dev,
    shard_rows,
    single_threaded,
    train_ranks,
    unsharded_big_step,
    unsharded_losses,
)

WORLD_SIZES = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return unsharded_losses()


def test_rank_slices_recompose_the_global_loss() -> None:
    """[Note: global loss] in one process: the mean of the slices' mean losses is the global loss."""
    torch.manual_seed(0)
    model = TinyLM()
    tokens = make_batch(3)
    assert torch.equal(tokens, make_batch(3)) and not torch.equal(tokens, make_batch(4))
    with torch.no_grad(), single_threaded():
        full = model.loss(tokens)
        for world in WORLD_SIZES:
            slices = [local_batch(tokens, r, world) for r in range(world)]
            assert torch.equal(torch.cat(slices), tokens)
            assert all(len(s) == GLOBAL_BATCH // world for s in slices)
            # float32 means of ~100 terms, summed in a different order: a few ulps.
            mean = sum(model.loss(s) for s in slices) / world
            torch.testing.assert_close(mean, full, rtol=1e-6, atol=0)


def test_reference_learns(reference) -> None:
    losses, _ = reference
    # Comparing loss curves means something only if they move: the data has structure to learn.
    assert losses[0] == pytest.approx(torch.log(torch.tensor(67.0)).item(), rel=0.05)
    assert losses[-1] < losses[0] - 0.5, losses


def _fsdp2_fp32(rank: int, world_size: int) -> dict[str, Any]:
    model = fsdp2_model(world_size)
    shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    losses = train_ranks(model, rank, world_size)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # a collective: every rank calls it
    return {
        "losses": losses,
        "shapes": shapes,
        "tied": model.head.weight is model.tok.weight,
        "params": full if rank == 0 else None,
    }


def _fsdp2_fp32_and_bf16(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # see models.single_threaded
    fp32 = _fsdp2_fp32(rank, world_size)
    return {"fp32": fp32, "bf16_losses": fsdp2_losses(rank, world_size, mp_bf16=True)}


# A rank's start-up (importing FSDP2, building the mesh: ~2-3 s on a shared 2-core box) costs more
# than a 20-step run, so the fp32 and bf16 runs of one world size share one call, made by whichever
# test asks first.
_fsdp2_results: dict[int, list[dict[str, Any]]] = {}


@pytest.fixture
def fsdp2_runs(distributed):
    """``fsdp2_runs(world_size)``: the per-rank results of :func:`_fsdp2_fp32_and_bf16`, cached."""

    def get(world_size: int) -> list[dict[str, Any]]:
        if world_size not in _fsdp2_results:
            _fsdp2_results[world_size] = distributed(_fsdp2_fp32_and_bf16, world_size)
        return _fsdp2_results[world_size]

    return get


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp2_fp32_matches_unsharded(fsdp2_runs, reference, world_size: int) -> None:
    ref_losses, ref_sd = reference
    results = [r["fp32"] for r in fsdp2_runs(world_size)]
    losses = results[0]["losses"]
    assert all(r["losses"] == losses for r in results), "ranks disagree on the all-reduced loss"
    assert max_rel_dev(losses, ref_losses) <= LOSS_RTOL, (losses, ref_losses)
    for rank, res in enumerate(results):
        assert res["tied"]
        # FSDP2's dim-0 shards follow the sharding rule, empty last shards included (pos.weight, w=4).
        for name, shape in res["shapes"].items():
            start, stop = shard_rows(ref_sd[name].shape[0], world_size, rank)
            assert shape == (stop - start, *ref_sd[name].shape[1:]), (name, rank, shape)
    params = results[0]["params"]
    assert set(params) == {n for n, _ in TinyLM().named_parameters()}
    for name, p in params.items():
        torch.testing.assert_close(p, ref_sd[name], rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp2_bf16_stays_within_the_bf16_tolerance(fsdp2_runs, reference, world_size: int) -> None:
    ref_losses, _ = reference
    losses = fsdp2_runs(world_size)[0]["bf16_losses"]
    dev = max_rel_dev(losses, ref_losses)
    # Above the floor: bf16 compute really happened (fp32 runs deviate by <= ~2.4e-7).
    assert BF16_MIN_DEV < dev <= BF16_LOSS_RTOL, (dev, losses, ref_losses)


def _fsdp2_accumulation(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2's form of ``overlap.no_sync``: gradient sync off for all but the last micro-batch."""
    from overlap.testing import current_link

    torch.set_num_threads(1)  # see models.single_threaded
    link = current_link()
    model = fsdp2_model(world_size)
    opt = accumulation_optimizer(model.parameters())
    reductions = []
    for i, tokens in enumerate(accumulation_batches()):
        link.reset_stats()
        model.set_requires_gradient_sync(i == MICRO_BATCHES - 1)
        (model.loss(local_batch(tokens, rank, world_size)) / MICRO_BATCHES).backward()
        reductions.append(gradient_reductions(link.stats()))
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    opt.step()
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"grads": grads, "params": params, "reductions": reductions}


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_accumulation_matches_one_big_step(distributed, world_size: int) -> None:
    ref_grads, ref_params = unsharded_big_step()
    res = distributed(_fsdp2_accumulation, world_size, link=COUNTING_LINK)[0]
    # The counting method test_shard_numerics applies to overlap.no_sync: with sync off FSDP2 issues
    # no gradient reduction; the synced backward reduce-scatters each of the 3 FSDP groups once.
    assert res["reductions"] == [0] * (MICRO_BATCHES - 1) + [3], res["reductions"]
    for name, g in res["grads"].items():
        # Gradient elements near zero carry only rounding noise: tolerance relative to the tensor's scale.
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(g, ref_grads[name], rtol=STEP_RTOL, atol=STEP_RTOL * scale,
                                   msg=lambda m: f"grad {name}: {m}")
    for name, p in res["params"].items():
        torch.testing.assert_close(p, ref_params[name], rtol=STEP_RTOL, atol=STEP_ATOL,
                                   msg=lambda m: f"param {name}: {m}")
