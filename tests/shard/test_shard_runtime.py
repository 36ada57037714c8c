"""overlap.shard runtime behaviour on gloo ranks: awkward models against the unsharded reference,
memory after steps, eval/no_grad, meta-device init, in-flight budget, overlap structure, bad input.

Numerics are compared with the same model trained unsharded in one process on the global batch.
Tolerance 1e-5 relative on losses and 1e-5 absolute on parameters: the sharded run averages
per-rank gradient sums in a different order than one process does (rounding differences only).
"""
from __future__ import annotations

import time
from typing import Any

import torch.utils.checkpoint

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlap
from overlap.sharding import sharded_states

STEPS = 4
BATCH = 12  # divisible by 1, 2, 3, 4


class Awkward(nn.Module):
    """Everything the runtime must get right at once: a tied embedding/head, a frozen layer, a
    parameter smaller than the world size, a 0-dim parameter, a buffer, a block called twice and a
    block that only runs on even steps."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.twice = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.sometimes = nn.Linear(6, 6)
        self.narrow = nn.Linear(6, 1)  # weight (1, 6), bias (1,): fewer rows than ranks
        self.widen = nn.Linear(1, 6)
        self.scale = nn.Parameter(torch.tensor(0.75))  # 0-dim
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        self.calls += 1
        h = self.emb(tokens)
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        h = self.frozen(h)
        if step % 2 == 0:
            h = h + torch.tanh(self.sometimes(h))
        h = h + self.widen(torch.tanh(self.narrow(h))) * self.scale
        return self.head(h)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 11, (BATCH, 5), generator=g), torch.randint(0, 11, (BATCH, 5), generator=g)


def _loss(model: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    tokens, targets = (t.chunk(world)[rank] for t in _data(step))
    logits = model(tokens, step)
    return nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))


def _awkward(shard: bool, **options: Any) -> nn.Module:
    torch.manual_seed(0)
    model = Awkward()
    if shard:
        for name in ("twice", "frozen", "sometimes", "narrow", "widen"):
            overlap.shard(getattr(model, name), **options)
        overlap.shard(model, **options)
    return model


def _global_loss(loss: torch.Tensor, world: int) -> float:
    """The mean of every rank's loss (also outside a process group, for the one-process reference)."""
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total)
    return total.item() / world


def _train(model: nn.Module, rank: int, world: int) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, step, rank, world)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_global_loss(loss, world))
    return losses


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _awkward(shard=False)
    losses = _train(model, 0, 1)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _awkward_rank(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    model = _awkward(shard=True, **options)
    frozen_before = overlap.full_state_dict(model, rank0_only=False)["frozen.weight"]
    losses = _train(model, rank, world)
    state = overlap.full_state_dict(model, rank0_only=False)
    return {
        "losses": losses,
        "state": state,
        "frozen_unchanged": torch.equal(state["frozen.weight"], frozen_before),
        "tied": model.head.weight is model.emb.weight,
        "unsharded_after_step": [s.group.is_unsharded for s in sharded_states(model) if s.group is not None],
        "inflight_after_step": len(overlap.inflight()),
        "max_inflight_seen": model.max_inflight_bytes_seen,
        "collective_bytes": max(max(s.group.all_gather_bytes(), s.group.reduce_bytes())
                                for s in sharded_states(model) if s.group is not None),
    }


def _check_against_reference(results: list[dict[str, Any]]) -> None:
    want_losses, want_state = _reference()
    for r in results:
        assert r["losses"] == pytest.approx(want_losses, rel=1e-5)
        assert r["state"].keys() == want_state.keys()
        for key, want in want_state.items():
            torch.testing.assert_close(r["state"][key], want, rtol=0, atol=1e-5, msg=key)
        assert r["frozen_unchanged"] and r["tied"]
        assert not any(r["unsharded_after_step"]), "every group is resharded after a step"
        assert r["inflight_after_step"] == 0, "no collective left in flight after a step"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_awkward_model_matches_unsharded_reference(distributed, world: int) -> None:
    _check_against_reference(distributed(_awkward_rank, world, {}))


def _awkward_runs(rank: int, world: int, option_sets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`_awkward_rank` once per option set, on one set of ranks (a start-up each costs more)."""
    return [_awkward_rank(rank, world, options) for options in option_sets]


@pytest.mark.torch_kernels  # three trainings of the awkward model: packing by the torch fallback
def test_options_do_not_change_results(distributed) -> None:
    """No prefetch, deep prefetch, no reshard after forward, and a tight in-flight budget."""
    budget = 700  # bytes: about one group's all-gather, so collectives must queue behind each other
    option_sets = [{"prefetch": 0}, {"prefetch": 3, "reshard_after_forward": False},
                   {"max_inflight_bytes": budget, "prefetch": 2}]
    per_rank = distributed(_awkward_runs, 3, option_sets)
    for i in range(len(option_sets)):
        _check_against_reference([runs[i] for runs in per_rank])
    for runs in per_rank:
        # a collective larger than the budget goes alone
        assert runs[2]["max_inflight_seen"] <= max(budget, runs[2]["collective_bytes"]), runs[2]["max_inflight_seen"]


class _Collective:
    """A runtime collective in flight (what ``_Root._admit`` reads): its bytes, whether it is still
    held, and a host wait that logs it and releases it."""

    def __init__(self, log: list[str], name: str, nbytes: int) -> None:
        self.log, self.name, self.nbytes, self.pending = log, name, nbytes, True

    def synchronize(self) -> None:
        self.log.append(self.name)
        self.pending = False


def test_the_budget_waits_for_the_oldest_only_until_the_next_collective_fits() -> None:
    """``max_inflight_bytes`` in the runtime (``_Root._admit``, on a stand-in root): before a
    collective is issued, the runtime's collectives in flight are waited oldest first (issue order,
    as the link serves them) and only while the new one would not fit: one that fits exactly goes at
    once, one already waited is not counted, and the most bytes in flight it reports
    (``max_inflight_bytes_seen``) are the ones it let through."""
    from types import SimpleNamespace

    from overlap.sharding import _Root

    waited: list[str] = []
    a, b, c = (_Collective(waited, name, 10) for name in "abc")
    root = SimpleNamespace(_outstanding=[a, b, c], max_inflight_seen=0)
    _Root._admit(root, 5, 35)  # 30 + 5: fits exactly
    assert waited == [] and root.max_inflight_seen == 35
    _Root._admit(root, 6, 35)  # 36: the oldest goes, then 26 fits
    assert waited == ["a"] and root._outstanding == [b, c] and root.max_inflight_seen == 35
    b.pending = False  # waited by its consumer: no longer in flight
    _Root._admit(root, 25, 35)  # c and 25
    assert waited == ["a"] and root._outstanding == [c]
    _Root._admit(root, 40, 35)  # over the budget alone: it goes once nothing else is in flight
    assert waited == ["a", "c"] and root._outstanding == [] and root.max_inflight_seen == 40


def test_the_budget_holds_for_the_cross_replica_all_reduce() -> None:
    """HSDP: a reduce-scatter's all-reduce over the replicas waits for room under ``max_inflight_bytes``
    like every other collective of the runtime (``_Root._all_reduce``, on a stand-in root), before it
    is issued. On CPU under a budget it goes out before the next reduction, after later collectives
    were issued (prefetches in backward), so the admission of those does not cover it."""
    from types import SimpleNamespace

    from overlap.sharding import _Root

    log: list[str] = []
    older = _Collective(log, "next reduce-scatter", 16)
    root = SimpleNamespace(_outstanding=[older], max_inflight_seen=0)
    root._admit = lambda nbytes, cap: _Root._admit(root, nbytes, cap)
    root._track = lambda work: root._outstanding.append(work)
    issued = _Collective(log, "all-reduce", 16)
    group = SimpleNamespace(issue_all_reduce=lambda pending: log.append("issue all-reduce") or issued)
    state = SimpleNamespace(group=group, max_inflight_bytes=24)
    _Root._all_reduce(root, state, SimpleNamespace(rs_output=torch.zeros(4)))  # 16 bytes: 32 > 24
    assert log == ["next reduce-scatter", "issue all-reduce"] and root._outstanding == [issued]
    assert root.max_inflight_seen == 16


# ------------------------------------------------------------------------------------------------
def _eval_and_memory_rank(rank: int, world: int) -> dict[str, Any]:
    model = _awkward(shard=True)
    groups = [s.group for s in sharded_states(model) if s.group is not None]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out: dict[str, Any] = {"live_bytes": [], "eval": []}
    for step in range(6):
        loss = _loss(model, step, rank, world)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["live_bytes"].append(sum(u.untyped_storage().nbytes() for g in groups for u in g.unsharded or ()))
        with torch.no_grad():
            logits = model(_data(step)[0], step)
        out["eval"].append({
            "unsharded": any(g.is_unsharded for g in groups),
            "inflight": len(overlap.inflight()),
            "grads": [p.grad is not None for p in model.parameters()],
            "shape": tuple(logits.shape),
        })
    model.eval()
    logits = model(_data(0)[0], 0)  # eval mode with grad enabled but no backward: cleaned up next step
    loss = _loss(model, 2, rank, world)  # an even step: every trainable block runs
    loss.backward()
    out["after_unused_forward"] = [p.grad is not None for p in model.parameters() if p.requires_grad]
    return out


def test_eval_forward_and_memory_do_not_leak(distributed) -> None:
    for r in distributed(_eval_and_memory_rank, 2):
        assert all(b == 0 for b in r["live_bytes"]), f"unsharded storage left after steps: {r['live_bytes']}"
        for e in r["eval"]:
            assert not e["unsharded"] and e["inflight"] == 0 and not any(e["grads"]), e
            assert e["shape"] == (BATCH, 5, 11)
        assert all(r["after_unused_forward"])


# ------------------------------------------------------------------------------------------------
def _peak_unsharded_rank(rank: int, world: int, prefetch: int) -> dict[str, int]:
    """Most non-root groups holding unsharded storage at once, sampled after every gather."""
    from overlap.param_group import ParamGroup

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), *[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])
    for block in list(model)[1:]:
        overlap.shard(block, prefetch=prefetch)
    overlap.shard(model, prefetch=prefetch)  # the root keeps model[0]'s parameters
    blocks = [s.group for s in sharded_states(model)[1:]]
    peak = {"forward": 0, "backward": 0}
    finish = ParamGroup.finish_gather

    def counting_finish(group: ParamGroup, *args: Any, **kwargs: Any) -> None:
        finish(group, *args, **kwargs)
        phase = "backward" if sharded_states(model)[0].root.in_backward else "forward"
        peak[phase] = max(peak[phase], sum(g.is_unsharded for g in blocks))

    ParamGroup.finish_gather = counting_finish  # type: ignore[method-assign]
    try:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
    finally:
        ParamGroup.finish_gather = finish  # type: ignore[method-assign]
    return peak


@pytest.mark.torch_kernels  # about when and what is gathered, not how it is packed
@pytest.mark.parametrize("prefetch", [1, 2])
def test_at_most_one_plus_prefetch_groups_unsharded(distributed, prefetch: int) -> None:
    for peak in distributed(_peak_unsharded_rank, 2, prefetch):
        assert 1 <= peak["forward"] <= 1 + prefetch, peak
        assert 1 <= peak["backward"] <= 1 + prefetch, peak


# ------------------------------------------------------------------------------------------------
class _Checkpointed(nn.Module):
    """Blocks run under non-reentrant activation checkpointing: backward re-runs their forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def _checkpointed_losses(shard: bool, rank: int, world: int) -> list[float]:
    torch.manual_seed(0)
    model = _Checkpointed()
    if shard:
        for block in model.blocks:
            overlap.shard(block)
        overlap.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x = torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(step))
        loss = model(x.chunk(world)[rank]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_global_loss(loss, world))
    return losses


def _checkpointed_rank(rank: int, world: int) -> list[float]:
    return _checkpointed_losses(True, rank, world)


def test_activation_checkpoint_recompute_inside_backward(distributed) -> None:
    want = _checkpointed_losses(False, 0, 1)
    for losses in distributed(_checkpointed_rank, 2):
        assert losses == pytest.approx(want, rel=1e-5)


# ------------------------------------------------------------------------------------------------
def _meta_rank(rank: int, world: int) -> dict[str, Any]:
    with torch.device("meta"):
        model = _awkward(shard=True)
    meta_before = all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(rank)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.reset_parameters()  # initializes this rank's shard only
    with torch.no_grad():
        model.scale.fill_(0.75)
    losses = _train(model, rank, world)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    local_shapes = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    return {"meta_before": meta_before, "losses": losses, "shapes": shapes, "local_shapes": local_shapes,
            "tied": model.head.weight is model.emb.weight, "finite": all(torch.isfinite(torch.tensor(losses)))}


@pytest.mark.torch_kernels  # about when and what is gathered, not how it is packed
def test_meta_device_model_is_materialized_shard_by_shard(distributed) -> None:
    for rank, r in enumerate(distributed(_meta_rank, 3)):
        assert r["meta_before"] and r["tied"] and r["finite"]
        # DTensor parameters: full logical shapes (what init code reads), local shards underneath:
        # ceil(11 / 3) = 4 rows of the embedding; rank 2 gets the last 3. A 0-dim one is replicated.
        assert r["shapes"]["emb.weight"] == (11, 6) and r["shapes"]["scale"] == ()
        assert r["local_shapes"]["emb.weight"] == ((4, 6) if rank < 2 else (3, 6))
        assert r["local_shapes"]["narrow.weight"] == ((1, 6) if rank == 0 else (0, 6))
        assert r["local_shapes"]["scale"] == ()


# ------------------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.log: list[dict[str, Any]] = []
        self.following: list[_Block] = []  # a plain list: the next block must not become a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nxt = self.following[0] if self.following else None
        pending = None
        if nxt is not None and nxt._overlap_state.group.pending_gather is not None:
            pending = nxt._overlap_state.group.pending_gather.work
        start = time.monotonic()
        y = x
        for _ in range(20):
            y = torch.tanh(self.lin(y))
        self.log.append({"next_in_flight": pending is not None and pending.pending,
                         "next_done_by": getattr(getattr(pending, "_work", None), "deadline", None),
                         "start": start, "end": time.monotonic()})
        return y


def _overlap_structure_rank(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    blocks = [_Block(64) for _ in range(4)]
    for a, b in zip(blocks, blocks[1:]):
        a.following.append(b)
    model = nn.Sequential(*blocks)
    for b in blocks:  # depth 1 from the first step (prefetch="auto" records its first steps unprefetched)
        overlap.shard(b, prefetch=1)
    overlap.shard(model, prefetch=1)
    x = torch.randn(32, 64)
    out: dict[str, Any] = {}
    for mode in ("overlap", "no_overlap"):
        for b in blocks:
            b.log.clear()
        for _ in range(2):  # the first step learns the order; the second replays it
            for b in blocks:
                b.log.clear()
            if mode == "overlap":
                model(x).sum().backward()
            else:
                with overlap.no_overlap(model):
                    model(x).sum().backward()
        out[mode] = [b.log[0] for b in blocks[:-1]]
    return out


@pytest.mark.torch_kernels  # about when and what is gathered, not how it is packed
def test_next_gather_is_in_flight_while_a_block_computes(distributed, monkeypatch: pytest.MonkeyPatch) -> None:
    # Scheduling, not kernels: the ranks pack with the torch path, because Triton's interpreter
    # takes longer to pack a group (~15 ms) than the link takes to move it. A 64x64 fp32 gather
    # moves 8 KiB to each rank: ~66 ms on this link, far longer than issuing it, and longer than a
    # rank of a loaded 2-core box is usually kept off the CPU (at 13 ms it failed under load).
    # (the torch_kernels marker reaches the fork server's ranks: OVERLAP_CPU_KERNELS=torch)
    for r in distributed(_overlap_structure_rank, 2, link=(0.001, 50.0)):
        for entry in r["overlap"]:
            assert entry["next_in_flight"], "the next block's all-gather was not in flight during compute"
            assert entry["next_done_by"] is not None and entry["next_done_by"] > entry["start"]
        for entry in r["no_overlap"]:
            assert not entry["next_in_flight"], "no_overlap must not prefetch"


# ------------------------------------------------------------------------------------------------
def _wrap_rank(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    layer = nn.Linear(7, 5)
    want_sd = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(4, 7)
    want = layer(x).detach()
    wrapped = overlap.wrap(layer)
    got = wrapped(x)
    got.sum().backward()
    full = overlap.full_state_dict(wrapped, rank0_only=False)
    sharded_sd = wrapped.state_dict()
    torch.manual_seed(1)
    other = overlap.wrap(nn.Linear(7, 5))
    other.load_state_dict(sharded_sd)  # the sharded state dict round trip
    return {"equal": torch.equal(got.detach(), want), "keys": sorted(full), "want_keys": sorted(want_sd),
            "full_equal": all(torch.equal(full[k], want_sd[k]) for k in want_sd),
            "reloaded": torch.equal(other(x).detach(), want), "grad_shape": tuple(layer.weight.grad.to_local().shape)}


def test_wrap_is_a_drop_in_layer(distributed) -> None:
    for rank, r in enumerate(distributed(_wrap_rank, 2)):
        assert r["equal"] and r["full_equal"] and r["reloaded"]
        assert r["keys"] == r["want_keys"] == ["bias", "weight"]
        assert r["grad_shape"] == ((3, 7) if rank == 0 else (2, 7))


# ------------------------------------------------------------------------------------------------
def _bad_input_rank(rank: int, world: int) -> list[str]:
    problems = []

    def expect(exc: type, match: str, fn: Any, module: nn.Module | None = None) -> None:
        before = {n: (p.shape, p.clone()) for n, p in module.named_parameters()} if module is not None else {}
        same = lambda a, b: a.is_meta or torch.equal(a, b)  # noqa: E731 (meta tensors have no values)
        cls = type(module) if module is not None else None
        try:
            fn()
        except exc as e:
            if match not in str(e):
                problems.append(f"{match!r} not in {e!r}")
        else:
            problems.append(f"no {exc.__name__} for {match!r}")
        if module is not None:
            after = {n: (p.shape, p) for n, p in module.named_parameters()}
            if type(module) is not cls or before.keys() != after.keys() or any(
                before[n][0] != after[n][0] or not same(before[n][1], after[n][1]) for n in before
            ):
                problems.append(f"module changed by a failed call ({match!r})")

    lin = nn.Linear(3, 3)
    expect(ValueError, "prefetch must be an int >= 0", lambda: overlap.shard(lin, prefetch=-1), lin)
    expect(TypeError, "mp must be None or an overlap.MixedPrecision", lambda: overlap.shard(lin, mp=torch.bfloat16), lin)
    expect(TypeError, "MixedPrecision.param_dtype must be None or a floating-point", lambda: overlap.MixedPrecision(param_dtype=torch.int32))
    expect(ValueError, "max_inflight_bytes must be None or an int >= 1", lambda: overlap.shard(lin, max_inflight_bytes=0), lin)
    mixed = nn.Module()
    mixed.a = nn.Linear(2, 2)
    mixed.b = nn.Linear(2, 2, device="meta")
    expect(ValueError, "parameters on several devices", lambda: overlap.shard(mixed), mixed)
    overlap.shard(lin)
    expect(ValueError, "already sharded", lambda: overlap.shard(lin))
    expect(TypeError, "module must be a torch.nn.Module", lambda: overlap.shard("linear"))
    empty = overlap.shard(nn.ReLU())  # no parameters: allowed, a no-op
    if not torch.equal(empty(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0])):
        problems.append("a parameterless sharded module changed its output")
    tied = nn.Module()
    tied.a = nn.Linear(2, 2)
    tied.b = nn.Linear(2, 2)
    tied.b.weight = tied.a.weight
    overlap.shard(tied.a)
    expect(ValueError, "'b.weight' of Module is shared with a submodule", lambda: overlap.shard(tied))
    expect(ValueError, "no_sync: Linear has no sharded modules", lambda: overlap.no_sync(nn.Linear(2, 2)).__enter__())
    model = overlap.shard(nn.Linear(4, 2))
    sd = overlap.full_state_dict(model, rank0_only=False)
    expect(ValueError, "missing key 'bias'", lambda: overlap.load_full_state_dict(model, {"weight": sd["weight"]}), model)
    expect(ValueError, "'weight' has shape (3, 4), the model expects (2, 4)",
           lambda: overlap.load_full_state_dict(model, {"weight": torch.zeros(3, 4), "bias": sd["bias"]}), model)
    return problems


def test_bad_input_is_named_and_changes_nothing(distributed) -> None:
    for problems in distributed(_bad_input_rank, 2):
        assert problems == []


def test_shard_without_process_group_says_how_to_initialize() -> None:
    assert not dist.is_initialized()
    lin = nn.Linear(3, 3)
    before = lin.weight.clone()
    with pytest.raises(RuntimeError, match="init_process_group"):
        overlap.shard(lin)
    assert type(lin) is nn.Linear and torch.equal(lin.weight, before)
