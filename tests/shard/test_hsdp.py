"""Hybrid sharding (HSDP): ``overlap.shard(module, mesh=<2-D DeviceMesh>)`` shards over dim 1 and
replicates over dim 0 (FSDP2's convention), on gloo CPU ranks.

Checked against the unsharded single-process run (the tolerances of ``models.py``'s [Note:
tolerances]: the sums differ from the unsharded ones in order only) and against torch's FSDP2 HSDP on
the same mesh, side by side in one rank function: losses, final parameters, parameters bitwise equal
across replicas after every step, the DTensor placements, mixed precision, ``no_sync`` (no traffic
across replicas inside it), ``set_requires_all_reduce(False)`` micro-batches (no all-reduce inside,
gradients bitwise FSDP2's, a non-finite gradient raised on every rank), full state dicts and DCP resume at another mesh; ``prefetch="auto"``'s
depth agreed across replicas and ``max_inflight_bytes`` over the all-reduces (bitwise the run without).
"""
from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import overlap
from overlap.sharding import sharded_states
from models import (
    BF16_LOSS_RTOL,
    BF16_MIN_DEV,
    COUNTING_LINK,
    LOSS_RTOL,
    PARAM_ATOL,
    PARAM_RTOL,
    SEED,
    TinyLM,
    local_batch,
    make_batch,
    make_optimizer_in_backward,
    max_rel_dev,
    shard_rows,
    train_ranks,
    unsharded_losses,
)

pytestmark = pytest.mark.torch_kernels  # long training loops: packing by the torch fallback (conftest)

MESH_DIMS = ("replicate", "shard")


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return unsharded_losses(steps=STEPS)


STEPS = 8  # enough to compound a wrong average or a missed replica; 4 ranks on 2 cores are slow
BF16_STEPS = 3


class ScaledLM(TinyLM):
    """:class:`TinyLM` whose logits are multiplied by a learned 0-dim ``temperature`` (a
    ``(Replicate(), Replicate())`` parameter under HSDP, reduced by rank 0 of each shard group)."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.temperature


def _hsdp_model(mesh, mp: Any = None, with_scalar: bool = False, prefetch: int | str = "auto",
                max_inflight_bytes: int | None = None) -> TinyLM:
    torch.manual_seed(SEED)
    model = ScaledLM() if with_scalar else TinyLM()
    for block in model.blocks:
        overlap.shard(block, mesh=mesh, mp=mp, prefetch=prefetch, max_inflight_bytes=max_inflight_bytes)
    overlap.shard(model, mesh=mesh, mp=mp, prefetch=prefetch, max_inflight_bytes=max_inflight_bytes)
    return model


def _fsdp2_hsdp_model(mesh) -> TinyLM:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(SEED)
    model = TinyLM()
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _replicas_identical(model: torch.nn.Module, mesh) -> list[str]:
    """Names of the parameters whose local shards differ between replicas (bitwise)."""
    group = mesh.get_group("replicate")
    differing = []
    for name, p in model.named_parameters():
        local = p.to_local().detach().contiguous()
        copies = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, local, group=group)
        if any(not torch.equal(c, copies[0]) for c in copies):
            differing.append(name)
    return differing


def _train(model: torch.nn.Module, mesh, rank: int, world_size: int, steps: int, check_replicas: bool) -> dict:
    """``models.train_ranks``; with ``check_replicas``, which parameters differ across replicas after
    each step."""
    differing: list[tuple[int, str]] = []

    def check(step: int) -> None:
        differing.extend((step, n) for n in _replicas_identical(model, mesh))

    losses = train_ranks(model, rank, world_size, steps, check if check_replicas else None)
    return {"losses": losses, "differing": differing}


def _train_hsdp_and_fsdp2(rank: int, world_size: int, shape: tuple[int, int], path: str) -> dict[str, Any]:
    torch.set_num_threads(1)  # see models.single_threaded
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
    model = _hsdp_model(mesh)
    placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
    out = _train(model, mesh, rank, world_size, STEPS, check_replicas=True)
    out["placements"] = placements
    out["params"] = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    out["shard_rank"] = mesh.get_local_rank("shard")
    out["full"] = overlap.full_state_dict(model, rank0_only=False)
    out["resumed"] = _dcp_resume_fully_sharded(model, path)
    out["fsdp2"] = _train(_fsdp2_hsdp_model(mesh), mesh, rank, world_size, STEPS, check_replicas=False)["losses"]
    return out


# 2x1 (replicas only) and 1x2 (a 2-D mesh that shards only) are under `slow`: the 2x2 run exercises
# both collectives, and the default suite's budget is tight.
@pytest.mark.parametrize("shape", [(2, 2), pytest.param((2, 1), marks=pytest.mark.slow),
                                   pytest.param((1, 2), marks=pytest.mark.slow)], ids=["2x2", "2x1", "1x2"])
def test_hsdp_matches_unsharded_and_fsdp2_hsdp(distributed, reference, tmp_path, shape: tuple[int, int]) -> None:
    """Also: a DCP checkpoint of the HSDP model resumes into a fully sharded one, bitwise."""
    ref_losses, ref_sd = reference
    world_size = shape[0] * shape[1]
    results = distributed(_train_hsdp_and_fsdp2, world_size, shape, str(tmp_path / "ckpt"))
    losses = results[0]["losses"]
    assert max_rel_dev(losses, ref_losses[:STEPS]) <= LOSS_RTOL, (losses, ref_losses)
    assert max_rel_dev(losses, results[0]["fsdp2"]) <= LOSS_RTOL, (losses, results[0]["fsdp2"])
    for rank, res in enumerate(results):
        assert res["differing"] == [], f"rank {rank}: replicas diverged: {res['differing']}"
        assert set(res["placements"].values()) == {(Replicate(), Shard(0))}, res["placements"]
        for name, local in res["params"].items():
            start, stop = shard_rows(ref_sd[name].shape[0], shape[1], res["shard_rank"])
            torch.testing.assert_close(local, ref_sd[name][start:stop], rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        for name, want in ref_sd.items():
            torch.testing.assert_close(res["full"][name], want, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)
        assert res["resumed"].keys() == res["full"].keys()
        for name, value in res["full"].items():
            assert torch.equal(res["resumed"][name], value), name  # DCP moves bytes: bitwise


# -- mixed precision, a 0-dim parameter, no_sync ------------------------------------------------------


def _train_bf16_with_scalar(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)
    mp = overlap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _hsdp_model(mesh, mp=mp, with_scalar=True)
    scalar_placements = tuple(model.temperature.placements)
    out = _train(model, mesh, rank, world_size, BF16_STEPS, check_replicas=True)
    out["scalar_placements"] = scalar_placements
    out["scalar"] = model.temperature.to_local().item()
    return out


def test_hsdp_bf16_and_0dim_parameter(distributed) -> None:
    ref_losses, ref_sd = unsharded_losses(ScaledLM, steps=BF16_STEPS)
    results = distributed(_train_bf16_with_scalar, 4)
    losses = results[0]["losses"]
    dev = max_rel_dev(losses, ref_losses)
    assert BF16_MIN_DEV < dev <= BF16_LOSS_RTOL, dev
    for rank, res in enumerate(results):
        assert res["differing"] == [], f"rank {rank}: replicas diverged: {res['differing']}"
        assert res["scalar_placements"] == (Replicate(), Replicate())
    assert len({res["scalar"] for res in results}) == 1, [res["scalar"] for res in results]
    # bf16 compute moves the learned temperature by a few bf16 ulps of its steps at most.
    assert abs(results[0]["scalar"] - ref_sd["temperature"].item()) < 1e-2, (results[0]["scalar"], ref_sd["temperature"])


def _replica_reductions(link, mesh) -> int:
    stats = link.stats_by_group().get(mesh.get_group("replicate").group_name)
    return 0 if stats is None else stats.by_op.get("all_reduce", 0)


def _no_sync_traffic(rank: int, world_size: int) -> dict[str, Any]:
    """All-reduces over the replicas during two no_sync micro-batches, then one synced backward."""
    from overlap.testing import current_link

    torch.set_num_threads(1)
    link = current_link()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)
    model = _hsdp_model(mesh)
    batches = [local_batch(make_batch(s), rank, world_size) for s in range(3)]
    start = _replica_reductions(link, mesh)
    with overlap.no_sync(model):
        for tokens in batches[:2]:
            model.loss(tokens).backward()
    inside = _replica_reductions(link, mesh) - start
    model.loss(batches[2]).backward()
    synced = _replica_reductions(link, mesh) - start - inside
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    return {"inside": inside, "synced": synced, "groups": len(sharded_states(model)), "grads": grads}


def _accumulated_reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    model = TinyLM()
    for s in range(3):
        # Each rank's loss is the mean over its quarter: the average over ranks of the summed
        # micro-batch gradients is the gradient of the sum of the global-batch means.
        model.loss(make_batch(s)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_hsdp_no_sync_sends_nothing_across_replicas(distributed) -> None:
    results = distributed(_no_sync_traffic, 4, link=COUNTING_LINK)
    want = _accumulated_reference()
    for rank, res in enumerate(results):
        assert res["inside"] == 0, f"rank {rank}: {res['inside']} all-reduces over replicas inside no_sync"
        assert res["synced"] == res["groups"], (rank, res["synced"], res["groups"])
        shard_rank = rank % 2
        for name, grad in res["grads"].items():
            start, stop = shard_rows(want[name].shape[0], 2, shard_rank)
            scale = want[name].abs().max().item()
            torch.testing.assert_close(grad, want[name][start:stop], rtol=1e-5, atol=1e-5 * scale,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def _partial_micro_batches(model: torch.nn.Module, batches: list[torch.Tensor], link, mesh) -> dict[str, Any]:
    """FSDP2's HSDP accumulation: ``set_requires_all_reduce(False)`` for all but the last
    micro-batch; replica all-reduces inside and at the last, and which ``.grad`` each backward left."""
    start = _replica_reductions(link, mesh)
    grads_after = []
    for i, tokens in enumerate(batches):
        model.set_requires_all_reduce(i == len(batches) - 1)
        model.loss(tokens).backward()
        grads_after.append([p.grad is not None for p in model.parameters()])
        if i == len(batches) - 2:
            inside = _replica_reductions(link, mesh) - start
    synced = _replica_reductions(link, mesh) - start - inside
    return {"inside": inside, "synced": synced, "grads_after": grads_after,
            "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()}}


def _partial_traffic(rank: int, world_size: int) -> dict[str, Any]:
    from overlap.testing import current_link

    torch.set_num_threads(1)
    link = current_link()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)
    batches = [local_batch(make_batch(s), rank, world_size) for s in range(3)]
    out = _partial_micro_batches(_hsdp_model(mesh, prefetch=1), batches, link, mesh)
    out["groups"] = len(sharded_states(_hsdp_model(mesh, prefetch=1)))
    out["fsdp2"] = _partial_micro_batches(_fsdp2_hsdp_model(mesh), batches, link, mesh)
    # a non-finite gradient on one rank in a partial backward: the finite check's flags still go over
    # the replicas, so every rank of the mesh raises (the other replica's shard group too)
    model = _hsdp_model(mesh, prefetch=1)
    model.set_requires_all_reduce(False)
    try:
        with overlap.check_finite():
            (model.loss(batches[0]) * (float("nan") if rank == world_size - 1 else 1.0)).backward()
        out["non_finite"] = "no error"
    except overlap.NonFiniteError:
        out["non_finite"] = "NonFiniteError"
    return out


def test_hsdp_requires_all_reduce_false_accumulates_partial_sums_as_fsdp2(distributed) -> None:
    results = distributed(_partial_traffic, 4, link=COUNTING_LINK)
    want = _accumulated_reference()
    for rank, res in enumerate(results):
        assert res["inside"] == res["fsdp2"]["inside"] == 0, (rank, res["inside"], res["fsdp2"]["inside"])
        assert res["synced"] == res["groups"], (rank, res["synced"], res["groups"])
        assert res["grads_after"] == res["fsdp2"]["grads_after"]  # no .grad until the all-reduce, as FSDP2
        assert not any(res["grads_after"][0]) and all(res["grads_after"][-1])
        assert res["non_finite"] == "NonFiniteError", rank
        for name, grad in res["grads"].items():
            assert torch.equal(grad, res["fsdp2"]["grads"][name]), (rank, name)  # the same sums, same order
            start, stop = shard_rows(want[name].shape[0], 2, rank % 2)
            scale = want[name].abs().max().item()
            torch.testing.assert_close(grad, want[name][start:stop], rtol=1e-5, atol=1e-5 * scale,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


# -- prefetch="auto" and max_inflight_bytes -------------------------------------------------------------


class _InflightSampler:
    """An ``overlap.inflight_work`` recorder: each runtime collective's bytes, and the bytes in flight
    once it is on its way (the agreements' own small gathers, waited at once, left out)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.samples: list[int] = []

    def on_issue(self, kind: str, nbytes: int, *rest: Any) -> None:
        if kind != "agree":
            self.sizes.append(nbytes)
            self.samples.append(overlap.inflight_bytes() + nbytes)


def _late_backward(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
    output.register_hook(lambda grad: time.sleep(0.02))


def _auto_depth_and_budget(rank: int, world_size: int) -> dict[str, Any]:
    """3 steps of TinyLM under HSDP over 2 replicas, ``prefetch="auto"`` chosen after one recorded
    step (no trial), the chooser of each rank picking ``1 +`` its replica's index, the optimizer
    stepped in backward; without a budget, then with ``max_inflight_bytes`` set to the largest
    collective of the first run.

    On a 2x2 mesh, ranks 1 and 2 (one per replica, in different shard groups) start each block's
    backward 20 ms late. Without a budget an all-reduce on CPU goes out when a poll finds its
    reduce-scatter done, at points that differ between ranks; under a budget that made the host
    waits go around the mesh (rank 0 waiting for room before its all-reduce for a reduce-scatter
    rank 1 had not issued, rank 1 for an all-reduce rank 3 held back, rank 3 for rank 2, rank 2 for
    rank 0): a hang, before [Note: hybrid sharding] put them at fixed points."""
    from overlap.inflight_work import set_recorder
    from scheduler import cost_samples, prefetch_depth, schedule_trial

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)
    replica = mesh.get_local_rank("replicate")
    cost_samples.COST_SAMPLES = 1
    schedule_trial.TRIAL_ROUNDS = 0  # the agreed choice runs at once
    prefetch_depth.choose_prefetch_depth = lambda *args, **kwargs: 1 + replica
    out: dict[str, Any] = {}
    for what in ("free", "capped"):
        model = _hsdp_model(mesh, max_inflight_bytes=out.get("budget"))
        if rank in (1, 2):
            for block in model.blocks:
                block.register_forward_hook(_late_backward)
        make_optimizer_in_backward(model)
        sampler = _InflightSampler()
        previous = set_recorder(sampler)
        try:
            losses = []
            for step in range(3):
                loss = model.loss(local_batch(make_batch(step), rank, world_size))
                loss.backward()
                losses.append(loss.detach())
        finally:
            set_recorder(previous)
        out.setdefault("budget", max(sampler.sizes))
        out[what] = {"losses": torch.stack(losses), "most_in_flight": max(sampler.samples),
                     "depth": model.prefetch_depth, "gather_ahead": model.gather_ahead,
                     "deferred": model.deferred_steps, "seen": model.max_inflight_bytes_seen,
                     "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()}}
    return out


def test_hsdp_auto_depth_is_agreed_across_replicas_and_the_budget_holds(distributed) -> None:
    """HSDP with ``prefetch="auto"``: one depth on every rank of the mesh, the deepest any rank chose,
    also where only replicas differ (each shard group agreeing within itself is not enough: [Note:
    same collectives, same order, on every rank]); no gather-ahead plan (under HSDP no gradient is
    final before its all-reduce). ``max_inflight_bytes`` holds for the cross-replica all-reduces too,
    and only delays: bitwise the run without it."""
    for rank, r in enumerate(distributed(_auto_depth_and_budget, 4)):
        free, capped = r["free"], r["capped"]
        assert free["most_in_flight"] > r["budget"], f"rank {rank}: the budget does not bind: {free['most_in_flight']}"
        assert capped["most_in_flight"] <= r["budget"], (rank, capped["most_in_flight"], r["budget"])
        assert 0 < capped["seen"] <= r["budget"], (rank, capped["seen"])
        assert torch.equal(capped["losses"], free["losses"]), rank
        for name, value in capped["params"].items():
            assert torch.equal(value, free["params"][name]), (rank, name)
        for run in (free, capped):
            assert run["depth"] == 2, f"rank {rank}: depth {run['depth']}, not the deepest replica's choice"
            assert run["gather_ahead"] is None and run["deferred"] is None, (rank, run["gather_ahead"])


# -- checkpoints ---------------------------------------------------------------------------------------


def _dcp_resume_fully_sharded(model: torch.nn.Module, path: str) -> dict[str, torch.Tensor]:
    """Save ``model`` (HSDP) with DCP, load the checkpoint into a fully sharded TinyLM of another
    init; return the loaded model's full state dict."""
    import torch.distributed.checkpoint as dcp

    dcp.save(model.state_dict(), checkpoint_id=path)
    torch.manual_seed(SEED + 1)  # different init: the load must overwrite every value
    other = TinyLM()
    for block in other.blocks:
        overlap.shard(block)
    overlap.shard(other)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    return overlap.full_state_dict(other, rank0_only=False)


# -- bad input -------------------------------------------------------------------------------------------


def _bad_meshes(rank: int, world_size: int) -> dict[str, str]:
    from torch.distributed.device_mesh import DeviceMesh

    errors = {}
    model = TinyLM()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cases = {
        "3-D": lambda: init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("a", "b", "c")),
        "not this rank": lambda: DeviceMesh("cpu", [1 - rank], _init_backend=False),
        "another device type": lambda: DeviceMesh("cuda", [[0, 1]], _init_backend=False),
    }
    for label, make in cases.items():
        try:
            overlap.shard(model, mesh=make())
        except (ValueError, TypeError) as e:
            errors[label] = str(e)
    untouched = not isinstance(model, overlap.ShardedModule) and all(
        torch.equal(p, before[n]) and not hasattr(p, "placements") for n, p in model.named_parameters())
    return {"errors": errors, "untouched": untouched}


def test_hsdp_bad_meshes_raise_before_anything_changes(distributed) -> None:
    for res in distributed(_bad_meshes, 2):
        assert "mesh must be a 1-D DeviceMesh (full sharding) or a 2-D one" in res["errors"]["3-D"]
        assert "does not contain this rank" in res["errors"]["not this rank"]
        assert "mesh is a 'cuda' mesh but the parameters are on 'cpu'" in res["errors"]["another device type"]
        assert res["untouched"]


# -- composition: profiler and desync checks ---------------------------------------------------------


def _profiled_and_checked_step(rank: int, world_size: int) -> dict[str, Any]:
    """Two HSDP steps under ``overlap.debug()`` (every collective fingerprinted across its group's
    ranks before it is issued) and ``overlap.profile()``."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS)
    model = _hsdp_model(mesh, prefetch=1)  # the data collectives only (auto's first steps agree their choice too)
    model.loss(local_batch(make_batch(0), rank, world_size)).backward()  # the first step agrees the order
    with overlap.debug(), overlap.profile() as prof:
        for step in range(1, 3):
            model.loss(local_batch(make_batch(step), rank, world_size)).backward()
            prof.step()
    replicate = mesh.get_group("replicate").group_name
    kinds = [(c.kind, c.group == replicate) for c in prof.collectives if c.step == 1]
    return {"kinds": kinds, "groups": len(sharded_states(model))}


def test_hsdp_under_the_profiler_and_the_desync_checks(distributed) -> None:
    for res in distributed(_profiled_and_checked_step, 4):
        kinds = res["kinds"]
        # Every cross-replica collective is an all-reduce, one per group, and nothing else crosses.
        assert [k for k, across in kinds if across] == ["all_reduce"] * res["groups"], kinds
        assert {k for k, across in kinds if not across} == {"all_gather", "reduce_scatter"}, kinds


def _under_recorded_schedule(rank: int, world_size: int, scheduled: bool) -> dict[str, Any]:
    """3 HSDP steps, each also all-reducing its loss with ``overlap.all_reduce`` (a user collective
    on the default group), inside ``scheduler.Scheduler(model).step()`` or not."""
    import scheduler

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=MESH_DIMS)  # replicas only: 2 ranks suffice
    model = _hsdp_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    sched = scheduler.Scheduler(model) if scheduled else None
    losses = []
    for step in range(3):
        with sched.step() if sched is not None else contextlib.nullcontext():
            loss = model.loss(local_batch(make_batch(step), rank, world_size))
            total = overlap.all_reduce(loss.detach())
            loss.backward()
            losses.append(total * 1.0)  # the first use: waits here
        opt.step()
        opt.zero_grad(set_to_none=True)
    kinds = [c.kind for c in sched.schedule.collectives] if sched is not None and sched.schedule else []
    return {"losses": torch.stack(losses), "kinds": kinds}


def _with_and_without_schedule(rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return _under_recorded_schedule(rank, world_size, True), _under_recorded_schedule(rank, world_size, False)


def test_hsdp_inside_a_recorded_schedule(distributed) -> None:
    for scheduled, plain in distributed(_with_and_without_schedule, 2):
        assert torch.equal(scheduled["losses"], plain["losses"])
        assert scheduled["kinds"] == ["all_reduce"], scheduled["kinds"]  # the user's; the runtime's are its own
