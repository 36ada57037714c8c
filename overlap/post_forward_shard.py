"""Resharding to a smaller group after forward (FSDP2's ``reshard_after_forward=<int>``).

[Note: resharding to a smaller group after forward]
``reshard_after_forward=k`` (``k`` dividing the shard group's size, 1 < ``k`` < size) frees the
unsharded parameters after forward as ``True`` does, but keeps this rank's ``1/k`` of them first,
so that backward gathers them from the ``k`` ranks of its post-forward group instead of from every
shard rank: with ``k`` the GPUs of a node, backward's all-gathers stay on the node's links, for
``1/k`` of the unsharded bytes held between forward and backward. The groups are FSDP2's: the shard
mesh's ranks (HSDP: the whole mesh's) in rows of ``k`` consecutive ranks (``post_forward_group``).

What is kept is bytes. A group's unsharded parameters are views of one storage ([Note: unsharded
parameters share one storage] in ``overlap/param_group.py``), already in ``param_dtype``, so the
post-forward shard is the ``r``-th of ``k`` equal byte ranges of that storage (the last padded),
and the backward gather is one ``uint8`` all-gather of those ranges, copied back into the storage
(``ParamGroup.reshard_after_forward``, ``issue_gather``, ``finish_gather``): no layout, no cast, the
same bytes whatever the dtypes. The shards' version counters are recorded with it: if the shards
change before the next gather (an optimizer step after a ``no_grad`` forward), it is dropped and
the group gathered from its shards, on every rank alike. A full reshard (the end of backward, a
dropped prefetch) drops it too.

Not with compressed all-gathers, FSDP2's all-gather extension or ``param_dtype_override_fn``
parameters (gathered apart, outside that storage; FSDP2 refuses the extension too), nor on a full
SPMD mesh (FSDP2 refuses it): NotImplementedError.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from overlap.groups import GroupInfo, resolve_group

__all__ = ["PostForwardGroup", "post_forward_group"]


@dataclass(frozen=True)
class PostForwardGroup:
    """The ``size`` ranks a group's post-forward shards are gathered from, and this rank's place."""

    size: int
    info: GroupInfo

    def part_bytes(self, nbytes: int) -> int:
        """The bytes of one post-forward shard of ``nbytes`` (16-byte multiples, the last padded)."""
        return -(-nbytes // (self.size * 16)) * 16


def post_forward_group(dtensor_mesh: Any, size: int) -> PostForwardGroup:
    """FSDP2's post-forward group: the ranks of ``dtensor_mesh`` (the shard mesh, or HSDP's 2-D one)
    in rows of ``size``, this rank's row. Every rank of the mesh must call it (it makes process
    groups; the first call per mesh and size does, later ones reuse its group)."""
    from torch.distributed.device_mesh import DeviceMesh

    import torch.distributed as dist

    # (the default group's id: a cached group never outlives the process group it was made in)
    key = (id(dist.group.WORLD), dtensor_mesh.device_type, tuple(dtensor_mesh.mesh.flatten().tolist()), size)
    group = _groups.get(key)
    if group is None:  # one per mesh and size, not per module: each makes process groups
        mesh = DeviceMesh(dtensor_mesh.device_type, dtensor_mesh.mesh.reshape(-1, size))
        group = _groups[key] = PostForwardGroup(size, resolve_group((mesh, 1), "mesh"))
    return group


_groups: dict[tuple, PostForwardGroup] = {}


def keep_part(whole: torch.Tensor, group: PostForwardGroup) -> torch.Tensor:
    """A copy of this rank's byte range of ``whole`` (the unsharded storage's ``uint8`` view)."""
    part = group.part_bytes(whole.numel())
    start = group.info.rank * part
    kept = torch.zeros(part, dtype=torch.uint8, device=whole.device)
    valid = max(0, min(part, whole.numel() - start))
    kept[:valid].copy_(whole[start:start + valid])
    return kept
