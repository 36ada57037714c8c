"""Hooks that Dynamo never traces, at the cost of a plain call when nothing is being compiled.

:func:`eager_hook` wraps a module hook of the runtime (``overlap.shard``'s pre- and post-forward
hooks) so that it runs eagerly wherever Dynamo meets it, as ``torch._dynamo.disable(fn,
recursive=True)`` does, without paying that wrapper on every call of an uncompiled step.

[Note: a disabled hook's cost outside torch.compile]
``torch._dynamo.disable``'s wrapper clears Dynamo's frame callback, restores it after the call and
asks whether an export is running, on every call: 2-4 µs on the 2-core CI box, twice per block per
forward (the pre- and post-forward hooks), also in a step that nothing compiles. What it buys is
needed only where Dynamo is active: (1) Dynamo tracing a module's ``_call_impl`` must not inline the
hook (it looks for the ``_torchdynamo_disable`` attribute on the function it is about to inline and
breaks the graph there), and (2) a hook called while Dynamo's frame callback is set (from the
compiled code around a graph break) must not have its own frames, or those of the functions it
calls, compiled. :func:`eager_hook` keeps both: its wrapper carries the attribute, its code object
is marked for Dynamo to skip (``torch._dynamo.eval_frame.skip_code``: that frame only, the frames it
calls are still seen), and it asks the C getter of the frame callback first: none set (an eager
step, or the compiled graphs of a per-block compile, which run no Python frames of ours) calls the
hook directly; anything else (a callback, or ``False``: Dynamo's run-only mode) calls
``torch._dynamo.disable``'s wrapper, as before. Where this torch lacks either name, the hook is
``torch._dynamo.disable``'s wrapper alone.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

__all__ = ["eager_hook"]

F = TypeVar("F", bound=Callable[..., Any])

try:  # torch 2.11-2.15 have both; a release without them gets torch._dynamo.disable alone
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _frame_callback
    from torch._dynamo.eval_frame import skip_code as _skip_code
except ImportError:  # pragma: no cover - not on the supported releases
    _frame_callback = None
    _skip_code = None


def eager_hook(fn: F) -> F:
    """``fn`` (a hook) wrapped so that Dynamo never traces it, as ``torch._dynamo.disable(fn,
    recursive=True)`` does, and called directly when no Dynamo frame callback is set ([Note: a
    disabled hook's cost outside torch.compile]). Returns a new function; ``fn`` is unchanged."""
    disabled = torch._dynamo.disable(fn, recursive=True)
    if _frame_callback is None or _skip_code is None:
        return disabled  # type: ignore[return-value]
    frame_callback = _frame_callback

    def hook(*args: Any, **kwargs: Any) -> Any:
        if frame_callback() is None:
            return fn(*args, **kwargs)
        return disabled(*args, **kwargs)

    hook.__name__ = getattr(fn, "__name__", "hook")
    hook.__qualname__ = getattr(fn, "__qualname__", hook.__name__)
    hook.__wrapped__ = fn  # type: ignore[attr-defined]
    hook._torchdynamo_disable = True  # type: ignore[attr-defined]  # Dynamo: never inline, break the graph
    hook._torchdynamo_orig_callable = fn  # type: ignore[attr-defined]
    _skip_code(hook.__code__)  # one code object for every wrapper made here: idempotent
    return hook  # type: ignore[return-value]

