"""The emulated link for functional collectives: CPU kernels for ``torch.ops._c10d_functional``.

What ``torch.distributed._functional_collectives``, DTensor, ``make_fx`` graphs and Inductor's
generated code call at run time. Inductor's code looks the ops up by attribute at run time
(``torch.ops._c10d_functional.all_gather_into_tensor.default(...)``), but replacing those Python
attributes would break every identity check (``target is ...wait_tensor.default``) in the tracers,
Inductor and the overlap graph pass. So :func:`register` registers kernels for the ops' ``CPU``
dispatch key with ``torch.library`` instead: torch implements them as ``CompositeExplicitAutograd``
kernels, which a ``CPU`` kernel takes precedence over; ours add the timing and run torch's kernel
by redispatching with the GIL released (see [Note: calling torch's kernel without the GIL]). Op
objects, graphs and fake-tensor tracing are untouched, and compiling while a link is active is fine.

Contract. While registered (from the entry of the first link made with ``functional=True`` to the
exit of the last link, under ``active.state_lock``), an issuing op of the table below, on CPU
tensors, runs torch's kernel, books the group's FIFO link of the innermost active link like any
other collective (``timing.LinkModel.book``, counted as ``_c10d_functional.<op>``) and records the
booking's deadline against the storage of each of its outputs (``all_gather_into_tensor`` runs as
torch's ``all_gather_into_tensor_out`` into a new tensor, here with or without a link: see
:func:`_gathered_into_out`); ``wait_tensor`` on that storage (the
output or a view of it) sleeps until then (``work.sleep_within``, bounded by the group's
``overlap.wait_timeout`` at issue, see [Note: timeouts behind the link]), then runs the real wait. A
second wait finds nothing recorded and does not sleep; an output with no bytes (an empty tensor) is
booked but not delayed; a ``_coalesced`` op is one collective (one booking) for all its tensors. With
no link active, or inside a modelled call (``active``), the kernels only run torch's. After
:func:`unregister`, a result waited is not delayed. Not covered: CUDA tensors (their kernel runs on
the ``CUDA`` key, and sleeping on the caller's stream would stall its compute, not a link), and a
torch whose ops have kernels of their own on the ``CPU`` or ``PrivateUse1`` key (a warning, then
full speed).

==================================================================  ==============  ==========
functional op (``_c10d_functional.``)                               kind            payload
==================================================================  ==============  ==========
all_gather_into_tensor, all_gather_into_tensor_out, ..._coalesced   all_gather      output
reduce_scatter_tensor, reduce_scatter_tensor_coalesced              reduce_scatter  input
all_reduce, all_reduce_, all_reduce_coalesced, ..._coalesced_      all_reduce      input
all_to_all_single                                                   all_to_all      input
broadcast, broadcast_                                               broadcast       input
==================================================================  ==============  ==========
"""
from __future__ import annotations

import datetime
import threading
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from overlap.errors import wait_timeout
from overlap.testing.emulated_link.active import current_link, inside, passing_through
from overlap.testing.emulated_link.timing import payload_bytes, tensors_in
from overlap.testing.emulated_link.work import sleep_within

__all__ = ["FUNCTIONAL_NAMESPACE", "register", "unregister"]

FUNCTIONAL_NAMESPACE = "_c10d_functional"
# functional op -> (whose bytes count: its first argument "input" or its result "output",
#                   collective kind); each takes a ``group_name`` argument
_FUNCTIONAL: dict[str, tuple[str, str]] = {
    "all_gather_into_tensor": ("output", "all_gather"),
    "all_gather_into_tensor_out": ("output", "all_gather"),
    "all_gather_into_tensor_coalesced": ("output", "all_gather"),
    "reduce_scatter_tensor": ("input", "reduce_scatter"),
    "reduce_scatter_tensor_coalesced": ("input", "reduce_scatter"),
    "all_reduce": ("input", "all_reduce"),
    "all_reduce_": ("input", "all_reduce"),
    "all_reduce_coalesced": ("input", "all_reduce"),
    "all_reduce_coalesced_": ("input", "all_reduce"),
    "all_to_all_single": ("input", "all_to_all"),
    "broadcast": ("input", "broadcast"),
    "broadcast_": ("input", "broadcast"),
}

_library: torch.library.Library | None = None  # the functional collectives' CPU kernels, while active
# storage address -> (completion time of the functional collective writing it, its wait's timeout)
_deadlines: dict[int, tuple[float, datetime.timedelta]] = {}
_deadlines_lock = threading.Lock()
_warned_unusual_registration = False


# [Note: calling torch's kernel without the GIL]
# The dispatcher runs a kernel registered from Python with the GIL held, and
# ``SafeKernelFunction.call_boxed`` (``torch.library.get_kernel``) keeps holding it while torch's
# kernel runs. That deadlocks on gloo (seen on torch 2.13): a gloo worker thread destroys a finished
# work while holding the process group's queue lock, which drops the last reference to a tensor
# that has a Python object and so needs the GIL; the main thread, holding the GIL inside our kernel,
# blocks on that lock when it issues the next collective (or in ``wait_tensor`` on a work behind
# it). ``OpOverload.redispatch`` releases the GIL around the call, so our kernels reach torch's
# kernel that way: torch registers these ops once, as ``CompositeExplicitAutograd``, which fills
# the dispatch table entry of every backend key, ``PrivateUse1`` included; redispatching to that
# key runs the same kernel our ``CPU`` entry replaced (the kernel dispatches its own collectives
# by the tensors' device, so nothing of PrivateUse1 reaches the process group). Registration checks
# that neither key has a kernel of its own and otherwise leaves functional collectives alone.
_TORCH_KERNEL_KEY = "PrivateUse1"

def _uses_torch_composite_kernel(op: torch._ops.OpOverload) -> bool:
    """True when ``op``'s CPU and PrivateUse1 entries both hold its CompositeExplicitAutograd kernel."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    name = op._schema.name + (f".{op._schema.overload_name}" if op._schema.overload_name else "")
    return (has(name, "CompositeExplicitAutograd") and not has(name, "CPU")
            and not has(name, _TORCH_KERNEL_KEY))


def register() -> None:
    """Give the functional collectives and ``wait_tensor`` CPU kernels that model the link (once:
    nothing happens while they are registered). Warns once, and registers nothing, on a torch whose
    ops have kernels of their own on the CPU or PrivateUse1 key."""
    global _library, _warned_unusual_registration
    if _library is not None:
        return
    ops = {name: _functional_overload(name) for name in (*_FUNCTIONAL, "wait_tensor")}
    ops = {name: op for name, op in ops.items() if op is not None}
    if "wait_tensor" not in ops or not all(_uses_torch_composite_kernel(op) for op in ops.values()):
        if not _warned_unusual_registration:
            _warned_unusual_registration = True
            warnings.warn(
                "torch.ops._c10d_functional has kernels of its own on the CPU or PrivateUse1 key here: "
                "functional collectives (and compiled code) are not slowed by the emulated link",
                RuntimeWarning,
                stacklevel=4,  # the `with` that entered the link: register <- activate <- __enter__
            )
        return
    torch_kernel = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _TORCH_KERNEL_KEY))
    library = torch.library.Library(FUNCTIONAL_NAMESPACE, "IMPL")
    try:
        for name, op in ops.items():
            if name == "wait_tensor":
                kernel = _wait_kernel(op, torch_kernel)
            else:
                which, kind = _FUNCTIONAL[name]
                kernel = _issue_kernel(op, name, torch_kernel, which, kind)
            library.impl(name, kernel, "CPU")
    except BaseException:
        library._destroy()
        raise
    _library = library


def unregister() -> None:
    """Remove the kernels (if registered) and forget the deliveries not waited yet."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None
    with _deadlines_lock:
        _deadlines.clear()


def _functional_overload(name: str) -> torch._ops.OpOverload | None:
    """``torch.ops._c10d_functional.<name>.default``, or None where this torch lacks the op."""
    try:
        return getattr(getattr(torch.ops, FUNCTIONAL_NAMESPACE), name).default
    except (AttributeError, RuntimeError):
        return None


def _process_group(group_name: Any) -> dist.ProcessGroup:
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    return c10d._resolve_process_group(group_name)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _issue_kernel(
    op: torch._ops.OpOverload, name: str, torch_kernel: Any, which: str, kind: str
) -> Callable[..., Any]:
    """A CPU kernel for ``op`` that runs torch's kernel and books the link for it."""
    group_index = [a.name for a in op._schema.arguments].index("group_name")
    label = f"{FUNCTIONAL_NAMESPACE}.{name}"

    run_torch = _gathered_into_out(torch_kernel) if name == "all_gather_into_tensor" else (
        lambda *args, **kwargs: op.redispatch(torch_kernel, *args, **kwargs))  # see [Note: calling torch's kernel without the GIL]

    def kernel(*args: Any, **kwargs: Any) -> Any:
        link = current_link()
        if link is None or inside():
            return run_torch(*args, **kwargs)
        group_name = args[group_index] if group_index < len(args) else kwargs["group_name"]
        group = _process_group(group_name)
        issued = time.monotonic()
        with passing_through():
            result = run_torch(*args, **kwargs)
        outputs = tensors_in(result)
        counted = outputs if which == "output" else tensors_in(args[0])
        booking = link.book(group, label, kind, payload_bytes(counted), issued)
        if booking.seconds > 0:
            timeout = wait_timeout(group.group_name)
            with _deadlines_lock:
                for t in outputs:
                    if t.untyped_storage().nbytes() > 0:
                        _deadlines[_storage_key(t)] = (booking.deadline, timeout)
        return result

    return kernel


def _gathered_into_out(torch_kernel: Any) -> Callable[..., Any]:
    """``all_gather_into_tensor(input, group_size, group_name)`` run as torch's
    ``all_gather_into_tensor_out`` into a new tensor: the same collective through gloo's
    ``_allgather_base``, not the coalesced entry point that corrupts the heap with two in flight
    (see [Note: gloo's coalesced all-gather with two in flight] in ``scheduler.cpu_all_gather``)."""
    gather_out = torch.ops._c10d_functional.all_gather_into_tensor_out.default

    def run(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
        out = input.new_empty((input.shape[0] * group_size, *input.shape[1:]))
        return gather_out.redispatch(torch_kernel, input.contiguous(), group_size, group_name, out=out)

    return run


def _wait_kernel(op: torch._ops.OpOverload, torch_kernel: Any) -> Callable[..., Any]:
    """A CPU kernel for ``wait_tensor``: sleep until the link delivers ``tensor``, then really wait."""

    def kernel(tensor: torch.Tensor) -> Any:
        with _deadlines_lock:
            booked = _deadlines.pop(_storage_key(tensor), None)
        if booked is not None:
            sleep_within(*booked, "this functional collective")  # see [Note: timeouts behind the link]
        return op.redispatch(torch_kernel, tensor)  # see [Note: calling torch's kernel without the GIL]

    return kernel
