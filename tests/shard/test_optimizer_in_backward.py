"""Optimizer in backward (``overlap.optimizer_in_backward``) and the post-accumulate-grad hooks the
runtime runs on sharded parameters after their reduction, on gloo CPU ranks.

Reference: the plain loop (backward, then one optimizer over all parameters), bitwise: an
elementwise optimizer updates each parameter from its own gradient and state, so stepping it per
group, earlier, must not change a bit. Side by side with FSDP2 for torch's own recipe
(``register_post_accumulate_grad_hook`` + one optimizer per parameter), which FSDP2 supports.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

import overlap
from models import SEED, LR, TinyLM, assert_same_run, fsdp2_model, local_batch, make_batch, make_optimizer

pytestmark = pytest.mark.torch_kernels  # long training loops: packing by the torch fallback (conftest)

STEPS = 3


def _sharded() -> TinyLM:
    torch.manual_seed(SEED)
    model = TinyLM()
    for block in model.blocks:
        overlap.shard(block)
    overlap.shard(model)
    return model


def _final_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


def _loop(model: nn.Module, rank: int, world_size: int, step_fn: Callable[[], None],
          micro_batches: int = 1) -> dict[str, Any]:
    """``STEPS`` steps; step 1 accumulates ``micro_batches`` under ``no_sync`` first (overlap only)."""
    losses = []
    for step in range(STEPS):
        batch = local_batch(make_batch(step), rank, world_size)
        parts = batch.chunk(micro_batches) if step == 1 else (batch,)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            with overlap.no_sync(model) if not last else _nothing():
                loss = model.loss(part)
                loss.backward()
        step_fn()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": _final_params(model)}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _plain_and_in_backward(rank: int, world_size: int) -> dict[str, Any]:
    """The plain loop and optimizer_in_backward for AdamW (with two no_sync micro-batches in step 1),
    the clipping fallback (``max_norm``) and, on one rank, SGD with momentum."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    sgd = dict(lr=LR, momentum=0.9, foreach=False)

    def plain(optimizer_fn: Callable, max_norm: float | None = None, micro: int = 1) -> dict[str, Any]:
        model = _sharded()
        opt = optimizer_fn(model.parameters())

        def step() -> None:
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return _loop(model, rank, world_size, step, micro)

    def in_backward(cls: type, kwargs: dict, max_norm: float | None = None, micro: int = 1) -> dict[str, Any]:
        model = _sharded()
        opt = overlap.optimizer_in_backward(model, cls, max_norm=max_norm, **kwargs)
        stepped_in_backward = []

        def step() -> None:
            # After backward, before step(): in-backward stepping has consumed every gradient.
            stepped_in_backward.append(all(p.grad is None for p in model.parameters()))
            opt.step()

        result = _loop(model, rank, world_size, step, micro)
        result["stepped_in_backward"] = stepped_in_backward
        return result

    adamw = make_optimizer([nn.Parameter(torch.zeros(1))]).defaults
    adamw = {k: adamw[k] for k in ("lr", "betas", "eps", "weight_decay", "foreach")}
    out["adamw, no_sync"] = (plain(make_optimizer, micro=2), in_backward(torch.optim.AdamW, adamw, micro=2))
    if world_size == 1:
        out["sgd"] = (plain(lambda p: torch.optim.SGD(p, **sgd)), in_backward(torch.optim.SGD, sgd))
    out["clip"] = (plain(make_optimizer, max_norm=0.05), in_backward(torch.optim.AdamW, adamw, max_norm=0.05))
    return {"runs": out, "initial": _final_params(_sharded())}


@pytest.mark.parametrize("world_size", [1, 2])
def test_optimizer_in_backward_is_bitwise_the_plain_loop(distributed, world_size: int) -> None:
    for result in distributed(_plain_and_in_backward, world_size):
        for what, (plain, in_backward) in result["runs"].items():
            assert_same_run(plain, in_backward, what)
            # Clipping needs the global norm first: nothing steps in backward then.
            assert in_backward["stepped_in_backward"] == [what != "clip"] * STEPS, what
            # The optimizer did something: not a comparison of two untouched models.
            initial = result["initial"]
            assert all(not torch.equal(v, initial[n]) for n, v in in_backward["params"].items() if v.numel()), what


def _per_parameter_recipe(rank: int, world_size: int) -> dict[str, Any]:
    """torch's optimizer-in-backward recipe (one optimizer per parameter, stepped from its
    post-accumulate-grad hook) on overlap.shard and on FSDP2, and the plain loop on overlap.shard."""
    torch.set_num_threads(1)

    def recipe(model: nn.Module) -> dict[str, Any]:
        optimizers = {p: make_optimizer([p]) for p in model.parameters()}
        calls: list[int] = []

        def hook(p: nn.Parameter) -> None:
            calls.append(1)
            optimizers[p].step()
            optimizers[p].zero_grad(set_to_none=True)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        result = _loop(model, rank, world_size, lambda: None)
        result["hook_calls"] = len(calls)
        return result

    ours = recipe(_sharded())
    fsdp2 = recipe(fsdp2_model(world_size))
    model = _sharded()
    opt = make_optimizer(model.parameters())
    plain = _loop(model, rank, world_size, lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
    return {"ours": ours, "fsdp2": fsdp2, "plain": plain, "params": len(list(model.parameters()))}


def test_post_accumulate_grad_hooks_run_on_sharded_parameters_like_fsdp2(distributed) -> None:
    for result in distributed(_per_parameter_recipe, 2):
        assert_same_run(result["ours"], result["plain"], "recipe vs plain loop")
        assert_same_run(result["ours"], result["fsdp2"], "recipe on overlap vs on FSDP2")
        # Once per parameter per step, as FSDP2 does.
        assert result["ours"]["hook_calls"] == result["fsdp2"]["hook_calls"] == STEPS * result["params"]


def test_optimizer_in_backward_bad_input(single_rank_group) -> None:
    plain = TinyLM()
    with pytest.raises(TypeError, match="model must be the root module passed to overlap.shard"):
        overlap.optimizer_in_backward(plain, torch.optim.AdamW)
    blocks_only = TinyLM()
    for block in blocks_only.blocks:
        overlap.shard(block)
    with pytest.raises(TypeError, match="model must be the root"):
        overlap.optimizer_in_backward(blocks_only, torch.optim.AdamW)
    model = _sharded()
    groups = [s.group for s in overlap.sharding.sharded_states(model) if s.group is not None]
    with pytest.raises(TypeError, match="optimizer_class must be a torch.optim.Optimizer subclass"):
        overlap.optimizer_in_backward(model, torch.optim.AdamW(model.parameters()))  # type: ignore[arg-type]
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="max_norm must be None or a finite number > 0"):
            overlap.optimizer_in_backward(model, torch.optim.AdamW, max_norm=bad)
    with pytest.raises(TypeError):  # torch's own check of the optimizer's arguments
        overlap.optimizer_in_backward(model, torch.optim.AdamW, not_an_argument=1)
    assert all(not g.reduced_hooks for g in groups), "a failed call registered a hook"
    first = overlap.optimizer_in_backward(model, torch.optim.AdamW)
    with pytest.raises(ValueError, match="already has an optimizer in backward"):
        overlap.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    first.remove()
    assert all(not g.reduced_hooks for g in groups)
    second = overlap.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="state must be a state_dict"):
        second.load_state_dict({"optimizers": []})
    second.load_state_dict(second.state_dict())
    # A parameter no overlap.shard group owns (left out by ignored_params) would get no optimizer:
    # refused, naming it, before anything is registered.
    loose = TinyLM()
    for block in loose.blocks:
        overlap.fully_shard(block)
    overlap.fully_shard(loose, ignored_params={loose.ln_f.weight})
    with pytest.raises(ValueError, match=r"model has parameters no overlap.shard group owns: \['ln_f.weight'\]"):
        overlap.optimizer_in_backward(loose, torch.optim.SGD, lr=0.1)
    assert all(not s.group.reduced_hooks for s in overlap.sharding.sharded_states(loose) if s.group is not None)


def test_a_frozen_group_gets_no_optimizer_and_the_rest_steps_as_the_plain_loop(single_rank_group) -> None:
    """A sharded group whose parameters are all frozen (here the first block) gets no optimizer (torch
    refuses an optimizer over an empty parameter list), and the others step bitwise as the plain
    loop's one optimizer does (which skips the frozen parameters: they have no gradient). Fails if
    optimizer_in_backward builds an optimizer for every group, frozen ones included."""
    adamw = make_optimizer([nn.Parameter(torch.zeros(1))]).defaults
    adamw = {k: adamw[k] for k in ("lr", "betas", "eps", "weight_decay", "foreach")}

    def frozen_first_block() -> TinyLM:
        torch.manual_seed(SEED)
        model = TinyLM()
        model.blocks[0].requires_grad_(False)
        for block in model.blocks:
            overlap.shard(block)
        return overlap.shard(model)

    model = frozen_first_block()
    opt = make_optimizer(model.parameters())
    plain = _loop(model, 0, 1, lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
    model = frozen_first_block()
    in_backward = overlap.optimizer_in_backward(model, torch.optim.AdamW, **adamw)
    assert len(in_backward.optimizers) == 2  # the second block's and the root's
    ours = _loop(model, 0, 1, in_backward.step)
    assert_same_run(plain, ours, "frozen first block")
    initial = _final_params(frozen_first_block())
    for name, value in ours["params"].items():
        assert torch.equal(value, initial[name]) == name.startswith("blocks.0."), name


def test_zero_grad_follows_set_to_none_as_torch_optimizers_do(single_rank_group) -> None:
    """``OptimizerInBackward.zero_grad(set_to_none=False)`` leaves zero-filled gradients, as
    ``torch.optim.Optimizer.zero_grad(set_to_none=False)`` does, and the default drops them. With
    ``max_norm`` nothing steps in backward, so the gradients are still there to zero. Fails if the
    argument is ignored."""
    model = _sharded()
    opt = overlap.optimizer_in_backward(model, torch.optim.SGD, max_norm=1.0, lr=0.1)
    model.loss(make_batch(0)).backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and p.grad.to_local().count_nonzero() == 0 for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
