"""scheduler.inductor_overlap: the overlap pass as Inductor's post_grad_custom_post_pass.

What the generated code looks like (torch 2.13, CPU, gloo; ``f`` below), in ``call``:

* without the hook: ``all_gather_into_tensor``, ``wait_tensor``, the sum over the gathered
  tensor, then ``extern_kernels.mm``: the wait sits right after the collective, so nothing overlaps;
* with ``inductor_overlap()``: ``all_gather_into_tensor``, ``extern_kernels.mm``, the sum over the
  mm, then ``wait_tensor`` and the rest: the mm runs while the all-gather is in flight.

One ``torch.compile`` per case on each of 2 ranks (the ranks compile in parallel); everything else
runs the pass object directly on hand-written graphs.
"""
from __future__ import annotations

import types
from typing import Any, Optional

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from scheduler import OverlapGraphPass, inductor_overlap, install, uninstall
from scheduler.torch_versions import funcol_all_gather

C10D = torch.ops._c10d_functional
ATEN = torch.ops.aten


def _acceptance_graph() -> fx.Graph:
    """Inductor's post-grad graph for ``f`` below: the wait (and its sum) before the mm."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    ag = g.call_function(C10D.all_gather_into_tensor.default, (x, 2, "0"))
    wait = g.call_function(C10D.wait_tensor.default, (ag,))
    s1 = g.call_function(ATEN.sum.default, (wait,))
    mm = g.call_function(ATEN.mm.default, (w, w))
    s2 = g.call_function(ATEN.sum.default, (mm,))
    g.output(g.call_function(ATEN.add.Tensor, (s1, s2)))
    return g


def _targets(g: fx.Graph) -> list[Any]:
    return [n.target for n in g.nodes if n.op == "call_function"]


class _UserPass(CustomGraphPass):
    """A user's cacheable pass that counts its calls."""

    def __init__(self, uuid: Optional[str] = "user-pass-v1") -> None:
        self.calls = 0
        self._uuid = uuid

    def __call__(self, graph: fx.Graph) -> None:
        self.calls += 1

    def uuid(self) -> Optional[str]:
        return self._uuid


@pytest.fixture
def clean_config():
    """Inductor's config as it was, afterwards, whatever a test did."""
    saved = (inductor_config.post_grad_custom_post_pass, inductor_config.reorder_for_peak_memory)
    yield
    inductor_config.post_grad_custom_post_pass, inductor_config.reorder_for_peak_memory = saved


def test_uuid_is_stable_and_depends_on_options() -> None:
    assert OverlapGraphPass().uuid() == OverlapGraphPass().uuid() == OverlapGraphPass(None).uuid()
    assert OverlapGraphPass(1 << 20).uuid() == OverlapGraphPass(1 << 20).uuid()
    ids = {OverlapGraphPass().uuid(), OverlapGraphPass(1 << 20).uuid(), OverlapGraphPass(0).uuid()}
    assert len(ids) == 3 and None not in ids
    composed = OverlapGraphPass(None, _UserPass("a"))
    assert composed.uuid() == OverlapGraphPass(None, _UserPass("a")).uuid()
    assert composed.uuid() not in ids | {OverlapGraphPass(None, _UserPass("b")).uuid()}


def test_uuid_is_none_when_a_composed_pass_cannot_be_hashed() -> None:
    # Inductor bypasses its FX graph cache for such passes; so must the composition.
    assert OverlapGraphPass(None, lambda graph: None).uuid() is None
    assert OverlapGraphPass(None, _UserPass(uuid=None)).uuid() is None
    assert OverlapGraphPass(None, [_UserPass(), lambda graph: None]).uuid() is None


def test_context_sets_and_restores_config(clean_config) -> None:
    user = _UserPass()
    inductor_config.post_grad_custom_post_pass = user
    inductor_config.reorder_for_peak_memory = True
    with inductor_overlap(4096) as p:
        assert inductor_config.post_grad_custom_post_pass is p
        assert isinstance(p, CustomGraphPass) and p.previous is user and p.max_inflight_bytes == 4096
        assert inductor_config.reorder_for_peak_memory is False
        with inductor_overlap() as inner:  # nests: composes with the outer one
            assert inner.previous is p
        assert inductor_config.post_grad_custom_post_pass is p
    assert inductor_config.post_grad_custom_post_pass is user
    assert inductor_config.reorder_for_peak_memory is True
    with pytest.raises(KeyError):
        with inductor_overlap(keep_peak_memory_reorder=True):
            assert inductor_config.reorder_for_peak_memory is True
            raise KeyError("boom")
    assert inductor_config.post_grad_custom_post_pass is user


def test_install_uninstall_pair(clean_config) -> None:
    inductor_config.post_grad_custom_post_pass = None
    p = install(0)
    assert inductor_config.post_grad_custom_post_pass is p and p.previous is None
    uninstall()
    assert inductor_config.post_grad_custom_post_pass is None
    with pytest.raises(RuntimeError, match="install"):
        uninstall()


def test_wrong_argument_types_raise(clean_config) -> None:
    inductor_config.post_grad_custom_post_pass = None
    with pytest.raises(TypeError, match="max_inflight_bytes"):
        install("1 MiB")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keep_peak_memory_reorder"):
        install(keep_peak_memory_reorder=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_inflight_bytes"):
        with inductor_overlap(1.5):  # type: ignore[arg-type]
            pass
    assert inductor_config.post_grad_custom_post_pass is None  # nothing half-installed


def test_pass_takes_a_graph_runs_user_passes_first_then_reorders() -> None:
    seen: list[list[Any]] = []
    user = _UserPass()

    def plain_user_pass(graph: fx.Graph) -> None:
        seen.append(_targets(graph))

    g = _acceptance_graph()
    original = _targets(g)
    OverlapGraphPass(None, [user, plain_user_pass])(g)
    assert user.calls == 1 and seen == [original]  # the user's passes saw the graph unchanged
    targets = _targets(g)
    assert targets.index(ATEN.mm.default) < targets.index(C10D.wait_tensor.default)
    g.lint()


def test_inference_aware_user_pass_gets_is_inference() -> None:
    aware = pytest.importorskip("torch._inductor.custom_graph_pass").__dict__.get(
        "CustomInferenceAwareGraphPass"
    )
    if aware is None:
        pytest.skip(f"torch {torch.__version__} has no CustomInferenceAwareGraphPass (the hook then passes no "
                    "is_inference on; composing plain passes is tested above)")
    got: list[bool] = []

    class Aware(aware):  # type: ignore[misc,valid-type]
        def __call__(self, graph: fx.Graph, is_inference: bool) -> None:
            got.append(is_inference)

        def uuid(self) -> str:
            return "aware"

    OverlapGraphPass(None, Aware())(_acceptance_graph(), is_inference=True)
    assert got == [True]


# -- torch.compile on 2 gloo ranks ------------------------------------------------------------

def _call_body(code: str) -> list[str]:
    """The lines of the generated ``call`` that launch work (no asserts, comments, dels)."""
    lines = []
    for line in code[code.index("def call(self, args)"):].splitlines()[1:]:
        line = line.strip()
        if line.startswith("return"):
            break
        if line and not line.startswith(("#", "assert", "del ")):
            lines.append(line)
    return lines


def _first(lines: list[str], *needles: str) -> int:
    return next(i for i, line in enumerate(lines) if any(s in line for s in needles))


def _compile_with_and_without_hook(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    group = dist.group.WORLD

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = funcol_all_gather(x, 0, group)
        z = w @ w
        return y.sum() + z.sum()

    # Small integers: every sum is exact in float32, so compiled and eager agree bit for bit.
    x = torch.arange(32.0).view(4, 8) % 7 + rank
    w = torch.arange(256.0).view(16, 16) % 5 - 2
    eager = f(x, w)
    user_calls: list[int] = []

    def user_pass(graph: fx.Graph) -> None:
        user_calls.append(len(graph.nodes))

    result: dict[str, Any] = {}
    with inductor_config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        out, codes = run_and_get_code(torch.compile(f, backend="inductor"), x, w)
        result["without"] = (_call_body("\n".join(codes)), torch.equal(out, eager))

        inductor_config.post_grad_custom_post_pass = user_pass
        peak_before = inductor_config.reorder_for_peak_memory
        try:
            torch._dynamo.reset()
            with inductor_overlap():
                out, codes = run_and_get_code(torch.compile(f, backend="inductor"), x, w)
            result["with"] = (_call_body("\n".join(codes)), torch.equal(out, eager))
            result["restored"] = (
                inductor_config.post_grad_custom_post_pass is user_pass
                and inductor_config.reorder_for_peak_memory == peak_before
            )
        finally:
            inductor_config.post_grad_custom_post_pass = None
        torch._dynamo.reset()
    result["user_calls"] = len(user_calls)
    return result


def test_compiled_wait_moves_below_the_mm(distributed) -> None:
    for rank, r in enumerate(distributed(_compile_with_and_without_hook, 2, timeout=180)):
        without, without_equal = r["without"]
        with_hook, with_equal = r["with"]
        assert without_equal and with_equal, f"rank {rank}: compiled result differs from eager"
        mm = ("extern_kernels.mm", "aten.mm")

        def positions(lines: list[str]) -> tuple[int, int, int]:
            return (_first(lines, "all_gather_into_tensor"), _first(lines, *mm),
                    _first(lines, "wait_tensor"))

        gather, matmul, wait = positions(without)
        # Default Inductor: the wait right after the collective, before the independent mm.
        assert gather < wait < matmul, "\n".join(without)
        gather, matmul, wait = positions(with_hook)
        # With the hook: the mm is issued while the all-gather is in flight.
        assert gather < matmul < wait, "\n".join(with_hook)
        assert r["user_calls"] >= 1, "the user's post-grad pass did not run under the hook"
        assert r["restored"], "config not restored after inductor_overlap()"


# -- the README's form: torch.compile inside the block, first call (the compile) after it ----------


def _counting_pass(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the overlap pass's runs (one per graph Inductor compiles with it)."""
    from scheduler import graph_pass

    runs: list[int] = []
    original = graph_pass.overlap_graph

    def counted(graph: fx.Graph, *args: Any, **kwargs: Any) -> bool:
        runs.append(len(graph.nodes))
        return original(graph, *args, **kwargs)

    monkeypatch.setattr(graph_pass, "overlap_graph", counted)
    return runs


def _gather_then_mm(group: Any) -> Any:
    """A fresh ``train_step(x, w)``: all-gather ``x``, an independent ``w @ w``, a loss using both.
    Each call returns a copy with a code object of its own, so Dynamo's per-code-object cache never
    serves one compile to another (see [Note: one code object per step] in
    ``tests/compiled_step.py``)."""

    def train_step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = funcol_all_gather(x, 0, group)
        z = w @ w
        return y.sum() + z.sum()

    return types.FunctionType(train_step.__code__.replace(), train_step.__globals__, train_step.__name__,
                              closure=train_step.__closure__)


def test_readme_form_compiles_with_the_pass_after_the_block(single_rank_group, monkeypatch, clean_config) -> None:
    import torch._functorch.config as functorch_config

    import scheduler
    from compiled_step import captured_code, collective_gaps

    runs = _counting_pass(monkeypatch)
    torch_compile = torch.compile
    train_step = _gather_then_mm(single_rank_group)
    x = torch.arange(32.0).view(4, 8) % 7
    w = (torch.arange(256.0).view(16, 16) % 5 - 2).requires_grad_()

    with scheduler.inductor_overlap():
        step = torch.compile(train_step)
    assert torch.compile is torch_compile, "torch.compile is torch's own again after the block"
    assert runs == [], "nothing compiled yet: torch.compile is lazy"

    # Caches off: a graph served from the FX graph cache would not run the pass again.
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        with captured_code() as codes:
            loss = step(x, w)
        forward_runs = len(runs)
        loss.backward()  # the backward graph compiles now, lazily, still with the pass
        backward_runs = len(runs) - forward_runs

        later_step = torch.compile(_gather_then_mm(single_rank_group))  # after the block: no pass
        with captured_code() as later_codes:
            later_step(x, w.detach())

    assert forward_runs == 1 and backward_runs == 1, runs
    assert len(runs) == 2, "the function compiled after the block must not get the pass"
    assert torch.equal(loss.detach(), train_step(x, w).detach())
    (gap,) = [g for code in codes for g in collective_gaps(code)]
    assert gap.op == "all_gather_into_tensor" and gap.compute_before_wait > 0, "the mm runs before the wait"
    (later_gap,) = [g for code in later_codes for g in collective_gaps(code)]
    assert later_gap.compute_before_wait == 0, "Inductor's default: the wait right after the collective"


def _compile_arguments(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> dict[str, Any]:
    """What ``torch.compile(fn, **kwargs)`` hands its backend (Dynamo is not entered): the Inductor
    config patches, or for another backend the options it would get."""
    seen: dict[str, Any] = {}

    def optimize(backend: Any, **_: Any) -> Any:
        config = getattr(backend, "config", None)
        seen.update(config if config is not None else backend.kwargs.get("options") or {})
        return lambda fn: fn

    monkeypatch.setattr(torch._dynamo, "optimize", optimize)
    torch.compile(lambda t: t + 1, **kwargs)
    return seen


def test_compile_in_the_block_merges_mode_and_user_options(monkeypatch, clean_config) -> None:
    from scheduler.inductor_hook import compile_options

    user = _UserPass()
    with inductor_overlap(4096) as installed:
        plain = _compile_arguments(monkeypatch)
        tuned = _compile_arguments(monkeypatch, mode="max-autotune-no-cudagraphs")
        composed = _compile_arguments(monkeypatch, options={"post_grad_custom_post_pass": user,
                                                            "reorder_for_peak_memory": True})
        other_backend = _compile_arguments(monkeypatch, backend="aot_eager")
    assert plain == {"post_grad_custom_post_pass": installed, "reorder_for_peak_memory": False}
    assert tuned["post_grad_custom_post_pass"] is installed and tuned["max_autotune"] is True, tuned
    p = composed["post_grad_custom_post_pass"]
    assert isinstance(p, OverlapGraphPass) and p.previous is user and p.max_inflight_bytes == 4096
    assert composed["reorder_for_peak_memory"] is True, "an option the call gives itself wins"
    assert other_backend == {}, "only Inductor runs post-grad passes: other backends are left alone"
    assert _compile_arguments(monkeypatch) == {}, "after the block torch.compile adds nothing"
    explicit = compile_options(1 << 20, keep_peak_memory_reorder=True)
    assert set(explicit) == {"post_grad_custom_post_pass"}
    assert explicit["post_grad_custom_post_pass"].max_inflight_bytes == 1 << 20
    with pytest.raises(TypeError, match="keep_peak_memory_reorder"):
        compile_options(keep_peak_memory_reorder="yes")  # type: ignore[arg-type]
