"""The ops as ``torch.ops.overlap.*``: registration, fake tensors, make_fx, torch.compile, dispatch.

What is checked, and what it means for users:

* ``torch.library.opcheck`` passes for all four ops (schema, fake implementation, AOT dispatch).
* ``make_fx`` records one ``overlap::*`` node per call, and the traced graph computes what eager does.
* ``torch.compile(fullgraph=True)`` of code calling the public functions works with ``aot_eager``
  and ``inductor`` on CPU (the ops are opaque custom ops with torch fallbacks, see
  ``overlap_kernels.library``), and equals eager bitwise.
* Eager calls launch exactly one kernel per op, whatever the number of parameters, without going
  through the dispatcher; without ``TRITON_INTERPRET`` the CPU takes the torch path, with results
  identical to the kernels'.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
import torch._dynamo.testing
from torch.utils._pytree import tree_leaves, tree_map

from kernel_cases import kernel_device, requires_kernels
from overlap_kernels import (
    ShardLayout,
    _jit,
    _launch,
    all_gather_copy_in,
    all_gather_copy_out,
    library,
    reduce_scatter_copy_in,
    reduce_scatter_copy_out,
)

SHAPES = [(10, 3), (7,), (), (0, 4), (5, 2, 3)]
WORLD_SIZE, RANK = 4, 1
REPO = Path(__file__).resolve().parents[2]

# torch's own Inductor internals warn about torch.jit.script_method on 2.13
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")



def data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def same(actual: object, expected: object) -> bool:
    """Equal structure, dtypes and bits, leaf by leaf (NaN-free data)."""
    a, e = tree_leaves(actual), tree_leaves(expected)
    return len(a) == len(e) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, e)
    )


class Inputs:
    """One set of arguments for all four ops, rank ``RANK`` of ``WORLD_SIZE``, mixed dtypes."""

    def __init__(self, world_size: int = WORLD_SIZE, rank: int = RANK) -> None:
        self.layout = layout = ShardLayout(SHAPES, world_size)
        self.rank = rank
        dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float32]
        self.fulls = [data(s, d, i) for i, (s, d) in enumerate(zip(SHAPES, dtypes))]
        # whole tensors, not views (see test_torch_compile_matches_eager)
        self.shards = [s.clone() for s in layout.shards(self.fulls, rank)]
        self.ag_output = data((layout.buffer_numel,), torch.bfloat16, 100)
        self.rs_output = data((layout.slot_numel,), torch.float32, 101)
        # sharded grads as views into one flat buffer, as an FSDP runtime keeps them
        self.flat_grads = data((sum(layout.shard_numel(i, rank) for i in range(len(SHAPES))),), torch.float32, 102)
        self.shard_grads = []
        offset = 0
        for i in range(len(SHAPES)):
            n = layout.shard_numel(i, rank)
            self.shard_grads.append(self.flat_grads[offset : offset + n].view(layout.shard_shape(i, rank)))
            offset += n


def run_all_ops(inputs: Inputs, shards: list[torch.Tensor], ag_output: torch.Tensor, fulls: list[torch.Tensor],
                rs_output: torch.Tensor, shard_grads: list[torch.Tensor]) -> tuple[object, ...]:
    layout, rank = inputs.layout, inputs.rank
    ag_input, _ = all_gather_copy_in(shards, layout, rank, torch.bfloat16)
    outs = all_gather_copy_out(ag_output, layout, dtype=torch.float32)
    rs_input = reduce_scatter_copy_in(fulls, layout, 0.25, torch.float32)
    reduce_scatter_copy_out(rs_output, shard_grads, layout, rank, 1 / 3, True)
    return ag_input, outs, rs_input


# ------------------------------------------------------------------------------------ registration
OP_NAMES = ["all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out"]


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_is_registered(name: str) -> None:
    schema = getattr(torch.ops.overlap, name).default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == {"all_gather_copy_out": ["outs"], "reduce_scatter_copy_out": ["shard_grads"]}.get(name, [])


def _opcheck_cases() -> dict[str, tuple[Callable[..., object], tuple[object, ...]]]:
    x = Inputs()
    # all_gather_copy_in leaves the other ranks' slots uninitialized (the all-gather fills them), so
    # its output is only comparable between runs on one rank: opcheck it with world_size 1.
    one = Inputs(world_size=1, rank=0)
    spec, ops = list(x.layout.spec), torch.ops.overlap
    return {
        "all_gather_copy_in": (ops.all_gather_copy_in.default, (one.shards, list(one.layout.spec), 0, torch.bfloat16)),
        "all_gather_copy_out": (ops.all_gather_copy_out.default, (x.ag_output, spec, [torch.empty(s) for s in SHAPES])),
        "reduce_scatter_copy_in": (ops.reduce_scatter_copy_in.default, (x.fulls, spec, 0.5, torch.float32)),
        "reduce_scatter_copy_out": (ops.reduce_scatter_copy_out.default,
                                    (x.rs_output, x.shard_grads, spec, RANK, 0.5, True)),
    }


@pytest.mark.parametrize("name", OP_NAMES)
def test_opcheck(name: str) -> None:
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


def test_dispatcher_rejects_bad_input_like_the_functions() -> None:
    x = Inputs()
    shards = list(x.shards)
    shards[0] = shards[0].reshape(-1)
    with pytest.raises(ValueError, match=r"shards\[0\]"):
        torch.ops.overlap.all_gather_copy_in(shards, list(x.layout.spec), RANK, None)
    with pytest.raises(TypeError, match="post_scale"):
        torch.ops.overlap.reduce_scatter_copy_out(
            x.rs_output, [g.to(torch.int32) for g in x.shard_grads], list(x.layout.spec), RANK, 0.5, False
        )


# ------------------------------------------------------------------------------------------ make_fx
@pytest.mark.parametrize("tracing_mode", ["real", "fake", "symbolic"])
def test_make_fx_records_the_ops(tracing_mode: str) -> None:
    x = Inputs()

    def step(shards: list[torch.Tensor], ag_output: torch.Tensor, fulls: list[torch.Tensor],
             rs_output: torch.Tensor, shard_grads: list[torch.Tensor]) -> tuple[object, ...]:
        return run_all_ops(x, shards, ag_output, fulls, rs_output, shard_grads)

    args = (x.shards, x.ag_output, x.fulls, x.rs_output, [g.clone() for g in x.shard_grads])
    graph = make_fx(step, tracing_mode=tracing_mode)(*args)
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    ops = torch.ops.overlap
    for op in (ops.all_gather_copy_in, ops.all_gather_copy_out, ops.reduce_scatter_copy_in, ops.reduce_scatter_copy_out):
        assert targets.count(op.default) == 1, targets

    traced_grads, eager_grads = [g.clone() for g in x.shard_grads], [g.clone() for g in x.shard_grads]
    traced = graph(x.shards, x.ag_output, x.fulls, x.rs_output, traced_grads)
    eager = step(x.shards, x.ag_output, x.fulls, x.rs_output, eager_grads)
    assert same(traced, eager)
    assert same(traced_grads, eager_grads)  # the in-place update is in the graph too


# ------------------------------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_matches_eager(backend: str) -> None:
    """fullgraph: no graph break around the public functions; results and the in-place update of
    the (view) sharded grads equal eager. On torch < 2.13 views of one tensor are refused with a
    clear error (``library.check_compiled_views``: Inductor there loses such writes), and separate
    tensors equal eager.

    The shards are passed as whole tensors: Inductor in torch 2.13 reads a clone of an input *view*
    with a storage offset from offset 0 when a custom op mutates that clone (reproduced with a
    one-line ``torch.library.custom_op``, so not specific to these ops); mutating input views, as
    here with the sharded grads, is fine.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    # Compiled afresh: torch 2.11's graph caches ignore the inputs' storage offsets and would serve a
    # graph compiled for views to separate tensors (seen: garbage values).
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        _compile_and_compare(backend)


def _compile_and_compare(backend: str) -> None:
    torch._dynamo.reset()
    x = Inputs()

    def step(shards: list[torch.Tensor], ag_output: torch.Tensor, fulls: list[torch.Tensor],
             rs_output: torch.Tensor, shard_grads: list[torch.Tensor]) -> tuple[object, ...]:
        ag_input, outs, rs_input = run_all_ops(x, shards, ag_output, fulls, rs_output, shard_grads)
        return ag_input * 2, [o + 1 for o in outs], rs_input * 3  # some compute around the ops

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    compiled_flat, eager_flat = x.flat_grads.clone(), x.flat_grads.clone()

    def views(flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[g.storage_offset() : g.storage_offset() + g.numel()].view(g.shape) for g in x.shard_grads]

    if library._LOSES_VIEW_WRITES:  # torch < 2.13 loses such writes: refused with a clear error instead
        with pytest.raises(Exception, match="shard_grads holds several views of one tensor.*torch 2.13"):
            compiled(x.shards, x.ag_output, x.fulls, x.rs_output, views(compiled_flat))
        assert torch.equal(compiled_flat, x.flat_grads), "nothing was written"
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend=backend)
        compiled_grads, eager_grads = ([g.clone() for g in x.shard_grads] for _ in range(2))  # separate tensors
        for _ in range(2):
            assert same(compiled(x.shards, x.ag_output, x.fulls, x.rs_output, compiled_grads),
                        step(x.shards, x.ag_output, x.fulls, x.rs_output, eager_grads))
            assert same(compiled_grads, eager_grads)
        assert not same(compiled_grads, x.shard_grads)  # they were updated
        return
    for _ in range(2):  # the second call runs the cached graph
        got = compiled(x.shards, x.ag_output, x.fulls, x.rs_output, views(compiled_flat))
        expected = step(x.shards, x.ag_output, x.fulls, x.rs_output, views(eager_flat))
        assert same(got, expected)
        assert torch.equal(compiled_flat, eager_flat)
    assert not torch.equal(compiled_flat, x.flat_grads)  # they were updated


def test_dynamo_graph_holds_the_ops() -> None:
    torch._dynamo.reset()
    x = Inputs()
    backend = torch._dynamo.testing.EagerAndRecordGraphs()

    def step(shards: list[torch.Tensor], ag_output: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return all_gather_copy_in(shards, x.layout, RANK)[1], all_gather_copy_out(ag_output, x.layout)

    torch.compile(step, fullgraph=True, backend=backend)([s.float() for s in x.shards], x.ag_output)
    (graph,) = backend.graphs
    code = graph.code
    assert "overlap.all_gather_copy_in" in code and "overlap.all_gather_copy_out" in code


# ------------------------------------------------------------------------------------------ dispatch
@requires_kernels
@pytest.mark.parametrize("num_params", [1, 40])
def test_one_launch_per_op_without_the_dispatcher(num_params: int, monkeypatch: pytest.MonkeyPatch) -> None:
    launches: list[str] = []
    real_launch = _launch.launch

    def counting_launch(kernel: object, *args: object, **kwargs: object) -> None:
        launches.append(kernel.__name__)  # type: ignore[attr-defined]
        real_launch(kernel, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_launch, "launch", counting_launch)
    shapes = [(3 + i % 5, 2) for i in range(num_params)]
    layout = ShardLayout(shapes, 2)
    fulls = [data(s, torch.float32, i).to(kernel_device()) for i, s in enumerate(shapes)]
    assert not library.use_dispatcher(fulls)
    _, ag_output = all_gather_copy_in(layout.shards(fulls, 0), layout, 0)
    all_gather_copy_out(ag_output, layout)
    rs_input = reduce_scatter_copy_in(fulls, layout, 0.5)
    reduce_scatter_copy_out(rs_input.view(2, -1)[0], [s.clone() for s in layout.shards(fulls, 0)], layout, 0, 2.0, True)
    assert launches == ["_all_gather_copy_in_kernel", "_all_gather_copy_out_kernel",
                        "_reduce_scatter_copy_in_kernel", "_reduce_scatter_copy_out_kernel"]


def test_use_dispatcher_when_tracing_or_under_a_mode() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    plain = [torch.zeros(2), torch.nn.Parameter(torch.zeros(2))]
    assert not library.use_dispatcher(plain)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.zeros(2))
        assert library.use_dispatcher([fake])
    assert library.use_dispatcher([fake])  # a subclass, even outside the mode


def test_triton_path_on_cpu_only_under_the_interpreter() -> None:
    assert _launch.triton_enabled(torch.device("cpu")) == _jit.INTERPRET
    assert not _launch.triton_enabled(torch.device("meta"))


def test_ops_are_tagged_cudagraph_unsafe_only_when_cuda_takes_the_torch_fallback() -> None:
    """[Note: ops in CUDA graphs]: the Triton launch path is capture-safe; the torch fallback that
    CUDA tensors take under ``TRITON_INTERPRET`` syncs the host (its NaN check), so then the ops
    carry ``torch.Tag.cudagraph_unsafe`` and Inductor's CUDA graphs leave them out."""
    unsafe = torch.Tag.cudagraph_unsafe
    assert library._cudagraph_tags(True) == (unsafe,) and library._cudagraph_tags(False) == ()
    for name in ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out"):
        tags = getattr(torch.ops.overlap, name).default.tags
        assert (unsafe in tags) == _jit.INTERPRET, (name, tags)


FALLBACK_CASES = [(1, 0), (2, 1), (3, 2), (4, 1), (8, 0), (8, 7)]
"""(world size, rank) pairs: SHAPES' 0-dim and (0, 4) parameters, short ranks, and empty shards on
high ranks (8 ranks: (7,) leaves rank 7 nothing, () every rank but 0)."""


def fallback_inputs(world_size: int, rank: int) -> dict[str, object]:
    x = Inputs(world_size, rank)
    return {"shapes": SHAPES, "world_size": world_size, "rank": rank, "shards": x.shards, "fulls": x.fulls,
            "ag_output": x.ag_output, "rs_output": x.rs_output, "shard_grads": x.shard_grads}


def run_fallback_ops(inputs: dict) -> dict[str, object]:
    """The four public ops on ``inputs`` with every option the runtime uses: casts both ways,
    mixed-dtype outs, a pre-scale and none, post-scale with accumulation and a plain copy (inputs
    are only read)."""
    layout = ShardLayout(inputs["shapes"], inputs["world_size"])
    rank = inputs["rank"]
    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    accumulated = [g.clone() for g in inputs["shard_grads"]]
    reduce_scatter_copy_out(inputs["rs_output"], accumulated, layout, rank, 1 / 3, True)
    copied = [torch.empty_like(g, dtype=bf16) for g in inputs["shard_grads"]]
    reduce_scatter_copy_out(inputs["rs_output"], copied, layout, rank)
    device = inputs["ag_output"].device
    mixed_outs = [torch.empty(s, dtype=d, device=device) for s, d in zip(layout.shapes, [f32, bf16, f16, f64, f32])]
    all_gather_copy_out(inputs["ag_output"], layout, mixed_outs)
    return {
        "ag_input": all_gather_copy_in(inputs["shards"], layout, rank, bf16)[0],
        "ag_input_fp32": all_gather_copy_in(inputs["shards"], layout, rank, f32)[0],
        "outs": all_gather_copy_out(inputs["ag_output"], layout, dtype=f16),
        "mixed_outs": mixed_outs,
        "rs_input": reduce_scatter_copy_in(inputs["fulls"], layout, 0.1, bf16),
        "rs_input_unscaled": reduce_scatter_copy_in(inputs["fulls"], layout, None, f32),
        "accumulated": accumulated,
        "copied": copied,
    }


_FALLBACK_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from overlap_kernels import _jit, _launch

    assert not _jit.INTERPRET and not _launch.triton_enabled(torch.device("cpu"))

    def no_launch(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched without the interpreter")

    _launch.launch = no_launch
    sys.path.insert(0, "tests/packing")
    from test_kernels_library import run_fallback_ops

    torch.save([run_fallback_ops(inputs) for inputs in torch.load(sys.argv[1])], sys.argv[2])
    """
)


def on_kernel_device(tree: object) -> object:
    """``tree`` with its tensors moved to :func:`kernel_device` (where the kernels launch)."""
    return tree_map(lambda t: t.to(kernel_device()) if isinstance(t, torch.Tensor) else t, tree)


def on_cpu(tree: object) -> object:
    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, tree)


@pytest.mark.skipif(not _jit.INTERPRET, reason="switches CPU tensors between the interpreted kernels and the "
                                               "fallback: needs TRITON_INTERPRET=1")
def test_torch_fallback_on_cpu_switches_this_process_and_back() -> None:
    """``overlap_kernels._launch.torch_fallback_on_cpu`` (what the suite's ``torch_kernels`` marker uses):
    inside it CPU tensors take the torch fallback even under the interpreter, with the kernels'
    results bitwise; after it, the kernels again."""
    from overlap_kernels._launch import torch_fallback_on_cpu, triton_enabled

    cpu = torch.device("cpu")
    inputs = fallback_inputs(3, 2)
    kernel = run_fallback_ops(inputs)
    with torch_fallback_on_cpu():
        assert not triton_enabled(cpu)
        fallback = run_fallback_ops(inputs)
    assert triton_enabled(cpu) == _jit.INTERPRET
    for key in kernel:
        assert same(fallback[key], kernel[key]), key


@requires_kernels
def test_torch_fallback_without_the_interpreter_equals_the_kernels(tmp_path: Path) -> None:
    """A fresh process with ``TRITON_INTERPRET=0`` (no GPU visible) computes the four ops with torch
    alone (the batched fallbacks, see ``test_kernels_torch_fallback``) over world sizes 1 to 8,
    first and last ranks; the results equal the kernels' here (interpreted, or on the GPU), bitwise."""
    cases = [fallback_inputs(w, r) for w, r in FALLBACK_CASES]
    torch.save(cases, tmp_path / "inputs.pt")
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", _FALLBACK_SCRIPT, str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    fallback = torch.load(tmp_path / "outputs.pt")
    assert len(fallback) == len(cases)
    for (w, r), inputs, got in zip(FALLBACK_CASES, cases, fallback):
        kernel = on_cpu(run_fallback_ops(on_kernel_device(inputs)))
        for key in kernel:
            assert same(got[key], kernel[key]), (w, r, key)
