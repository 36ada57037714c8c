"""A small FSDP-style model and its compiled training step, for tests and benchmarks of compiled code.

A test helper, not part of the installed package: test modules import it as ``compiled_step`` (pytest
puts ``tests/`` on ``sys.path``, as for ``models``), and ``benchmarks/bench_scheduler.py`` through
``benchmarks/_common.py``, which appends ``tests/`` to its ``sys.path``.

:class:`ShardedMLP` is ``blocks`` residual blocks ``x + fc2(gelu(fc1(x)))``. Each block keeps its
parameters as one flat dim-0 shard (a plain ``nn.Parameter``; the sharding rule of
``DESIGN.md``: ``ceil(n / w)`` elements per rank, the last ranks fewer or none, padding only in the
buffer that is communicated). Its forward all-gathers the shard with :func:`overlap.all_gather`
(under ``torch.compile`` that is ``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor``, see
``overlap.traced``) and its backward reduce-scatters the flat gradient (average over ranks), so a
compiled step holds one all-gather per block in the forward graph and one reduce-scatter per block
in the backward graph, each followed by its wait: what the Inductor hook reorders.

Unlike FSDP, the gathered parameters are not freed after forward: AOTAutograd saves them for
backward, so backward gathers nothing.

Shapes (``n = 2 * dim * hidden + hidden + dim`` per block, ``w`` ranks):

==================  ==========================  =====================================
tensor              shape                        notes
==================  ==========================  =====================================
block shard         ``(rows,)``                  ``rows = ceil(n / w)``, fewer at the end
gathered block      ``(w * ceil(n / w),)``       first ``n``: fc1.weight, fc1.bias,
                                                 fc2.weight, fc2.bias, flattened
input / output      ``(batch, dim)``
==================  ==========================  =====================================

:func:`compiled_step` returns a step (compiled forward and backward, then plain SGD on the shards)
that compiles on its first call. To compile with the overlap pass, build the step inside
``scheduler.inductor_overlap()`` (the pass then stays with it, recompiles included: see [Note:
torch.compile inside the block] in ``scheduler.inductor_hook``), or make its first call there. :func:`captured_code` collects the Python modules Inductor generates
meanwhile, and :func:`collective_gaps` reads from one how much compute each collective overlaps.
"""
from __future__ import annotations

import contextlib
import math
import re
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import overlap
from scheduler.torch_versions import funcol_reduce_scatter

__all__ = ["CollectiveGap", "ShardedBlock", "ShardedMLP", "captured_code", "collective_gaps", "compiled_step"]



class _GatherShard(torch.autograd.Function):
    """All-gather a flat shard in forward; reduce-scatter (average) its gradient in backward.

    The backward calls torch's functional collective directly: dynamo traces an autograd.Function's
    backward in strict mode, which rejects the ``x.layout`` read in ``overlap.reduce_scatter``'s
    input checks (torch 2.13).
    """

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        ctx.group = group
        return overlap.all_gather(shard, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group if ctx.group is not None else dist.group.WORLD
        reduced = funcol.wait_tensor(funcol_reduce_scatter(grad.contiguous(), "sum", 0, group))
        return reduced / dist.get_world_size(group), None


class ShardedBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))`` whose four parameters live in one flat shard (``self.shard``)."""

    def __init__(self, dim: int, hidden: int, rank: int, world_size: int,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        fc1, fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        full = torch.cat([p.detach().reshape(-1) for p in (fc1.weight, fc1.bias, fc2.weight, fc2.bias)])
        self.shapes = [(hidden, dim), (hidden,), (dim, hidden), (dim,)]
        self.numel = full.numel()
        self.rows = math.ceil(self.numel / world_size)
        start = min(rank * self.rows, self.numel)
        self.shard = nn.Parameter(full[start : min(start + self.rows, self.numel)].clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padded = F.pad(self.shard, (0, self.rows - self.shard.numel()))
        full = _GatherShard.apply(padded, self.group)[: self.numel]
        sizes = [math.prod(s) for s in self.shapes]
        w1, b1, w2, b2 = (t.view(s) for t, s in zip(full.split(sizes), self.shapes))
        return x + F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


class ShardedMLP(nn.Sequential):
    """``blocks`` :class:`ShardedBlock` s; every rank starts from the same full weights (``seed``)."""

    def __init__(self, blocks: int, dim: int, hidden: int, rank: int, world_size: int,
                 seed: int = 0, group: Optional[dist.ProcessGroup] = None) -> None:
        torch.manual_seed(seed)
        super().__init__(*[ShardedBlock(dim, hidden, rank, world_size, group) for _ in range(blocks)])


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def compiled_step(model: nn.Module, x: torch.Tensor, lr: float = 0.05) -> Callable[[], torch.Tensor]:
    """A training step on ``x``: compiled forward + backward (Inductor), then SGD on the shards.

    Returns ``step() -> loss`` (detached). The compile happens on the step's first call (backward
    graph: at its first backward). Each call of this function compiles its own copy of the loss
    function, see [Note: one code object per step].
    """
    # [Note: one code object per step]
    # Dynamo keeps compiled code per code object, not per torch.compile wrapper, and its guards
    # tell two ShardedMLPs of the same shapes apart only by type and sizes. Two steps compiling the
    # same function would therefore both run whichever compiled entry was added last (seen on
    # torch 2.13: the step compiled without the hook ran the hooked graph). A fresh code object
    # per step gives each step a cache of its own.
    loss_fn = types.FunctionType(_loss.__code__.replace(), _loss.__globals__, _loss.__name__)
    compiled = torch.compile(loss_fn, fullgraph=True)
    params = list(model.parameters())

    def step() -> torch.Tensor:
        loss = compiled(model, x)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.sub_(p.grad, alpha=lr)
                p.grad = None
        return loss.detach()

    return step


@contextlib.contextmanager
def captured_code() -> Iterator[list[str]]:
    """Collect the source of every module Inductor generates inside the block (fresh compiles only).

    Unlike ``torch._inductor.utils.run_and_get_code`` this does not reset dynamo, so compiled code
    made before stays cached. A graph served from Inductor's FX graph cache may not be seen:
    compile with ``fx_graph_cache=False`` to see every one.
    """
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        yield codes


@dataclass(frozen=True)
class CollectiveGap:
    """One collective in generated code: its op, its buffer, and the compute launched between its
    issue and its first ``wait_tensor`` (0: the wait comes right after it, nothing overlaps)."""

    op: str
    buffer: str
    compute_before_wait: int


# torch's functional collectives, and the CPU all-gather the hook emits (scheduler.cpu_all_gather:
# torch's out variant on a snapshot of the input, its out buffer the last argument)
_COLLECTIVE_LINE = re.compile(r"^(?:(\w+) = )?torch\.ops\."
                              r"(?:_c10d_functional\.(\w+)|overlap\.(snapshot_all_gather_into_tensor_out))"
                              r"\.default\((\w+)")
_WAIT = "wait_tensor"
_OUT_ARG = re.compile(r"\bout=(\w+)")
_LAST_ARG = re.compile(r"(\w+)\)$")
_COMPUTE_LINE = re.compile(r"^(?:\w+ = )?(?:extern_kernels\.\w+|cpp_fused_\w+|triton_\w+\.run|aten\.\w+)")


def collective_gaps(code: str) -> list[CollectiveGap]:
    """For each collective launched by the ``call`` function of Inductor's generated ``code``, in
    order, how many compute launches (extern kernels, generated kernels) run before its wait."""
    body = code[code.index("def call(self, args)") :].splitlines()[1:]
    pending: dict[str, tuple[str, int]] = {}  # buffer -> (op, compute launches since issue)
    gaps: list[CollectiveGap] = []
    for raw in body:
        line = raw.strip()
        if line.startswith("return"):
            break
        m = _COLLECTIVE_LINE.match(line)
        if m is not None:
            assigned, op, snapshot, first_arg = m.groups()
            out = _OUT_ARG.search(line) if snapshot is None else _LAST_ARG.search(line)
            if (snapshot or op).endswith("_out") and out is not None:  # writes its out buffer, which the wait reads
                op, assigned = "all_gather_into_tensor" if snapshot else op.removesuffix("_out"), out.group(1)
            if op == _WAIT:
                if first_arg in pending:
                    issued_op, compute = pending.pop(first_arg)
                    gaps.append(CollectiveGap(issued_op, first_arg, compute))
            else:  # an in-place collective (all_reduce_) writes its first argument
                pending[assigned or first_arg] = (op, 0)
        elif _COMPUTE_LINE.match(line):
            pending = {b: (op, n + 1) for b, (op, n) in pending.items()}
    gaps += [CollectiveGap(op, b, n) for b, (op, n) in pending.items()]  # never waited in this module
    return gaps
