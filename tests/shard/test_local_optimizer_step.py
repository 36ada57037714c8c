"""The local optimizer step (``overlap/local_optimizer_step.py``): torch's Adam, AdamW and SGD over
``overlap.shard``'s DTensor parameters run on the local tensors, bitwise as torch's DTensor path.

Reference: the same model, batches and optimizer with the local step turned off
(``overlap.set_local_optimizer_step(False)``: torch's DTensor path), side by side in one process:
parameters and every optimizer state entry (type, spec, local values) bitwise equal after several
steps, at world size 1 (in this process) and 2 (gloo ranks, also HSDP on a 2x1 mesh). Fused SGD has no
DTensor path (torch raises); its reference is fused SGD over plain tensors holding the same rows.
Engagement is read from the module's counters: the local path ran where expected, and fell back
where a precondition fails (mixed placements at one index, a plain parameter in the group,
``Partial``, a DTensor learning rate, buffers to create beside one laid out unlike its parameter,
state loaded beside parameters of another layout); FSDP2's parameters are never touched. The comparison with FSDP2's state dicts is in
``tests/clients/test_clients.py`` (full optimizer state bitwise FSDP2's, sharded entries alike).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.optim.optimizer import _get_fused_kernels_supported_devices

import overlap
from overlap import local_optimizer_step as los

pytestmark = pytest.mark.torch_kernels  # packing by the torch fallback (conftest): many short loops

STEPS = 3  # the first step creates state (SGD's momentum buffers inside the step); later ones update it
FUSED_CPU = "cpu" in _get_fused_kernels_supported_devices()

# id -> (optimizer class, arguments)
CONFIGS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw-default": (torch.optim.AdamW, {"lr": 1e-2}),
    "adamw-foreach": (torch.optim.AdamW, {"lr": 1e-2, "foreach": True}),
    "adamw-single": (torch.optim.AdamW, {"lr": 1e-2, "foreach": False}),
    "adamw-amsgrad-maximize-foreach": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True,
                                                           "maximize": True, "foreach": True}),
    "adamw-amsgrad-maximize-single": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True,
                                                          "maximize": True, "foreach": False}),
    "adam-wd-foreach": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    "adam-wd-single": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}),
    "sgd-momentum-foreach": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
    "sgd-momentum-single": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": False}),
    "sgd-nesterov-wd-maximize-foreach": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                                           "weight_decay": 0.01, "maximize": True, "foreach": True}),
    "sgd-nesterov-wd-single": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                                 "weight_decay": 0.01, "foreach": False}),
    "sgd-dampening-foreach": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5, "dampening": 0.3, "foreach": True}),
    "sgd-plain-foreach": (torch.optim.SGD, {"lr": 0.1, "foreach": True}),
    "sgd-plain-single": (torch.optim.SGD, {"lr": 0.1, "foreach": False}),
}
if FUSED_CPU:
    CONFIGS["adamw-fused"] = (torch.optim.AdamW, {"lr": 1e-2, "fused": True})
    CONFIGS["adamw-fused-amsgrad"] = (torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True, "fused": True})


class Net(nn.Module):
    """Two odd-sized blocks (dim 0 of 7, 3 and 5: uneven rows on 2 ranks) and a 0-dim scale (a
    ``Replicate()`` parameter: another placement in the same optimizer group)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(5, 7), nn.Tanh()), nn.Linear(7, 3))
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x) * self.scale


def _sharded_net(mesh: Any = None) -> Net:
    torch.manual_seed(0)
    net = Net()
    overlap.shard(net.blocks[0], mesh=mesh)
    overlap.shard(net, mesh=mesh)
    return net


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(config: str, local_step: bool, rank: int, mesh: Any = None) -> dict[str, Any]:
    """``STEPS`` steps of ``config`` over a sharded :class:`Net`: the parameters' and the optimizer
    state's local tensors, the state's types and specs, and how many inner calls ran locally."""
    optimizer, kwargs = CONFIGS[config]
    previous = overlap.set_local_optimizer_step(local_step)
    try:
        net = _sharded_net(mesh)
        opt = optimizer(net.parameters(), **kwargs)
        engaged, fell_back = los.engaged, los.fell_back
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            net(_batch(step, rank)).square().sum().backward()
            opt.step()
        return {"params": {n: p._local_tensor.clone() for n, p in net.named_parameters()},
                "state": _describe_state(opt), "engaged": los.engaged - engaged, "fell_back": los.fell_back - fell_back}
    finally:
        overlap.set_local_optimizer_step(previous)


def _describe_state(opt: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """Per parameter index and state key: (type name, spec or None, local tensor)."""
    out: dict[int, dict[str, Any]] = {}
    for index, per in opt.state_dict()["state"].items():
        out[index] = {k: (type(v).__name__, v._spec if isinstance(v, DTensor) else None,
                          v._local_tensor.clone() if isinstance(v, DTensor) else v)
                      for k, v in per.items()}
    return out


def _differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What differs between two :func:`_train` results (bitwise), as readable lines."""
    problems = [f"param {n}" for n in want["params"] if not torch.equal(got["params"][n], want["params"][n])]
    if got["state"].keys() != want["state"].keys():
        return [*problems, f"state indices {sorted(got['state'])} != {sorted(want['state'])}"]
    for index, per in want["state"].items():
        if per.keys() != got["state"][index].keys():
            problems.append(f"state {index} keys {sorted(got['state'][index])} != {sorted(per)}")
            continue
        for key, (kind, spec, value) in per.items():
            g_kind, g_spec, g_value = got["state"][index][key]
            if (g_kind, g_spec) != (kind, spec) or not isinstance(g_value, type(value)):
                problems.append(f"state {index}.{key}: {g_kind} {g_spec} != {kind} {spec}")
            elif isinstance(value, torch.Tensor) and not (g_value.dtype == value.dtype and torch.equal(g_value, value)):
                problems.append(f"state {index}.{key} values")
            elif not isinstance(value, torch.Tensor) and g_value != value:
                problems.append(f"state {index}.{key}: {g_value} != {value}")
    return problems


def _local_vs_dtensor_path(rank: int, mesh: Any = None,
                           configs: Sequence[str] = tuple(CONFIGS)) -> dict[str, tuple[list[str], int, int, int]]:
    """Per config: the differences, and the local run's engaged / fell-back counts and the DTensor
    run's engaged count."""
    out = {}
    for config in configs:
        local, reference = _train(config, True, rank, mesh), _train(config, False, rank, mesh)
        out[config] = (_differences(local, reference), local["engaged"], local["fell_back"], reference["engaged"])
    return out


def _check_local_vs_dtensor_path(results: dict[str, tuple[list[str], int, int, int]], where: str) -> None:
    for config, (problems, engaged, fell_back, reference_engaged) in results.items():
        assert problems == [], f"{where} {config}: local step differs from the DTensor path: {problems}"
        assert (engaged, fell_back, reference_engaged) == (STEPS, 0, 0), (where, config, engaged, fell_back)


# ------------------------------------------------------------------------------------ world size 1
@pytest.mark.parametrize("config", list(CONFIGS))
def test_local_step_is_the_dtensor_path_bitwise(single_rank_group: dist.ProcessGroup, config: str) -> None:
    """Parameters and optimizer state (types, specs, values) after ``STEPS`` steps; SGD's momentum
    buffers, created inside the first step, come back as DTensors with the DTensor path's spec."""
    _check_local_vs_dtensor_path(_local_vs_dtensor_path(0, configs=[config]), "world size 1")


def test_fused_sgd_runs_as_on_plain_tensors(single_rank_group: dist.ProcessGroup) -> None:
    """torch has no DTensor strategy for ``_fused_sgd_`` (the DTensor path raises); the local step
    runs it on the shards, bitwise fused SGD over plain tensors holding the same rows."""
    kwargs = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01, "fused": True}
    net = _sharded_net()
    named = list(net.named_parameters())
    shadow = [nn.Parameter(p._local_tensor.detach().clone()) for _, p in named]
    opt, shadow_opt = torch.optim.SGD(net.parameters(), **kwargs), torch.optim.SGD(shadow, **kwargs)
    engaged = los.engaged
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        net(_batch(step, 0)).square().sum().backward()
        for s, (_, p) in zip(shadow, named):
            s.grad = p.grad._local_tensor.clone()
        opt.step()
        shadow_opt.step()
    assert los.engaged - engaged == STEPS
    for s, (name, p) in zip(shadow, named):
        assert torch.equal(p._local_tensor, s), name
        buf = opt.state[p]["momentum_buffer"]
        assert type(buf) is DTensor and buf._spec == p._spec, (name, type(buf))
        assert torch.equal(buf._local_tensor, shadow_opt.state[s]["momentum_buffer"]), name
    previous = overlap.set_local_optimizer_step(False)
    try:
        net(_batch(0, 0)).sum().backward()
        with pytest.raises(NotImplementedError, match="_fused_sgd_"):
            torch.optim.SGD(net.parameters(), **kwargs).step()
    finally:
        overlap.set_local_optimizer_step(previous)


def _mixed_run(local_step: bool, change: str) -> dict[str, Any]:
    """Two foreach=False AdamW steps (SGD with momentum for ``"buffers relaid"``) over a sharded
    :class:`Net`, where ``change`` is applied before the second: ``"replicated state"`` swaps one
    exp_avg for a ``Replicate()`` DTensor of the same values (at world size 1 the same local rows:
    the DTensor path redistributes it as a no-op), ``"plain param"`` steps a plain parameter in the
    same group, ``"partial"`` steps a marked ``Partial()`` DTensor parameter with its gradient,
    ``"DTensor lr"`` makes the learning rate a 0-dim ``Replicate()`` DTensor (not a plain scalar),
    ``"buffers relaid"`` swaps one momentum buffer for a ``Replicate()`` DTensor of the same rows
    and drops another, which the step then creates beside it. The values: parameters, then the
    optimizer state's tensors."""
    previous = overlap.set_local_optimizer_step(local_step)
    try:
        net = _sharded_net()
        params: list[torch.Tensor] = list(net.parameters())
        extra: list[torch.Tensor] = []
        mesh = params[0].device_mesh
        if change == "plain param":
            extra = [nn.Parameter(torch.arange(6.0).reshape(2, 3))]
        elif change == "partial":
            p = nn.Parameter(DTensor.from_local(torch.arange(6.0).reshape(2, 3), mesh, [Partial()]))
            setattr(p, los.MARK, object())  # as if the runtime had made it
            extra = [p]
        if change == "buffers relaid":
            opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
        else:
            opt = torch.optim.AdamW(params + extra, lr=1e-2, foreach=False)
        counts = []
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            net(_batch(step, 0)).square().sum().backward()
            for e in extra:  # a gradient laid out like its parameter
                local = e._local_tensor if isinstance(e, DTensor) else e
                grad = local.detach() * 0.5 + 0.25
                e.grad = DTensor.from_local(grad, mesh, e.placements) if isinstance(e, DTensor) else grad
            if step == 1 and change == "replicated state":
                state = opt.state[next(p for p in params if p.dim() > 0)]  # a Shard(0) parameter
                state["exp_avg"] = DTensor.from_local(state["exp_avg"]._local_tensor.clone(), mesh, [Replicate()])
            elif step == 1 and change == "DTensor lr":
                opt.param_groups[0]["lr"] = DTensor.from_local(torch.tensor(1e-2), mesh, [Replicate()])
            elif step == 1 and change == "buffers relaid":
                first, second = [p for p in params if p.dim() > 0][:2]  # Shard(0) parameters
                buffer = opt.state[first]["momentum_buffer"]
                opt.state[first]["momentum_buffer"] = DTensor.from_local(buffer._local_tensor.clone(), mesh, [Replicate()])
                del opt.state[second]["momentum_buffer"]
            engaged, fell_back = los.engaged, los.fell_back
            try:
                opt.step()
            except RuntimeError as e:  # torch's DTensor path refuses in-place updates of a Partial()
                counts.append((los.engaged - engaged, los.fell_back - fell_back))
                return {"values": [], "counts": counts, "error": str(e)}
            counts.append((los.engaged - engaged, los.fell_back - fell_back))
        values = [(p._local_tensor if isinstance(p, DTensor) else p).detach().clone() for p in params + extra]
        values += [t._local_tensor if isinstance(t, DTensor) else t
                   for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        return {"values": values, "counts": counts, "error": None}
    finally:
        overlap.set_local_optimizer_step(previous)


@pytest.mark.parametrize("change, counts", [("replicated state", [(1, 0), (0, 1)]),
                                            ("plain param", [(0, 1), (0, 1)]),
                                            ("partial", [(0, 1)]),
                                            ("DTensor lr", [(1, 0), (0, 1)]),
                                            ("buffers relaid", [(1, 0), (0, 1)])])
def test_mixed_specs_fall_back_to_the_dtensor_path(single_rank_group: dist.ProcessGroup, change: str,
                                                   counts: list[tuple[int, int]]) -> None:
    """(engaged, fell back) per step, and the outcome of the DTensor path: the same values
    (parameters and optimizer state) bitwise, or the same error (torch refuses to update a
    ``Partial()`` parameter in place)."""
    local, reference = _mixed_run(True, change), _mixed_run(False, change)
    assert local["counts"] == counts, local["counts"]
    assert reference["counts"] == [(0, 0)] * len(counts)
    assert local["error"] == reference["error"]
    assert (local["error"] is not None) == (change == "partial"), local["error"]
    assert len(local["values"]) == len(reference["values"])
    assert all(torch.equal(a, b) for a, b in zip(local["values"], reference["values"]))


def _state_moved_to_replicated_params(local_step: bool) -> dict[str, Any]:
    """An AdamW state stepped over a sharded :class:`Net` (``Shard(0)`` DTensors), loaded into an
    optimizer over the same values as ``Replicate()`` DTensor parameters (marked as the runtime's),
    then stepped there with given gradients: the state tensors are the same objects, laid out
    unlike the new parameters."""
    previous = overlap.set_local_optimizer_step(local_step)
    try:
        net = _sharded_net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=False)
        net(_batch(0, 0)).square().sum().backward()
        opt.step()
        replicated = []
        for p in net.parameters():
            q = nn.Parameter(DTensor.from_local(p._local_tensor.detach().clone(), p.device_mesh, [Replicate()]))
            setattr(q, los.MARK, object())  # as if the runtime had made it
            q.grad = DTensor.from_local(torch.full_like(p._local_tensor, 0.5), p.device_mesh, [Replicate()])
            replicated.append(q)
        moved = torch.optim.AdamW(replicated, lr=1e-2, foreach=False)
        moved.load_state_dict(opt.state_dict())
        engaged, fell_back = los.engaged, los.fell_back
        moved.step()
        values = [q._local_tensor.clone() for q in replicated]
        values += [t._local_tensor for state in moved.state.values() for t in state.values() if isinstance(t, DTensor)]
        return {"values": values, "counts": (los.engaged - engaged, los.fell_back - fell_back)}
    finally:
        overlap.set_local_optimizer_step(previous)


def test_state_laid_out_unlike_its_parameters_falls_back(single_rank_group: dist.ProcessGroup) -> None:
    """State tensors already accepted beside one parameter list are checked again beside another:
    ``Shard(0)`` state with ``Replicate()`` parameters falls back, with the DTensor path's values
    (at world size 1 the same rows; on 2 ranks the local path would have stepped rows of other
    shapes and raised)."""
    local, reference = _state_moved_to_replicated_params(True), _state_moved_to_replicated_params(False)
    assert local["counts"] == (0, 1), local["counts"]
    assert reference["counts"] == (0, 0)
    assert len(local["values"]) == len(reference["values"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(local["values"], reference["values"]))


def _fsdp2_and_ours() -> tuple[nn.Module, Net]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    fsdp2 = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    fully_shard(fsdp2)
    return fsdp2, _sharded_net()


def test_fsdp2_parameters_are_not_touched(single_rank_group: dist.ProcessGroup) -> None:
    """A group of FSDP2's DTensor parameters (unmarked) runs torch's code: neither counter moves.
    Grouped after the runtime's parameters (the first is marked), they step on their local tensors
    too, bitwise as torch's DTensor path (see [Note: what the checks read])."""
    overlap.shard(nn.Linear(2, 2))  # the wrappers are installed
    for foreach in (False, True):
        results = []
        for local_step in (True, False):
            previous = overlap.set_local_optimizer_step(local_step)
            try:
                fsdp2, ours = _fsdp2_and_ours()
                counts = []
                for params in ([*fsdp2.parameters()], [*ours.parameters(), *fsdp2.parameters()]):
                    opt = torch.optim.AdamW(params, lr=1e-2, foreach=foreach)
                    for step in range(2):
                        opt.zero_grad(set_to_none=True)
                        fsdp2(_batch(step, 0)).sum().backward()
                        ours(_batch(step, 0)).sum().backward()
                        engaged, fell_back = los.engaged, los.fell_back
                        opt.step()
                        counts.append((los.engaged - engaged, los.fell_back - fell_back))
                values = [p._local_tensor.clone() for p in [*fsdp2.parameters(), *ours.parameters()]]
            finally:
                overlap.set_local_optimizer_step(previous)
            results.append((counts, values))
        (counts, values), (reference_counts, reference_values) = results
        assert counts == [(0, 0), (0, 0), (1, 0), (1, 0)], (foreach, counts)
        assert reference_counts == [(0, 0)] * 4, (foreach, reference_counts)
        assert all(torch.equal(a, b) for a, b in zip(values, reference_values)), foreach


def test_install_is_idempotent_and_chains() -> None:
    """Every wrapped function is ours exactly once, chained to torch's function of that name."""
    los.install()
    los.install()
    for module_name, name, _ in los._TARGETS:
        module = __import__(module_name, fromlist=[name])
        fn = getattr(module, name)
        original = getattr(fn, los._WRAPPED)
        assert getattr(original, los._WRAPPED, None) is None, f"{name} wrapped twice"
        assert original.__module__ == module_name and original.__name__ == name


def _init_group_chain(owner: type) -> list[Any]:
    """What ``owner._init_group`` resolves to, then each ``__wrapped__`` inside it, outermost first."""
    chain, fn = [], owner._init_group
    while fn is not None and len(chain) < 16:
        chain.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return chain


def _assert_init_group_wrapped_once() -> None:
    ours = los._wrap_init_group(lambda *a, **k: None).__code__
    for owner in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        chain = _init_group_chain(owner)
        assert [getattr(f, "__code__", None) is ours for f in chain].count(True) == 1, f"{owner.__name__}: {chain}"
        defining = "SGD" if owner is torch.optim.SGD else "Adam"  # AdamW inherits Adam's on torch 2.11-2.15
        assert chain[-1].__qualname__ == f"{defining}._init_group"
        assert getattr(chain[-1], "__wrapped__", None) is None


def test_init_group_wrappers_are_installed_once_and_chain() -> None:
    """``_init_group`` of Adam (which AdamW inherits) and SGD runs ours exactly once, chained to torch's,
    however often ``install`` runs."""
    los.install()
    los.install()
    _assert_init_group_wrapped_once()


@pytest.mark.skipif(not hasattr(getattr(torch._dynamo, "eval_frame", None), "TorchPatcher"),
                    reason="this torch has no torch._dynamo.eval_frame.TorchPatcher")
def test_init_group_wrappers_survive_dynamos_optimizer_patch() -> None:
    """Dynamo's first use wraps every optimizer class's ``_init_group`` in ``disable`` (AdamW's too,
    around the ``_init_group`` it inherits): ours still runs exactly once. Whether it patched before or
    after ``install`` depends on the tests this worker ran first; once patched it stays so."""
    los.install()
    torch._dynamo.eval_frame.TorchPatcher.patch()
    _assert_init_group_wrapped_once()


def test_steady_family_follows_wrappers_to_torchs_loop() -> None:
    """The steady-state gathering is chosen by the torch loop a class's ``_init_group`` runs in the
    end: also through Dynamo's ``disable`` wrapper (which gives AdamW one of its own around Adam's
    loop when Dynamo patches before ``install``); any other function gets none."""
    adams_loop = _init_group_chain(torch.optim.Adam)[-1]
    sgds_loop = _init_group_chain(torch.optim.SGD)[-1]
    assert los._steady_family(adams_loop) == "adam" and los._steady_family(sgds_loop) == "sgd"
    assert los._steady_family(torch._dynamo.disable(adams_loop)) == "adam"
    assert los._steady_family(los._wrap_init_group(torch._dynamo.disable(sgds_loop))) == "sgd"
    assert los._steady_family(lambda *a: None) is None
    assert los._steady_family(_init_group_chain(torch.optim.RMSprop)[-1]) is None


class _TorchFunctionProbe(dict):  # type: ignore[type-arg]
    """An optimizer's ``state`` that records, at each lookup ``_init_group`` makes, whether
    torch-function dispatch was on for tensor subclasses."""

    def __init__(self, state: dict) -> None:  # type: ignore[type-arg]
        super().__init__(state)
        self.seen: set[bool] = set()

    def __missing__(self, key: Any) -> dict:  # type: ignore[type-arg]
        self[key] = {}
        return self[key]

    def __getitem__(self, key: Any) -> Any:
        self.seen.add(torch._C._is_torch_function_enabled())
        return super().__getitem__(key)


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.SGD])
def test_init_group_runs_without_torch_function_lookups_only_for_the_runtimes_groups(
        single_rank_group: dist.ProcessGroup, optimizer: type[torch.optim.Optimizer]) -> None:
    """Over the runtime's parameters torch-function dispatch for subclasses is off inside
    ``_init_group`` (see [Note: gathering the lists without torch-function lookups]); with a plain
    parameter in the group, with the fast path off, or with ``differentiable`` it stays on."""
    net = _sharded_net()
    plain = nn.Parameter(torch.ones(3))
    cases = [(list(net.parameters()), {}, True, False), ([*net.parameters(), plain], {}, True, True),
             (list(net.parameters()), {}, False, True), (list(net.parameters()), {"differentiable": True}, True, True)]
    for params, extra, local_step, expect_enabled in cases:
        kwargs = {"lr": 1e-2, "momentum": 0.9} if optimizer is torch.optim.SGD else {"lr": 1e-2}
        opt = optimizer(params, **kwargs, **extra)
        net(_batch(0, 0)).sum().backward()
        plain.grad = torch.ones(3)
        opt.state = _TorchFunctionProbe(opt.state)  # type: ignore[assignment]
        previous = overlap.set_local_optimizer_step(local_step)
        try:
            with torch.no_grad():  # differentiable=True steps need grad mode; no_grad keeps them comparable
                opt._init_group(opt.param_groups[0], *[[] for _ in range(3 if optimizer is torch.optim.SGD else 6)])
        finally:
            overlap.set_local_optimizer_step(previous)
        assert opt.state.seen == {expect_enabled}, (len(params), extra, local_step, opt.state.seen)
        opt.zero_grad(set_to_none=True)


class _LookupCounting(torch.Tensor):
    """A gradient type with a ``__torch_function__`` of its own: counts the calls that reach it."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def _gathered(opt: torch.optim.Optimizer, lists: int, local_step: bool) -> tuple[list[list[Any]], set[bool]]:
    """``opt._init_group``'s lists for its first group (``lists`` of them), and whether torch-function
    dispatch was on at its state lookups."""
    gathered: list[list[Any]] = [[] for _ in range(lists)]
    opt.state = _TorchFunctionProbe(opt.state)  # type: ignore[assignment]
    previous = overlap.set_local_optimizer_step(local_step)
    try:
        opt._init_group(opt.param_groups[0], *gathered)
    finally:
        overlap.set_local_optimizer_step(previous)
    return gathered, opt.state.seen  # type: ignore[attr-defined]


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.SGD])
def test_init_group_gathers_again_with_lookups_when_a_gradient_is_not_a_dtensor(
        single_rank_group: dist.ProcessGroup, optimizer: type[torch.optim.Optimizer]) -> None:
    """A gradient of another type (here a subclass with a ``__torch_function__``) is found in the
    gathered list after the lookup-free pass: the lists are gathered again by torch's path, whose
    lookups reach that override, and hold each parameter once, as with the fast path off."""
    net = _sharded_net()
    kwargs = {"lr": 1e-2, "momentum": 0.9} if optimizer is torch.optim.SGD else {"lr": 1e-2}
    lists = 3 if optimizer is torch.optim.SGD else 6
    net(_batch(0, 0)).sum().backward()
    weight = net.blocks[0][0].weight
    weight.grad = weight.grad._local_tensor.clone().as_subclass(_LookupCounting)
    results = []
    for local_step in (True, False):
        opt = optimizer(net.parameters(), **kwargs)
        _LookupCounting.calls = 0
        gathered, seen = _gathered(opt, lists, local_step)
        results.append((gathered, seen, _LookupCounting.calls))
    (fast, fast_seen, fast_calls), (torchs, torchs_seen, torchs_calls) = results
    assert torchs_seen == {True} and True in fast_seen, (fast_seen, torchs_seen)
    assert fast_calls == torchs_calls > 0, (fast_calls, torchs_calls)
    assert [len(g) for g in fast] == [len(g) for g in torchs]
    assert len(fast[0]) == len(list(net.parameters()))
    for got, want in zip(fast[:2], torchs[:2]):  # parameters and gradients: the same objects, in order
        assert all(a is b for a, b in zip(got, want))


STEADY_CONFIGS = ["adamw-foreach", "adamw-amsgrad-maximize-single", "adam-wd-foreach", "sgd-momentum-foreach",
                  "sgd-plain-single", *(["adamw-fused-amsgrad"] if FUSED_CPU else [])]


def _gather_once(opt: torch.optim.Optimizer, local_step: bool) -> tuple[list[list[Any]], Any, int]:
    """``opt._init_group``'s lists for its first group, its return value, and how many steady
    gatherings ran, with the fast path ``local_step``."""
    gathered: list[list[Any]] = [[] for _ in range(3 if isinstance(opt, torch.optim.SGD) else 6)]
    before = los.gathered_steady
    previous = overlap.set_local_optimizer_step(local_step)
    try:
        result = opt._init_group(opt.param_groups[0], *gathered)
    finally:
        overlap.set_local_optimizer_step(previous)
    return gathered, result, los.gathered_steady - before


def _stepped(optimizer: type[torch.optim.Optimizer], kwargs: dict[str, Any], steps: int) -> tuple[Net, Any]:
    """A sharded :class:`Net` and a new ``optimizer`` over it after ``steps`` steps, then a backward."""
    net = _sharded_net()
    opt = optimizer(net.parameters(), **kwargs)
    for step in range(steps):
        net(_batch(step, 0)).square().sum().backward()
        opt.step()
    net(_batch(steps, 0)).square().sum().backward()
    return net, opt


def _same_objects(got: list[list[Any]], want: list[list[Any]]) -> bool:
    """The same number of lists, of the same lengths, holding the same objects in the same order."""
    return [len(g) for g in got] == [len(w) for w in want] and all(
        a is b for g, w in zip(got, want) for a, b in zip(g, w))


@pytest.mark.parametrize("config", STEADY_CONFIGS)
def test_steady_gathering_gives_the_objects_torchs_loop_gives(single_rank_group: dist.ProcessGroup,
                                                               config: str) -> None:
    """The same optimizer gathered twice, by the steady-state gathering and by torch's loop (fast
    path off): the same objects in the same order, the same return value."""
    optimizer, kwargs = CONFIGS[config]
    net, opt = _stepped(optimizer, kwargs, 2)
    results = [_gather_once(opt, local_step) for local_step in (True, False)]
    (fast, fast_result, fast_steady), (torchs, torchs_result, torchs_steady) = results
    assert (fast_steady, torchs_steady) == (1, 0)
    assert fast_result == torchs_result and type(fast_result) is type(torchs_result)
    assert _same_objects(fast, torchs), [[len(g) for g in fast], [len(g) for g in torchs]]
    assert len(fast[0]) == len(list(net.parameters())) and None not in map(type, fast[1])


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.SGD])
def test_steady_gathering_leaves_other_groups_to_torchs_loop(single_rank_group: dist.ProcessGroup,
                                                              optimizer: type[torch.optim.Optimizer]) -> None:
    """A parameter without a gradient, Adam's first step (state to create), fused SGD before its
    first device check: torch's loop gathers (no steady gathering), and its lists are the loop's.
    SGD's first step creates nothing in ``_init_group`` (``None`` momentum buffers): gathered steadily."""
    kwargs = {"lr": 1e-2, "momentum": 0.9} if optimizer is torch.optim.SGD else {"lr": 1e-2}
    net, opt = _stepped(optimizer, kwargs, 1)
    net.scale.grad = None
    (got, _, steady), (torchs, _, _) = _gather_once(opt, True), _gather_once(opt, False)
    assert steady == 0 and _same_objects(got, torchs) and len(got[0]) == len(list(net.parameters())) - 1
    net = _sharded_net()
    opt = optimizer(net.parameters(), **kwargs)
    net(_batch(0, 0)).square().sum().backward()
    before = los.gathered_steady
    opt.step()  # Adam's first step creates state: torch's loop
    first_step_steady = 1 if optimizer is torch.optim.SGD else 0
    assert los.gathered_steady == before + first_step_steady
    opt.step()
    assert los.gathered_steady == before + first_step_steady + 1
    if optimizer is torch.optim.SGD and FUSED_CPU:
        fused = optimizer(net.parameters(), lr=1e-2, momentum=0.9, fused=True)
        fused.state = opt.state  # state in place, but the fused device check not done yet
        before = los.gathered_steady
        fused.step()
        fused.step()
        assert los.gathered_steady == before + 1


def test_init_group_error_is_torchs(single_rank_group: dist.ProcessGroup) -> None:
    """An error raised by ``_init_group`` in the lookup-free pass (a tensor ``lr`` with
    ``foreach=True``, refused there) is raised again by torch's path: the same message."""
    net = _sharded_net()
    net(_batch(0, 0)).sum().backward()
    messages = []
    for local_step in (True, False):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True)
        opt.param_groups[0]["lr"] = torch.tensor(1e-2)
        with pytest.raises(RuntimeError) as error:
            _gathered(opt, 6, local_step)
        messages.append(str(error.value))
        assert True in opt.state.seen  # type: ignore[attr-defined]
    assert messages[0] == messages[1] and "lr as a Tensor" in messages[0], messages


def test_a_spec_list_sharing_its_first_spec_is_checked_again(single_rank_group: dist.ProcessGroup) -> None:
    """The parameter spec list accepted last is found again by its first spec: a list of the same
    length and first spec with a ``Partial()`` parameter in place of the last one falls back
    (torch's path then refuses or not, by version: ``test_mixed_specs_fall_back_to_the_dtensor_path``
    compares that outcome), and the accepted list still engages afterwards."""
    net = _sharded_net()
    params = list(net.parameters())
    mesh = params[0].device_mesh
    partial = nn.Parameter(DTensor.from_local(torch.arange(6.0).reshape(2, 3), mesh, [Partial()]))
    setattr(partial, los.MARK, object())  # as if the runtime had made it
    outcomes = []
    for group in (params, [*params[:-1], partial], params):
        opt = torch.optim.AdamW(group, lr=1e-2, foreach=True)
        opt.zero_grad(set_to_none=True)
        net(_batch(0, 0)).square().sum().backward()
        partial.grad = DTensor.from_local(torch.ones(2, 3), mesh, [Partial()])
        engaged, fell_back = los.engaged, los.fell_back
        try:
            opt.step()
        except RuntimeError:
            pass
        outcomes.append((los.engaged - engaged, los.fell_back - fell_back))
    assert outcomes == [(1, 0), (0, 1), (1, 0)], outcomes
    specs = [p._spec for p in params]  # the parameters' own check, without the other lists' behind it
    for group_specs, allowed in ((specs, True), ([*specs[:-1], partial._spec], False), (specs, True)):
        assert (los._meshes_and_placements_allowed(group_specs) is not None) == allowed, allowed


def test_set_local_optimizer_step_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Explicit settings win; ``None`` follows ``OVERLAP_LOCAL_OPTIMIZER_STEP`` (default on)."""
    previous = overlap.set_local_optimizer_step(False)
    try:
        assert not overlap.local_optimizer_step_enabled()
        monkeypatch.setenv(los.ENV, "off")
        assert overlap.set_local_optimizer_step(None) is False
        assert not overlap.local_optimizer_step_enabled()
        monkeypatch.delenv(los.ENV)
        overlap.set_local_optimizer_step(None)
        assert overlap.local_optimizer_step_enabled()
        with pytest.raises(TypeError, match="on must be True, False or None"):
            overlap.set_local_optimizer_step("no")  # type: ignore[arg-type]
    finally:
        overlap.set_local_optimizer_step(previous)


# ------------------------------------------------------------------------------------ world size 2
def _state_of_another_shape(rank: int) -> dict[str, Any]:
    """One foreach=False AdamW step, then the ``exp_avg`` of the (7, 5) weight replaced by a
    ``Shard(0)`` DTensor of global shape (6, 5): local rows 3 and 3 against the weight's 4 and 3, so
    on rank 1 alone the local shapes agree. The step's outcome and (engaged, fell back) counts."""
    from torch.distributed.tensor import Shard, distribute_tensor

    net = _sharded_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=False)
    net(_batch(0, rank)).square().sum().backward()
    opt.step()
    weight = net.blocks[0][0].weight
    opt.state[weight]["exp_avg"] = distribute_tensor(torch.zeros(6, 5), weight.device_mesh, [Shard(0)])
    opt.zero_grad(set_to_none=True)
    net(_batch(1, rank)).square().sum().backward()
    engaged, fell_back = los.engaged, los.fell_back
    try:
        opt.step()
        error = None
    except RuntimeError as e:
        error = type(e).__name__
    return {"error": error, "counts": (los.engaged - engaged, los.fell_back - fell_back)}


def _rank_world2(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    results = {"sharded": _local_vs_dtensor_path(rank)}
    results["hsdp"] = _local_vs_dtensor_path(rank, hsdp, ("adamw-foreach", "adamw-single", "sgd-momentum-foreach",
                                                          *(("adamw-fused",) if FUSED_CPU else ())))
    results["hsdp_placements"] = sorted({str(p.placements) for p in _sharded_net(hsdp).parameters()})
    results["state_of_another_shape"] = _state_of_another_shape(rank)
    return results


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    """Both 2-rank checks from one pair of gloo ranks."""
    from overlap.testing import run_distributed

    return run_distributed(_rank_world2, 2, timeout=300.0)


def test_local_step_is_the_dtensor_path_bitwise_on_2_ranks(world2: list[dict[str, Any]]) -> None:
    """Every config on uneven ``Shard(0)`` shards (and a ``Replicate()`` 0-dim parameter)."""
    for rank, result in enumerate(world2):
        _check_local_vs_dtensor_path(result["sharded"], f"rank {rank}")


def test_hsdp_local_step_is_the_dtensor_path_bitwise(world2: list[dict[str, Any]]) -> None:
    """HSDP parameters ``(Replicate(), Shard(0))`` on a 2x1 mesh."""
    for rank, result in enumerate(world2):
        assert result["hsdp_placements"] == ["(Replicate(), Replicate())", "(Replicate(), Shard(dim=0))"]
        _check_local_vs_dtensor_path(result["hsdp"], f"HSDP rank {rank}")


def test_state_of_another_global_shape_falls_back_on_every_rank(world2: list[dict[str, Any]]) -> None:
    """State whose global shape differs from its parameter's sends every rank to torch's DTensor path
    (which refuses the step on each), also the rank whose local shapes happen to agree: no rank
    steps locally while another raises."""
    for rank, result in enumerate(world2):
        got = result["state_of_another_shape"]
        assert got == {"error": "RuntimeError", "counts": (0, 1)}, (rank, got)
