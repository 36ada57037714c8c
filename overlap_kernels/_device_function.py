"""``device_function``: ``triton.jit`` for the helpers that kernels call (never launched themselves).

Contract: ``device_function(fn)`` is ``triton.jit(fn)``, the same object on a GPU build. Under Triton's
interpreter (``TRITON_INTERPRET=1``) it is that ``InterpretedFunction`` with one difference, in a call
made while ``triton.language`` is patched for the interpreter (that is, from inside a launch): the
call runs the helper's rewritten function at once, without patching the language again. Any other
call (outside a launch), and every call on a Triton whose interpreter lacks what this relies on
(``InterpretedFunction.rewrite``, ``InterpreterError``), is the interpreter's own. Launches, compiles
and everything a GPU runs are untouched.

[Note: the interpreter's per-call patch]
Triton's interpreter (3.6 through 3.9) runs a launch by patching ``triton.language`` (every builtin
of ``tl``, ``tl.tensor``, ``tl.math`` and the descriptor base becomes an interpreter op) for the
launch's duration, then calls the kernel's rewritten Python once per program. A call of a jit
helper from inside goes through ``InterpretedFunction.__call__``, which patches the language once
more: four ``inspect.getmembers`` scans of those modules (a few hundred members, sorted) that find
nothing left to patch, since the launch's patch already replaced every builtin (which this module's
check reads: ``tl.load`` is no longer a builtin). The scope they record is dropped and the launch
restores the language when it ends, so the repeat changes nothing. It costs a few hundred µs per
call, and the packing kernels call helpers in every block of every program:
``tests/packing/test_kernels_ops.py`` took 75 s in one process on this project's 2-core CI box, 41 s
without the repeat (torch 2.13, Triton 3.9, 2026-12-04). What the call then runs is what it ran
before: the helper's rewritten function, with the same arguments, and an exception from it wrapped
in ``InterpreterError`` as the interpreter wraps it. Every kernel test compares the interpreted
kernels with pure-torch references.
"""
from __future__ import annotations

from typing import Any, Callable

import triton
import triton.language as tl

try:
    from triton.runtime.interpreter import InterpretedFunction, InterpreterError
except ImportError:  # a Triton without the interpreter: nothing to change
    InterpretedFunction = InterpreterError = None

__all__ = ["device_function"]


def _language_patched() -> bool:
    """Is ``triton.language`` patched for the interpreter now (inside a launch)? A patched builtin
    is the interpreter's wrapper, which carries no builtin mark."""
    return not tl.core.is_builtin(tl.load)


if InterpretedFunction is not None and hasattr(InterpretedFunction, "rewrite"):
    class _InterpretedHelper(InterpretedFunction):  # type: ignore[misc, valid-type]
        """An interpreted helper whose calls from inside a launch skip the repeat patch (see the
        Note); no state of its own, so an ``InterpretedFunction`` is turned into one in place."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if not _language_patched():
                return super().__call__(*args, **kwargs)
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise InterpreterError(repr(e)) from e
else:
    _InterpretedHelper = None


def device_function(fn: Callable[..., Any]) -> Any:
    """``triton.jit(fn)`` for a helper that kernels call; see the module docstring."""
    jitted = triton.jit(fn)
    if _InterpretedHelper is not None and type(jitted) is InterpretedFunction:
        jitted.__class__ = _InterpretedHelper
    return jitted
