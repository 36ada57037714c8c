"""``overlap.share_comm_ctx`` (FSDP2's ``share_comm_ctx``, for pipeline stages whose model chunks are
each a root): accepted for this runtime's modules, where torch's raises on them, and the roots then
train as before: two roots at one rank, each 2 AdamW steps after the call, bitwise the same roots
trained without it. Bad arguments: ``tests/reliability/test_bad_input_matrix.py``."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import overlap
from models import SEED, train_unfrozen

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)


def _chunks(share: bool) -> list[torch.Tensor]:
    torch.manual_seed(SEED)
    mesh = init_device_mesh("cpu", (1,))
    roots = [overlap.fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), mesh=mesh) for _ in range(2)]
    if share:
        assert overlap.share_comm_ctx(roots) is None
    return [loss for root in roots for loss in train_unfrozen(root, 0, 8, 2)]


def test_roots_sharing_the_comm_context_train_as_before(single_rank_group) -> None:
    from torch.distributed.fsdp import share_comm_ctx

    with pytest.raises(ValueError):  # torch's own, on this runtime's modules
        share_comm_ctx([overlap.fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1,)))])
    assert torch.equal(torch.stack(_chunks(share=True)), torch.stack(_chunks(share=False)))
