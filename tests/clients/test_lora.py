"""LoRA under ``overlap.fully_shard``, side by side with FSDP2: each block's group holds a frozen base
weight and the trainable low-rank adapters beside it (PEFT's and torchtune's ``LoRALinear``).

Backward reads the frozen weight for its input's gradient, and may do so after both adapters'
gradients are in (the two branches are independent in the graph). A group used to be reduced, and
resharded, as soon as every parameter needing a gradient had one; that freed the frozen weight
before backward read it ("setStorage: ... out of bounds for storage of size 0", or a crash for a
weight whose subclass reads raw memory, torchao's NF4). Such a group is now reduced when backward
has passed its module's calls, or at the end of backward ([Note: counting a group's gradients] in
``overlap/param_group.py``), as FSDP2's post-backward is.

On 2 gloo ranks, two LoRA blocks (the first one's input needs no gradient, so only the end of
backward says it is done; the second's is watched), 3 AdamW steps over the adapters, in float32 and
under bf16 mixed precision, resharded after forward and not: losses and adapters bitwise FSDP2's,
the frozen weights unchanged and without gradients.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import overlap
from models import SEED, assert_same_run, run_of, train_unfrozen

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

STEPS, WIDTH, RANK = 3, 16, 4


class LoRALinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH ** 0.5, requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(RANK, WIDTH) / WIDTH ** 0.5)
        self.lora_b = nn.Parameter(torch.randn(WIDTH, RANK) / RANK)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + (x @ self.lora_a.t()) @ self.lora_b.t()


def _train(runtime: str, world: int, rank: int, mp: Any, reshard: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = nn.Sequential(LoRALinear(), nn.GELU(), LoRALinear())
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    mesh = init_device_mesh("cpu", (world,))
    shard = overlap.fully_shard if runtime == "overlap" else fully_shard
    kwargs = {} if mp is None else {"mp_policy": mp}
    for layer in (model[0], model[2]):
        shard(layer, mesh=mesh, reshard_after_forward=reshard, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    out = run_of(train_unfrozen(model, rank, WIDTH, STEPS), model)
    out["frozen_kept"] = all(torch.equal(model.get_parameter(n).full_tensor(), v) for n, v in frozen.items())
    out["frozen_grads"] = [n for n in frozen if model.get_parameter(n).grad is not None]
    return out


def _rank(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.set_num_threads(1)
    mp_bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {(mp_name, reshard): {runtime: _train(runtime, world, rank, mp, reshard) for runtime in ("overlap", "fsdp2")}
            for mp_name, mp in (("fp32", None), ("bf16-mp", mp_bf16)) for reshard in (True, False)}


def test_lora_with_frozen_base_weights_trains_bitwise_as_under_fsdp2(distributed) -> None:
    """Fails if a group with a frozen weight is resharded before backward has read that weight (the
    overlap run raises), or reduced with its adapters' gradients incomplete (they drift)."""
    for rank, res in enumerate(distributed(_rank, 2)):
        for what, runs in res.items():
            ours, fsdp2 = runs["overlap"], runs["fsdp2"]
            assert_same_run(fsdp2, ours, (rank, what))
            assert ours["frozen_kept"] and fsdp2["frozen_kept"], (rank, what)
            assert ours["frozen_grads"] == fsdp2["frozen_grads"] == [], (rank, what)
