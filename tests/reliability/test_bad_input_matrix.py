"""Bad input to every public function and constructor: a specific exception, a message that names the
argument and its allowed values, and nothing left broken behind.

One table row per invalid argument (``MATRIX``: ``overlap.*``, ``overlap_kernels.*``, ``scheduler.*``) on a
1-rank gloo group in this process, and the rows that need two ranks (``MATRIX_2_RANKS``: divisibility
by the group size, one entry per rank, ``src`` of another rank, shard-sized tensors) on 2 gloo ranks.

Each row: ``call(env)`` must raise ``exc`` (or a subclass of it; any other exception is a failure),
and ``str(e)`` must contain ``names`` (the argument, as the caller spelled it) and ``allowed`` (the
allowed values, or for a state error what to do instead). Then the environment must
still work as before the call (``check_usable``): every tensor, parameter, buffer and layout input
bitwise unchanged, the plain module still a plain module with the same output, the sharded module
giving the same output, a collective on the group matching its reference, a packing kernel matching
its reference, the graph pass still reordering, Inductor's config untouched, nothing left in flight.

Each row gets a fresh environment, so a row that changed something shows up as its own failure.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import overlap_kernels
import overlap
import scheduler
from scheduler.torch_versions import TORCH_VERSION
from fx_graphs import acceptance_graph, names
from overlap_kernels import ShardLayout

f32, bf16, i32 = torch.float32, torch.bfloat16, torch.int32
LAYOUT_SHAPES = [(5, 3), (7,), ()]
WORLD = 3  # of the kernels' layout (kernels know nothing of process groups)


# ------------------------------------------------------------------------------------ environment
class Env:
    """Fresh objects for one row: tensors, a plain and a sharded module, a layout with its tensors,
    an FX graph; and what each of them gives now, to compare with after the failed call."""

    def __init__(self, world: int = 1, rank: int = 0) -> None:
        self.world, self.rank = world, rank
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(4, 3, generator=gen)
        self.xi = torch.arange(4, dtype=i32)
        self.inp = torch.randn(2, 3, generator=gen)
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        self.sharded = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        overlap.shard(self.sharded[0])
        overlap.shard(self.sharded)
        self.layout = ShardLayout(LAYOUT_SHAPES, WORLD)
        self.fulls = [torch.randn(s, generator=gen) for s in LAYOUT_SHAPES]
        self.shards = self.layout.shards(self.fulls, 1)
        self.buffer = torch.randn(self.layout.buffer_numel, generator=gen)
        self.outs = [torch.zeros(s) for s in LAYOUT_SHAPES]
        self.slot = torch.randn(self.layout.slot_numel, generator=gen)
        self.shard_grads = [torch.zeros(s) for s in self.layout.shard_shapes(0)]
        self.mesh: Any = None
        # what must not change
        self.watched = {"x": self.x, "xi": self.xi, "inp": self.inp, "buffer": self.buffer, "slot": self.slot}
        self.watched.update({f"fulls[{i}]": t for i, t in enumerate(self.fulls)})
        self.watched.update({f"outs[{i}]": t for i, t in enumerate(self.outs)})
        self.watched.update({f"shard_grads[{i}]": t for i, t in enumerate(self.shard_grads)})
        self.watched.update({f"model.{k}": v for k, v in self.model.state_dict(keep_vars=True).items()})
        self.watched.update({f"sharded.{k}": v for k, v in self.sharded.state_dict(keep_vars=True).items()})
        self.before = {k: v.detach().clone() for k, v in self.watched.items()}
        with torch.no_grad():  # a grad-enabled forward without backward leaves the step open
            self.model_out = self.model(self.inp)
            self.sharded_out = self.sharded(self.inp)
        self.ag_expected = overlap_kernels.all_gather_copy_in_ref(self.shards, self.layout, 1)[0]
        self.graph_order = _pass_order()
        self.inductor = _inductor_config()

    def graph(self) -> fx.GraphModule:
        return acceptance_graph()

    def check_usable(self) -> list[str]:
        """What the failed call broke (empty: nothing)."""
        problems = []
        for k, v in self.watched.items():
            if not torch.equal(v.detach(), self.before[k]):
                problems.append(f"{k} changed")
        if type(self.model) is not nn.Sequential or any(isinstance(m, overlap.ShardedModule) for m in self.model.modules()):
            problems.append("the plain module was left (partly) sharded")
        if any(isinstance(p, DTensor) for p in self.model.parameters()) or any(
                type(m) not in (nn.Sequential, nn.Linear, nn.Tanh) for m in self.model.modules()):
            problems.append("the plain module was left (partly) parallelized")
        with torch.no_grad():
            if not torch.equal(self.model(self.inp), self.model_out):
                problems.append("the plain module's output changed")
            if not torch.equal(self.sharded(self.inp), self.sharded_out):
                problems.append("the sharded module's output changed")
        reduced = overlap.wait(overlap.all_reduce(self.x))
        expected = self.x.clone()
        dist.all_reduce(expected)
        if not torch.equal(reduced, expected):
            problems.append("a collective on the group no longer matches dist.all_reduce")
        if overlap.inflight():
            problems.append(f"collectives left in flight: {overlap.inflight()}")
        got = overlap_kernels.all_gather_copy_in(self.shards, self.layout, 1)[0]
        if not torch.equal(got, self.ag_expected):
            problems.append("all_gather_copy_in no longer matches its reference")
        if _pass_order() != self.graph_order:
            problems.append("overlap_pass orders a graph differently")
        if _inductor_config() != self.inductor:
            problems.append("Inductor's config changed")
        return problems


def _pass_order() -> list[str]:
    return names(scheduler.overlap_pass(acceptance_graph()))


def _inductor_config() -> tuple[Any, Any]:
    from torch._inductor import config

    return config.post_grad_custom_post_pass, config.reorder_for_peak_memory


def _enter(cm: contextlib.AbstractContextManager) -> None:
    with cm:
        pass


def _int_param_module() -> nn.Module:
    m = nn.Module()
    m.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    return m


class _GatheredAsBf16(torch.Tensor):
    """A tensor subclass with FSDP2's all-gather extension (torchao's float8 and NF4 weights have
    one): it gathers its values as bf16 and builds the unsharded parameter from them."""

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], None]:
        return (self.to(bf16),), None

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: None, param_dtype: torch.dtype, *,
                             out: Any = None) -> Any:
        return None if out is not None else (outputs[0].to(param_dtype), outputs)


class _PreAllGatherOnly(torch.Tensor):
    """Half of FSDP2's all-gather extension: no ``fsdp_post_all_gather``."""

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], None]:
        return (self.to(bf16),), None


class _TwoArgumentPreAllGather(_GatheredAsBf16):
    """An ``fsdp_pre_all_gather`` of neither signature FSDP2 knows (1 or 5 arguments)."""

    def fsdp_pre_all_gather(self, mesh: Any, module: Any) -> tuple[tuple[torch.Tensor, ...], None]:  # type: ignore[override]
        return (self.to(bf16),), None


def _extension_param_module(kind: type = _GatheredAsBf16) -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight = nn.Parameter(model[0].weight.detach().as_subclass(kind))
    return model


def _two_dim_mesh(env: Env) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))


class _ScaledLinear(nn.Linear):
    """A Linear whose own ``forward`` doubles the output (``tensor_parallel`` would replace it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def _tp_mesh(env: Env) -> Any:
    """The 1-D mesh over every rank that ``overlap.tensor_parallel`` rows parallelize over."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (env.world,))


def _tp_linear(mesh: Any) -> nn.Module:
    """A fresh Linear whose weight and bias are ``Shard(0)`` DTensors on ``mesh`` (each on every
    mesh dim when the mesh has several)."""
    from torch.distributed.tensor import distribute_tensor

    linear = nn.Linear(4, 4)
    for name, p in list(linear.named_parameters()):
        linear.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)] * mesh.ndim)))
    return linear


def _three_dim_mesh(env: Env) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))


# --------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Bad:
    """One invalid call, the exception it must raise and what its message must say."""

    call: Callable[[Env], object]
    exc: type[BaseException]
    names: str  # the argument, as the message names it
    allowed: str  # the allowed values (or, for a state error, what to do instead)


def _cpu_offload() -> object:
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy()


def _sd(env: Env, **changes: Any) -> dict[str, Any]:
    """The sharded module's full state dict with ``changes`` (a value ``None`` drops the key)."""
    sd = overlap.full_state_dict(env.sharded, rank0_only=False)
    for k, v in changes.items():
        key = k.replace("__", ".")
        if v is None:
            sd.pop(key)
        else:
            sd[key] = v
    return sd


MATRIX: dict[str, Bad] = {
    # overlap collectives ----------------------------------------------------------------------
    "all_gather x not a tensor": Bad(lambda e: overlap.all_gather([1.0, 2.0]), TypeError, "x", "torch.Tensor"),
    "all_gather x 0-dim": Bad(lambda e: overlap.all_gather(torch.tensor(1.0)), ValueError, "x", "at least 1 dim"),
    "all_gather x sparse": Bad(lambda e: overlap.all_gather(e.x.to_sparse()), TypeError, "x", "dense (strided)"),
    "all_gather dim not an int": Bad(lambda e: overlap.all_gather(e.x, dim="0"), TypeError, "dim", "int"),
    "all_gather dim out of range": Bad(lambda e: overlap.all_gather(e.x, dim=2), IndexError, "dim", "allowed -2..1"),
    "all_gather group not a group": Bad(lambda e: overlap.all_gather(e.x, group="world"), TypeError, "group",
                                        "ProcessGroup, a 1-D DeviceMesh, a (DeviceMesh, dim) pair or None"),
    "all_gather 2-D mesh without dim": Bad(lambda e: overlap.all_gather(e.x, group=_two_dim_mesh(e)), ValueError,
                                           "group", "pass (group, dim)"),
    "all_gather mesh dim name unknown": Bad(lambda e: overlap.all_gather(e.x, group=(_two_dim_mesh(e), "pp")),
                                            ValueError, "'pp'", "('dp', 'tp')"),
    "all_gather mesh dim negative": Bad(lambda e: overlap.all_gather(e.x, group=(_two_dim_mesh(e), -1)), ValueError,
                                        "group: mesh dim", "0..1"),
    "reduce_scatter op unknown": Bad(lambda e: overlap.reduce_scatter(e.x, op="mean"), ValueError, "op",
                                     "'sum', 'avg', 'max', 'min', 'product'"),
    "reduce_scatter op a ReduceOp": Bad(lambda e: overlap.reduce_scatter(e.x, op=dist.ReduceOp.SUM), TypeError, "op",
                                        "'sum', 'avg', 'max', 'min', 'product'"),
    "reduce_scatter dim not an int": Bad(lambda e: overlap.reduce_scatter(e.x, dim=0.0), TypeError, "dim", "int"),
    "all_reduce x None": Bad(lambda e: overlap.all_reduce(None), TypeError, "x", "torch.Tensor"),
    "all_reduce avg of ints": Bad(lambda e: overlap.all_reduce(e.xi, op="avg"), ValueError, "op='avg'",
                                  "floating-point tensor"),
    "all_to_all split not an int": Bad(lambda e: overlap.all_to_all(e.x, [1.5], [4]), TypeError,
                                       "output_split_sizes", "non-negative ints"),
    "all_to_all split negative": Bad(lambda e: overlap.all_to_all(e.x, [4], [-4]), ValueError,
                                     "input_split_sizes", "non-negative ints"),
    "all_to_all splits not a list": Bad(lambda e: overlap.all_to_all(e.x, 4, [4]), TypeError,
                                        "output_split_sizes", "None or a list of 1 non-negative ints"),
    "all_to_all splits do not sum": Bad(lambda e: overlap.all_to_all(e.x, [4], [3]), ValueError,
                                        "input_split_sizes", "sum to x.shape[0]=4"),
    "all_to_all input splits alone": Bad(lambda e: overlap.all_to_all(e.x, None, [4]), ValueError,
                                         "output_split_sizes", "needed when input_split_sizes is given"),
    "broadcast src out of range": Bad(lambda e: overlap.broadcast(e.x, src=1), ValueError, "src", "0..0"),
    "broadcast src a str": Bad(lambda e: overlap.broadcast(e.x, src="0"), TypeError, "src", "0..0"),
    "broadcast src a bool": Bad(lambda e: overlap.broadcast(e.x, src=True), TypeError, "src", "0..0"),
    "all_gather_coalesced xs a tensor": Bad(lambda e: overlap.all_gather_coalesced(e.x), TypeError, "xs",
                                            "list or tuple of tensors"),
    "all_gather_coalesced item not a tensor": Bad(lambda e: overlap.all_gather_coalesced([e.x, 3]), TypeError,
                                                  "xs[1]", "torch.Tensor"),
    "all_gather_coalesced item 0-dim": Bad(lambda e: overlap.all_gather_coalesced([e.x, torch.tensor(2.0)]),
                                           ValueError, "xs[1]", "at least 1 dim"),
    "all_gather_coalesced two devices": Bad(lambda e: overlap.all_gather_coalesced([e.x, e.x.to("meta")]),
                                            ValueError, "xs", "one device"),
    "all_gather_coalesced needs grad": Bad(lambda e: overlap.all_gather_coalesced([e.x.clone().requires_grad_()]),
                                           RuntimeError, "xs", "torch.no_grad()"),
    "reduce_scatter_coalesced needs grad": Bad(
        lambda e: overlap.reduce_scatter_coalesced([e.x.clone().requires_grad_()]), RuntimeError, "xs",
        "torch.no_grad()"),
    "reduce_scatter_coalesced op unknown": Bad(lambda e: overlap.reduce_scatter_coalesced([e.x], op="mean"),
                                               ValueError, "op", "'sum', 'avg', 'max', 'min', 'product'"),
    "reduce_scatter_coalesced avg of ints": Bad(lambda e: overlap.reduce_scatter_coalesced([e.x, e.xi], op="avg"),
                                                ValueError, "op (for xs[1]", "floating-point tensor"),
    # shard, wrap, no_sync, no_overlap, MixedPrecision, state dicts ---------------------------------
    "shard module not a module": Bad(lambda e: overlap.shard("linear"), TypeError, "module", "torch.nn.Module"),
    "shard prefetch negative": Bad(lambda e: overlap.shard(e.model, prefetch=-1), ValueError, "prefetch", "int >= 0"),
    "shard prefetch a str": Bad(lambda e: overlap.shard(e.model, prefetch="1"), TypeError, "prefetch", "int >= 0"),
    "shard prefetch a bool": Bad(lambda e: overlap.shard(e.model, prefetch=True), TypeError, "prefetch", "int >= 0"),
    "shard prefetch another str": Bad(lambda e: overlap.shard(e.model, prefetch="deep"), TypeError, "prefetch",
                                      "or 'auto'"),
    "shard budget zero": Bad(lambda e: overlap.shard(e.model, max_inflight_bytes=0), ValueError,
                             "max_inflight_bytes", "None or an int >= 1"),
    "shard budget a float": Bad(lambda e: overlap.shard(e.model, max_inflight_bytes=1.5e6), TypeError,
                                "max_inflight_bytes", "None or an int >= 1"),
    "shard reshard not a bool": Bad(lambda e: overlap.shard(e.model, reshard_after_forward=1), TypeError,
                                    "reshard_after_forward", "bool"),
    "shard mp a dtype": Bad(lambda e: overlap.shard(e.model, mp=torch.bfloat16), TypeError, "mp",
                            "None or an overlap.MixedPrecision"),
    "shard group not a group": Bad(lambda e: overlap.shard(e.model, group="world"), TypeError, "group",
                                   "ProcessGroup, a 1-D DeviceMesh"),
    "shard group and mesh": Bad(lambda e: overlap.shard(e.model, group=dist.group.WORLD, mesh=_two_dim_mesh(e)),
                                ValueError, "group or mesh", "not both"),
    "shard 3-D mesh": Bad(lambda e: overlap.shard(e.model, mesh=_three_dim_mesh(e)), ValueError, "mesh",
                          "1-D DeviceMesh (full sharding) or a 2-D one (HSDP"),
    "shard unknown option": Bad(lambda e: overlap.shard(e.model, prefetched=1), TypeError, "prefetched",
                                "unexpected keyword argument"),
    "shard int params in bf16": Bad(lambda e: overlap.shard(_int_param_module(), mp=overlap.MixedPrecision(bf16)),
                                    TypeError, "MixedPrecision.param_dtype", "floating-point parameters"),
    "shard twice": Bad(lambda e: overlap.shard(e.sharded), ValueError, "Sequential",
                       "already sharded (shard() was called on it before)"),
    "shard TP params with a process group": Bad(
        lambda e: overlap.shard(_tp_linear(_two_dim_mesh(e)["tp"])), ValueError, "mesh=",
        "the data-parallel dim of the same DeviceMesh"),
    "shard TP params over their own mesh": Bad(
        lambda e: overlap.shard(_tp_linear(_tp_mesh(e)), mesh=_tp_mesh(e)), ValueError, "mesh",
        "must be different dims of one DeviceMesh"),
    "shard DTensor params on a 2-D mesh": Bad(
        lambda e: overlap.shard(_tp_linear(_two_dim_mesh(e)), mesh=_two_dim_mesh(e)["dp"]), ValueError, "'weight'",
        "Shard or Replicate on a 1-D mesh"),
    # fully_shard (FSDP2's signature) and the FSDPModule methods -----------------------------------
    "fully_shard module not a module": Bad(lambda e: overlap.fully_shard("linear"), TypeError, "module",
                                           "torch.nn.Module or a non-empty list of them"),
    "fully_shard compress not a Compression": Bad(lambda e: overlap.fully_shard(e.model, compress="int8"), TypeError,
                                                  "compress", "overlap.Compression"),
    "fully_shard empty list": Bad(lambda e: overlap.fully_shard([]), TypeError, "module",
                                  "torch.nn.Module or a non-empty list of them"),
    "fully_shard list repeats a module": Bad(lambda e: overlap.fully_shard([e.model[0], e.model[0]]), ValueError,
                                             "module", "a module twice"),
    "fully_shard list with a sharded module": Bad(lambda e: overlap.fully_shard([e.model[0], e.sharded[0]]),
                                                  ValueError, "Linear", "already sharded"),
    "fully_shard CPU offload": Bad(lambda e: overlap.fully_shard(e.model, offload_policy=_cpu_offload()),
                                   NotImplementedError, "offload_policy", "use torch.distributed.fsdp.fully_shard"),
    "fully_shard offload not a policy": Bad(lambda e: overlap.fully_shard(e.model, offload_policy="cpu"), TypeError,
                                            "offload_policy", "OffloadPolicy() (no offload)"),
    "fully_shard placement not a Shard": Bad(
        lambda e: overlap.fully_shard(e.model, shard_placement_fn=lambda p: Replicate()), NotImplementedError,
        "shard_placement_fn", "return None or Shard(dim)"),
    "fully_shard placement dim out of range": Bad(
        lambda e: overlap.fully_shard(e.model, shard_placement_fn=lambda p: Shard(2)), ValueError,
        "shard_placement_fn", "the dim must be in [-2, 2)"),
    "fully_shard placement fn not callable": Bad(lambda e: overlap.fully_shard(e.model, shard_placement_fn=0),
                                                 TypeError, "shard_placement_fn", "None or a callable"),
    "fully_shard dp_mesh_dims not a DataParallelMeshDims": (
        Bad(lambda e: overlap.fully_shard(e.model, dp_mesh_dims=object()), TypeError, "dp_mesh_dims",
            "torch.distributed.fsdp.DataParallelMeshDims or None") if TORCH_VERSION >= (2, 13) else
        Bad(lambda e: overlap.fully_shard(e.model, dp_mesh_dims=object()), NotImplementedError, "dp_mesh_dims",
            "torch 2.13 or later")),
    "fully_shard mp_policy a dtype": Bad(lambda e: overlap.fully_shard(e.model, mp_policy=bf16), TypeError,
                                         "mp_policy", "MixedPrecisionPolicy or an overlap.MixedPrecision"),
    "fully_shard reshard a str": Bad(lambda e: overlap.fully_shard(e.model, reshard_after_forward="yes"), ValueError,
                                     "reshard_after_forward", "a bool, None or an int"),
    "fully_shard reshard int not a divisor": Bad(lambda e: overlap.fully_shard(e.model, reshard_after_forward=2),
                                                 ValueError, "reshard_after_forward", "divide the shard size 1"),
    "fully_shard mesh a str": Bad(lambda e: overlap.fully_shard(e.model, mesh="cpu"), TypeError, "mesh",
                                  "DeviceMesh or None"),
    "fully_shard ignored_params not params": Bad(lambda e: overlap.fully_shard(e.model, ignored_params=3), TypeError,
                                                 "ignored_params", "None or a set of parameters"),
    "fully_shard prefetch negative": Bad(lambda e: overlap.fully_shard(e.model, prefetch=-1), ValueError, "prefetch",
                                         "fully_shard: prefetch must be an int >= 0"),
    "FSDPModule set_requires_gradient_sync not a bool": Bad(
        lambda e: e.sharded.set_requires_gradient_sync(0), ValueError, "requires_gradient_sync", "bool"),
    "FSDPModule set_reshard_after_backward not a bool": Bad(
        lambda e: e.sharded.set_reshard_after_backward("no"), ValueError, "reshard_after_backward", "bool"),
    "ShardedModule set_gather_ahead not a bool": Bad(
        lambda e: e.sharded.set_gather_ahead(1), TypeError, "set_gather_ahead", "enabled must be a bool"),
    "ShardedModule set_schedule_trial not a bool": Bad(
        lambda e: e.sharded.set_schedule_trial("off"), TypeError, "set_schedule_trial", "enabled must be a bool"),
    "FSDPModule set_reshard_after_forward not a bool": Bad(
        lambda e: e.sharded.set_reshard_after_forward(1), ValueError, "reshard_after_forward", "bool"),
    "FSDPModule set_is_last_backward not a bool": Bad(
        lambda e: e.sharded.set_is_last_backward(None), ValueError, "is_last_backward", "bool"),
    "FSDPModule unshard async_op not a bool": Bad(
        lambda e: e.sharded.unshard(async_op="yes"), ValueError, "async_op", "bool"),
    "FSDPModule forward prefetch of a plain module": Bad(
        lambda e: e.sharded.set_modules_to_forward_prefetch([e.model]), ValueError, "set_modules_to_forward_prefetch",
        "sharded by overlap.fully_shard / overlap.shard"),
    "FSDPModule backward prefetch not a list": Bad(
        lambda e: e.sharded.set_modules_to_backward_prefetch(e.sharded[0]), ValueError, "modules",
        "a list of sharded modules"),
    "FSDPModule post-optimizer event not an event": Bad(
        lambda e: e.sharded.set_post_optim_event(1), ValueError, "event", "torch.Event"),
    "FSDPModule set_gradient_divide_factor zero": Bad(
        lambda e: e.sharded.set_gradient_divide_factor(0.0), ValueError, "set_gradient_divide_factor",
        "factor must be a positive finite number"),
    "FSDPModule set_gradient_divide_factor not a number": Bad(
        lambda e: e.sharded.set_gradient_divide_factor("2"), ValueError, "factor", "positive finite number"),
    "FSDPModule set_requires_all_reduce not a bool": Bad(
        lambda e: e.sharded.set_requires_all_reduce("no"), ValueError, "requires_all_reduce", "bool"),
    "FSDPModule set_keep_unsharded_storage not a bool": Bad(
        lambda e: e.sharded.set_keep_unsharded_storage("yes"), ValueError, "keep", "bool"),
    "FSDPModule set_custom_all_gather not a Comm": Bad(
        lambda e: e.sharded.set_custom_all_gather(print), ValueError, "comm", "with a callable allocate"),
    "FSDPModule set_custom_reduce_scatter not a Comm": Bad(
        lambda e: e.sharded.set_custom_reduce_scatter(None), ValueError, "comm", "torch.distributed.fsdp Comm"),
    "FSDPModule set_allocate_memory_from_process_group_for_comm not a bool": Bad(
        lambda e: e.sharded.set_allocate_memory_from_process_group_for_comm(1), ValueError, "enable", "bool"),
    "FSDPModule set_separate_reduce_scatter_group not a bool": Bad(
        lambda e: e.sharded.set_separate_reduce_scatter_group("yes"), ValueError, "enable", "bool"),
    "FSDPModule set_reduce_scatter_max_input_buffers zero": Bad(
        lambda e: e.sharded.set_reduce_scatter_max_input_buffers(0), ValueError, "max_input_buffers", "positive int"),
    "FSDPModule set_reduce_scatter_max_input_buffers a bool": Bad(
        lambda e: e.sharded.set_reduce_scatter_max_input_buffers(True), TypeError, "max_input_buffers", "an int"),
    "share_comm_ctx not a list": Bad(
        lambda e: overlap.share_comm_ctx(e.sharded), TypeError, "modules", "a list of sharded modules"),
    "share_comm_ctx a module not sharded": Bad(
        lambda e: overlap.share_comm_ctx([e.sharded, nn.Linear(2, 2)]), ValueError, "modules",
        "sharded by overlap.fully_shard or overlap.shard"),
    "register_fsdp_forward_method no such method": Bad(
        lambda e: overlap.register_fsdp_forward_method(e.sharded, "no_such_method"), ValueError, "method_name",
        "a method of"),
    "FSDPModule set_manual_backward_finalization not a bool": Bad(
        lambda e: e.sharded.set_manual_backward_finalization(1), ValueError, "enabled", "bool"),
    "FSDPModule finalize_backward async_op not a bool": Bad(
        lambda e: e.sharded.finalize_backward(async_op="yes"), ValueError, "async_op", "bool"),
    "FSDPModule set_all_reduce_hook not callable": Bad(
        lambda e: e.sharded.set_all_reduce_hook(0), ValueError, "hook", "callable"),
    "FSDPModule set_all_reduce_hook stream not a stream": Bad(
        lambda e: e.sharded.set_all_reduce_hook(print, stream=0), ValueError, "stream", "torch.cuda.Stream or None"),
    "fully_shard a parameter with half of FSDP2's all-gather extension": Bad(
        lambda e: overlap.fully_shard(_extension_param_module(_PreAllGatherOnly)), TypeError, "'0.weight'",
        "fsdp_post_all_gather"),
    "shard a parameter whose fsdp_pre_all_gather takes neither signature": Bad(
        lambda e: overlap.shard(_extension_param_module(_TwoArgumentPreAllGather)), TypeError, "'0.weight'",
        "(mesh, orig_size, contiguous_orig_stride, module, mp_policy)"),
    "shard compress= over a parameter with FSDP2's all-gather extension": Bad(
        lambda e: overlap.shard(_extension_param_module(), compress=overlap.Compression(gather="int8")), ValueError,
        "compress", "compress=None"),
    "FSDPModule set_reduce_scatter_unused_params not a bool": Bad(
        lambda e: e.sharded.set_reduce_scatter_unused_params(None), ValueError, "reduce_scatter_unused_params", "bool"),
    "FSDPModule set_unshard_in_backward not a bool": Bad(
        lambda e: e.sharded.set_unshard_in_backward(0), ValueError, "unshard_in_backward", "bool"),
    "FSDPModule set_force_sum_reduction_for_comms not a bool": Bad(
        lambda e: e.sharded.set_force_sum_reduction_for_comms(1), ValueError, "enable", "bool"),
    "wrap layer not a module": Bad(lambda e: overlap.wrap("linear"), TypeError, "layer", "torch.nn.Module"),
    "wrap bad option": Bad(lambda e: overlap.wrap(e.model, prefetch=-1), ValueError, "prefetch", "int >= 0"),
    "exclude_from_ddp model not a module": Bad(lambda e: overlap.exclude_from_ddp([e.model]), TypeError, "model",
                                               "torch.nn.Module"),
    "exclude_from_ddp nothing sharded": Bad(lambda e: overlap.exclude_from_ddp(e.model), ValueError, "exclude_from_ddp",
                                            "overlap.wrap / overlap.shard"),
    "Wrapped module not a module": Bad(lambda e: overlap.Wrapped("linear"), TypeError, "module", "torch.nn.Module"),
    "no_sync module not a module": Bad(lambda e: _enter(overlap.no_sync("model")), TypeError, "module",
                                       "torch.nn.Module sharded by overlap.shard"),
    "no_sync module not sharded": Bad(lambda e: _enter(overlap.no_sync(e.model)), ValueError, "no_sync",
                                      "call overlap.shard first"),
    "prefetch_next_step module not sharded": Bad(lambda e: overlap.prefetch_next_step(e.model), TypeError,
                                                  "prefetch_next_step", "module sharded by overlap.shard"),
    "optimizer_in_backward model not sharded": Bad(lambda e: overlap.optimizer_in_backward(e.model, torch.optim.SGD),
                                                    TypeError, "model", "root module passed to overlap.shard"),
    "optimizer_in_backward not an optimizer class": Bad(lambda e: overlap.optimizer_in_backward(e.sharded, "sgd"),
                                                        TypeError, "optimizer_class", "torch.optim.Optimizer"),
    "optimizer_in_backward bad max_norm": Bad(lambda e: overlap.optimizer_in_backward(e.sharded, torch.optim.SGD,
                                                                                      max_norm=-1.0, lr=0.1),
                                              ValueError, "max_norm", "finite number > 0"),
    "no_overlap module not a module": Bad(lambda e: _enter(overlap.no_overlap(3)), TypeError, "module",
                                          "torch.nn.Module sharded by overlap.shard"),
    "no_overlap module not sharded": Bad(lambda e: _enter(overlap.no_overlap(e.model)), ValueError, "no_overlap",
                                         "call overlap.shard first"),
    "Compression gather fp4": Bad(lambda e: overlap.Compression(gather="fp4"), ValueError, "Compression.gather",
                                  "None or one of ('int8', 'fp8')"),
    "Compression reduce fp4": Bad(lambda e: overlap.Compression(reduce="fp4"), ValueError, "Compression.reduce",
                                  "None or one of ('int8', 'fp8')"),
    "Compression block not a power of two": Bad(lambda e: overlap.Compression(block=100), ValueError,
                                                "Compression.block", "one of (32, 64, 128"),
    "shard compress a str": Bad(lambda e: overlap.shard(e.model, compress="int8"), TypeError, "compress",
                                "None or an overlap.Compression"),
    "MixedPrecision int param_dtype": Bad(lambda e: overlap.MixedPrecision(param_dtype=i32), TypeError,
                                          "param_dtype", "None or a floating-point torch.dtype"),
    "MixedPrecision str reduce_dtype": Bad(lambda e: overlap.MixedPrecision(reduce_dtype="bf16"), TypeError,
                                           "reduce_dtype", "None or a floating-point torch.dtype"),
    "MixedPrecision bool output_dtype": Bad(lambda e: overlap.MixedPrecision(output_dtype=torch.bool), TypeError,
                                            "output_dtype", "None or a floating-point torch.dtype"),
    "full_state_dict module not a module": Bad(lambda e: overlap.full_state_dict("model"), TypeError, "module",
                                               "torch.nn.Module"),
    "full_state_dict rank0_only not a bool": Bad(lambda e: overlap.full_state_dict(e.sharded, rank0_only=1),
                                                 TypeError, "rank0_only", "bool"),
    "load_full_state_dict module not a module": Bad(lambda e: overlap.load_full_state_dict("m", {}), TypeError,
                                                    "module", "torch.nn.Module"),
    "load_full_state_dict not a mapping": Bad(lambda e: overlap.load_full_state_dict(e.sharded, list(_sd(e).items())),
                                              TypeError, "state_dict", "mapping of str to tensors"),
    "load_full_state_dict missing key": Bad(lambda e: overlap.load_full_state_dict(e.sharded, _sd(e, **{"2__bias": None})),
                                            ValueError, "'2.bias'", "missing key"),
    "load_full_state_dict unexpected key": Bad(lambda e: overlap.load_full_state_dict(e.sharded, _sd(e, extra=e.x)),
                                               ValueError, "'extra'", "unexpected key"),
    "load_full_state_dict not a tensor": Bad(lambda e: overlap.load_full_state_dict(e.sharded, _sd(e, **{"0__bias": [0.0]})),
                                             ValueError, "'0.bias'", "not a tensor"),
    "load_full_state_dict wrong shape": Bad(
        lambda e: overlap.load_full_state_dict(e.sharded, _sd(e, **{"0__weight": torch.zeros(3, 4)})),
        ValueError, "'0.weight' has shape (3, 4)", "the model expects (4, 3)"),
    "load_checkpoint state_dict not a dict": Bad(lambda e: overlap.load_checkpoint([], checkpoint_id="c"), TypeError,
                                                 "state_dict", "a dict (as dcp.load takes)"),
    "load_checkpoint no checkpoint": Bad(lambda e: overlap.load_checkpoint(e.sharded.state_dict()), ValueError,
                                         "checkpoint_id", "or storage_reader"),
    "load_checkpoint reader not a reader": Bad(lambda e: overlap.load_checkpoint({}, storage_reader="c"), TypeError,
                                               "storage_reader", "torch.distributed.checkpoint.StorageReader"),
    "load_checkpoint staged not a bool": Bad(lambda e: overlap.load_checkpoint({}, checkpoint_id="c", staged=1),
                                             TypeError, "staged", "bool"),
    "device_info with an argument": Bad(lambda e: overlap.device_info("cuda"), TypeError, "device_info()",
                                        "takes 0 positional arguments"),
    "profile enabled not a bool": Bad(lambda e: overlap.profile(enabled=1), TypeError, "enabled", "bool"),
    "set_debug on not a bool": Bad(lambda e: overlap.set_debug("yes"), TypeError, "on", "True, False or None"),
    "set_local_optimizer_step on not a bool": Bad(lambda e: overlap.set_local_optimizer_step(1), TypeError, "on",
                                                  "True, False or None"),
    "set_check_finite on not a bool": Bad(lambda e: overlap.set_check_finite(1), TypeError, "on",
                                          "True, False or None"),
    "set_measure_gradient_error on not a bool": Bad(lambda e: overlap.set_measure_gradient_error(1), TypeError,
                                                    "set_measure_gradient_error", "True, False or None"),
    "measure_gradient_error on not a bool": Bad(lambda e: _enter(overlap.measure_gradient_error("yes")), TypeError,
                                                "on", "True or False"),
    "relative_gradient_error records not GradientError": Bad(lambda e: overlap.relative_gradient_error([0.5]),
                                                             TypeError, "records", "GradientError"),
    "check_finite on not a bool": Bad(lambda e: _enter(overlap.check_finite("yes")), TypeError, "on", "True or False"),
    "debug on not a bool": Bad(lambda e: _enter(overlap.debug(1)), TypeError, "on", "True, False or None"),
    "set_wait_timeout negative": Bad(lambda e: overlap.set_wait_timeout(-1.0), ValueError, "timeout",
                                     "a number of seconds or a datetime.timedelta, from 0.001 s (1 ms) to 1e+09 s"),
    "set_wait_timeout nan": Bad(lambda e: overlap.set_wait_timeout(float("nan")), ValueError, "got nan",
                                "a number of seconds or a datetime.timedelta, from 0.001 s (1 ms) to 1e+09 s"),
    "set_wait_timeout a str": Bad(lambda e: overlap.set_wait_timeout("5"), TypeError, "timeout",
                                  "a number of seconds or a datetime.timedelta"),
    "wait_timeout group not a name": Bad(lambda e: overlap.wait_timeout(dist.group.WORLD), TypeError, "group",
                                         "process group name (str; '' for WORLD)"),
    "wait_timeout unknown group": Bad(lambda e: overlap.wait_timeout("nope"), ValueError, "group 'nope'",
                                      "'' (WORLD) or a ProcessGroup's group_name"),
    "set_max_inflight_bytes zero": Bad(lambda e: overlap.inflight_work.set_max_inflight_bytes(0), ValueError,
                                       "limit", "None (no cap) or an int number of bytes >= 1"),
    "set_max_inflight_bytes a float": Bad(lambda e: overlap.inflight_work.set_max_inflight_bytes(1.5), TypeError,
                                          "limit", "None (no cap) or an int number of bytes >= 1"),
    # kernels ---------------------------------------------------------------------------------------
    "ShardLayout world_size zero": Bad(lambda e: ShardLayout(LAYOUT_SHAPES, 0), ValueError, "world_size", "int >= 1"),
    "ShardLayout world_size a float": Bad(lambda e: ShardLayout(LAYOUT_SHAPES, 2.0), TypeError, "world_size",
                                          "int >= 1"),
    "ShardLayout no shapes": Bad(lambda e: ShardLayout([], 2), ValueError, "param_shapes", "at least one shape"),
    "ShardLayout shapes a tensor": Bad(lambda e: ShardLayout(torch.zeros(3), 2), TypeError, "param_shapes",
                                       "sequence of shapes"),
    "ShardLayout negative dim": Bad(lambda e: ShardLayout([(4,), (-1, 2)], 2), ValueError, "param_shapes[1]",
                                    "non-negative ints"),
    "ShardLayout float dim": Bad(lambda e: ShardLayout([(4,), (2.0,)], 2), TypeError, "param_shapes[1]",
                                 "non-negative ints"),
    "ShardLayout shape a str": Bad(lambda e: ShardLayout([(4,), "ab"], 2), TypeError, "param_shapes[1]",
                                   "non-negative ints"),
    "ShardLayout.shard_rows index out of range": Bad(lambda e: e.layout.shard_rows(3, 0), IndexError, "index",
                                                     "[0, 3)"),
    "ShardLayout.shard_rows rank out of range": Bad(lambda e: e.layout.shard_rows(0, 3), ValueError, "rank", "[0, 3)"),
    "ShardLayout.shard_shape rank a float": Bad(lambda e: e.layout.shard_shape(0, 1.0), TypeError, "rank", "[0, 3)"),
    "ShardLayout.shard not a tensor": Bad(lambda e: e.layout.shard([1, 2], 0), TypeError, "tensor", "torch.Tensor"),
    "ShardLayout.shards wrong count": Bad(lambda e: e.layout.shards(e.fulls[:1], 0), ValueError, "tensors",
                                          "layout has 3 parameters"),
    "ShardLayout.shards not a list": Bad(lambda e: e.layout.shards(5, 0), TypeError, "tensors", "sequence of 3 tensors"),
    "ShardLayout.shards wrong shape": Bad(lambda e: e.layout.shards([e.x, *e.fulls[1:]], 0), ValueError,
                                          "tensors[0]", "layout expects (5, 3)"),
    "ShardLayout.shard_views wrong slot": Bad(lambda e: e.layout.shard_views(torch.zeros(5), 0), ValueError, "slot",
                                              "1-D with 48 elements"),
    "ShardLayout.shard_views slot not a tensor": Bad(lambda e: e.layout.shard_views([0.0] * 48, 0), TypeError,
                                                     "slot", "1-D torch.Tensor of 48 elements"),
    "ShardLayout.from_spec malformed": Bad(lambda e: ShardLayout.from_spec([3, 2, 1, 5]), ValueError, "spec",
                                           "(world_size, N, then per parameter ndim followed by its dims)"),
    "ShardLayout.from_spec not ints": Bad(lambda e: ShardLayout.from_spec("3"), TypeError, "spec",
                                          "sequence of ints"),
    "chunk_place buf of another dtype": Bad(
        lambda e: overlap_kernels.chunk_place(torch.zeros(4, 3), torch.zeros(2, 2, 3, dtype=torch.float16), [0, 2], [2, 2], 0),
        ValueError, "buf", "full's dtype and device"),
    "chunk_pack piece longer than the width": Bad(
        lambda e: overlap_kernels.chunk_pack(torch.zeros(2, 2, 3), torch.zeros(4, 3), [0, 2], [3, 1], 0), ValueError,
        "piece 0", "must fit in buf's width 2"),
    "all_gather_copy_in layout not a layout": Bad(lambda e: overlap_kernels.all_gather_copy_in(e.shards, "layout", 1),
                                                  TypeError, "layout", "overlap_kernels.ShardLayout"),
    "all_gather_copy_in rank out of range": Bad(lambda e: overlap_kernels.all_gather_copy_in(e.shards, e.layout, 3),
                                                ValueError, "rank", "[0, 3)"),
    "all_gather_copy_in rank a float": Bad(lambda e: overlap_kernels.all_gather_copy_in(e.shards, e.layout, 1.0), TypeError,
                                           "rank", "[0, 3)"),
    "all_gather_copy_in complex dtype": Bad(
        lambda e: overlap_kernels.all_gather_copy_in(e.shards, e.layout, 1, torch.complex64), TypeError, "dtype",
        "float64, float32, float16, bfloat16, int64"),
    "all_gather_copy_in too few shards": Bad(lambda e: overlap_kernels.all_gather_copy_in(e.shards[:2], e.layout, 1),
                                             ValueError, "shards", "the layout has 3 parameters"),
    "all_gather_copy_in shard of the wrong rank": Bad(lambda e: overlap_kernels.all_gather_copy_in(e.shards, e.layout, 2),
                                                      ValueError, "shards[0]", "the layout expects (1, 3)"),
    "all_gather_copy_out buffer short": Bad(lambda e: overlap_kernels.all_gather_copy_out(e.buffer[:-1], e.layout),
                                            ValueError, "ag_output", "exactly 144"),
    "all_gather_copy_out out not contiguous": Bad(
        lambda e: overlap_kernels.all_gather_copy_out(e.buffer, e.layout, [torch.zeros(3, 5).t(), *e.outs[1:]]),
        ValueError, "outs[0]", "must be contiguous"),
    "all_gather_copy_out out of another dtype": Bad(
        lambda e: overlap_kernels.all_gather_copy_out(e.buffer, e.layout, e.outs, dtype=bf16), TypeError, "outs[0]",
        "expected dtype=torch.bfloat16"),
    "reduce_scatter_copy_in scale a str": Bad(
        lambda e: overlap_kernels.reduce_scatter_copy_in(e.fulls, e.layout, pre_scale="0.5"), TypeError, "pre_scale",
        "None or a float"),
    "reduce_scatter_copy_in scaled ints": Bad(
        lambda e: overlap_kernels.reduce_scatter_copy_in([f.to(i32) for f in e.fulls], e.layout, 0.5), TypeError,
        "pre_scale", "floating-point tensors"),
    "reduce_scatter_copy_out accumulate an int": Bad(
        lambda e: overlap_kernels.reduce_scatter_copy_out(e.slot, e.shard_grads, e.layout, 0, accumulate=1), TypeError,
        "accumulate", "bool"),
    "reduce_scatter_copy_out scale a list": Bad(
        lambda e: overlap_kernels.reduce_scatter_copy_out(e.slot, e.shard_grads, e.layout, 0, post_scale=[1.0]), TypeError,
        "post_scale", "None or a float"),
    "reduce_scatter_copy_out slot short": Bad(
        lambda e: overlap_kernels.reduce_scatter_copy_out(e.slot[:-1], e.shard_grads, e.layout, 0), ValueError,
        "rs_output", "exactly 48"),
    # scheduler ---------------------------------------------------------------------------------------
    "overlap_pass gm a Graph": Bad(lambda e: scheduler.overlap_pass(e.graph().graph), TypeError, "gm",
                                   "torch.fx.GraphModule"),
    "overlap_pass budget negative": Bad(lambda e: scheduler.overlap_pass(e.graph(), max_inflight_bytes=-1),
                                        ValueError, "max_inflight_bytes", ">= 0"),
    "overlap_pass budget a str": Bad(lambda e: scheduler.overlap_pass(e.graph(), max_inflight_bytes="1 MiB"),
                                     TypeError, "max_inflight_bytes", "int or None"),
    "overlap_graph graph a GraphModule": Bad(lambda e: scheduler.overlap_graph(e.graph()), TypeError, "graph",
                                             "torch.fx.Graph"),
    "Scheduler model not a module": Bad(lambda e: scheduler.Scheduler("model"), TypeError, "model",
                                                        "torch.nn.Module"),
    "Scheduler group not a group": Bad(lambda e: scheduler.Scheduler(e.model, group="world"), TypeError, "group",
                                       "None or a torch.distributed.ProcessGroup"),
    "Scheduler verify not a bool": Bad(lambda e: scheduler.Scheduler(e.model, verify=1), TypeError, "verify",
                                       "None or a bool"),
    "install keep_peak_memory_reorder not a bool": Bad(lambda e: scheduler.install(keep_peak_memory_reorder=1),
                                                       TypeError, "keep_peak_memory_reorder", "bool"),
    "install budget negative": Bad(lambda e: scheduler.install(-1), ValueError, "max_inflight_bytes", ">= 0"),
    "inductor_overlap budget a float": Bad(lambda e: _enter(scheduler.inductor_overlap(1.5)), TypeError,
                                           "max_inflight_bytes", "int or None"),
    "OverlapGraphPass previous not callable": Bad(lambda e: scheduler.OverlapGraphPass(previous=[3]), TypeError,
                                                  "previous", "callables taking a torch.fx.Graph"),
    "compile_options budget negative": Bad(lambda e: _inductor_hook().compile_options(-1), ValueError,
                                           "max_inflight_bytes", ">= 0"),
    "inductor_overlap collective_matmul_chunks zero": Bad(
        lambda e: _enter(scheduler.inductor_overlap(collective_matmul_chunks=0)), ValueError,
        "collective_matmul_chunks", ">= 1"),
    "compile_options collective_matmul_chunks a float": Bad(
        lambda e: _inductor_hook().compile_options(collective_matmul_chunks=2.0), TypeError,
        "collective_matmul_chunks", "int or None"),
    # tensor_parallel (every plan entry is checked before any is applied) -----------------------------
    "tensor_parallel module not a module": Bad(lambda e: overlap.tensor_parallel("mlp", _tp_mesh(e), {}), TypeError,
                                               "module", "torch.nn.Module"),
    "tensor_parallel mesh a process group": Bad(
        lambda e: overlap.tensor_parallel(e.model, dist.group.WORLD, {"0": ColwiseParallel()}), TypeError, "mesh",
        "1-D torch.distributed DeviceMesh"),
    "tensor_parallel 2-D mesh": Bad(lambda e: overlap.tensor_parallel(e.model, _two_dim_mesh(e), {"0": ColwiseParallel()}),
                                    ValueError, "mesh", "1-D DeviceMesh (the TP dim; slice this 2-D one"),
    "tensor_parallel plan a list": Bad(lambda e: overlap.tensor_parallel(e.model, _tp_mesh(e), [ColwiseParallel()]),
                                       TypeError, "plan", "dict of submodule name (str) to a torch ParallelStyle"),
    "tensor_parallel missing submodule": Bad(
        lambda e: overlap.tensor_parallel(e.model, _tp_mesh(e), {"0": ColwiseParallel(), "fc9": RowwiseParallel()}),
        ValueError, "'fc9'", "names no submodule"),
    "tensor_parallel unknown style": Bad(
        lambda e: overlap.tensor_parallel(e.model, _tp_mesh(e), {"0": ColwiseParallel(), "2": "rowwise"}), TypeError,
        "'2'", "ColwiseParallel, RowwiseParallel, SequenceParallel"),
    "tensor_parallel colwise on a non-linear": Bad(
        lambda e: overlap.tensor_parallel(e.model, _tp_mesh(e), {"1": ColwiseParallel()}), ValueError, "'1'",
        "nn.Linear or nn.Embedding"),
    "tensor_parallel colwise feature-sharded input": Bad(
        lambda e: overlap.tensor_parallel(e.model, _tp_mesh(e), {"0": ColwiseParallel(input_layouts=Shard(-1))}),
        ValueError, "'0'", "Replicate() or Shard(d) with d >= 0"),
    "tensor_parallel rowwise feature-sharded output": Bad(
        lambda e: overlap.tensor_parallel(e.model, _tp_mesh(e), {"2": RowwiseParallel(output_layouts=Shard(-1))}),
        ValueError, "'2'", "Replicate() or Shard(d) with d >= 0"),
    "tensor_parallel one linear twice": Bad(
        lambda e: overlap.tensor_parallel(e.model, _tp_mesh(e), {"0": ColwiseParallel(), "*": RowwiseParallel()}),
        ValueError, "'0'", "one ColwiseParallel or RowwiseParallel"),
    "tensor_parallel Linear overriding forward": Bad(
        lambda e: overlap.tensor_parallel(nn.Sequential(_ScaledLinear(3, 4)), _tp_mesh(e), {"0": ColwiseParallel()}),
        ValueError, "'0'", "overrides nn.Linear.forward"),
    "tensor_parallel already sharded": Bad(
        lambda e: overlap.tensor_parallel(e.sharded, _tp_mesh(e), {"0": ColwiseParallel()}), ValueError, "'0'",
        "already has DTensor parameters"),
    "tensor_parallel chunks zero": Bad(lambda e: overlap.tensor_parallel(e.model, _tp_mesh(e), {}, chunks=0),
                                       ValueError, "chunks", "None (chosen from measured costs) or an int >= 1"),
    "tensor_parallel chunks a str": Bad(lambda e: overlap.tensor_parallel(e.model, _tp_mesh(e), {}, chunks="2"),
                                        TypeError, "chunks", "None (chosen from measured costs) or an int >= 1"),
    "compile_options keep_peak_memory_reorder not a bool": Bad(
        lambda e: _inductor_hook().compile_options(keep_peak_memory_reorder=1), TypeError, "keep_peak_memory_reorder",
        "bool"),
}


def _inductor_hook() -> Any:
    """``scheduler.inductor_hook`` (loaded on first use, like ``scheduler.install``)."""
    from scheduler import inductor_hook

    return inductor_hook


def _run_row(row: Bad, env: Env) -> list[str]:
    """Run one row; return what went wrong (empty: the right exception, message and nothing broken)."""
    problems = []
    try:
        row.call(env)
    except row.exc as e:
        message = str(e)
        for part, what in ((row.names, "the argument"), (row.allowed, "the allowed values")):
            if part not in message:
                problems.append(f"message does not name {what} ({part!r}): {message!r}")
    except Exception as e:  # noqa: BLE001  (reported: the wrong type)
        problems.append(f"raised {type(e).__name__}, not {row.exc.__name__}: {e}")
    else:
        problems.append(f"no {row.exc.__name__} raised")
    return problems + env.check_usable()


@pytest.mark.parametrize("row", list(MATRIX))
def test_bad_input_one_rank(single_rank_group: dist.ProcessGroup, row: str) -> None:
    """Each invalid argument: the named exception and message, and everything still works after."""
    assert _run_row(MATRIX[row], Env()) == []


def test_every_public_name_has_a_row() -> None:
    """The table covers every public callable that takes arguments (kept in sync with ``__all__``)."""
    no_arguments = {"inflight", "inflight_bytes", "max_inflight_bytes", "wait_all", "debug_enabled", "uninstall",  # none
                    "local_optimizer_step_enabled",
                    "wait", "wait_tensor", "is_pending",  # take any object (non-tensors pass through)
                    "AsyncTensor", "Completion", "Schedule", "ShardedModule", "FSDPModule", "UnshardHandle", "OptimizerInBackward", "DeviceInfo", "Profiler",
                    "CollectiveError", "CollectiveTimeoutError", "DesyncError", "CheckpointLoadError", "NonFiniteError", "check_finite_enabled", "take_gradient_errors", "GradientError", "ScheduleMismatchError"}
    # The types are built (or raised) by the library itself, and ``*_ref`` are the plain-torch
    # references.
    covered = " ".join(MATRIX) + " " + " ".join(MATRIX_2_RANKS)
    missing = [
        f"{mod.__name__}.{name}"
        for mod in (overlap, overlap_kernels, scheduler)
        for name in mod.__all__
        if name not in no_arguments and not name.endswith("_ref") and name not in covered
    ]
    assert missing == []


# ------------------------------------------------------------------------------------ two ranks
def _sharded_sd(env: Env, key: str, rank: int) -> dict[str, Any]:
    """The full state dict with ``key`` replaced by this rank's shard of it (the shape of a shard)."""
    sd = overlap.full_state_dict(env.sharded, rank0_only=False)
    sd[key] = ShardLayout([tuple(sd[key].shape)], 2).shard(sd[key], rank).clone()
    return sd


def _replicated(env: Env, key: str) -> DTensor:
    """``key``'s full tensor as a ``Replicate()`` DTensor on its sharded parameter's mesh."""
    full = overlap.full_state_dict(env.sharded, rank0_only=False)[key]
    return distribute_tensor(full, env.sharded.state_dict()[key].device_mesh, [Replicate()], src_data_rank=None)


MATRIX_2_RANKS: dict[str, Bad] = {
    "reduce_scatter rows not divisible": Bad(lambda e: overlap.reduce_scatter(torch.ones(5, 3)), ValueError,
                                             "x.shape[0]=5", "divisible by the group size 2"),
    "reduce_scatter dim 1 not divisible": Bad(lambda e: overlap.reduce_scatter(e.x, dim=1), ValueError,
                                              "x.shape[1]=3", "divisible by the group size 2"),
    "all_to_all rows not divisible": Bad(lambda e: overlap.all_to_all(torch.ones(5, 3)), ValueError,
                                         "x.shape[0]=5", "divisible by the group size 2"),
    "all_to_all one split for two ranks": Bad(lambda e: overlap.all_to_all(e.x, [4], [4]), ValueError,
                                              "output_split_sizes", "one entry per rank (2)"),
    "broadcast src of no rank": Bad(lambda e: overlap.broadcast(e.x, src=2), ValueError, "src", "0..1"),
    "reduce_scatter_coalesced rows not divisible": Bad(
        lambda e: overlap.reduce_scatter_coalesced([e.x, torch.ones(3)]), ValueError, "xs[1].shape[0]=3",
        "divisible by the group size 2"),
    "load_full_state_dict shard-sized tensor": Bad(
        lambda e: overlap.load_full_state_dict(e.sharded, _sharded_sd(e, "0.weight", e.rank)), ValueError,
        "'0.weight' has shape (2, 3)", "the model expects (4, 3)"),
    "load_full_state_dict DTensor on other placements": Bad(
        lambda e: overlap.load_full_state_dict(e.sharded, _sd(e, **{"0__weight": _replicated(e, "0.weight")})),
        ValueError, "'0.weight' is a DTensor with placements (Replicate(),)", "pass the full tensor"),
    "tensor_parallel rowwise in_features not divisible": Bad(
        lambda e: overlap.tensor_parallel(e.model, _tp_mesh(e), {"2": RowwiseParallel(), "0": RowwiseParallel()}),
        ValueError, "in_features=3", "divisible by the mesh size 2"),
    "full_state_dict rank0_only a str": Bad(lambda e: overlap.full_state_dict(e.sharded, rank0_only="yes"),
                                            TypeError, "rank0_only", "bool"),
}


def _two_rank_rows(rank: int, world_size: int) -> dict[str, list[str]]:
    """Every two-rank row, each with a fresh environment; returns the problems per row."""
    return {name: _run_row(row, Env(world_size, rank)) for name, row in MATRIX_2_RANKS.items()}


def test_bad_input_two_ranks(distributed: Callable[..., list[Any]]) -> None:
    """Rows whose validity depends on the group size: raised on every rank before any collective, so
    no rank hangs, and the group still runs collectives that match torch's afterwards."""
    for rank, problems in enumerate(distributed(_two_rank_rows, 2, timeout=120)):
        assert {k: v for k, v in problems.items() if v} == {}, f"rank {rank}"
