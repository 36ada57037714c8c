"""torchao's float8 training and its NF4 weights (QLoRA) under ``overlap.fully_shard``, side by side
with FSDP2: the clients of FSDP2's all-gather extension ([Note: all-gather extensions] in
``overlap/gather_extension.py``).

``torchao.float8.convert_to_float8_training(..., Float8LinearConfig(enable_fsdp_float8_all_gather=True))``
makes each linear's weight a ``WeightWithDynamicFloat8CastTensor``: its ``fsdp_pre_all_gather`` casts
the shard to float8 with a scale agreed over the shard group (an all-reduce of the amax, inside the
pre-all-gather), the all-gather moves float8 bytes, and ``fsdp_post_all_gather`` wraps them as the
``Float8TrainingTensor`` the float8 linear multiplies with; a re-gather refills the same bytes and
sets the new scale through ``out=``. torchtitan's float8 recipe is this, with
``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step (one all-reduce for every
weight's scale instead of one per weight).

torchtune's QLoRA recipe is the other: each frozen base weight an ``NF4Tensor`` (4-bit codes with
double-quantized block scales; its all-gather moves the codes and both scale tensors, three inputs),
trainable bf16 LoRA adapters beside it, sharded by ``torch.chunk`` (NF4 implements that cut, not
every slice).

On 2 gloo ranks (torchao's float8 linear and NF4 run on the CPU too), 3 AdamW steps, resharded after
forward: a 2-block float8 MLP with and without precomputed scales, and a 2-block QLoRA MLP: losses
and parameters bitwise FSDP2's, and the weights' local tensors stay torchao's subclasses. And DCP:
each runtime saves its float8 model and loads the other's checkpoint; torch's full state dicts are
equal throughout. And torchtitan's float8 with tensor parallelism (torchao's ``Float8ColwiseParallel`` /
``Float8RowwiseParallel`` on a (dp 2, tp 2) mesh, the float8 all-gather over dp): bitwise FSDP2's,
and ``overlap.full_state_dict`` equal to torch's full state dict.
Skipped without torchao (the test extra installs it).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import overlap
from models import SEED, NormedMLP, assert_same_run, run_of, train_unfrozen

float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install -e '.[test]' installs it)")

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

STEPS = 3
WIDTH = 32  # float8 matmuls want multiples of 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(NormedMLP(WIDTH, torch.relu) for _ in range(2))
        self.out = nn.LayerNorm(WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _float8_model(runtime: str, world: int, seed: int) -> Net:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = float8.convert_to_float8_training(
        Net(), config=float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    mesh = init_device_mesh("cpu", (world,))
    shard = overlap.fully_shard if runtime == "overlap" else fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _float8_run(model: nn.Module, data_rank: int, precompute: bool) -> dict[str, Any]:
    """``STEPS`` AdamW steps of a sharded float8 model on ``data_rank``'s batches, scales precomputed
    after each step if ``precompute``: the run (``run_of``) and each parameter's local tensor type."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(100 * step + data_rank))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            float8.precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.detach())
    out = run_of(losses, model)
    out["kinds"] = {n: type(p.to_local()).__name__ for n, p in model.named_parameters()}
    return out


def _train(runtime: str, world: int, rank: int, precompute: bool) -> dict[str, Any]:
    return _float8_run(_float8_model(runtime, world, SEED), rank, precompute)


LORA_WIDTH, RANK = 256, 8  # NF4 quantizes in blocks of 64 values, its scales in blocks of 256


class LoRALinear(nn.Module):
    """A frozen NF4 base weight and a trainable low-rank update (torchtune's ``LoRALinear`` for QLoRA)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        base = torch.randn(width, width, dtype=torch.bfloat16) / width ** 0.5
        self.weight = nn.Parameter(to_nf4(base), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(RANK, width, dtype=torch.bfloat16) / width ** 0.5)
        self.lora_b = nn.Parameter(torch.randn(width, RANK, dtype=torch.bfloat16) / RANK)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + (x @ self.lora_a.t()) @ self.lora_b.t()


def _train_qlora(runtime: str, world: int, rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = nn.Sequential(LoRALinear(LORA_WIDTH), nn.GELU(), LoRALinear(LORA_WIDTH))
    mesh = init_device_mesh("cpu", (world,))
    shard = overlap.fully_shard if runtime == "overlap" else fully_shard
    for layer in (model[0], model[2]):
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    out = run_of(train_unfrozen(model, rank, LORA_WIDTH, STEPS, torch.bfloat16), model)
    out["params"] = {n: p for n, p in out["params"].items() if "lora" in n}  # the NF4 weights are frozen
    out["kinds"] = {n: type(p.to_local()).__name__ for n, p in model.named_parameters()}
    return out


def _rank(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[Any, Any] = {precompute: {runtime: _train(runtime, world, rank, precompute)
                                        for runtime in ("overlap", "fsdp2")} for precompute in (False, True)}
    out["qlora"] = {runtime: _train_qlora(runtime, world, rank) for runtime in ("overlap", "fsdp2")}
    return out


def test_torchao_weights_train_bitwise_as_under_fsdp2(distributed) -> None:
    """Fails if the weights are gathered as values (another computation than float8's or NF4's), if
    a re-gather leaves the old scale, or if the shards lose torchao's subclasses."""
    for rank, res in enumerate(distributed(_rank, 2)):
        for what, runs in res.items():
            ours, fsdp2 = runs["overlap"], runs["fsdp2"]
            assert_same_run(fsdp2, ours, (rank, what))
            assert ours["kinds"] == fsdp2["kinds"], (ours["kinds"], fsdp2["kinds"])
            weight = "0.weight" if what == "qlora" else "blocks.0.up.weight"
            assert ours["kinds"][weight] == ("NF4Tensor" if what == "qlora" else "WeightWithDynamicFloat8CastTensor")


def _checkpoints(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each runtime saves its float8 model with DCP and loads the other's checkpoint into a fresh
    model of its own; the full state dicts (torch's ``get_model_state_dict``) before and after."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    torch.set_num_threads(1)
    full_options = StateDictOptions(full_state_dict=True)
    out: dict[str, Any] = {}
    for runtime in ("overlap", "fsdp2"):
        model = _float8_model(runtime, world, SEED)
        model(torch.randn(16, WIDTH)).square().mean().backward()  # gathered and reduced once
        out["saved", runtime] = {k: v.detach().clone() for k, v in get_model_state_dict(model, options=full_options).items()}
        dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(root, runtime))
    for runtime, other in (("overlap", "fsdp2"), ("fsdp2", "overlap")):
        model = _float8_model(runtime, world, SEED + 1)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=os.path.join(root, other))
        set_model_state_dict(model, state)
        out["loaded", runtime] = {k: v.detach().clone() for k, v in get_model_state_dict(model, options=full_options).items()}
    return out


def test_torchao_float8_checkpoints_load_across_runtimes(distributed, tmp_path) -> None:
    """Fails if the extension's shards save other values than FSDP2's (a full state dict differs),
    or if DCP cannot load one runtime's checkpoint into the other's model."""
    for rank, res in enumerate(distributed(_checkpoints, 2, str(tmp_path))):
        saved = res["saved", "fsdp2"]
        assert len(saved) == 14, sorted(saved)
        for key in ("saved", "overlap"), ("loaded", "overlap"), ("loaded", "fsdp2"):
            assert res[key].keys() == saved.keys(), (rank, key)
            for name, value in saved.items():
                assert torch.equal(res[key][name], value), (rank, key, name)


def _float8_tensor_parallel(rank: int, world: int) -> dict[str, Any]:
    """torchtitan's float8 with tensor parallelism: on a (dp 2, tp 2) mesh, each block's linears
    parallelized by torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``, then sharded
    over dp with the float8 all-gather; 3 AdamW steps, scales precomputed after each."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for runtime in ("overlap", "fsdp2"):
        torch.manual_seed(SEED)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH))
                                for _ in range(2)])
        model = float8.convert_to_float8_training(model, config=float8.Float8LinearConfig(
            enable_fsdp_float8_all_gather=True))
        for block in model:
            parallelize_module(block, mesh["tp"], {"0": Float8ColwiseParallel(), "2": Float8RowwiseParallel()})
        shard = overlap.fully_shard if runtime == "overlap" else fully_shard
        for block in model:
            shard(block, mesh=mesh["dp"])
        shard(model, mesh=mesh["dp"])
        out[runtime] = _float8_run(model, rank // 2, precompute=True)  # a batch per dp rank
        if runtime == "overlap":  # the runtime's own full state dict against torch's utility
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            out["full_state_dict"] = overlap.full_state_dict(model, rank0_only=False)
            out["torch full"] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return out


def test_torchao_float8_with_tensor_parallelism_trains_bitwise_as_under_fsdp2(distributed) -> None:
    """Fails if a tensor-parallel parameter's extension is not run on its local tensor (refused, or
    gathered as values) or its unsharded result loses the TP spec."""
    for rank, res in enumerate(distributed(_float8_tensor_parallel, 4)):
        assert_same_run(res["fsdp2"], res["overlap"], rank)
        assert res["overlap"]["kinds"] == res["fsdp2"]["kinds"], res["overlap"]["kinds"]
        assert res["overlap"]["kinds"]["0.0.weight"] == "WeightWithDynamicFloat8CastTensor", res["overlap"]["kinds"]
        assert res["full_state_dict"].keys() == res["torch full"].keys(), rank
        for name, value in res["torch full"].items():
            assert torch.equal(res["full_state_dict"][name], value), (rank, name)
