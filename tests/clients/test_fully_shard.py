"""``overlap.fully_shard`` (issue 32): FSDP2's signature and ``FSDPModule`` methods, run with only the
import swapped, side by side with torch's FSDP2 from the same weights on the same batches.

One 2-rank call (``_rank_checks``) runs every check for both runtimes (see [Note: recorded checks] in
``side_by_side.py``); a second one (``_rank_hf``) the HF ``save_pretrained`` / ``from_pretrained``
round trip. Bad input is checked in this process, without ranks.

===============================================  ====================================================
test                                             checks
===============================================  ====================================================
test_apply_fsdp_matches_fsdp2                    torchtitan's ``apply_fsdp`` calls (below), fp32 and
                                                 bf16 ``MixedPrecisionPolicy``: losses, clip norms,
                                                 parameters after 3 AdamW steps bitwise FSDP2's
test_gradient_accumulation_matches_fsdp2         ``set_requires_gradient_sync(False)`` +
                                                 ``set_reshard_after_backward(False)`` micro-batches,
                                                 then True, ``set_is_last_backward``: what is
                                                 registered after each micro-batch, parameters: bitwise
test_manual_prefetch_matches_fsdp2               ``set_modules_to_forward/backward_prefetch``,
                                                 ``model.unshard()``, ``unshard(async_op=True)`` then
                                                 ``wait()``: bitwise; the prefetch list is followed
test_ignored_params_match_fsdp2                  ``ignored_params``: left plain, gradients not reduced
test_gradient_divide_factor_matches_fsdp2        ``set_gradient_divide_factor``: 1.0 (sum) on every
                                                 module, 3.0 on one block (no power of two: the
                                                 division is torch's, not times 1/3); losses, grads,
                                                 parameters bitwise
test_an_embedding_left_sharded_in_backward_...   ``tok_embeddings.set_unshard_in_backward(False)``:
                                                 one all-gather less per step than without it, as
                                                 in FSDP2; losses and parameters bitwise FSDP2's
                                                 and the same as without it
test_unsupported_methods_raise                   every FSDPModule method without a counterpart;
                                                 how each reshard_after_forward value (None, bools,
                                                 ints) resolves, the int on a 2-D mesh's shard dim;
                                                 ``set_requires_all_reduce(False)`` on HSDP with a
                                                 compressed replica tier
test_three_ranks_are_bitwise_fsdp2               3 ranks (the sum order and the division matter),
                                                 fp32 and bf16 reductions: gradients and parameters
                                                 bitwise, 3 AdamW steps
test_reshard_to_a_smaller_group_raises           an int reshard_after_forward we cannot honour
                                                 (other bad input: test_bad_input_matrix.py)
test_not_torchs_fsdp_module                      the documented isinstance choice
test_a_blocks_mp_policy_reaches_its_inputs_...   a block's output_dtype and cast_forward_inputs=False,
                                                 as FSDP2 (1 rank, in this process)
test_shard_placement_fn_is_asked_only_...        not about ignored_params, as FSDP2 (1 rank)
test_hf_save_pretrained_round_trip               rank 0 writes ``save_pretrained(state_dict=
                                                 overlap.full_state_dict(model))``; from_pretrained
                                                 gives the sharded model's logits, bitwise
===============================================  ====================================================

Tolerances: none. Every comparison is bitwise: both runtimes run the same kernels on the same
shards and average over the ranks the same way (``test_clients.py`` [Note: client tolerances]), and
the HF logits come from the same weights in the same order of operations.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
from torch import nn

from client_zoo import CLIENTS, Client
from models import make_optimizer
from side_by_side import RUNTIMES, Checks, Env, build, full_parameters, max_abs_diff, outcome, train

pytestmark = pytest.mark.torch_kernels  # see test_clients.py [Note: packing at the client level]

TIMEOUT_S = 240
PG_TIMEOUT_S = 30
STEPS = 3
MICRO_BATCHES = 2


def fully_shard_of(runtime: str) -> Callable[..., Any]:
    """The ``fully_shard`` a training script imports: torch's, or overlap's (the one-line swap)."""
    if runtime == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from overlap import fully_shard
    return fully_shard


def apply_fsdp(fully_shard: Callable[..., Any], model: nn.Module, dp_mesh: Any, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, pp_enabled: bool = False,
               reshard_after_forward_policy: str = "default") -> None:
    """The ``fully_shard`` calls torchtitan 0.3's ``apply_fsdp`` makes on a Llama 3 (written here):
    the embedding and each block with the policy's ``reshard_after_forward``, ``[norm, output]`` as
    one group kept unsharded after forward unless the policy is "always", then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    config = {"mesh": dp_mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    reshard = {"always": True, "never": False, "default": not pp_enabled}[reshard_after_forward_policy]
    fully_shard(model.tok_embeddings, **config, reshard_after_forward=reshard)
    for block in model.layers.values():
        fully_shard(block, **config, reshard_after_forward=reshard)
    fully_shard([model.norm, model.output], **config, reshard_after_forward=reshard_after_forward_policy == "always")
    fully_shard(model, **config)


def _titan(runtime: str, client: Client, env: Env, dtype: torch.dtype) -> dict[str, Any]:
    model = build(client)
    apply_fsdp(fully_shard_of(runtime), model, env.mesh, dtype, torch.float32)
    _, losses, norms = train(model, client, env, STEPS)
    return {"losses": losses, "norms": norms, "params": full_parameters(model)}


def _accumulation(runtime: str, client: Client, env: Env, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Two optimizer steps of MICRO_BATCHES micro-batches each, FSDP2's accumulation pattern;
    ``dtype``: the parameters' compute dtype (bf16: the micro-batches accumulate in the float32
    reduce dtype, [Note: accumulating in the reduce dtype])."""
    model = build(client)
    apply_fsdp(fully_shard_of(runtime), model, env.mesh, dtype, torch.float32)
    opt = make_optimizer(model.parameters())
    grads_present = []
    for step in range(2):
        for micro in range(MICRO_BATCHES):
            last = micro == MICRO_BATCHES - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            model.set_is_last_backward(last)
            client.loss(model, env.local(client, 2 * step + micro)).backward()
            grads_present.append([(p.grad is not None, type(p).__name__) for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"grads_present": grads_present, "params": full_parameters(model)}


def _manual_accumulation(runtime: str, client: Client, env: Env) -> dict[str, Any]:
    """The accumulation above under torch 2.15's manual backward finalization: every micro-batch
    under ``no_sync`` keeping the unsharded parameters, then sync and resharding on again and
    ``finalize_backward()``, which reduces the accumulated sum once."""
    model = build(client)
    apply_fsdp(fully_shard_of(runtime), model, env.mesh, torch.float32, torch.float32)
    model.set_manual_backward_finalization(True)
    opt = make_optimizer(model.parameters())
    for step in range(2):
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        for micro in range(MICRO_BATCHES):
            client.loss(model, env.local(client, 2 * step + micro)).backward()
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        model.finalize_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": full_parameters(model)}


def _manual_prefetch(runtime: str, client: Client, env: Env) -> dict[str, Any]:
    """FSDP2's explicit-prefetch recipe: each module prefetches the next two in forward and the
    previous two in backward, the root is unsharded before forward, and one block is gathered by
    hand (``unshard(async_op=True)``, ``wait()``) before the step."""
    model = build(client)
    apply_fsdp(fully_shard_of(runtime), model, env.mesh, torch.float32, torch.float32)
    order = [model.tok_embeddings, *model.layers.values(), model.norm]
    for i, module in enumerate(order):
        module.set_modules_to_forward_prefetch(order[i + 1 : i + 3])
        module.set_modules_to_backward_prefetch(order[max(0, i - 2) : i][::-1])
    in_flight: list[bool] = []
    if runtime == "overlap":  # runs after the runtime's own pre-forward hook: what it prefetched
        last_block = list(model.layers.values())[-1]
        model.tok_embeddings.register_forward_pre_hook(lambda *_: in_flight.append(
            last_block._overlap_state.group.pending_gather is not None))
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        model.unshard()
        handle = model.layers["0"].unshard(async_op=True)
        handle.wait()
        loss = client.loss(model, env.local(client, step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": full_parameters(model), "in_flight": in_flight,
            "handle": type(handle).__name__}


def _ignored(runtime: str, client: Client, env: Env) -> dict[str, Any]:
    model = build(client)
    fully_shard = fully_shard_of(runtime)
    for block in model.layers.values():
        fully_shard(block, mesh=env.mesh)
    fully_shard(model, mesh=env.mesh, ignored_params={model.norm.weight})
    client.loss(model, env.local(client, 0)).backward()
    return {"type": type(model.norm.weight).__name__, "norm_grad": model.norm.weight.grad.clone(),
            "grads": full_parameters(model, grads=True)}


def _divide_factor(runtime: str, client: Client, env: Env) -> dict[str, Any]:
    """A loss summed over the global batch's tokens divided by nothing (factor 1.0 on every sharded
    module, torchtitan's recipe for a loss normalised by the global token count), one block divided
    by 3 instead. FSDP2 on gloo divides by a factor only with sum-only collectives (gloo has no
    ``PREMUL_SUM``), so both runs set ``set_force_sum_reduction_for_comms(True)``; and
    ``set_requires_all_reduce(False)``, as a client's sum-reduction policy does on every module."""
    averaged = build(client)  # the default, for the first step's gradients
    apply_fsdp(fully_shard_of(runtime), averaged, env.mesh, torch.float32, torch.float32)
    client.loss(averaged, env.local(client, 0)).backward()
    model = build(client)
    apply_fsdp(fully_shard_of(runtime), model, env.mesh, torch.float32, torch.float32)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(3.0 if module is model.layers["0"] else 1.0)
            module.set_requires_all_reduce(False)  # a 1-D mesh has no replica all-reduce: no effect
    opt = make_optimizer(model.parameters())
    losses, grads = [], []
    for step in range(STEPS):
        loss = client.loss(model, env.local(client, step))
        loss.backward()
        grads.append(full_parameters(model, grads=True))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": full_parameters(model),
            "averaged": full_parameters(averaged, grads=True)}


def _embedding_left_sharded(runtime: str, client: Client, env: Env) -> dict[str, Any]:
    """torchtitan's sharding with ``tok_embeddings.set_unshard_in_backward(False)`` (an embedding's
    backward reads the indices, not the weight), beside the same loop without it: the all-gathers
    each step issues, and the trained state."""
    import torch.distributed as dist

    from scheduler.torch_versions import DIST_ALL_GATHER

    issued = [0]
    gather = getattr(dist, DIST_ALL_GATHER)

    def counted(*args: Any, **kwargs: Any) -> Any:  # both runtimes look it up at each call
        issued[0] += 1
        return gather(*args, **kwargs)

    out: dict[str, Any] = {}
    setattr(dist, DIST_ALL_GATHER, counted)
    try:
        for unshard_in_backward in (True, False):
            model = build(client)
            apply_fsdp(fully_shard_of(runtime), model, env.mesh, torch.float32, torch.float32)
            model.tok_embeddings.set_unshard_in_backward(unshard_in_backward)
            opt, gathers, losses = make_optimizer(model.parameters()), [], []
            for step in range(STEPS):
                before = issued[0]
                loss = client.loss(model, env.local(client, step))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                gathers.append(issued[0] - before)
                losses.append(loss.item())
            out[str(unshard_in_backward)] = {"gathers": gathers, "losses": losses, "params": full_parameters(model)}
    finally:
        setattr(dist, DIST_ALL_GATHER, gather)
    return out


def _unsupported(runtime: str, client: Client, env: Env) -> dict[str, str]:
    from overlap.fsdp_module import UNSUPPORTED

    model = build(client)
    fully_shard_of(runtime)(model, mesh=env.mesh)
    raised = {}
    for name in UNSUPPORTED:
        try:
            getattr(model, name)(True)
        except NotImplementedError as e:
            raised[name] = str(e)
    shard_int = {}
    # at 2 ranks: 1 keeps the parameters (False), 2 reshards (True), as FSDP2; None (the default) is True
    for value in (None, True, False, 1, 2):
        m = build(client)
        fully_shard_of(runtime)(m, mesh=env.mesh, reshard_after_forward=value)
        shard_int[repr(value)] = m._overlap_state.reshard_after_forward  # repr: True and 1 are one dict key
    # An int counts the ranks of the shard dim: on a 2-D (HSDP) mesh of 2 replicas of 1 shard, 2 is
    # not a divisor of that 1 (FSDP2 refuses it too), although the mesh has 2 ranks.
    from torch.distributed.device_mesh import init_device_mesh

    hsdp = init_device_mesh("cpu", (env.world, 1), mesh_dim_names=("replicate", "shard"))
    hsdp_int = {}
    for name in RUNTIMES:
        try:
            fully_shard_of(name)(build(client), mesh=hsdp, reshard_after_forward=env.world)
            hsdp_int[name] = "accepted"
        except ValueError:
            hsdp_int[name] = "ValueError"
    import overlap

    compressed = fully_shard_of(runtime)(build(client), mesh=hsdp, compress=overlap.Compression(gather=None,
                                                                                                 reduce="int8"))
    try:
        compressed.set_requires_all_reduce(False)
        skip_all_reduce = "accepted"
    except NotImplementedError as e:
        skip_all_reduce = str(e)
    return {"raised": raised, "int": shard_int, "hsdp_int": hsdp_int, "skip_all_reduce": skip_all_reduce,
            "still_all_reduces": [s.group.requires_all_reduce for s in overlap.sharding.sharded_states(compressed)]}


def _rank_checks(rank: int, world: int) -> dict[str, Any]:
    client = CLIENTS["llama3"]
    env = Env(rank, world)
    checks = Checks(env)
    for runtime in RUNTIMES:
        for dtype in (torch.float32, torch.bfloat16):
            checks.run(f"{runtime}/titan/{dtype}", _titan, runtime, client, env, dtype)
        checks.run(f"{runtime}/accumulation", _accumulation, runtime, client, env)
        checks.run(f"{runtime}/accumulation_bf16", _accumulation, runtime, client, env, torch.bfloat16)
        if runtime == "overlap" or hasattr(torch.distributed.fsdp.FSDPModule, "finalize_backward"):  # 2.15
            checks.run(f"{runtime}/manual_accumulation", _manual_accumulation, runtime, client, env)
        checks.run(f"{runtime}/prefetch", _manual_prefetch, runtime, client, env)
        checks.run(f"{runtime}/ignored", _ignored, runtime, client, env)
        checks.run(f"{runtime}/divide_factor", _divide_factor, runtime, client, env)
        checks.run(f"{runtime}/embedding_left_sharded", _embedding_left_sharded, runtime, client, env)
    checks.run("overlap/unsupported", _unsupported, "overlap", client, env)
    return checks.result()


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    from overlap.testing import run_distributed

    return run_distributed(_rank_checks, 2, timeout=TIMEOUT_S, pg_timeout=PG_TIMEOUT_S)


def _side_by_side(runs: list[dict[str, Any]], name: str) -> tuple[list[Any], list[Any]]:
    return outcome(runs, f"fsdp2/{name}"), outcome(runs, f"overlap/{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_apply_fsdp_matches_fsdp2(runs, dtype: torch.dtype) -> None:
    fsdp2, ours = _side_by_side(runs, f"titan/{dtype}")
    for want, got in zip(fsdp2, ours):
        assert got["losses"] == want["losses"]
        assert got["norms"] == want["norms"]
        assert set(max_abs_diff(got["params"], want["params"]).values()) == {0.0}
    assert ours[0]["losses"][-1] < ours[0]["losses"][0]  # it trains


def test_gradient_accumulation_matches_fsdp2(runs) -> None:
    fsdp2, ours = _side_by_side(runs, "accumulation")
    for want, got in zip(fsdp2, ours):
        assert got["grads_present"] == want["grads_present"]
        assert set(max_abs_diff(got["params"], want["params"]).values()) == {0.0}
    # Between micro-batches the unsharded parameters stay registered, holding the accumulated
    # unsharded gradients (FSDP2 and here); after the synced one, the sharded DTensors and theirs.
    assert {t for _, t in ours[0]["grads_present"][0]} == {"Parameter"}
    assert {t for _, t in ours[0]["grads_present"][MICRO_BATCHES - 1]} == {"DTensor"}
    assert all(g for step in ours[0]["grads_present"] for g, _ in step)


def test_gradient_accumulation_in_bf16_matches_fsdp2(runs) -> None:
    """The parameters, bitwise. (Between micro-batches FSDP2 before torch 2.15 keeps the float32
    sum in an accumulator of its own and leaves the unsharded ``.grad`` None; from 2.15 it keeps it
    in ``.grad``, as this runtime does on every version.)"""
    fsdp2, ours = _side_by_side(runs, "accumulation_bf16")
    for want, got in zip(fsdp2, ours):
        assert set(max_abs_diff(got["params"], want["params"]).values()) == {0.0}
    assert all(g for step in ours[0]["grads_present"] for g, _ in step)


def test_manual_finalization_accumulates_as_fsdp2_accumulates(runs) -> None:
    """Bitwise FSDP2's automatic accumulation (and FSDP2's own manual loop where its torch has it):
    the same sum reduced once."""
    automatic = outcome(runs, "fsdp2/accumulation")
    for name in ("overlap/manual_accumulation", "fsdp2/manual_accumulation"):
        if any(name in r["values"] or name in r["errors"] for r in runs):
            for want, got in zip(automatic, outcome(runs, name)):
                assert set(max_abs_diff(got["params"], want["params"]).values()) == {0.0}, name


def test_manual_prefetch_matches_fsdp2(runs) -> None:
    fsdp2, ours = _side_by_side(runs, "prefetch")
    for want, got in zip(fsdp2, ours):
        assert got["losses"] == want["losses"]
        assert set(max_abs_diff(got["params"], want["params"]).values()) == {0.0}
        # The embedding's list names the last block two ahead: its gather is in flight once the
        # embedding's pre-forward ran (the default, prefetch=1, issues only the next block's).
        assert got["in_flight"] == [True] * STEPS
        assert got["handle"] == "UnshardHandle"


def test_ignored_params_match_fsdp2(runs) -> None:
    fsdp2, ours = _side_by_side(runs, "ignored")
    for want, got in zip(fsdp2, ours):
        assert got["type"] == want["type"] == "Parameter"  # not a DTensor
        assert torch.equal(got["norm_grad"], want["norm_grad"])  # this rank's own, not reduced
        assert set(max_abs_diff(got["grads"], want["grads"]).values()) == {0.0}
    assert not torch.equal(ours[0]["norm_grad"], ours[1]["norm_grad"])


def test_gradient_divide_factor_matches_fsdp2(runs) -> None:
    fsdp2, ours = _side_by_side(runs, "divide_factor")
    for want, got in zip(fsdp2, ours):
        assert got["losses"] == want["losses"]
        for got_grads, want_grads in zip(got["grads"], want["grads"]):
            assert set(max_abs_diff(got_grads, want_grads).values()) == {0.0}
        assert set(max_abs_diff(got["params"], want["params"]).values()) == {0.0}
    # the factors took effect (first step, same weights and batch): the sums are twice the 2-rank
    # average (exactly: halving is exact), layer 0's are 2/3 of it (up to the division's rounding)
    first, averaged = ours[0]["grads"][0], ours[0]["averaged"]
    for name, grad in first.items():
        if name.startswith("layers.0."):
            torch.testing.assert_close(grad * 3, averaged[name] * 2, rtol=1e-6, atol=0)
        else:
            assert torch.equal(grad, averaged[name] * 2), name


def test_an_embedding_left_sharded_in_backward_matches_fsdp2(runs) -> None:
    fsdp2, ours = _side_by_side(runs, "embedding_left_sharded")
    for want, got in zip(fsdp2, ours):
        left, usual = got["False"], got["True"]
        assert left["losses"] == want["False"]["losses"]
        assert set(max_abs_diff(left["params"], want["False"]["params"]).values()) == {0.0}
        # the same training as with the embedding gathered in backward, one all-gather less per step,
        # as FSDP2's
        assert left["losses"] == usual["losses"]
        assert set(max_abs_diff(left["params"], usual["params"]).values()) == {0.0}

        assert [a - b for a, b in zip(usual["gathers"], left["gathers"])] == [1] * STEPS
        assert [a - b for a, b in zip(want["True"]["gathers"], want["False"]["gathers"])] == [1] * STEPS


def test_unsupported_methods_raise(runs) -> None:
    from overlap.fsdp_module import UNSUPPORTED

    got = outcome(runs, "overlap/unsupported")[0]
    assert sorted(got["raised"]) == sorted(UNSUPPORTED)
    for name, message in got["raised"].items():
        assert name in message and UNSUPPORTED[name] in message
    assert got["int"] == {"None": True, "True": True, "False": False, "1": False, "2": True}
    assert got["hsdp_int"] == {"fsdp2": "ValueError", "overlap": "ValueError"}
    # a compressed replica tier: refused before anything changes
    assert "set_requires_all_reduce(False)" in got["skip_all_reduce"] and "compress" in got["skip_all_reduce"]
    assert "set_requires_gradient_sync(False)" in got["skip_all_reduce"]
    assert got["still_all_reduces"] and all(got["still_all_reduces"])


def _three_ranks(rank: int, world: int, runtime: str, bf16: bool) -> dict[str, Any]:
    """3 AdamW steps of a stack of Linears sharded layer by layer, on ``world`` ranks (``bf16``: with
    bf16 parameters and reductions); the gradients and parameters after each step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 24), nn.GELU(), nn.Linear(24, 48))
    fully_shard = fully_shard_of(runtime)
    mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)} if bf16 else {}
    for layer in model[::2]:
        fully_shard(layer, **mp)
    fully_shard(model, **mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(1 + rank)
    seen = []
    for _ in range(3):
        x = torch.randn(5, 24) * torch.logspace(-2, 2, 24)  # mixed magnitudes: the sum order shows
        model(x).float().pow(2).mean().backward()
        seen.append(full_parameters(model, grads=True))
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen.append(full_parameters(model))
    return {"seen": seen}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_three_ranks_are_bitwise_fsdp2(bf16: bool) -> None:
    """At 3 ranks the gradients are FSDP2's bit for bit: the sum over the ranks in gloo's
    reduce-scatter order and the average as torch's division, its quotient in the reduce dtype
    ([Note: the reduction's average]). Every layer's FSDP2 shard has an even number of elements
    (16 rows of 24 plus 16; 8 rows of 48 plus 8): see [Note: client tolerances] in test_clients.py
    for an odd one."""
    from overlap.testing import run_distributed

    fsdp2, ours = (run_distributed(_three_ranks, 3, runtime, bf16, timeout=TIMEOUT_S, pg_timeout=PG_TIMEOUT_S)
                   for runtime in ("fsdp2", "overlap"))
    for want, got in zip(fsdp2, ours):
        for step, (w, g) in enumerate(zip(want["seen"], got["seen"])):
            assert set(max_abs_diff(g, w).values()) == {0.0}, (step, max_abs_diff(g, w))


def test_reshard_after_forward_int_not_dividing_the_shard_size_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """An int ``reshard_after_forward`` that does not divide the shard size names itself and the
    shard size, before the module changes (the supported ints: ``test_reshard_after_forward_int.py``
    in tests/shard; the other bad arguments are rows of ``tests/reliability/test_bad_input_matrix.py``)."""
    import overlap
    import overlap.fsdp2_api as fs

    layer = nn.Linear(4, 4)
    monkeypatch.setattr(fs, "_shard_size", lambda mesh: 8)  # no process group needed: fails before one is
    with pytest.raises(ValueError, match="divide the shard size 8"):
        overlap.fully_shard(layer, reshard_after_forward=3)
    assert type(layer) is nn.Linear and not isinstance(layer.weight, torch.distributed.tensor.DTensor)


def test_not_torchs_fsdp_module() -> None:
    """[Note: not a subclass of torch's FSDPModule]: sharded modules are ``overlap.FSDPModule``s, not
    torch's, and carry FSDP2's methods."""
    import overlap
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    assert overlap.FSDPModule is overlap.ShardedModule
    assert not issubclass(overlap.FSDPModule, TorchFSDPModule)
    for name in ("set_requires_gradient_sync", "set_reshard_after_backward", "set_reshard_after_forward",
                 "set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch", "unshard", "reshard",
                 "set_is_last_backward", "set_post_optim_event", "set_post_optimizer_event"):
        assert callable(getattr(overlap.FSDPModule, name)), name


class _Seen(nn.Module):
    """A linear that records the dtype of each input it gets, then runs in its weight's dtype."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.lin = nn.Linear(inputs, outputs)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return self.lin(x.to(self.lin.weight.dtype))


@pytest.fixture
def one_rank_mesh(single_rank_group) -> Any:
    """A 1-D device mesh over this process's 1-rank group, for FSDP2 and overlap side by side here."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def test_a_blocks_mp_policy_reaches_its_inputs_and_outputs_as_in_fsdp2(one_rank_mesh) -> None:
    """A non-root block's ``MixedPrecisionPolicy(param_dtype=bf16, output_dtype=fp32,
    cast_forward_inputs=False)``: the block gets its fp32 input as it is, and its bf16 output is cast
    to fp32 before the next module sees it, on overlap as on FSDP2 (1 rank, this process). Fails if
    ``cast_forward_inputs`` is dropped on the way to overlap's policy, or if ``output_dtype`` casts
    only the root's output (``overlap.shard``'s behaviour) instead of every sharded module's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32, cast_forward_inputs=False)
    seen = {}
    for runtime in RUNTIMES:
        torch.manual_seed(0)
        model = nn.Sequential(_Seen(4, 4), _Seen(4, 2))
        fully_shard_of(runtime)(model[0], mesh=one_rank_mesh, mp_policy=policy)
        fully_shard_of(runtime)(model, mesh=one_rank_mesh)
        out = model(torch.randn(3, 4))
        seen[runtime] = (model[0].seen, model[1].seen, out.dtype)
    assert seen["overlap"] == seen["fsdp2"] == ([torch.float32], [torch.float32], torch.float32)


def test_shard_placement_fn_is_asked_only_about_the_parameters_it_shards(one_rank_mesh) -> None:
    """As FSDP2, ``shard_placement_fn`` is called for the parameters that get sharded, not for
    ``ignored_params``: a function that returns ``Shard(1)`` (which overlap cannot honour) for an
    ignored parameter is fine, and that parameter stays a plain ``Parameter``. Fails if the ignored
    parameters are passed to the function (overlap would raise NotImplementedError)."""
    from torch.distributed.tensor import Shard

    for runtime in RUNTIMES:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        ignored = model[1].weight
        asked: list[nn.Parameter] = []

        def placement(p: nn.Parameter) -> Any:
            asked.append(p)
            return Shard(1) if p is ignored else None

        fully_shard_of(runtime)(model, mesh=one_rank_mesh, ignored_params={ignored}, shard_placement_fn=placement)
        assert asked and all(p is not ignored for p in asked), runtime
        assert type(model[1].weight) is nn.Parameter, runtime


def _unshard_and_reshard(runtime: str, mesh: Any) -> dict[str, Any]:
    """The FSDPModule calls around a step on 1 rank: what ``unshard`` / ``reshard`` leave registered
    on the block, what its full weight reads after ``set_reshard_after_backward(False)`` and an
    optimizer step on the shards, and where ``recurse=False`` applies the root's settings. The
    parameters are cast to bf16 for compute, so that (at 1 rank too) the unsharded parameters are
    copies of the shards, not views that follow them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))  # model[1]'s parameters are the root's
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard_of(runtime)(model[0], mesh=mesh, mp_policy=policy)
    fully_shard_of(runtime)(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # over the sharded parameters
    shard = model[0].weight

    def step() -> None:
        model(torch.ones(3, 4)).sum().backward()

    out: dict[str, Any] = {}
    model[0].unshard()
    weight = model[0].weight
    out["after unshard"] = (type(weight).__name__, tuple(weight.shape),
                            torch.equal(weight, shard.full_tensor().to(weight.dtype)))
    model[0].reshard()
    out["after reshard"] = type(model[0].weight).__name__
    handle = model[0].unshard(async_op=True)
    if handle is not None:
        handle.wait()
    out["after unshard(async_op) and wait"] = type(model[0].weight).__name__
    step()
    out["after a step"] = [type(p).__name__ for p in model.parameters()]
    model[0].set_reshard_after_backward(False)
    model.set_reshard_after_backward(False, recurse=False)
    opt.zero_grad()
    step()
    out["kept after backward"] = [type(p).__name__ for p in model.parameters()]
    opt.step()  # changes the shards in place while the block's unsharded weight is kept
    model[0].unshard()
    weight = model[0].weight.detach()
    out["unshard after a step reads the new shards"] = torch.equal(weight, shard.full_tensor().to(weight.dtype))
    return out


def test_unshard_and_reshard_leave_the_parameters_fsdp2_leaves(one_rank_mesh) -> None:
    """``unshard()`` (and ``unshard(async_op=True)`` once waited) registers the block's full
    parameters on it, ``reshard()`` the sharded ones again, and ``set_reshard_after_backward(False,
    recurse=False)`` keeps the root's alone, as FSDP2 on 1 rank (in this process). After an optimizer
    step on the shards, a kept block's ``unshard()`` reads the new values, where FSDP2 keeps the stale
    ones."""
    got = {runtime: _unshard_and_reshard(runtime, one_rank_mesh) for runtime in RUNTIMES}
    # The one difference: FSDP2's unshard() of a block still unsharded does nothing, so it goes on
    # reading the values from before the step; the runtime gathers the changed shards again.
    fresh = {runtime: got[runtime].pop("unshard after a step reads the new shards") for runtime in RUNTIMES}
    assert fresh == {"overlap": True, "fsdp2": False}
    assert got["overlap"] == got["fsdp2"], got
    want = got["overlap"]
    assert want["after unshard"] == ("Parameter", (4, 4), True)
    assert want["after reshard"] == "DTensor" and want["after unshard(async_op) and wait"] == "Parameter"
    assert want["kept after backward"] == ["Parameter"] * 4


def test_recurse_false_sets_the_root_alone(one_rank_mesh) -> None:
    """``set_reshard_after_backward`` / ``set_reshard_after_forward`` / ``set_requires_gradient_sync``
    with ``recurse=False`` change the module they are called on and none of its sharded descendants;
    with the default ``recurse=True``, every one."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard_of("overlap")(model[0], mesh=one_rank_mesh)
    fully_shard_of("overlap")(model, mesh=one_rank_mesh)
    root, block = model._overlap_state, model[0]._overlap_state
    model.set_reshard_after_backward(False, recurse=False)
    model.set_reshard_after_forward(False, recurse=False)
    model.set_requires_gradient_sync(False, recurse=False)
    assert (root.reshard_after_backward, root.reshard_after_forward, root.sync_grads) == (False, False, False)
    assert (block.reshard_after_backward, block.reshard_after_forward, block.sync_grads) == (True, True, True)
    model.set_reshard_after_backward(False)
    model.set_reshard_after_forward(False)
    model.set_requires_gradient_sync(False)
    assert (block.reshard_after_backward, block.reshard_after_forward, block.sync_grads) == (False, False, False)


# --------------------------------------------------------------------------------- HF round trip
def _rank_hf(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    import overlap
    from hf_models import gpt2, hf_blocks, hf_loss, llama

    env = Env(rank, world)
    out: dict[str, Any] = {}
    tokens = CLIENTS["hf_gpt2"].batch(0)[:, :-1]
    for name, make in (("gpt2", gpt2), ("llama", llama)):
        torch.manual_seed(0)
        model = make()
        for block in hf_blocks(model):
            overlap.fully_shard(block, mesh=env.mesh)
        overlap.fully_shard(model, mesh=env.mesh)
        opt = make_optimizer(model.parameters())
        hf_loss(model, tokens[rank::world]).backward()  # one step, so the saved weights are trained ones
        opt.step()
        path = os.path.join(root, name)
        model.save_pretrained(path, state_dict=overlap.full_state_dict(model), is_main_process=rank == 0)
        dist.barrier()
        with torch.no_grad():
            out[name] = model(input_ids=tokens).logits
        # And back: from_pretrained on every rank, then shard: the same logits.
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
        for block in hf_blocks(loaded):
            overlap.fully_shard(block, mesh=env.mesh)
        overlap.fully_shard(loaded, mesh=env.mesh)
        with torch.no_grad():
            out[f"{name}/resharded"] = loaded(input_ids=tokens).logits
    return out


def test_hf_save_pretrained_round_trip(tmp_path) -> None:
    """The documented recipe: ``model.save_pretrained(path, state_dict=overlap.full_state_dict(model),
    is_main_process=rank == 0)``. The files load into an unsharded HF model that gives the sharded
    model's logits, and sharding the loaded model gives them too."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from overlap.testing import run_distributed

    results = run_distributed(_rank_hf, 2, str(tmp_path), timeout=TIMEOUT_S, pg_timeout=PG_TIMEOUT_S)
    tokens = CLIENTS["hf_gpt2"].batch(0)[:, :-1]
    for name in ("gpt2", "llama"):
        unsharded = AutoModelForCausalLM.from_pretrained(tmp_path / name, attn_implementation="sdpa")
        with torch.no_grad():
            logits = unsharded(input_ids=tokens).logits
        for rank_out in results:
            assert torch.equal(rank_out[name], logits), name
            assert torch.equal(rank_out[f"{name}/resharded"], logits), name


class _SkipsTail(nn.Module):
    """``head`` then, unless ``skip_tail`` is set, ``tail``: the two members of one grouped
    ``fully_shard([head, tail])``."""

    def __init__(self) -> None:
        super().__init__()
        self.head, self.tail = nn.Linear(4, 4), nn.Linear(4, 4)
        self.skip_tail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(x)
        return x if self.skip_tail else self.tail(x)


def test_a_group_member_skipped_in_one_pass_does_not_hold_the_next(one_rank_mesh) -> None:
    """A ``fully_shard([head, tail])`` group whose ``tail`` did not run in one forward: the next
    forward starts the group again at ``head`` (gathered, hooked), and its output and gradients
    equal FSDP2's, bitwise."""
    got = {}
    for runtime in RUNTIMES:
        torch.manual_seed(0)
        model = _SkipsTail()
        fully_shard_of(runtime)([model.head, model.tail], mesh=one_rank_mesh)
        fully_shard_of(runtime)(model, mesh=one_rank_mesh)
        x = torch.randn(3, 4)
        model.skip_tail = True
        with torch.no_grad():
            model(x)
        model.skip_tail = False
        out = model(x)
        out.sum().backward()
        got[runtime] = (out.detach(), [p.grad.full_tensor() for p in model.parameters()])
    (ours, our_grads), (theirs, their_grads) = got["overlap"], got["fsdp2"]
    assert torch.equal(ours, theirs)
    assert len(our_grads) == len(their_grads) == 4
    assert all(torch.equal(a, b) for a, b in zip(our_grads, their_grads))
