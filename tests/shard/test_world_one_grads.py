"""World size 1 moves each unsharded gradient to its shard without packing ([Note: world size 1] in
``overlap/param_group.py``): as it is, or cast under mixed precision (rounded through a narrower
reduce dtype first, with or without a parameter cast). Checked against the unsharded model's gradients, bitwise: new gradients, ones
accumulated into, a kept gradient, a ``.grad`` the user assigned, a parameter without a gradient,
and a group that mixes cast and uncast parameters. The fp16 reduction runs on a loss scaled by
2**-20, so that the bf16 gradients lie below fp16's smallest normal value (6.1e-5), where fp16 keeps
fewer bits than bf16: there the rounding through the reduce dtype changes them (bf16 values of
ordinary magnitude are exact in fp16, and would not show a rounding left out). With a gradient
divide factor (``set_gradient_divide_factor``) each gradient is divided by it in the reduce dtype,
by torch's division, as FSDP2 does at world size 1.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn

import overlap
from overlap.sharding import sharded_states


class _Model(nn.Module):
    def __init__(self, odd_dtype: torch.dtype) -> None:
        super().__init__()
        self.lin1 = nn.Linear(6, 9)
        self.odd = nn.Parameter(torch.randn(5, 3, dtype=odd_dtype))
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim
        self.lin2 = nn.Linear(9, 4)
        self.unused = nn.Parameter(torch.randn(3))
        self.use_unused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.lin1(x)) * self.scale
        out = self.lin2(hidden).sum(1, keepdim=True) * self.odd.to(hidden.dtype).sum()
        return out + self.unused.sum() if self.use_unused else out


def _world_one_rank(rank: int, world: int, param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype],
                    odd_dtype: torch.dtype, loss_scale: float, factor: Optional[float]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Model(odd_dtype)
    reference = _Model(odd_dtype)
    reference.load_state_dict(model.state_dict())
    compute = param_dtype or torch.float32
    reference.to(compute)
    mp = overlap.MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    overlap.shard(model, mp=mp)
    if factor is not None:
        model.set_gradient_divide_factor(factor)
    (group,) = [s.group for s in sharded_states(model) if s.group is not None]
    params = dict(model.named_parameters())
    x = torch.randn(4, 6)
    (reference(x.to(compute)).sum() * loss_scale).backward()
    rounding = reduce_dtype or compute
    want = {n: (p.grad.to(rounding) if factor is None else p.grad.to(rounding) / factor).to(params[n].dtype)
            for n, p in reference.named_parameters() if p.grad is not None}

    def backward() -> None:
        (model(x).sum() * loss_scale).backward()

    seen: dict[str, Any] = {}
    backward()
    fresh = {n: p.grad._local_tensor.clone() for n, p in params.items() if p.grad is not None}
    # the rounding through the reduce dtype changed some gradient (else this case would check nothing of it)
    seen["rounding_shows"] = reduce_dtype not in (torch.float16, torch.bfloat16) or any(
        not torch.equal(p.grad.to(params[n].dtype), want[n]) for n, p in reference.named_parameters() if n in want)
    seen["unused_none"] = params["unused"].grad is None and set(fresh) == set(want)
    seen["values"] = all(torch.equal(fresh[n], want[n]) for n in want)
    seen["specs"] = all(type(params[n].grad).__name__ == "DTensor" and params[n].grad._spec is params[n]._spec
                        and params[n].grad.dtype == params[n].dtype for n in fresh)
    seen["unsharded_grads_dropped"] = all(u.grad is None for u in group.unsharded)
    grads = {n: params[n].grad for n in fresh}
    backward()  # accumulated into the existing gradients
    seen["accumulated"] = all(params[n].grad is grads[n] and torch.equal(grads[n]._local_tensor, 2 * fresh[n])
                              for n in fresh)
    kept = params["lin1.weight"].grad
    model.zero_grad(set_to_none=True)
    own = torch.zeros_like(params["odd"])
    params["odd"].grad = own  # a .grad the user assigns: accumulated into, never replaced
    backward()
    seen["kept_unchanged"] = torch.equal(kept._local_tensor, 2 * fresh["lin1.weight"])
    seen["own_kept"] = params["odd"].grad is own and torch.equal(own._local_tensor, fresh["odd"])
    seen["others_equal"] = all(torch.equal(params[n].grad._local_tensor, fresh[n]) for n in fresh)
    model.zero_grad(set_to_none=True)
    model.use_unused = True  # every parameter gets a gradient
    backward()
    four_rows = torch.full((3,), 4.0 * loss_scale / (factor or 1.0))  # 1 per row of the batch of 4, scaled
    seen["unused_value"] = torch.equal(params["unused"].grad._local_tensor, four_rows)
    seen["others_equal_again"] = all(torch.equal(params[n].grad._local_tensor, fresh[n]) for n in fresh)
    return seen


@pytest.mark.parametrize("param_dtype, reduce_dtype, odd_dtype, loss_scale, factor", [
    (None, None, torch.float32, 1.0, None),  # the gradients move as they are
    (torch.bfloat16, None, torch.float32, 1.0, None),  # every one cast
    # no parameter cast, a narrower reduce dtype: rounded through it all the same, as FSDP2 and more ranks do
    (None, torch.bfloat16, torch.float32, 1.0, None),
    # rounded through a narrower reduce dtype first: to fp16's subnormals, which hold fewer bits than bf16
    (torch.bfloat16, torch.float16, torch.float32, 2.0**-20, None),
    (torch.bfloat16, torch.float32, torch.float32, 1.0, None),  # a wider one: no rounding
    (torch.bfloat16, None, torch.bfloat16, 1.0, None),  # one parameter already bf16: moved as it is, the others cast
    (None, None, torch.float32, 1.0, 3.0),  # divided by a factor
    (torch.bfloat16, torch.float32, torch.float32, 1.0, 3.0),  # divided in the wider reduce dtype, then cast
    (None, torch.float64, torch.float32, 1.0, 3.0),  # no parameter cast: divided in float64, back to float32
])
def test_world_one_gradients_match_the_unsharded_model(distributed, param_dtype: Optional[torch.dtype],
                                                       reduce_dtype: Optional[torch.dtype], odd_dtype: torch.dtype,
                                                       loss_scale: float, factor: Optional[float]) -> None:
    (seen,) = distributed(_world_one_rank, 1, param_dtype, reduce_dtype, odd_dtype, loss_scale, factor)
    assert all(seen.values()), seen
