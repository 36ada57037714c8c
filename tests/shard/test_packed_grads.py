"""New sharded gradients are views of one storage per reduction ([Note: new sharded gradients
share one storage] in ``overlap/param_group.py``), and the reduce-scatter copy-out keys its pointer
table on that storage (its launch: tests/packing/test_packed_placement.py). Checked here: the
storage and its placement, the copy-out keyed on it, a kept gradient, a ``.grad`` the user assigned (the per-tensor path),
accumulation into the views, and a clipped, foreach-AdamW training loop bitwise equal to the one
whose gradients stay allocated. Training against the unsharded model and FSDP2 through this path
is test_shard_numerics.py's and test_reference_fsdp2.py's.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

import overlap
from overlap_kernels import _launch
from models import bits
from overlap.sharding import sharded_states

WORLD = 3  # rows split unevenly: lin2.weight's 4 rows leave rank 2 none


# --------------------------------------------------------------------------------------- the runtime
class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(6, 9)
        self.odd = nn.Parameter(torch.randn(5, 3, dtype=torch.bfloat16))
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim: replicated, broadcast after the reduction
        self.lin2 = nn.Linear(9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.lin1(x)) * self.scale
        return self.lin2(hidden).sum(1, keepdim=True) * self.odd.float().sum()


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad._local_tensor.clone() for n, p in model.named_parameters()}


def _storages(model: nn.Module) -> set[int]:
    return {p.grad._local_tensor.untyped_storage().data_ptr() for p in model.parameters()
            if p.grad._local_tensor.numel()}


def _grads_rank(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Model()
    overlap.shard(model)
    (group,) = [s.group for s in sharded_states(model) if s.group is not None]
    params = dict(model.named_parameters())
    torch.manual_seed(1 + rank)
    x = torch.randn(4, 6)

    def backward() -> None:
        model(x).sum().backward()

    seen: dict[str, Any] = {}
    backward()  # no .grad yet: one new storage
    fresh = _locals(model)
    grads = {n: p.grad for n, p in params.items()}
    storage = next(iter(grads.values()))._local_tensor.untyped_storage()
    seen["one_storage"] = _storages(model) == {storage.data_ptr()}
    seen["aligned"] = all((g._local_tensor.data_ptr() - storage.data_ptr()) % 16 == 0
                          for g in grads.values() if g._local_tensor.numel())
    seen["specs"] = all(g._spec is p._spec and type(g).__name__ == "DTensor" for g, p in
                        zip(grads.values(), params.values()))
    keys = [k for layout in group._reduce_layouts.values() for k in layout._device_cache
            if isinstance(k, tuple) and k[0] == "packed pointers"]
    seen["kernel_path"] = _launch.triton_enabled(torch.device("cpu"))
    seen["keyed_on_storage"] = storage.data_ptr() in {k[2] for k in keys}

    backward()  # accumulate into the views: fresh + fresh, in place
    seen["accumulated"] = all(torch.equal(params[n].grad._local_tensor, fresh[n] + fresh[n]) for n in fresh)
    seen["same_objects"] = all(params[n].grad is grads[n] for n in grads)

    kept = params["lin1.weight"].grad  # a gradient the user keeps past zero_grad
    model.zero_grad(set_to_none=True)
    backward()
    seen["kept_alive_and_unchanged"] = (kept._local_tensor.untyped_storage().data_ptr() == storage.data_ptr()
                                        and torch.equal(kept._local_tensor, fresh["lin1.weight"] * 2))
    seen["new_storage"] = len(_storages(model)) == 1 and _storages(model) != {storage.data_ptr()}
    seen["kept_run_equal"] = all(torch.equal(g, fresh[n]) for n, g in _locals(model).items())

    model.zero_grad(set_to_none=True)
    own = torch.zeros_like(params["odd"])  # a .grad the user assigns: read, never replaced
    params["odd"].grad = own
    backward()
    seen["own_kept"] = params["odd"].grad is own
    nonempty = sum(1 for p in params.values() if p.grad._local_tensor.numel())
    seen["separate_storages"] = len(_storages(model)) == nonempty
    seen["own_run_equal"] = all(torch.equal(g, fresh[n]) for n, g in _locals(model).items())
    return seen


def test_new_grads_share_one_storage_kept_and_assigned_grads(distributed) -> None:
    for rank, seen in enumerate(distributed(_grads_rank, WORLD)):
        assert seen["one_storage"] and seen["aligned"] and seen["specs"], (rank, seen)
        assert seen["keyed_on_storage"] or not seen["kernel_path"], "the copy-out did not key on the storage"
        assert seen["accumulated"] and seen["same_objects"], (rank, seen)
        assert seen["kept_alive_and_unchanged"] and seen["new_storage"] and seen["kept_run_equal"], (rank, seen)
        assert seen["own_kept"] and seen["separate_storages"] and seen["own_run_equal"], (rank, seen)


def _training_rank(rank: int, world: int, set_to_none: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _Model()
    overlap.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    if not set_to_none:  # gradients allocated one by one before the first step: the per-tensor path throughout
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        model(torch.randn(4, 6)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)  # False: the runtime accumulates into the zeroed gradients
    return [p._local_tensor.clone() for p in model.parameters()]


def test_training_over_packed_grads_is_bitwise(distributed) -> None:
    packed = distributed(_training_rank, WORLD, True)
    allocated = distributed(_training_rank, WORLD, False)
    for rank in range(WORLD):
        for got, want in zip(packed[rank], allocated[rank]):
            assert got.dtype == want.dtype and torch.equal(bits(got), bits(want)), (rank, got, want)


def _freezing_rank(rank: int, world: int) -> dict[str, Any]:
    import copy

    import torch.distributed as dist

    torch.manual_seed(0)
    model = _Model()
    plain = copy.deepcopy(model)  # the unsharded model, on this rank's batch
    overlap.shard(model)
    (group,) = [s.group for s in sharded_states(model) if s.group is not None]
    torch.manual_seed(1 + rank)
    x = torch.randn(4, 6)
    seen: dict[str, Any] = {}

    def step() -> dict[str, torch.Tensor | None]:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        return {n: None if p.grad is None else p.grad._local_tensor.clone() for n, p in model.named_parameters()}

    first = step()
    # Every gradient (the 0-dim scale's too, reduced on rank 0 and broadcast) is the average of the two
    # ranks' unsharded gradients, summed in float32 (the group's reduce dtype: its widest), bitwise.
    plain(x).sum().backward()
    full = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    averaged = {}
    for n, p in plain.named_parameters():
        total = p.grad.float()
        dist.all_reduce(total)  # a sum of two: the same in either order
        averaged[n] = (total * 0.5).to(p.dtype)
    seen["average_of_the_ranks"] = all(torch.equal(full[n], averaged[n]) for n in averaged)
    model.lin1.requires_grad_(False)  # frozen between steps: the next gather drops its gradients
    frozen = step()
    seen["unsharded_follow"] = [u.requires_grad for u in group.unsharded] == [p.requires_grad for p in group.sharded]
    seen["frozen_none"] = frozen["lin1.weight"] is None and frozen["lin1.bias"] is None
    seen["others_equal"] = all(torch.equal(frozen[n], first[n]) for n in first if not n.startswith("lin1."))
    seen["subset_one_storage"] = len({p.grad._local_tensor.untyped_storage().data_ptr()
                                      for n, p in model.named_parameters()
                                      if not n.startswith("lin1.") and p.grad._local_tensor.numel()}) == 1
    model.lin1.requires_grad_(True)  # and unfrozen again
    again = step()
    seen["unfrozen_equal"] = all(torch.equal(again[n], first[n]) for n in first)
    model.lin2.requires_grad_(False)  # another subset of as many parameters as lin1's freeze left: other shapes
    other = step()
    seen["other_subset_none"] = other["lin2.weight"] is None and other["lin2.bias"] is None
    seen["other_subset_equal"] = all(torch.equal(other[n], first[n]) for n in first if not n.startswith("lin2."))
    return seen


def test_freezing_between_steps_reduces_a_subset_into_one_storage(distributed) -> None:
    """The first step's gradients are the average of the unsharded model's over the ranks, bitwise.
    Also: two frozen subsets of the same size (lin1's, then lin2's: four of six parameters each)
    reduce each its own parameters, with the layout and gradient placement of their shapes (cached
    per set of indices, not per count)."""
    for rank, seen in enumerate(distributed(_freezing_rank, 2)):  # 2 ranks: a sum of two is bitwise in any order
        assert all(seen.values()), (rank, seen)
