"""The unsharded parameters of a group are views of one storage ([Note: unsharded parameters share
one storage] in ``overlap/param_group.py``): one ``resize_`` frees or re-allocates them all, each is
16-byte aligned and contiguous, and the copy-out keys its pointer table on that storage. Training
through it is checked against the unsharded model and FSDP2 in test_shard_numerics.py; here, the
storage itself, with mixed dtypes (fp32, bf16 and an int parameter) in one group, and with
``set_keep_unsharded_storage(True)``: allocated at one address across steps, training unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

import overlap
from overlap.sharding import sharded_states


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 7)
        self.odd = nn.Parameter(torch.randn(3, 3, dtype=torch.bfloat16))
        self.steps = nn.Parameter(torch.arange(6, dtype=torch.int32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum(1, keepdim=True) * self.odd.float().sum() + self.steps.sum()


def _storage_rank(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Mixed()
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    overlap.shard(model)
    (group,) = [s.group for s in sharded_states(model) if s.group is not None]
    seen: dict[str, Any] = {}

    def look(module: nn.Module, args: Any) -> None:  # inside the forward: gathered
        storage, placement = group._unsharded_storage
        data = list(group.unsharded)
        seen["one_storage"] = all(d.untyped_storage().data_ptr() == storage.data_ptr() for d in data)
        seen["offsets"] = [d.data_ptr() - storage.data_ptr() for d in data]
        seen["placement_offsets"] = list(placement.byte_offsets)
        seen["nbytes"] = (storage.nbytes(), placement.nbytes)
        seen["contiguous"] = all(d.is_contiguous() for d in data)
        seen["dtypes"] = [d.dtype for d in data]
        seen["values_right"] = all(
            torch.equal(model.get_parameter(name).detach(), p)
            for name, p in expected.items())

    model.lin.register_forward_pre_hook(look)
    model(torch.randn(4, 5)).float().sum().backward()
    seen["freed_after_step"] = group._unsharded_storage[0].nbytes()
    seen["versions"] = _versions_over_steps(model, group, lambda: model(torch.randn(4, 5)).float().sum())
    return seen


def _versions_over_steps(model: nn.Module, group: Any, loss: Any) -> list[list[int]]:
    """The unsharded parameters' version counters seen in forward and in backward (after the
    re-gather that ``reshard_after_forward`` asks for) of two steps; the fill tensors' too."""
    seen: list[list[int]] = []

    def record(*_: Any) -> None:
        seen.append([u._version for u in group.unsharded])

    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    handles = [first.register_forward_pre_hook(record), first.register_full_backward_hook(record)]
    for _ in range(2):
        loss().backward()
    for handle in handles:
        handle.remove()
    seen.append([t._version > 0 for t in group._unsharded_fill])  # the writes went through these
    return seen


def test_unsharded_parameters_share_one_aligned_storage(distributed) -> None:
    for seen in distributed(_storage_rank, 2):
        assert seen["one_storage"] and seen["contiguous"]
        assert seen["offsets"] == seen["placement_offsets"] and all(o % 16 == 0 for o in seen["offsets"])
        assert seen["nbytes"][0] == seen["nbytes"][1] > 0
        assert sorted(map(str, seen["dtypes"])) == ["torch.bfloat16", "torch.float32", "torch.float32", "torch.int32"]
        assert seen["values_right"], "the gathered parameters differ from the originals"
        assert seen["freed_after_step"] == 0
        *versions, fills_written = seen["versions"]
        assert len(versions) == 4 and all(v == versions[0] for v in versions), versions
        assert all(fills_written), fills_written


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))  # the weight saved twice, read after the re-gather


def _mp_world_one_versions(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    inner = _Twice()
    model = nn.Sequential(inner, nn.Linear(5, 1))
    overlap.shard(inner, mp=overlap.MixedPrecision(param_dtype=torch.bfloat16))
    overlap.shard(model, mp=overlap.MixedPrecision(param_dtype=torch.bfloat16))
    group = sharded_states(inner)[0].group
    x = torch.randn(3, 5)
    return {"versions": _versions_over_steps(inner, group, lambda: model(x).float().sum()),
            "gathers_in_backward": group.casts_shards}


def test_a_gather_bumps_no_version_counter(distributed) -> None:
    """[Note: a gather bumps no version counter]: the world-size-1 cast path, re-gathered in backward."""
    (seen,) = distributed(_mp_world_one_versions, 1)  # 2 steps x (2 forward + 2 backward calls of lin)
    *versions, fills_written = seen["versions"]
    assert seen["gathers_in_backward"] and len(versions) == 8 and all(v == versions[0] for v in versions), seen
    assert all(fills_written), fills_written


def _kept_storage_rank(rank: int, world: int) -> dict[str, Any]:
    """``set_keep_unsharded_storage(True)`` (FSDP2's): 3 SGD steps of TinyLM beside the same run
    without it; each group's unsharded storage after every step (allocated, at one address)."""
    import sys

    sys.path.insert(0, __file__.rsplit("/shard/", 1)[0])
    from models import SEED, TinyLM, local_batch, make_batch

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for keep in (True, False):
        torch.manual_seed(SEED)
        model = TinyLM()
        for block in model.blocks:
            overlap.fully_shard(block)
        overlap.fully_shard(model)
        model.set_keep_unsharded_storage(keep)
        groups = [s.group for s in sharded_states(model) if s.group is not None]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        storages = []
        for step in range(3):
            model.loss(local_batch(make_batch(step), rank, world)).backward()
            opt.step()
            opt.zero_grad()
            storages.append([(g._unsharded_storage[0].nbytes(), g._unsharded_storage[0].data_ptr()) for g in groups])
        out[keep] = {"storages": storages, "params": {n: p.to_local().clone() for n, p in model.named_parameters()}}
    return out


def test_kept_unsharded_storage_stays_at_one_address_and_trains_the_same(distributed) -> None:
    for seen in distributed(_kept_storage_rank, 2):
        kept, freed = seen[True], seen[False]
        first = kept["storages"][0]
        assert all(nbytes > 0 for nbytes, _ in first), "resharded storage was freed"
        assert all(step == first for step in kept["storages"]), "the kept storage moved between steps"
        assert all(nbytes == 0 for step in freed["storages"] for nbytes, _ in step)
        for name, value in freed["params"].items():
            assert torch.equal(kept["params"][name], value), name
