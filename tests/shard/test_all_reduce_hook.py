"""``set_all_reduce_hook`` (FSDP2's): a hook called with each reduction's output before the sharded
gradients are set, for one more reduction the runtime does not know of ([Note: the all-reduce
hook] in ``overlap/param_group.py``).

The user's case is a replica tier of their own: a 1-D mesh over the shard dimension of a ``(2, 2)``
world, and a hook that all-reduces over the other dimension. On 4 gloo ranks, side by side with
FSDP2 running the same hook, and against the runtime's own HSDP on the ``(2, 2)`` mesh (the same
sums in the same order: the divisions by 2 are exact, so bitwise):

- the hook averaging (a sum over the replicas, then ``/ 2``): what it sees is the average over the
  shard group, as FSDP2's;
- ``set_force_sum_reduction_for_comms(True)`` with ``set_gradient_divide_factor(4.0)`` and a hook
  that only sums: it sees the sum, divided after it, as FSDP2's;
- a hook on native HSDP (it runs after the all-reduce over the replicas), scaling by 0.5, FSDP2
  side by side;
- how many times each runs: once per group per backward that reduces, never in a ``no_sync``
  micro-batch.

On 2 ranks with the Triton kernels (interpreted): a hook that changes nothing leaves training
bitwise what it is without a hook, in fp32 and with bf16 reductions, with a divide factor of 3 (the
in-place division before the hook gives the copy-out's quotients). A hook that raises: its error
reaches ``backward()``'s caller, and after ``reset_iter_state()`` training is bitwise a run whose hook
never raised. At one rank (this process): FSDP2's concatenated gradients, divided by a set factor
first. Bad input, in this process.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import overlap
from overlap.sharding import sharded_states
from models import SEED, TinyLM, local_batch, make_batch, make_optimizer, train_ranks

STEPS = 2


class _Recorder:
    """A hook: records the dtype and dimensionality of what it gets, and its largest magnitude (what
    a layout's padding cannot change: the runtimes pack differently), then runs ``then`` on it."""

    def __init__(self, then: Callable[[torch.Tensor], None]) -> None:
        self.then = then
        self.calls: list[tuple[torch.dtype, int]] = []
        self.maxima: list[float] = []
        self.backward_done = [False]  # set by _train once backward has reached the embeddings
        self.when: list[bool] = []  # per call: had it?

    def __call__(self, output: torch.Tensor) -> None:
        self.calls.append((output.dtype, output.dim()))
        self.maxima.append(output.abs().max().item())
        self.when.append(self.backward_done[0])
        self.then(output)


def _sum_over(group: Any, then_divide: Optional[float] = None) -> Callable[[torch.Tensor], None]:
    def reduce(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=group)
        if then_divide is not None:
            output.div_(then_divide)
    return reduce


def _model(runtime: str, mesh: Any, hook: Optional[Callable[[torch.Tensor], None]] = None,
           force_sum_factor: Optional[float] = None, mp: Any = None) -> TinyLM:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(SEED)
    model = TinyLM()
    fully_shard = overlap.fully_shard if runtime == "overlap" else torch.distributed.fsdp.fully_shard
    policy = mp or MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for module in (*model.blocks, model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
        if hook is not None:
            module.set_all_reduce_hook(hook)
        if force_sum_factor is not None:
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(force_sum_factor)
    return model


def _train(model: TinyLM, rank: int, world: int, hook: Optional[_Recorder] = None) -> dict[str, Any]:
    """A ``no_sync`` micro-batch then a synced one per step, AdamW; the hook's calls per backward."""
    opt = make_optimizer(model.parameters())
    losses, calls = [], []
    if hook is not None:  # backward's last compute: the token embedding's output gradient
        done = hook.backward_done

        def mark(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            output.register_hook(lambda grad: done.__setitem__(0, True))

        model.tok.register_forward_hook(mark)
    for step in range(STEPS):
        for micro, sync in enumerate((False, True)):
            model.set_requires_gradient_sync(sync)
            if hook is not None:
                hook.backward_done[0] = False
            before = len(hook.calls) if hook is not None else 0
            loss = model.loss(local_batch(make_batch(2 * step + micro), rank, world))
            loss.backward()
            losses.append(loss.detach())
            calls.append((len(hook.calls) if hook is not None else 0) - before)
        opt.step()
        opt.zero_grad()
    return {"losses": torch.stack(losses), "calls": calls,
            "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
            "seen": sorted(set(hook.calls)) if hook is not None else [],
            "maxima": hook.maxima if hook is not None else [],
            "at_end_of_backward": hook.when if hook is not None else []}


def _custom_replica_tier(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard_mesh, replicas = mesh["shard"], mesh.get_group("replicate")
    out: dict[str, Any] = {"native": _train(_model("overlap", mesh), rank, world)}
    for runtime in ("overlap", "fsdp2"):
        hook = _Recorder(_sum_over(replicas, then_divide=2.0))
        out[f"average/{runtime}"] = _train(_model(runtime, shard_mesh, hook), rank, world, hook)
        hook = _Recorder(_sum_over(replicas))
        out[f"force_sum/{runtime}"] = _train(_model(runtime, shard_mesh, hook, force_sum_factor=4.0), rank, world, hook)
        hook = _Recorder(lambda output: output.mul_(0.5))
        out[f"hsdp/{runtime}"] = _train(_model(runtime, mesh, hook), rank, world, hook)
    out["groups"] = len(sharded_states(_model("overlap", shard_mesh)))
    return out


@pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)
def test_a_hook_over_the_replicas_matches_fsdp2_and_native_hsdp(distributed) -> None:
    """Fails if the hook sees the sum where it should see the average or the other way round under
    force-sum (the gradients come out alike, the division and the hook's sum commuting: what the
    hook saw does not), if it never runs or runs in a ``no_sync`` micro-batch, with HSDP if it runs
    before the all-reduce over the replicas, or if it runs before the end of backward (where a poll
    found a reduction done: a point that depends on timing, where its collective can deadlock)."""
    for rank, res in enumerate(distributed(_custom_replica_tier, 4)):
        groups = res["groups"]
        for case in ("average", "force_sum", "hsdp"):
            ours, theirs = res[f"{case}/overlap"], res[f"{case}/fsdp2"]
            assert ours["calls"] == theirs["calls"] == [0, groups] * STEPS, (rank, case, ours["calls"])
            assert ours["seen"] == theirs["seen"] == [(torch.float32, 1)], (rank, case)
            assert ours["maxima"] == theirs["maxima"], (rank, case)  # what the hook saw: same values
            # it communicates: on CPU it runs at the end of backward, a fixed point on every rank
            assert all(ours["at_end_of_backward"]), (rank, case, ours["at_end_of_backward"])
            assert torch.equal(ours["losses"], theirs["losses"]), (rank, case)
            for name, value in ours["params"].items():
                assert torch.equal(value, theirs["params"][name]), (rank, case, name)
        for case in ("average", "force_sum"):  # the user's replica tier is the native one, bitwise
            assert torch.equal(res[f"{case}/overlap"]["losses"], res["native"]["losses"]), (rank, case)
            for name, value in res["native"]["params"].items():
                assert torch.equal(res[f"{case}/overlap"]["params"][name], value), (rank, case, name)
        # the hsdp hook halves every gradient: AdamW's update barely changes, the run does
        assert not torch.equal(res["hsdp/overlap"]["params"]["tok.weight"], res["native"]["params"]["tok.weight"])


def _identity_hook_run(rank: int, world: int, reduce_dtype: torch.dtype, hooked: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(SEED)
    model = TinyLM(layers=1)
    hook = _Recorder(lambda output: None)
    for module in (model.blocks[0], model):
        overlap.fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
        module.set_gradient_divide_factor(3.0)
        if hooked:
            module.set_all_reduce_hook(hook)
    model.loss(local_batch(make_batch(0), rank, world)).backward()
    return {"grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()}, "seen": sorted(set(hook.calls))}


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_hook_that_changes_nothing_changes_nothing(distributed, reduce_dtype: torch.dtype) -> None:
    """The division moved before the hook (torch's, in place) gives the Triton copy-out's quotients
    (``div_rn``, rounded to the reduce dtype) bitwise. Fails if it divides twice or not at all."""
    plain = distributed(_identity_hook_run, 2, reduce_dtype, False)
    hooked = distributed(_identity_hook_run, 2, reduce_dtype, True)
    for rank, (a, b) in enumerate(zip(plain, hooked)):
        assert b["seen"] == [(reduce_dtype, 1)], rank
        for name, grad in a["grads"].items():
            assert torch.equal(grad, b["grads"][name]), (rank, name)


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


@pytest.fixture
def one_rank_mesh(single_rank_group) -> Any:
    return init_device_mesh("cpu", (1,))


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-params"])
def test_one_rank_hands_the_concatenated_gradients_to_the_hook_as_fsdp2(one_rank_mesh, param_dtype) -> None:
    """World size 1: nothing is reduced, yet the hook gets every gradient of the group concatenated
    (the reduce dtype), divided by the factor first, as FSDP2's; what it does to them reaches the
    sharded gradients, which accumulate across backwards. Fails if the hook is skipped at one rank
    or the factor is applied after it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    got = {}
    for runtime, shard in (("overlap", overlap.fully_shard), ("fsdp2", fully_shard)):
        torch.manual_seed(SEED)
        model = _TwoLayers()
        # adds the buffer's length: whole buffers (not one per parameter), and not linear (the
        # factor before or after it differs)
        hook = _Recorder(lambda output: output.add_(output.numel() / 64))
        shard(model.first, mesh=one_rank_mesh, mp_policy=policy)
        shard(model, mesh=one_rank_mesh, mp_policy=policy)
        for module in (model.first, model):
            module.set_gradient_divide_factor(3.0)
            module.set_all_reduce_hook(hook)
        for step in range(2):
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        got[runtime] = ({n: p.grad.to_local().clone() for n, p in model.named_parameters()}, hook.calls, hook.maxima)
    (ours, our_calls, our_maxima), (theirs, their_calls, their_maxima) = got["overlap"], got["fsdp2"]
    assert our_calls == their_calls == [(torch.float32, 1)] * 4
    assert sorted(our_maxima) == sorted(their_maxima)  # FSDP2 reduces the root's group last, at one rank
    for name, grad in ours.items():
        assert torch.equal(grad, theirs[name]), name


def test_bad_input_raises_before_anything_changes(one_rank_mesh) -> None:
    model = overlap.fully_shard(nn.Linear(4, 4), mesh=one_rank_mesh)
    group = model._overlap_state.group
    with pytest.raises(ValueError, match="hook must be callable"):
        model.set_all_reduce_hook("not a function")
    with pytest.raises(ValueError, match="stream must be a torch.cuda.Stream"):
        model.set_all_reduce_hook(print, stream="side")
    assert group.all_reduce_hook is None and group.all_reduce_hook_stream is None


def _refused(rank: int, world: int) -> dict[str, str]:
    """What a stream with HSDP and a hook on compressed reductions raise, and whether a hook was set."""
    out = {}
    hsdp = overlap.fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("r", "s")))
    compressed = overlap.shard(nn.Linear(4, 4), compress=overlap.Compression())
    for case, model, stream in (("hsdp", hsdp, torch.Stream(device="cpu")), ("compressed", compressed, None)):
        try:
            model.set_all_reduce_hook(print, stream=stream)
            out[case] = "no error"
        except (ValueError, NotImplementedError) as error:
            out[case] = f"{type(error).__name__}: {error}"
        if model._overlap_state.group.all_reduce_hook is not None:
            out[case] += " (set anyway)"
    return out


def test_a_stream_with_hsdp_and_compressed_reductions_raise(distributed) -> None:
    """FSDP2 refuses a stream with HSDP (the hook runs on the replica all-reduce's stream); a
    compressed reduction has no reduced tensor to hand over (its copy-out kernel sums and averages)."""
    for got in distributed(_refused, 2):
        assert got["hsdp"].startswith("ValueError") and "stream cannot be set with HSDP" in got["hsdp"]
        assert got["compressed"].startswith("NotImplementedError") and "compressed reductions" in got["compressed"]


def _raising_hook(rank: int, world: int, raises: bool) -> dict[str, Any]:
    """blocks[1]'s hook raises in the first backward (on every rank); ``reset_iter_state()``, then two
    steps: their losses and parameters."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = TinyLM()
    for module in (*model.blocks, model):
        overlap.fully_shard(module)
    armed = [raises]

    def hook(output: torch.Tensor) -> None:
        if armed[0]:
            raise ValueError("the user's hook failed")

    model.blocks[1].set_all_reduce_hook(hook)
    out: dict[str, Any] = {"error": None}
    try:
        model.loss(local_batch(make_batch(0), rank, world)).backward()
    except ValueError as error:
        out["error"] = str(error)
    model.reset_iter_state()
    model.zero_grad(set_to_none=True)  # what reductions completed before the error set
    armed[0] = False
    out.update(losses=train_ranks(model, rank, world, 2),
               params={n: p.to_local().detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.torch_kernels  # training loops: packing by the torch fallback (conftest)
def test_a_hook_that_raises_reaches_the_caller_and_the_next_steps_are_clean(distributed) -> None:
    """The hook's error comes out of ``backward()`` on every rank (each rank's hook raised), and after
    ``reset_iter_state()`` training goes on bitwise as a run whose hook never raised (no reduction of
    the failed backward left behind)."""
    failed, clean = distributed(_raising_hook, 2, True), distributed(_raising_hook, 2, False)
    for rank, (a, b) in enumerate(zip(failed, clean)):
        assert a["error"] == "the user's hook failed" and b["error"] is None, (rank, a["error"])
        assert a["losses"] == b["losses"], rank
        for name, value in a["params"].items():
            assert torch.equal(value, b["params"][name]), (rank, name)
