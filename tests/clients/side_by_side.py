"""Rank-side half of the real-client tests: shard a client model with ``overlap.shard`` or torch's
FSDP2 ``fully_shard`` (blocks, then the root, the way a training script does), train it, gather
what it holds, and record named checks.

Everything here runs inside ``overlap.testing.run_distributed`` rank functions (gloo, one intra-op
thread per rank), except :func:`outcome`, which the test process uses to read the results.

[Note: recorded checks] A rank function runs many checks, for both runtimes, in one process (a rank
start-up costs more than a tiny model's whole check). Each check runs through :meth:`Checks.run`:
its exception is recorded with its traceback instead of ending the rank, so an overlap-side failure
does not hide the FSDP2 side or the next check. Every check builds fresh models, and both ranks run
the same code, so a failure leaves the ranks at the same point of their collective sequences.
:func:`outcome` turns a recorded failure into a test failure that shows the rank's traceback.
"""
from __future__ import annotations

import datetime
import time
import traceback
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from client_zoo import CLIENTS, CLIP_NORM, Client
from models import SEED, global_mean, local_batch, make_optimizer

__all__ = [
    "OTHER_SEED", "RUNTIMES", "Checks", "Env", "build", "build_sharded", "describe", "full_parameters", "full_tensor",
    "gather_state", "local", "max_abs_diff", "outcome", "per_runtime", "replace_module", "scalar", "shard",
    "shard_info", "train",
]

RUNTIMES = ("fsdp2", "overlap")
OTHER_SEED = SEED + 1  # a model that must be overwritten by a load starts from other weights


class Checks:
    """Named check results of one rank: ``values`` (what each check returned) and ``errors``
    (tracebacks). See [Note: recorded checks].

    After each check the ranks compare outcomes on a side process group (``Env.control``). If they
    differ (one rank failed, another did not), or a check timed out, the ranks may no longer issue
    the same collectives, so every later check is recorded as not run instead of hanging.
    """

    def __init__(self, env: "Env") -> None:
        self.env = env
        self.values: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.out_of_step: Optional[str] = None
        self.seconds: dict[str, float] = {}

    def run(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.out_of_step is not None:
            self.errors[name] = f"not run: {self.out_of_step}"
            return None
        start = time.perf_counter()
        try:
            # A copy: results are pickled when the rank function returns, after later checks ran
            # (a full optimizer state dict's ``step`` is the live tensor, for one).
            self.values[name] = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), fn(*args, **kwargs))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 -- recorded, re-raised by outcome(); DCP's CheckpointException
            self.errors[name] = traceback.format_exc()  # is a BaseException
        self.seconds[name] = time.perf_counter() - start
        failed = name in self.errors
        statuses: list[Any] = [None] * self.env.world
        try:
            dist.all_gather_object(statuses, failed, group=self.env.control)
        except Exception as e:  # noqa: BLE001
            statuses = [f"compare failed: {e}"]
        if len(set(statuses)) > 1 or (failed and "timed out" in self.errors[name].lower()):
            self.out_of_step = f"ranks out of step after check {name!r} (failed on ranks: {statuses})"
        return self.values.get(name)

    def needs(self, *names: str) -> list[Any]:
        """The values of earlier checks this one builds on; raises if one of them failed."""
        missing = [n for n in names if n not in self.values]
        if missing:
            raise RuntimeError(f"not run: it builds on {missing}, which failed")
        return [self.values[n] for n in names]

    def result(self) -> dict[str, Any]:
        return {"values": self.values, "errors": self.errors, "seconds": self.seconds}


def per_runtime(rank: int, world: int, client_name: str, name: str,
                check: Callable[[str, Client, "Env"], Any]) -> dict[str, Any]:
    """A rank function's body: ``check(runtime, client, env)`` for each runtime, recorded as
    ``"<runtime>/<name>"``; returns :meth:`Checks.result`."""
    env = Env(rank, world)
    checks = Checks(env)
    for runtime in RUNTIMES:
        checks.run(f"{runtime}/{name}", check, runtime, CLIENTS[client_name], env)
    return checks.result()


def outcome(results: list[dict[str, Any]], name: str) -> list[Any]:
    """Test-process side: every rank's value of check ``name``; fails the test with the rank's
    traceback if the check raised on any rank."""
    for rank, res in enumerate(results):
        if name in res["errors"]:
            pytest.fail(f"check {name!r} raised on rank {rank}:\n{res['errors'][name]}", pytrace=False)
    return [res["values"][name] for res in results]


class Env:
    """A rank's set-up: one intra-op thread (see ``models.single_threaded``), the 1-D mesh, and a
    side gloo group for :class:`Checks` to compare outcomes on."""

    def __init__(self, rank: int, world: int, control_timeout_s: float = 30.0) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        self.mesh = init_device_mesh("cpu", (world,))
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s))

    def local(self, client: Client, step: int) -> torch.Tensor:
        """This rank's slice of the global batch of ``step``."""
        return local_batch(client.batch(step), self.rank, self.world)

    def global_loss(self, client: Client, model: nn.Module, step: int) -> float:
        return global_mean(client.loss(model, self.local(client, step)))

    def rank0(self, value: Any) -> Any:
        """``value`` on rank 0, None elsewhere (results travel back by pickle: send one copy)."""
        return value if self.rank == 0 else None


def build(client: Client, seed: int = SEED) -> nn.Module:
    torch.manual_seed(seed)
    return client.build()


def shard(runtime: str, model: nn.Module, blocks: list[nn.Module], env: Env,
          mp: Optional[tuple[torch.dtype, torch.dtype]] = None) -> nn.Module:
    """Shard ``blocks``, then ``model``, with ``runtime``; ``mp`` = (param_dtype, reduce_dtype)."""
    if runtime == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(*mp) if mp else MixedPrecisionPolicy()
        for block in blocks:
            fully_shard(block, mesh=env.mesh, mp_policy=policy)
        fully_shard(model, mesh=env.mesh, mp_policy=policy)
    elif runtime == "overlap":
        import overlap

        precision = overlap.MixedPrecision(param_dtype=mp[0], reduce_dtype=mp[1]) if mp else None
        for block in blocks:
            overlap.shard(block, mesh=env.mesh, mp=precision)
        overlap.shard(model, mesh=env.mesh, mp=precision)
    else:
        raise ValueError(f"unknown runtime {runtime!r}")
    return model


def build_sharded(runtime: str, client: Client, env: Env, seed: int = SEED,
                  mp: Optional[tuple[torch.dtype, torch.dtype]] = None) -> nn.Module:
    """The client model from ``seed``, its blocks then the root sharded with ``runtime``."""
    model = build(client, seed)
    return shard(runtime, model, client.blocks(model), env, mp)


def replace_module(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` where ``old`` is registered under ``root``."""
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return
    raise ValueError("module not found under root")


def scalar(t: torch.Tensor) -> float:
    """A 0-dim result as a float (``clip_grad_norm_`` returns a replicated DTensor under FSDP2)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).item()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a DTensor's local tensor; a plain tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def describe(t: torch.Tensor) -> dict[str, Any]:
    """Type, placements, local and global shape of a (possibly sharded) tensor."""
    return {"type": type(t).__name__, "placements": str(getattr(t, "placements", None)),
            "local": tuple(local(t).shape), "global": tuple(t.shape)}


def shard_info(model: nn.Module) -> dict[str, dict[str, Any]]:
    """:func:`describe` of every parameter, by name."""
    return {n: describe(p) for n, p in model.named_parameters()}


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The full (unsharded) value of a sharded parameter, gradient or optimizer state, on every rank.

    A DTensor is gathered by DTensor. A plain tensor of 1 dim or more is taken to be this rank's
    dim-0 shard (the chunk rule) and gathered by concatenation: that is overlap's representation
    before its shards became DTensors, so numerics checks stay meaningful either way. 0-dim
    tensors (AdamW's ``step``) are replicated and returned as they are.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    if t.dim() == 0 or dist.get_world_size() == 1:
        return t.detach().clone()
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, t.detach().cpu())
    return torch.cat(pieces)


def full_parameters(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full parameters (or gradients) by name; a collective: every rank calls it."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        out[name] = full_tensor(t if t is not None else torch.zeros_like(p))
    return out


def max_abs_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``max |got - want|`` per key (0.0 when bitwise equal); a missing key or another shape or
    dtype is named instead of a number."""
    out: dict[str, Any] = {}
    for k in sorted(set(got) | set(want)):
        if k not in got or k not in want:
            out[k] = "missing" if k not in got else "unexpected"
        elif got[k].shape != want[k].shape or got[k].dtype != want[k].dtype:
            out[k] = f"{got[k].dtype}{list(got[k].shape)} vs {want[k].dtype}{list(want[k].shape)}"
        elif torch.equal(got[k], want[k]):
            out[k] = 0.0
        else:
            out[k] = (got[k].double() - want[k].double()).abs().max().item()
    return out


def gather_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state (``{param name: {key: tensor}}``) with every tensor made full."""
    return {name: {k: full_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in per.items()}
            for name, per in state.items()}


def train(model: nn.Module, client: Client, env: Env, steps: int, start: int = 0,
          opt: Optional[torch.optim.Optimizer] = None) -> tuple[torch.optim.Optimizer, list[float], list[float]]:
    """AdamW steps ``start .. start + steps - 1`` on this rank's slices, gradients clipped to
    ``CLIP_NORM`` by ``torch.nn.utils.clip_grad_norm_``. Returns the optimizer, the global loss and
    the total norm ``clip_grad_norm_`` returned on this rank, per step. The last step's (clipped)
    gradients stay in ``.grad``."""
    opt = opt if opt is not None else make_optimizer(model.parameters())
    losses, norms = [], []
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        loss = client.loss(model, env.local(client, step))
        loss.backward()
        norms.append(scalar(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)))
        opt.step()
        losses.append(global_mean(loss))
    return opt, losses, norms

