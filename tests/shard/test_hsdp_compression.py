"""HSDP with compressed collectives (issue 30) on 4 gloo ranks (2 replicas x 2 shards), side by side
with exact HSDP from the same weights.

``overlap.shard(module, mesh=<2-D mesh>, compress=...)``: ``reduce="int8"`` compresses the sum over
the replicas (the inter-node tier; the shard group's reduce-scatter stays exact: [Note: compressing
the inter-node tier] in ``overlap/param_group.py``); ``gather="int8"`` quantizes the shard group's
all-gather, as on a 1-D mesh ([Note: compressed collectives] in ``overlap/compression.py``).

Checked: the replicas hold bitwise equal parameters after every step (every replica dequantizes the
same gathered bytes, and quantizes bitwise equal shards); the shard group's reduce traffic is exactly
the exact run's while the replicas' tier carries <= 0.28x of the exact all-reduce's bytes, and a
compressed gather carries <= 0.28x of the float32 gather's; one step's gradients are within the
two-stage bound of exact HSDP's and not equal to them; training tracks exact HSDP; the Triton kernels
give bitwise the torch fallback's training; ``no_sync`` micro-batches, optimizer-in-backward and a
DCP round trip; the gradient error measurement on the replicas' tier against exact HSDP's gradients;
``torch.compile`` of the compressed model. fp8 gathers (``Compression(gather="fp8")``): replicas
bitwise equal, int8's bytes, training within [Note: fp8 gather tolerances] of exact HSDP, and the
Triton kernels bitwise the torch fallback. fp8 replica sums (``Compression(reduce="fp8")``): replicas
bitwise equal, int8's bytes across the replicas, exact HSDP's in the shard group, gradients and
training within [Note: fp8 replica sum tolerances], the gradient error measurement, and the Triton
kernels bitwise the torch fallback. A shard group of one rank (a ``(2, 1)`` mesh, 2 ranks) gathers
exactly (nothing moves there) and still compresses the replica sum.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import overlap
from models import (COUNTING_LINK, LR, SEED, TinyLM, gradient_reductions, local_batch, make_batch, make_optimizer,
                    train_ranks)
from test_compression import _triton_vs_torch
from test_hsdp import MESH_DIMS, _replicas_identical  # differing parameter names across replicas

INTER_NODE = overlap.Compression(gather=None, reduce="int8")
BOTH = overlap.Compression()  # int8 gather in the shard group, int8 sum over the replicas
FP8_GATHER = overlap.Compression(gather="fp8", reduce=None)  # e4m3 gather in the shard group, exact replica sum
FP8_BOTH = overlap.Compression(gather="fp8")  # e4m3 gather, int8 sum over the replicas (the demo's --compress fp8-gather)
FP8_SUM = overlap.Compression(gather=None, reduce="fp8")  # e4m3 sum over the replicas, exact gather
FP8_ALL = overlap.Compression(gather="fp8", reduce="fp8")  # e4m3 gather and sum over the replicas
STEPS = 6  # 4 ranks on 2 cores are slow
# Tolerances, measured (TinyLM, 2x2, block 256): one step's gradients differ from exact HSDP's by
# 0.6-0.7% relative (median over parameters) and 1.9% at most (a small LayerNorm bias) with the
# replica sum compressed; 1.6-1.9% median and 2.7% at most with the gather compressed too (the
# forward then sees quantized parameters). Over 6 steps the global losses by at most 0.09% (0.03%).
# The bounds leave 1.5x room on the gradients and 20x on the losses (training noise grows with
# steps), while a wrong average (a factor 2) or a replica's sum missing moves both by far more.
GRAD_RTOL = 0.04
LOSS_RTOL = 0.02
# A compressed float32 gather: (1 + 4/256) / 4 = 0.254x for large parameters; TinyLM's small ones
# (LayerNorm shards of 15 elements, one scale each) cost a little more: measured 0.257x.
GATHER_RATIO = 0.28
# fp8 gathers [Note: fp8 gather tolerances]: e4m3 keeps 3 mantissa bits per element (error up to
# |x|/17) where int8 gives absmax/254 per block, and TinyLM's Gaussian-like weights suit int8:
# benchmarks/bench_fp8_gather.py measured, on a 1-D mesh, gathered parameters 2.5% off per step
# against int8's 0.5% and gradients 5.9% against 1.1% (~5x). Measured here (2x2, one step, against
# exact HSDP, relative error per parameter): fp8 gather alone 7.2-8.9% median / 14.9% max, with the
# int8 replica sum too 7.1-9.0% / 14.8%; int8 gather alone 1.4-1.5% / 2.5% (5.8x less). Over 6 steps
# the global losses moved by at most 0.21% (fp8 gather alone) and 0.12% (with the replica sum).
# Bounds: the gradients 1.5x the measured max (as GRAD_RTOL for int8); the losses the goal,
# 1% (5x the measured); and a median above 3%, twice int8's, so an int8 gather posing as fp8 fails.
FP8_GRAD_RTOL = 0.22
FP8_LOSS_RTOL = 0.01
FP8_GRAD_MEDIAN_ABOVE = 0.03
# [Note: fp8 replica sum tolerances] reduce="fp8" quantizes the sum over the replicas twice in e4m3
# (each element within |x|/17 per stage where int8 gives absmax/254 per block). Measured (TinyLM, 2x2,
# one step, against exact HSDP, relative error per parameter): fp8 1.4-3.9% (median 2.9-3.0%), int8
# 0.4-1.9% (median 0.6-0.7%): 4.5x; over the whole step (overlap.measure_gradient_error) 3.5% against
# int8's 1.1%. Over 6 steps the global losses moved by at most 0.04%. Bounds: the gradients 1.5x the
# measured max; the losses FP8_LOSS_RTOL (the issue's 1%); and a median above twice int8's, so int8
# codes posing as fp8 fail.
FP8_SUM_GRAD_RTOL = 0.06


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)


def _model(mesh, compress: overlap.Compression | None, prefetch: int | str = "auto") -> TinyLM:
    torch.manual_seed(SEED)
    model = TinyLM()
    for block in model.blocks:
        overlap.shard(block, mesh=mesh, compress=compress, prefetch=prefetch)
    overlap.shard(model, mesh=mesh, compress=compress, prefetch=prefetch)
    return model


def _tier_bytes(link, mesh) -> dict[str, int]:
    by_group = link.stats_by_group()
    return {tier: by_group[mesh.get_group(tier).group_name].wire_bytes if mesh.get_group(tier).group_name in by_group
            else 0 for tier in MESH_DIMS}


def _run(rank: int, world: int, runs: dict[str, overlap.Compression | None]) -> dict[str, Any]:
    """Each of ``runs`` (name: compress) from the same weights: one step's bytes per tier (forward
    and forward + backward) and gradients, then ``STEPS`` steps' global losses and the parameters
    that differed across the replicas after a step."""
    from overlap.testing import current_link

    torch.set_num_threads(1)
    mesh = _mesh()
    link = current_link()
    out: dict[str, Any] = {}
    for name, compress in runs.items():
        model = _model(mesh, compress)
        link.reset_stats()
        loss = model.loss(local_batch(make_batch(0), rank, world))
        out[name + " forward bytes"] = _tier_bytes(link, mesh)  # the gathers only
        loss.backward()
        out[name + " bytes"] = _tier_bytes(link, mesh)
        out[name + " grads"] = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        model = _model(mesh, compress)
        differing: list[tuple[int, str]] = []
        out[name + " losses"] = train_ranks(model, rank, world, STEPS,
                                            lambda step: differing.extend((step, n) for n in _replicas_identical(model, mesh)))
        out[name + " differing"] = differing
    return out


def _gradient_errors(got: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative error per parameter, ``||got - exact|| / ||exact||`` over this rank's shard."""
    return {n: float((got[n] - want).norm() / want.norm().clamp_min(1e-30)) for n, want in exact.items()}


@pytest.mark.torch_kernels
def test_hsdp_compresses_the_replica_sum_and_optionally_the_gather(distributed) -> None:
    runs = {"exact": None, "int8": INTER_NODE, "both": BOTH}
    for r in distributed(_run, 4, runs, link=COUNTING_LINK):
        for name in ("exact", "int8", "both"):
            assert r[name + " differing"] == [], name  # replicas bitwise equal, every step
        exact, int8, both = r["exact bytes"], r["int8 bytes"], r["both bytes"]
        assert int8["shard"] == exact["shard"]  # gather=None: the intra-node tier stays exact
        assert int8["replicate"] <= 0.28 * exact["replicate"], (int8, exact)
        assert both["replicate"] == int8["replicate"]  # the gather never crosses the replicas
        # The gather alone (the forward's traffic): quantized in the shard group; across the replicas
        # only what an exact forward sends too (the runtime's first-step agreement, a few bytes).
        gathered, exact_gathered = r["both forward bytes"], r["exact forward bytes"]
        assert gathered["replicate"] == exact_gathered["replicate"] < 100, (gathered, exact_gathered)
        assert 0 < gathered["shard"] <= GATHER_RATIO * exact_gathered["shard"], (gathered, exact_gathered)
        assert both["shard"] - gathered["shard"] < exact["shard"] - exact_gathered["shard"]  # backward's re-gathers too
        # One step's gradients against exact HSDP's, relative error per parameter ||got - exact|| /
        # ||exact||. Measured: GRAD_RTOL's comment. (The per-element bounds of the two quantizations
        # are checked on the ops themselves in tests/packing/test_quantized_kernels.py; here the
        # replicas' partial sums, which set the blocks' scales, are not visible.)
        for name in ("int8", "both"):
            errors = _gradient_errors(r[name + " grads"], r["exact grads"])
            assert max(errors.values()) <= GRAD_RTOL, (name, errors)
            assert max(errors.values()) > 0  # it was quantized (a test that can fail)
            losses, exact_losses = r[name + " losses"], r["exact losses"]
            assert all(abs(a - b) <= LOSS_RTOL * b for a, b in zip(losses, exact_losses)), (name, losses, exact_losses)


@pytest.mark.torch_kernels
def test_hsdp_fp8_gathers_train_near_exact_hsdp(distributed) -> None:
    """fp8 (e4m3) all-gathers in the shard group, alone and with the int8 replica sum: the replicas
    stay bitwise equal after every step, the gather moves int8's bytes (a byte per element plus a
    scale per block) and nothing more crosses the replicas, and one step's gradients and 6 steps'
    losses stay within [Note: fp8 gather tolerances] of exact HSDP's."""
    runs = {"exact": None, "fp8": FP8_GATHER, "fp8 + int8 sum": FP8_BOTH}
    for r in distributed(_run, 4, runs, link=COUNTING_LINK):
        exact_gathered = r["exact forward bytes"]
        for name in ("fp8", "fp8 + int8 sum"):
            assert r[name + " differing"] == [], name  # replicas bitwise equal, every step
            gathered = r[name + " forward bytes"]
            assert gathered["replicate"] == exact_gathered["replicate"] < 100, (name, gathered, exact_gathered)
            assert 0 < gathered["shard"] <= GATHER_RATIO * exact_gathered["shard"], (name, gathered, exact_gathered)
            errors = _gradient_errors(r[name + " grads"], r["exact grads"])
            assert max(errors.values()) <= FP8_GRAD_RTOL, (name, errors)
            assert sorted(errors.values())[len(errors) // 2] > FP8_GRAD_MEDIAN_ABOVE, (name, errors)
            losses, exact_losses = r[name + " losses"], r["exact losses"]
            assert all(abs(a - b) <= FP8_LOSS_RTOL * b for a, b in zip(losses, exact_losses)), (name, losses,
                                                                                                 exact_losses)
        # the replica sum alone decides the replicas' tier: exact with FP8_GATHER, int8 with FP8_BOTH
        assert r["fp8 bytes"]["replicate"] == r["exact bytes"]["replicate"]
        assert r["fp8 + int8 sum bytes"]["replicate"] <= 0.28 * r["exact bytes"]["replicate"]


@pytest.mark.torch_kernels
def test_hsdp_fp8_replica_sum_trains_near_exact_hsdp(distributed) -> None:
    """``reduce="fp8"`` under HSDP: the sum over the replicas in e4m3 codes (the shard group's
    reduce-scatter exact): the replicas stay bitwise equal after every step, the replicas' tier
    carries exactly int8's bytes and the shard group's exactly exact HSDP's, and one step's gradients
    and 6 steps' losses stay within [Note: fp8 replica sum tolerances] of exact HSDP's."""
    runs = {"exact": None, "int8": INTER_NODE, "fp8": FP8_SUM}
    for r in distributed(_run, 4, runs, link=COUNTING_LINK):
        assert r["fp8 differing"] == []  # replicas bitwise equal, every step
        assert r["fp8 bytes"]["replicate"] == r["int8 bytes"]["replicate"] <= 0.28 * r["exact bytes"]["replicate"]
        assert r["fp8 bytes"]["shard"] == r["exact bytes"]["shard"]
        errors, int8_errors = (_gradient_errors(r[name + " grads"], r["exact grads"]) for name in ("fp8", "int8"))
        assert max(errors.values()) <= FP8_SUM_GRAD_RTOL, errors
        median, int8_median = (sorted(e.values())[len(e) // 2] for e in (errors, int8_errors))
        assert median > 2 * int8_median, (median, int8_median)  # e4m3's codes, not int8's
        losses, exact_losses = r["fp8 losses"], r["exact losses"]
        assert all(abs(a - b) <= FP8_LOSS_RTOL * b for a, b in zip(losses, exact_losses)), (losses, exact_losses)


def _one_rank_shard_group(rank: int, world: int) -> dict[str, Any]:
    """HSDP on a ``(world, 1)`` mesh, exact and with ``BOTH``: the unsharded parameters of the first
    forward and the reduced gradients."""
    from torch import nn

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=MESH_DIMS)
    out = {}
    for name, compress in (("exact", None), ("compressed", BOTH)):
        torch.manual_seed(SEED)
        model = overlap.shard(nn.Linear(64, 64), mesh=mesh, compress=compress)
        model.unshard()
        out[name + " unsharded"] = [u.detach().clone() for u in model._overlap_state.group.unsharded]
        model.reshard()
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
        model(x).square().sum().backward()
        out[name + " grads"] = [p.grad.to_local().clone() for p in model.parameters()]
    return out


@pytest.mark.torch_kernels
def test_a_shard_group_of_one_rank_gathers_exactly(distributed) -> None:
    """On a ``(2, 1)`` mesh the shard group's all-gather moves nothing, so ``gather="int8"`` leaves
    it exact (the unsharded parameters bitwise the exact run's) while the replica sum is still
    compressed (the gradients differ from exact HSDP's)."""
    for r in distributed(_one_rank_shard_group, 2):
        assert all(torch.equal(a, b) for a, b in zip(r["compressed unsharded"], r["exact unsharded"]))
        assert not all(torch.equal(a, b) for a, b in zip(r["compressed grads"], r["exact grads"]))


# ------------------------------------------------------------------------------ Triton vs torch
@pytest.mark.parametrize("compress", [BOTH, FP8_BOTH, FP8_ALL], ids=["int8", "fp8-gather", "fp8"])
def test_hsdp_on_triton_kernels_equals_the_torch_fallback(distributed, compress: overlap.Compression) -> None:
    """Two steps of an MLP compressed on both tiers (int8 gather or fp8 gather, int8 or fp8 replica sum) with
    the Triton kernels (interpreter on CPU) and with the torch fallback (torch's own float8_e4m3fn
    casts for fp8): bitwise the same parameters on every rank."""
    from overlap_kernels import _launch

    if not _launch.triton_enabled(torch.device("cpu")):
        pytest.skip("Triton runs CPU tensors only under TRITON_INTERPRET=1 (conftest sets it without a GPU)")
    for r in distributed(_triton_vs_torch, 4, (2, 2), compress):
        assert all(torch.equal(a, b) for a, b in zip(r["triton"], r["torch"]))


# ------------------------------------------------------------- no_sync, in-backward, checkpoints
def _no_sync_in_backward(rank: int, world: int, compress: overlap.Compression) -> dict[str, Any]:
    from overlap.testing import current_link

    torch.set_num_threads(1)
    mesh = _mesh()
    out = {}
    for mode in ("plain", "in_backward"):
        # a fixed depth: prefetch="auto" agrees its choice and trial steps across every rank (a few
        # bytes per step of its first ones), no_sync or not; this test counts the gradients' bytes
        model = _model(mesh, compress, prefetch=1)
        if mode == "plain":
            opt = make_optimizer(model.parameters())
        else:
            opt = overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=LR, betas=(0.9, 0.95), eps=1e-8,
                                                weight_decay=0.1, foreach=False)
        reductions, replica_bytes, differing = [], [], []
        for step in range(3):
            parts = local_batch(make_batch(step), rank, world).chunk(2)
            current_link().reset_stats()
            with overlap.no_sync(model):
                model.loss(parts[0]).backward()
            reductions.append(gradient_reductions(current_link().stats()))
            replica_bytes.append(_tier_bytes(current_link(), mesh)["replicate"])
            model.loss(parts[1]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            differing.extend((step, n) for n in _replicas_identical(model, mesh))
        out[mode] = {"params": {k: v.to_local().clone() for k, v in model.state_dict().items()},
                     "reductions_under_no_sync": reductions, "replica_bytes_under_no_sync": replica_bytes,
                     "differing": differing}
    return out


@pytest.mark.torch_kernels
@pytest.mark.parametrize("compress", [BOTH, FP8_ALL], ids=["int8", "fp8"])
def test_hsdp_no_sync_and_optimizer_in_backward(distributed, compress) -> None:
    """Two micro-batches per step, the first under ``no_sync`` (nothing reduced, nothing crosses the
    replicas), then the compressed reductions: optimizer-in-backward gives bitwise the plain loop's
    parameters, and the replicas stay bitwise equal."""
    for r in distributed(_no_sync_in_backward, 4, compress, link=COUNTING_LINK):
        plain, in_backward = r["plain"], r["in_backward"]
        for mode in (plain, in_backward):
            assert mode["reductions_under_no_sync"] == [0, 0, 0]
            # across the replicas: nothing, but for the first forward's agreement (a few bytes, exact runs too)
            assert mode["replica_bytes_under_no_sync"][0] < 100 and mode["replica_bytes_under_no_sync"][1:] == [0, 0]
            assert mode["differing"] == []
        for k, v in plain["params"].items():
            assert torch.equal(v, in_backward["params"][k]), k


def _checkpoint(rank: int, world: int, path: str, compress: overlap.Compression) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    mesh = _mesh()
    model = _model(mesh, compress)
    train_ranks(model, rank, world, steps=2)
    shards = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    full = overlap.full_state_dict(model, rank0_only=False)
    exact_full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    dcp.save(model.state_dict(), checkpoint_id=path)
    fresh = _model(mesh, compress)
    target = fresh.state_dict()
    dcp.load(target, checkpoint_id=path)
    fresh.load_state_dict(target)
    loaded = {k: v.to_local().clone() for k, v in fresh.state_dict().items()}
    # and the loaded model trains on exactly as the saved one does
    losses = [train_ranks(m, rank, world, steps=1)[0] for m in (model, fresh)]
    return {"full_exact": all(torch.equal(full[k], exact_full[k]) for k in exact_full),
            "loaded_exact": all(torch.equal(shards[k], loaded[k]) for k in shards),
            "trained_alike": all(torch.equal(a.to_local(), b.to_local())
                                 for a, b in zip(model.state_dict().values(), fresh.state_dict().values())),
            "losses": losses}


@pytest.mark.torch_kernels
@pytest.mark.parametrize("compress", [BOTH, FP8_ALL], ids=["int8", "fp8"])
def test_hsdp_checkpoints_are_exact(distributed, tmp_path, compress) -> None:
    """State dicts and DCP carry the exact shards under HSDP compression: the full state dict is the
    exact all-gather of them, a DCP save / load round trip gives them back bit for bit, and the
    loaded model's next step is bitwise the saved one's."""
    for r in distributed(_checkpoint, 4, str(tmp_path / "ckpt"), compress):
        assert r["full_exact"] and r["loaded_exact"] and r["trained_alike"], r
        assert r["losses"][0] == r["losses"][1]


# ---------------------------------------------------------------------------- gradient error
def _measured(rank: int, world: int, compress: overlap.Compression) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = _mesh()
    tokens = local_batch(make_batch(0), rank, world)

    def grads(compress: overlap.Compression | None) -> list[torch.Tensor]:
        model = _model(mesh, compress)
        model.loss(tokens).backward()
        return [p.grad.to_local().clone() for p in model.parameters()]

    overlap.take_gradient_errors()
    unmeasured = grads(compress)
    logged_off = overlap.take_gradient_errors()
    with overlap.measure_gradient_error():
        measured = grads(compress)
        records = overlap.take_gradient_errors()
        exact = grads(None)
        logged_exact = overlap.take_gradient_errors()
    every_rank = overlap.relative_gradient_error(records, group=dist.group.WORLD)
    return {"unmeasured": unmeasured, "measured": measured, "exact": exact, "off": len(logged_off),
            "logged_exact": len(logged_exact), "modules": [r.module for r in records],
            "error_sq": sum(float(r.error_sq) for r in records), "exact_sq": sum(float(r.exact_sq) for r in records),
            "every_rank": every_rank}


@pytest.mark.torch_kernels
@pytest.mark.parametrize("compress", [INTER_NODE, FP8_SUM], ids=["int8", "fp8"])
def test_hsdp_gradient_error_is_the_error_against_exact_hsdp(distributed, compress) -> None:
    """``overlap.measure_gradient_error`` under HSDP: one record per compressed replica sum, whose
    squared norms equal ``||grad - exact||^2`` and ``||exact||^2`` over this rank's shards, ``exact``
    being exact HSDP's gradients (the same reduce-scatter, an exact sum over the replicas); measuring
    changes no gradient. Tolerance: relative 1e-6 for float32 summation order (2 replicas: the sums
    agree to the last bit in practice, the bound does not rely on gloo's order)."""
    results = distributed(_measured, 4, compress)
    total_error = total_exact = 0.0
    for r in results:
        assert r["off"] == 0 and r["logged_exact"] == 0
        assert all(torch.equal(a, b) for a, b in zip(r["unmeasured"], r["measured"]))
        assert sorted(r["modules"]) == ["blocks.0", "blocks.1", "root"]
        error_sq = sum(float((g.double() - e.double()).square().sum()) for g, e in zip(r["measured"], r["exact"]))
        exact_sq = sum(float(e.double().square().sum()) for e in r["exact"])
        assert r["error_sq"] == pytest.approx(error_sq, rel=1e-6) and r["exact_sq"] == pytest.approx(exact_sq, rel=1e-6)
        assert 0 < math.sqrt(error_sq / exact_sq) < (GRAD_RTOL if compress.reduce == "int8" else FP8_SUM_GRAD_RTOL)
        total_error, total_exact = total_error + error_sq, total_exact + exact_sq
    for r in results:  # over every rank of the mesh (each replica counts its copy: the ratio is the same)
        assert r["every_rank"] == pytest.approx(math.sqrt(total_error / total_exact), rel=1e-6)


# ---------------------------------------------------------------------------------- torch.compile
def _compiled(rank: int, world: int, backend: str) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    mesh = _mesh()
    tokens = local_batch(make_batch(0), rank, world)
    out = {}
    for name, compress, compiled in (("exact", None, False), ("eager", BOTH, False), ("compiled", BOTH, True)):
        model = _model(mesh, compress)
        loss = torch.compile(model.loss, backend=backend) if compiled else model.loss
        for _ in range(2):  # the second call runs the compiled graph without recompiling
            loss(tokens).backward()
        out[name] = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
    out["graphs"] = counters["stats"]["unique_graphs"]  # Dynamo's compiled graphs: the step did compile
    return out


# The default suite compiles with AOTAutograd's eager backend: Dynamo's graph breaks at the hooks and
# AOTAutograd's forward/backward split are what the hooks meet, and its ATen ops are eager's, so the
# gradients are bitwise. Inductor's code generation does not touch the hooks; its 4 ranks compiling
# at once cost 55-65 s of the 2-core CI box cold (2026-12-07), 6x aot_eager's, so it runs under slow.
@pytest.mark.torch_kernels
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_hsdp_compression_under_torch_compile(distributed, backend: str) -> None:
    """``torch.compile`` of a model sharded with HSDP compression: the runtime's hooks, and so the
    quantized collectives, run outside the compiled graph, unchanged. The gradients are those of
    eager compressed HSDP and far from exact HSDP's, so the compressed collectives did run: bitwise
    with ``aot_eager``; with Inductor within a tolerance: its fused kernels round differently from
    eager's ops (2e-8 relative on an MLP with exact collectives), and a difference that small can
    move a value across a quantization boundary, a jump of one code (absmax/127) on that element:
    measured 8.4e-5 relative on TinyLM, bound 1e-3; compression itself moves the gradients by
    1.6-1.9% (GRAD_RTOL's comment)."""
    # 4 ranks each compile at once: 120 s (the harness's default) ran out on a 16-core GPU host with
    # 14 xdist workers, a rank still in its first compile's start-up ([Note: Inductor's per-process
    # start-up in tests] in tests/conftest.py). The bound is for hangs, under pytest's 300 s.
    for r in distributed(_compiled, 4, backend, timeout=280):
        eager, compiled, exact = r["eager"], r["compiled"], r["exact"]
        assert r["graphs"] > 0
        if backend == "aot_eager":
            assert torch.equal(compiled, eager)
        else:
            assert float((compiled - eager).norm() / eager.norm()) <= 1e-3
        assert float((compiled - exact).norm() / exact.norm()) > 5e-3
