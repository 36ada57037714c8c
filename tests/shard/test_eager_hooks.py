"""``overlap.eager_hooks.eager_hook``: the runtime's module hooks run eagerly under torch.compile (as
``torch._dynamo.disable`` makes them) and are called directly when nothing is compiled ([Note: a
disabled hook's cost outside torch.compile]).

What is checked, against ``torch._dynamo.disable`` itself as the reference:
* eager: the hook's own function is called (no Dynamo wrapper in between), with its arguments and
  result unchanged;
* under ``torch.compile`` of a function and of a module with the hook registered: the hook runs, but
  its body is never traced (``torch.compiler.is_compiling()`` is False inside, as under
  ``torch._dynamo.disable``), Dynamo breaks the graph at it, and the compiled results equal eager's.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from overlap.eager_hooks import eager_hook


def _called_from_dynamo_wrapper() -> bool:
    """Is a frame of torch/_dynamo/eval_frame.py (``torch._dynamo.disable``'s wrapper) on the stack?"""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith("torch/_dynamo/eval_frame.py"):
            return True
        frame = frame.f_back
    return False


def test_eager_call_is_direct_with_arguments_and_result() -> None:
    seen: list[tuple] = []

    def fn(a, b, *, c):
        seen.append((a, b, c, _called_from_dynamo_wrapper(), torch.compiler.is_compiling()))
        return a + b + c

    hook = eager_hook(fn)
    assert hook(1, 2, c=3) == 6
    assert seen == [(1, 2, 3, False, False)]
    assert hook.__wrapped__ is fn and hook._torchdynamo_disable is True
    # the reference: torch's own wrapper is on the stack of the same call
    assert torch._dynamo.disable(fn, recursive=True)(1, 2, c=3) == 6
    assert seen[-1] == (1, 2, 3, True, False)


def test_hook_called_from_compiled_code_runs_eagerly_like_dynamo_disable() -> None:
    torch._dynamo.reset()
    results = {}
    for name, wrap in (("eager_hook", eager_hook), ("dynamo.disable", lambda f: torch._dynamo.disable(f, recursive=True))):
        inside: list[bool] = []

        def body(x: torch.Tensor) -> torch.Tensor:
            inside.append(torch.compiler.is_compiling())
            return x * 2

        hook = wrap(body)

        def f(x: torch.Tensor) -> torch.Tensor:
            y = torch.sin(x) + 1
            y = hook(y)
            return torch.cos(y)

        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(f, backend="eager")
        x = torch.randn(5)
        out = [compiled(x), compiled(x)]
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        results[name] = (inside, breaks)
        for o in out:
            assert torch.equal(o, f(x))
        torch._dynamo.reset()
    # each of the two compiled calls ran the hook once, never traced (is_compiling False inside),
    # and Dynamo broke the graph at it: what torch._dynamo.disable gives
    assert results["eager_hook"][0][:2] == [False, False]
    assert results["eager_hook"] == results["dynamo.disable"]
    assert results["eager_hook"][1] >= 1


def test_module_forward_hooks_under_compiled_module_run_eagerly() -> None:
    torch._dynamo.reset()
    calls: list[tuple[str, bool]] = []

    def pre(module, args, kwargs):
        calls.append(("pre", torch.compiler.is_compiling()))
        return (args[0] + 1,), kwargs

    def post(module, args, output):
        calls.append(("post", torch.compiler.is_compiling()))
        return output * 3

    torch.manual_seed(0)
    eager = nn.Linear(4, 4)
    hooked = nn.Linear(4, 4)
    hooked.load_state_dict(eager.state_dict())
    hooked.register_forward_pre_hook(eager_hook(pre), with_kwargs=True)
    hooked.register_forward_hook(eager_hook(post))
    compiled = torch.compile(hooked, backend="eager")
    x = torch.randn(2, 4)
    for _ in range(2):
        assert torch.equal(compiled(x), eager(x + 1) * 3)
    assert calls == [("pre", False), ("post", False)] * 2
    torch._dynamo.reset()
