"""``overlap.register_fsdp_forward_method`` (FSDP2's ``register_fsdp_forward_method``): a method other
than ``forward`` runs the sharded module's pre- and post-forward around it.

The client is a small two-stage encoder whose ``encode`` reads the root's own projection directly
(what a CLIP-style model's ``encode_image`` or a retrieval model's ``embed`` does), and a ``generate``
that calls ``forward`` repeatedly under ``no_grad`` (what HF's generation does, and what TRL and
torchtune register). On 2 gloo ranks, side by side with FSDP2 (torch's function on FSDP2's modules):

- training through ``encode`` (3 AdamW steps, loss from ``encode`` alone): losses and parameters
  bitwise FSDP2's, the all-gathers per step (from step 2) FSDP2's count or fewer;
- ``generate``'s tokens and logits bitwise FSDP2's, and the model resharded after it;
- unregistered, ``encode`` fails in both runtimes (the root's parameters are shards), so the
  registration is what makes it work;
- with bf16 parameters and a float32 ``output_dtype``, a registered method's output is cast as
  ``forward``'s.

At one rank, in this process: a no-op on a module that is not sharded (as FSDP2's), and ValueError
naming a missing method.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import overlap
from models import SEED, assert_same_run, run_of

pytestmark = pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)

STEPS = 3
WIDTH, VOCAB = 12, 17


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))

    def pre_activation(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h)


class Encoder(nn.Module):
    """Token embedding, two blocks, and a projection the root owns (``encode`` reads it directly)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.proj = nn.Parameter(torch.randn(WIDTH, 6) / WIDTH ** 0.5)
        self.head = nn.Linear(WIDTH, VOCAB)

    def _trunk(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self._trunk(tokens))

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._trunk(tokens).mean(dim=1).to(self.proj.dtype) @ self.proj

    def first_pre_activation(self, tokens: torch.Tensor) -> torch.dtype:
        """The dtype of block 0's ``pre_activation`` output, called inside this method."""
        return self.blocks[0].pre_activation(self.tok(tokens)).dtype

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = []
        for _ in range(new):
            step = self(tokens)[:, -1]
            logits.append(step)
            tokens = torch.cat([tokens, step.argmax(-1, keepdim=True)], dim=1)
        return tokens, torch.stack(logits)


def _model(runtime: str, world: int, register: bool, mp: Any = None) -> Encoder:
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    torch.manual_seed(SEED)
    model = Encoder()
    mesh = init_device_mesh("cpu", (world,))
    shard = overlap.fully_shard if runtime == "overlap" else fully_shard
    kwargs = {} if mp is None else {"mp_policy": mp}
    for block in model.blocks:
        shard(block, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    if register:
        registered = overlap.register_fsdp_forward_method if runtime == "overlap" else register_fsdp_forward_method
        registered(model, "encode")
        registered(model, "generate")
        registered(model.blocks[0], "pre_activation")
        registered(model, "first_pre_activation")
    return model


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(100 * step + rank))


def _run(rank: int, world: int, runtime: str) -> dict[str, Any]:
    import torch.distributed as dist

    from scheduler.torch_versions import DIST_ALL_GATHER

    out: dict[str, Any] = {}
    model = _model(runtime, world, register=False)
    try:
        model.encode(_tokens(0, rank))
        out["unregistered"] = "ran"
    except Exception as e:  # noqa: BLE001 (which error is the runtime's business; that it fails is the point)
        out["unregistered"] = type(e).__name__
    model = _model(runtime, world, register=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses, gathers, issued = [], [], [0]
    gather = getattr(dist, DIST_ALL_GATHER)

    def counted(*args: Any, **kwargs: Any) -> Any:  # both runtimes look it up at each call
        issued[0] += 1
        return gather(*args, **kwargs)

    setattr(dist, DIST_ALL_GATHER, counted)
    try:
        for step in range(STEPS):
            before = issued[0]
            loss = model.encode(_tokens(step, rank)).square().mean()
            loss.backward()
            gathers.append(issued[0] - before)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        out["generated"] = model.generate(_tokens(9, rank), 3)
        before = issued[0]  # a second call (the first also agrees its forward order across the ranks)
        model.generate(_tokens(9, rank), 3)
        out["generate_gathers"] = issued[0] - before
    finally:
        setattr(dist, DIST_ALL_GATHER, gather)
    out.update(run_of(losses, model), gathers=gathers)
    out["sharded_after"] = all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    cast = _model(runtime, world, register=True, mp=mp)
    out["output_dtype"] = cast.encode(_tokens(0, rank)).dtype
    # a block's method inside the root's: cast as fully_shard casts a block's forward output
    out["block_output_dtype"] = cast.first_pre_activation(_tokens(0, rank))
    return out


def _rank(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {runtime: _run(rank, world, runtime) for runtime in ("overlap", "fsdp2")}


def test_a_registered_method_runs_as_forward_does_bitwise_fsdp2(distributed) -> None:
    """Fails if the method runs without the hooks (it raises, as unregistered), if its backward is
    not reduced (the parameters drift from FSDP2's), if a forward inside it re-enters the hooks
    (generate's forwards would restart the step and gather again), or if its output skips the cast."""
    for rank, res in enumerate(distributed(_rank, 2)):
        ours, fsdp2 = res["overlap"], res["fsdp2"]
        assert ours["unregistered"] != "ran" and fsdp2["unregistered"] != "ran", rank
        assert_same_run(fsdp2, ours, rank)
        # from step 2 on (the first also agrees the forward order across the ranks: one all-gather more)
        assert all(a <= b for a, b in zip(ours["gathers"][1:], fsdp2["gathers"][1:])), (ours["gathers"], fsdp2["gathers"])
        for got, want in zip(ours["generated"], fsdp2["generated"]):
            assert torch.equal(got, want), rank
        assert ours["sharded_after"] and fsdp2["sharded_after"], rank
        assert ours["output_dtype"] == fsdp2["output_dtype"] == torch.float32, rank  # computed in bf16
        assert ours["block_output_dtype"] == fsdp2["block_output_dtype"] == torch.float32, rank
        assert ours["generate_gathers"] <= fsdp2["generate_gathers"], (ours["generate_gathers"], fsdp2["generate_gathers"])


def test_registration_is_a_no_op_on_a_plain_module_and_names_a_missing_method(single_rank_group) -> None:
    plain = Encoder()
    encode = plain.encode
    overlap.register_fsdp_forward_method(plain, "encode")
    assert plain.encode == encode  # unchanged: a bound method equal to the original
    sharded = overlap.fully_shard(Encoder(), mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(ValueError, match="method_name must name a method of ShardedEncoder, got 'decode'"):
        overlap.register_fsdp_forward_method(sharded, "decode")
