"""FSDP2's all-gather extension under ``overlap.fully_shard``: parameters whose tensor subclass defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` choose what their all-gather moves ([Note:
all-gather extensions] in ``overlap/gather_extension.py``).

The weights are ``tests/gather_extensions.py``'s: a float32 weight whose all-gather moves bfloat16
(the 5-argument pre-all-gather), or int8 codes plus per-row scales (two inputs of two dtypes, the
1-argument one). Each ``nn.Linear``'s weight is one; biases and a LayerNorm stay plain, so each
block's group gathers both kinds.

- On 2 gloo ranks and on 1 (and HSDP on a (2, 2) mesh, float32), side by side with FSDP2 on the same
  weights: 3 AdamW steps, resharded after forward (so backward gathers again, through
  ``fsdp_post_all_gather(out=...)``), in float32 and under bf16 mixed precision: losses and parameters bitwise FSDP2's, and the sharded parameters'
  local tensors keep the subclass.
- What travels is the extension's: an int8 model's all-gathers move fewer bytes than the same model
  with plain weights, and the unsharded weight is the per-row int8 round trip of the full weight
  bitwise, also on 3 ranks where a block's rows do not divide (a rank with none: its inputs are
  padded, where FSDP2 asks the extension to pad). ``overlap.full_state_dict`` gives the full float32
  weight (the shards' values, not what travels).
- At one rank an extension's unsharded tensor is a copy: kept unsharded across an optimizer step it
  is gathered again before the next forward uses it.
- Refused before anything changes, naming the parameter: a subclass with one of the two methods,
  and ``compress=`` over an extension parameter.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import overlap
from conftest import requires_cuda
from overlap.testing import run_distributed
from gather_extensions import Int8Gathered, gathered_weights, row_int8
from models import SEED, NormedMLP, assert_same_run, run_of

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

STEPS = 3
WIDTH = 8


class Net(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(NormedMLP(width) for _ in range(2))
        self.head = nn.Linear(width, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _model(runtime: str, world: int, mode: str, mp: Any = None, width: int = WIDTH, device: str = "cpu") -> Net:
    """``world`` 4: HSDP on a (2, 2) mesh."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = Net(width).to(device)
    model = gathered_weights(model, mode) if mode != "plain" else model
    mesh = (init_device_mesh(device, (world,)) if world < 4
            else init_device_mesh(device, (2, 2), mesh_dim_names=("replicate", "shard")))
    shard = overlap.fully_shard if runtime == "overlap" else fully_shard
    kwargs = {} if mp is None else {"mp_policy": mp}
    for block in model.blocks:
        shard(block, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    return model


def _batch(step: int, rank: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank)).to(device)


def _train(runtime: str, world: int, rank: int, mode: str, mp: Any, device: str = "cpu") -> dict[str, Any]:
    model = _model(runtime, world, mode, mp, device=device) if runtime != "fake-quantized" else _fake_quantized()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = model(_batch(step, rank, device)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    if runtime == "fake-quantized":
        return {"losses": torch.stack(losses), "params": {n.replace("parametrizations.weight.original", "weight"):
                                                          p.detach().clone() for n, p in model.named_parameters()}}
    out = run_of(losses, model)
    out["kinds"] = {n: type(p.to_local()).__name__ for n, p in model.named_parameters()}
    return out


class _RowInt8(torch.autograd.Function):
    """The int8 weight's forward (the per-row round trip) with the gradient passed through, as the
    sharded runtimes reduce the unsharded weight's gradient into the shard."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        codes, scale = row_int8(w)
        return codes.to(torch.float32) * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Quantize(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return _RowInt8.apply(w)


def _fake_quantized() -> Net:
    """The unsharded reference of an int8 run at one rank: plain weights seen through ``_RowInt8``."""
    from torch.nn.utils import parametrize

    torch.manual_seed(SEED)
    model = Net()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            parametrize.register_parametrization(m, "weight", _Quantize())
    return model


def _rank(rank: int, world: int) -> dict[str, Any]:
    """Per (mode, precision), the run of each runtime. FSDP2 at one rank gathers only an extension's
    first input (its one-rank path reads ``all_gather_inputs[0]``), so there the int8 run is compared
    with the unsharded model instead."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    mp_bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for mode in ("bf16", "int8"):
        for mp_name, mp in (("fp32", None), ("bf16-mp", mp_bf16))[: 1 if world == 4 else 2]:
            reference = "fsdp2" if mode == "bf16" or world > 1 else "fake-quantized" if mp is None else None
            if reference is not None:
                out[mode, mp_name] = {runtime: _train(runtime, world, rank, mode, mp)
                                      for runtime in ("overlap", reference)}
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_extension_weights_train_bitwise_as_under_fsdp2(distributed, world: int) -> None:
    """Fails if the runtime gathers the subclass's values instead of running its extension (the
    int8 runs drift from FSDP2's), if a re-gather skips ``out=`` or leaves the outputs stale, or if
    the shards lose their subclass."""
    for rank, res in enumerate(distributed(_rank, world)):
        assert len(res) == {1: 3, 2: 4, 4: 2}[world], res.keys()
        for what, runs in res.items():
            ours, reference = runs.pop("overlap"), next(iter(runs.values()))
            assert_same_run(reference, ours, (rank, what, *runs))
            if "kinds" in reference:
                assert ours["kinds"] == reference["kinds"], (what, ours["kinds"], reference["kinds"])
            assert ours["kinds"]["blocks.0.up.weight"] == ("Bf16Gathered" if what[0] == "bf16" else "Int8Gathered")


def _rank_cuda(rank: int, world: int) -> dict[str, Any]:
    """The bf16-gathering weights on CUDA (NCCL, one rank), float32 and bf16 mixed precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp_bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {}
    for mp_name, mp in (("fp32", None), ("bf16-mp", mp_bf16)):
        runs = {runtime: _train(runtime, world, rank, "bf16", mp, device="cuda") for runtime in ("overlap", "fsdp2")}
        out[mp_name] = {runtime: {"losses": run["losses"].cpu(), "params": {n: p.cpu() for n, p in run["params"].items()},
                                  "kinds": run["kinds"]} for runtime, run in runs.items()}
    return out


@pytest.mark.gpu
@requires_cuda
def test_extension_weights_train_bitwise_as_under_fsdp2_on_cuda() -> None:
    """The side all-gather's streams on CUDA: its pre-all-gather on the copy-in stream, its copy-out
    after the wait. Fails as the CPU test does, and on a stream race (a refill read before it lands)."""
    (res,) = run_distributed(_rank_cuda, 1, backend="nccl")
    for what, runs in res.items():
        assert_same_run(runs["fsdp2"], runs["overlap"], what)
        assert runs["overlap"]["kinds"] == runs["fsdp2"]["kinds"], what


def _gathered(rank: int, world: int, width: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for mode in ("int8", "plain"):
        model = _model("overlap", world, mode, width=width)
        group = model.blocks[0]._overlap_state.group
        out[mode, "bytes"] = group.all_gather_bytes() if mode == "plain" else None
        model.blocks[0].unshard()
        out[mode, "up"] = model.blocks[0].up.weight.detach().clone()
        if mode == "int8":
            out[mode, "bytes"] = group.all_gather_bytes()  # measured by the gather
        model.blocks[0].reshard()
        out[mode, "state"] = overlap.full_state_dict(model, rank0_only=False)["blocks.0.up.weight"]
    torch.manual_seed(SEED)
    out["full"] = Net(width).blocks[0].up.weight.detach()
    return out


@pytest.mark.parametrize("world,width", [(2, WIDTH), (3, 5)])
def test_what_travels_is_the_extensions_format(distributed, world: int, width: int) -> None:
    """Fails if the unsharded weight is not the int8 round trip of the full weight (values gathered
    instead), if a short shard's inputs are not padded (rows misplaced), or if the byte count is
    the plain weights'."""
    for rank, res in enumerate(distributed(_gathered, world, width)):
        codes, scale = row_int8(res["full"])
        assert torch.equal(res["int8", "up"], codes.float() * scale), rank
        assert torch.equal(res["plain", "up"], res["full"]), rank
        assert torch.equal(res["int8", "state"], res["full"]) and torch.equal(res["plain", "state"], res["full"]), rank
        assert res["int8", "bytes"] < res["plain", "bytes"], (res["int8", "bytes"], res["plain", "bytes"])


class _PreOnly(torch.Tensor):
    def fsdp_pre_all_gather(self, mesh: Any) -> Any:
        raise AssertionError("never called")


def test_an_extension_the_runtime_cannot_run_is_refused_before_anything_changes(single_rank_group) -> None:
    mesh = init_device_mesh("cpu", (1,))
    half = nn.Linear(4, 4)
    half.weight = nn.Parameter(half.weight.detach().as_subclass(_PreOnly))
    with pytest.raises(TypeError, match="parameter 'weight' is a _PreOnly with fsdp_pre_all_gather but no "
                                        "fsdp_post_all_gather"):
        overlap.fully_shard(half, mesh=mesh)
    assert type(half) is nn.Linear and type(half.weight) is _PreOnly
    int8 = gathered_weights(nn.Linear(4, 4), "int8")
    with pytest.raises(ValueError, match="parameter 'weight' is a Int8Gathered with FSDP2's all-gather extension, "
                                         "which chooses what its all-gather moves; compress= cannot apply"):
        overlap.shard(int8, group=mesh, compress=overlap.Compression(gather="int8"))
    assert type(int8) is nn.Linear and type(int8.weight) is Int8Gathered


def _kept_across_a_step(rank: int, world: int) -> dict[str, Any]:
    """One rank: block 0 kept unsharded after backward (``set_reshard_after_backward(False)``) across
    the optimizer step, then a forward; the same with the default resharding."""
    torch.set_num_threads(1)
    out = {}
    for keep in (True, False):
        model = _model("overlap", world, "bf16")
        if keep:
            model.blocks[0].set_reshard_after_backward(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(_batch(0, rank)).square().mean().backward()
        opt.step()
        out[keep] = model(_batch(1, rank)).detach()
    return out


def test_an_extension_kept_unsharded_across_a_step_is_gathered_again(distributed) -> None:
    """At one rank the other parameters alias their shards, but an extension's unsharded tensor is a
    copy: kept across the optimizer step it is stale, and the next forward must gather it again (as
    this runtime does for every kept group whose shards changed). Fails if it computes with the old
    weights."""
    (res,) = distributed(_kept_across_a_step, 1)
    assert torch.equal(res[True], res[False])
