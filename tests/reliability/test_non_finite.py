"""Non-finite gradients found where they start (issue 31): ``overlap.set_check_finite`` on 1 and 2 gloo ranks.

A NaN or inf is put into one element of one parameter's gradient on one rank (a hook on the
unsharded parameter, before the reduce-scatter packs it). With the check on, every rank must raise
``NonFiniteError`` in that backward: the producing rank naming itself, the step and the parameter,
the others naming the producing rank; nothing of that group is written (the sharded ``.grad`` stays
as it was) and the parameters are unchanged, also with mixed precision and with the optimizer
stepped in backward. With the check off, the same NaN spreads silently to every rank's parameters
(what the check is for), and clean training is bitwise the same with the check on and off. The
flags alone: NaN, inf and -inf found in fp32, bf16 and fp16 reduce-scatter inputs, the largest finite
values not flagged; the error names global ranks, and each non-finite rank its own parameter.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlap

_POISON: dict[str, Any] = {"value": None, "rank": None, "index": 3}


def _poison_hook(grad: torch.Tensor) -> torch.Tensor:
    if _POISON["value"] is None or _POISON["rank"] != dist.get_rank():
        return grad
    grad = grad.clone()
    grad.view(-1)[_POISON["index"]] = _POISON["value"]
    return grad


def _hook_unsharded(module: nn.Module, args: Any) -> None:
    weight = module.weight  # the unsharded parameter while forward runs (the same object every step)
    if not getattr(weight, "_test_poison_hooked", False):
        weight.register_hook(_poison_hook)
        weight._test_poison_hooked = True


def _model(mp: Optional[overlap.MixedPrecision], mesh: Any = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4))
    overlap.shard(model[0], mp=mp, mesh=mesh)
    overlap.shard(model[2], mp=mp, mesh=mesh)
    overlap.shard(model, mp=mp, mesh=mesh)
    model[2][0].register_forward_pre_hook(_hook_unsharded)
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def _locals(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().clone() for p in model.parameters()]


def _train(steps: int, check: bool, poison: Any = None, poison_step: int = -1, mp: Any = None,
           in_backward: bool = False, hsdp: bool = False, index: int = 3) -> dict[str, Any]:
    """``steps`` AdamW steps; at ``poison_step`` the last rank's gradient of ``2.0.weight`` (16 x 16)
    gets ``poison`` at flat ``index`` (3: in the first rank's shard; 200, row 12: in the second
    one's on 2 ranks, so the producer finds it in its own slot of the packed input). Returns the error (if any), the parameters before that step and at the end, and
    the sharded gradient of the poisoned group after the error."""
    mesh = None
    if hsdp:  # two replicas of one shard each: the flags travel over the replicas only
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    model = _model(mp, mesh)
    if in_backward:
        opt: Any = overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    out: dict[str, Any] = {"error": None}
    before = _locals(model)
    with overlap.check_finite(check):
        for step in range(steps):
            _POISON.update(value=poison if step == poison_step else None, rank=dist.get_world_size() - 1, index=index)
            before = _locals(model)
            try:
                model(_batch(step)).square().sum().backward()
            except overlap.NonFiniteError as e:
                out.update(error=str(e), ranks=list(e.ranks), step=e.step, fqns=list(e.fqns),
                           grad_of_poisoned_group=[p.grad for p in model[2].parameters()])
                break
            opt.step()
            opt.zero_grad()
    _POISON.update(value=None)
    out["before"], out["after"] = before, _locals(model)
    out["finite_after"] = all(bool(torch.isfinite(t).all()) for t in out["after"])
    return out


def _rank(rank: int, world: int) -> dict[str, Any]:
    bf16 = overlap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    hsdp = {"nan_hsdp": _train(2, True, float("nan"), poison_step=1, hsdp=True)} if world > 1 else {}
    return {
        **hsdp,
        "nan": _train(3, True, float("nan"), poison_step=1),
        "inf": _train(2, True, float("-inf"), poison_step=0, index=200),
        "nan_mp": _train(2, True, float("nan"), poison_step=1, mp=bf16),
        "nan_in_backward": _train(2, True, float("nan"), poison_step=1, in_backward=True),
        "nan_off": _train(3, False, float("nan"), poison_step=1),
        "clean_on": _train(3, True),
        "clean_off": _train(3, False),
        "clean_mp_on": _train(2, True, mp=bf16),
        "clean_mp_off": _train(2, False, mp=bf16),
    }


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("world", [1, 2])
def test_a_non_finite_gradient_raises_on_every_rank_naming_its_rank_step_and_parameter(distributed, world) -> None:
    results = distributed(_rank, world)
    producer = world - 1
    for rank, r in enumerate(results):
        cases = [("nan", 2), ("inf", 1), ("nan_mp", 2), ("nan_in_backward", 2)] + [("nan_hsdp", 2)] * (world > 1)
        for name, step in cases:
            got = r[name]
            assert got["error"] is not None, (rank, name)
            assert got["ranks"] == [producer] and got["step"] == step, (rank, name, got["error"])
            assert f"at step {step} " in got["error"], (rank, name, got["error"])
            if rank == producer:
                assert got["fqns"] == ["2.0.weight"], (rank, name, got["error"])
                assert f"on rank {producer} at step" in got["error"] and "'2.0.weight'" in got["error"], got["error"]
            else:
                assert got["fqns"] == [] and f"rank(s) {producer} " in got["error"], (rank, name, got["error"])
            # nothing of that group was written, no parameter changed in that step (nor stepped in backward)
            assert all(g is None for g in got["grad_of_poisoned_group"]), (rank, name)
            assert _same(got["before"], got["after"]) and got["finite_after"], (rank, name)
        # off: no error, and the NaN reached every rank's parameters (what the check is for)
        assert r["nan_off"]["error"] is None and not r["nan_off"]["finite_after"], rank
        # on, without a NaN: the same training, bitwise
        assert r["clean_on"]["error"] is None and _same(r["clean_on"]["after"], r["clean_off"]["after"]), rank
        assert r["clean_mp_on"]["error"] is None and _same(r["clean_mp_on"]["after"], r["clean_mp_off"]["after"]), rank


def test_the_flag_and_its_environment_variable(monkeypatch) -> None:
    from overlap import finite_check
    from scheduler.env_flags import EnvFlagError

    previous = overlap.set_check_finite(None)
    try:
        monkeypatch.setenv("OVERLAP_CHECK_FINITE", "1")
        assert overlap.check_finite_enabled()
        overlap.set_check_finite(None)
        monkeypatch.setenv("OVERLAP_CHECK_FINITE", "off")
        assert not overlap.check_finite_enabled() and not finite_check.SWITCH.on
        with overlap.check_finite():
            assert overlap.check_finite_enabled()
        assert not overlap.check_finite_enabled()
        overlap.set_check_finite(None)
        monkeypatch.setenv("OVERLAP_CHECK_FINITE", "of")
        with pytest.raises(EnvFlagError, match="OVERLAP_CHECK_FINITE"):
            overlap.check_finite_enabled()
    finally:
        overlap.set_check_finite(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_flags_find_nan_and_inf_in_every_reduce_dtype_and_nothing_in_large_finite_values(dtype) -> None:
    """``finite_check.local_flags`` and ``bad_slots`` on a reduce-scatter input as the reduction packs
    it, in each reduce dtype: a NaN, an inf or a -inf anywhere flags this rank's slot; finite values
    up to the dtype's largest (whose squares overflow) flag nothing (the flag is the largest
    magnitude, not a norm that could overflow)."""
    from overlap import finite_check

    largest = torch.finfo(dtype).max
    clean = torch.full((64,), largest, dtype=dtype)
    clean[::2] = -largest
    flags = finite_check.local_flags(clean, 1, 3)
    assert finite_check.bad_slots(flags) == [] and flags.tolist() == [0.0, float(largest), 0.0], flags
    for bad in (float("nan"), float("inf"), float("-inf")):
        packed = torch.ones(64, dtype=dtype)
        packed[37] = bad
        assert finite_check.bad_slots(finite_check.local_flags(packed, 1, 3)) == [1], (dtype, bad)
    assert finite_check.bad_slots(finite_check.local_flags(torch.empty(0, dtype=dtype), 1, 3)) == []


def test_the_error_names_global_ranks_and_each_bad_rank_its_own_parameters() -> None:
    """``finite_check.raise_non_finite`` over a group whose slots are global ranks 2 and 3 (an HSDP
    shard group, or a sub-group): the ranks named are global ones; with both slots non-finite, each
    rank's error names its own first parameter (it is not a bystander), the other's names it too."""
    from overlap import finite_check

    def error(flags: list[float], slot: int, fqns: list[str]) -> finite_check.NonFiniteError:
        values = torch.tensor(flags, dtype=torch.float64)
        check = finite_check.FiniteCheck(values, None, values, slot, (2, 3), 5)
        with pytest.raises(finite_check.NonFiniteError) as caught:
            finite_check.raise_non_finite(check, finite_check.bad_slots(values), fqns, "blocks.1")
        return caught.value

    one = error([0.0, float("nan")], 0, [])
    assert one.ranks == (3,) and one.step == 5 and "on rank(s) 3 at step 5" in str(one), str(one)
    assert "this rank's were finite" in str(one)
    both = error([float("nan"), float("inf")], 1, ["blocks.1.weight"])
    assert both.ranks == (2, 3) and both.fqns == ("blocks.1.weight",)
    assert "on rank 3 at step 5" in str(both) and "parameter 'blocks.1.weight' first" in str(both), str(both)
