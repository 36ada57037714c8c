"""The emulated link's eager patch: ``torch.distributed``'s collective functions, delayed by the link.

Contract. :func:`install` replaces each collective function of the table below on both
``torch.distributed`` and ``torch.distributed.distributed_c10d`` (both names are used, by users and by
torch itself, e.g. FSDP2 calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single``, on torch 2.11
``all_gather_into_tensor`` / ``reduce_scatter_tensor``) with a
wrapper; :func:`uninstall` puts the originals back (warning about, and leaving, a function someone
else replaced meanwhile). Both run under ``active.state_lock``, called by the package's activation.
A wrapper books the innermost active link (``timing.LinkModel.book``) for the call, with the bytes of
the argument the table names as payload, and runs the real collective (its inner collectives pass
through, see ``active``):

* CPU tensors: the real collective is issued with ``async_op=True`` and an :class:`~overlap.testing.
  emulated_link.work.EmulatedWork` is returned that completes no sooner than the booking's deadline;
  with ``async_op=False`` the wrapper waits it before returning. A wait without a timeout is bounded
  by the group's ``overlap.wait_timeout`` at issue (see [Note: timeouts behind the link]).
* CUDA tensors: ``cuda_sleep`` for the link time on the current stream, then the real collective;
  its ``Work`` is returned as is.

A call runs unmodelled when no link is active, inside another wrapper or kernel, while compiling, in
a process group that is not initialized or that this rank is not in, and inside
``dist._coalescing_manager``; so do modules that bound a collective with ``from torch.distributed
import all_reduce`` before the link was entered.

=============================================================  ==============  ===============
function                                                       kind            payload
=============================================================  ==============  ===============
all_gather_single, all_gather_into_tensor, _all_gather_base    all_gather      output bytes
all_gather                                                     all_gather      the output list
reduce_scatter_single, reduce_scatter_tensor, _reduce_scatter_base  reduce_scatter  input bytes
reduce_scatter                                                 reduce_scatter  the input list
all_reduce                                                     all_reduce      the tensor
broadcast                                                      broadcast       the tensor
all_to_all_single, all_to_all                                  all_to_all      input bytes
=============================================================  ==============  ===============
"""
from __future__ import annotations

import functools
import inspect
import time
import warnings
from types import ModuleType
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from overlap.errors import wait_timeout
from overlap.testing.emulated_link.active import current_link, inside, passing_through
from overlap.testing.emulated_link.cuda_sleep import cuda_sleep
from overlap.testing.emulated_link.timing import payload_bytes, tensors_in
from overlap.testing.emulated_link.work import EmulatedWork

__all__ = ["install", "uninstall"]

# collective function -> (argument holding the tensors whose bytes count, collective kind)
_COLLECTIVES: dict[str, tuple[str, str]] = {
    "all_gather_single": ("output_tensor", "all_gather"),
    "all_gather_into_tensor": ("output_tensor", "all_gather"),
    "_all_gather_base": ("output_tensor", "all_gather"),
    "all_gather": ("tensor_list", "all_gather"),
    "reduce_scatter_single": ("input", "reduce_scatter"),
    "reduce_scatter_tensor": ("input", "reduce_scatter"),
    "_reduce_scatter_base": ("input", "reduce_scatter"),
    "reduce_scatter": ("input_list", "reduce_scatter"),
    "all_reduce": ("tensor", "all_reduce"),
    "broadcast": ("tensor", "broadcast"),
    "all_to_all_single": ("input", "all_to_all"),
    "all_to_all": ("input_tensor_list", "all_to_all"),
}
_MODULES: tuple[ModuleType, ...] = (dist, c10d)
_patched: dict[tuple[ModuleType, str], tuple[Callable[..., Any], Callable[..., Any]]] = {}


def install() -> None:
    """Replace the collective functions by their wrappers (the first link's entry)."""
    for module in _MODULES:
        for name, (arg, kind) in _COLLECTIVES.items():
            original = getattr(module, name, None)
            if original is not None:
                wrapper = _wrap(name, original, arg, kind)
                _patched[(module, name)] = (original, wrapper)
                setattr(module, name, wrapper)


def uninstall() -> None:
    """Put the original functions back (the last link's exit)."""
    for (module, name), (original, wrapper) in _patched.items():
        if getattr(module, name, None) is wrapper:
            setattr(module, name, original)
        else:
            warnings.warn(
                f"{module.__name__}.{name} was replaced while an emulated link was active; "
                "leaving the replacement in place",
                RuntimeWarning,
                stacklevel=4,  # the `with` that left the link: uninstall <- deactivate <- __exit__
            )
    _patched.clear()


def _wrap(name: str, original: Callable[..., Any], arg: str, kind: str) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        link = current_link()
        if link is None or inside() or torch.compiler.is_compiling():
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        if not dist.is_initialized() or c10d._rank_not_in_group(group):
            return original(*args, **kwargs)  # let torch report or skip it
        group = group if group is not None else c10d._get_default_group()
        if group in c10d._world.pg_coalesce_state:
            return original(*args, **kwargs)
        tensors = tensors_in(bound.arguments.get(arg))
        payload = payload_bytes(tensors)
        if tensors and tensors[0].is_cuda:
            booking = link.book(group, name, kind, payload, time.monotonic())
            if booking.seconds > 0:
                cuda_sleep(booking.seconds, tensors[0].device)
            with passing_through():
                return original(*args, **kwargs)
        async_op = bool(bound.arguments.get("async_op", False))
        bound.arguments["async_op"] = True
        issued = time.monotonic()
        with passing_through():
            work = original(*bound.args, **bound.kwargs)
        booking = link.book(group, name, kind, payload, issued)
        emulated = EmulatedWork(work, booking.deadline, wait_timeout(group.group_name),
                                link_start=booking.deadline - booking.seconds)
        if async_op:
            return emulated
        emulated.wait()
        return None

    return wrapper
