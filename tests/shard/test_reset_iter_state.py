"""``reset_iter_state()`` (FSDP2's recovery after an exception in forward or backward), on 2 gloo
ranks: after it the next step is bitwise the step of a model that never ran the failed one.

Each case starts a gradient accumulation, fails, resets the root and runs one clean step; the
reference runs the clean step alone from the same weights. Without the reset the same sequence
must differ from the reference (the case leaves state behind that the reset has to discard). The
cases: a ``no_sync`` micro-batch (unsharded gradients accumulated), an HSDP ``(2, 1)`` micro-batch
under ``set_requires_all_reduce(False)`` (a partial sum over the replicas), a backward that raises
half-way (some groups reduced, the others not), each followed by a forward that raises. And the
call on a module that is not the root raises.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import overlap
from models import SEED, TinyLM, local_batch, make_batch, make_optimizer

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)


class _Failure(RuntimeError):
    pass


def _model(hsdp: bool) -> TinyLM:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(SEED)
    model = TinyLM()
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world, 1) if hsdp else (world,),
                            mesh_dim_names=("replicate", "shard") if hsdp else ("shard",))
    for block in model.blocks:
        overlap.fully_shard(block, mesh=mesh)
    overlap.fully_shard(model, mesh=mesh)
    return model


def _raise_once(module: torch.nn.Module) -> None:
    def hook(*_: Any) -> None:
        handle.remove()
        raise _Failure("injected")

    handle = module.register_forward_pre_hook(hook)


def _fail_in_backward(model: TinyLM, tokens: torch.Tensor) -> None:
    """A backward that raises where it reaches blocks[0]'s output (the later groups are reduced)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        raise _Failure("injected in backward")

    def capture(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        output.register_hook(hook)
        handle.remove()

    handle = model.blocks[0].register_forward_hook(capture)
    model.loss(tokens).backward()


def _no_sync(model: TinyLM, tokens: torch.Tensor) -> None:
    model.set_requires_gradient_sync(False)
    model.loss(tokens).backward()
    model.set_requires_gradient_sync(True)


def _partial(model: TinyLM, tokens: torch.Tensor) -> None:
    model.set_requires_all_reduce(False)
    model.loss(tokens).backward()
    model.set_requires_all_reduce(True)


CASES: dict[str, tuple[bool, Callable[[TinyLM, torch.Tensor], None]]] = {
    "no_sync": (False, _no_sync), "partial": (True, _partial), "backward": (False, _fail_in_backward)}


def _clean_step(model: TinyLM, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model.loss(tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


def _run(rank: int, world: int, case: str, reset: bool) -> dict[str, torch.Tensor]:
    hsdp, start = CASES[case]
    model = _model(hsdp)
    opt = make_optimizer(model.parameters())
    first, second = (local_batch(make_batch(s), rank, world) for s in (1, 2))
    try:
        start(model, first)
    except _Failure:
        pass
    _raise_once(model.blocks[1])
    with pytest.raises(_Failure):
        model.loss(second)
    if reset:
        model.reset_iter_state()
    opt.zero_grad(set_to_none=True)  # what reductions that completed left (as under FSDP2)
    return _clean_step(model, opt, second)


def _cases(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for case, (hsdp, _) in CASES.items():
        model = _model(hsdp)
        reference = _clean_step(model, make_optimizer(model.parameters()), local_batch(make_batch(2), rank, world))
        out[case] = {reset: all(torch.equal(v, reference[n]) for n, v in _run(rank, world, case, reset).items())
                     for reset in (True, False)}
    model = _model(False)
    model.loss(local_batch(make_batch(0), rank, world)).backward()
    try:
        model.blocks[0].reset_iter_state()
        out["not_root"] = "accepted"
    except RuntimeError as e:
        out["not_root"] = str(e)
    return out


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    from overlap.testing import run_distributed

    return run_distributed(_cases, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_the_step_after_a_reset_is_the_clean_step(cases, case: str) -> None:
    for rank in cases:
        assert rank[case][True], f"{case}: the step after reset_iter_state() is not the clean step"
        assert not rank[case][False], f"{case}: without the reset the step should carry the failed one's state"


def test_reset_iter_state_on_a_module_that_is_not_the_root_raises(cases) -> None:
    for rank in cases:
        assert "must be called on the root" in rank["not_root"]
