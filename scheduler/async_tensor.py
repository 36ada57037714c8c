"""AsyncTensor: the result of an in-flight collective, which waits once, right before its first use.

Contract
--------
* A collective returns an ``AsyncTensor`` at once. Its storage is the collective's result buffer;
  the data in it is not ready yet.
* The first op that touches the tensor (reads, writes, makes a view, or lets the data escape through
  ``.numpy()``, ``.tolist()``, ``.item()``, ``data_ptr()``, ``repr`` ...) first calls its
  ``Completion.wait()``. On CUDA that is a stream wait on an event (the host is not blocked); on
  CPU it is ``work.wait()``. Reading metadata (shape, dtype, device, ``requires_grad`` ...) does
  not wait.
* The wait happens exactly once. Right after it the object's class is switched to plain
  ``torch.Tensor`` (see [Note: plain after wait]), so every later op costs what an op on a plain
  tensor costs.
* A view of a pending tensor can only be made through an op on it, and that op waits first, so an
  alias never sees unfinished data.

[Note: plain after wait]
torch's ``AsyncCollectiveTensor`` stays a ``__torch_dispatch__`` subclass forever, so every op on a
finished result pays a Python round trip, many times the op's own cost for small tensors
(``benchmarks/bench_dispatch.py``). Here
the interception is ``__torch_function__`` on a subclass that shares the result's storage, and the
object's ``__class__`` is set to ``torch.Tensor`` once it has waited: after that torch no longer
sees an override, and there is nothing left to pay.

Escapes that bypass ``__torch_function__`` (C++ extensions and raw ``torch.distributed`` calls that
take the tensor directly) must call :func:`wait_tensor` first.

[Note: DLPack export]
``torch.from_dlpack(y)`` and ``y.__dlpack__()`` go through ``__torch_function__`` and wait. The
legacy ``torch.utils.dlpack.to_dlpack(y)`` (also ``torch.to_dlpack``) is ``torch._C._to_dlpack``,
a C function that takes the tensor directly and would export unfinished data. Importing this module
therefore replaces those two module attributes with :func:`to_dlpack`, which waits first and then
calls torch's function (it stays for the process). A name bound earlier with ``from
torch.utils.dlpack import to_dlpack`` keeps torch's function: call :func:`wait_tensor` first there.
Newer torch also offers DLPack's C exchange API (``type(t).__dlpack_c_exchange_api__``, a capsule
of C functions that export without calling Python): ``AsyncTensor`` hides it (looking it up raises
``AttributeError``), so a consumer falls back to ``__dlpack__``, which waits; once waited, the
object is a plain tensor and has torch's.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["AsyncTensor", "Completion", "WaitObserver", "wait_tensor", "is_pending", "set_observer", "to_dlpack"]


class Completion(Protocol):
    """What an AsyncTensor waits on.

    ``wait()`` is called once, right before the first use, on the thread and CUDA stream of that
    use. After it returns, the tensor's storage holds the final result as seen from that stream.
    """

    def wait(self) -> None: ...


_METADATA_PROPERTIES = (
    "shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_cuda", "is_cpu", "is_meta",
    "is_sparse", "is_quantized", "is_leaf", "grad_fn", "grad", "names", "itemsize", "nbytes",
    "_version", "_base",
)
_METADATA_METHODS = (
    "size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
    "element_size", "get_device", "is_floating_point", "is_complex", "__len__", "__hash__",
    "requires_grad_", "register_hook", "retain_grad",
)


def _metadata_functions() -> frozenset:
    funcs = set()
    for name in _METADATA_PROPERTIES:
        attr = getattr(torch.Tensor, name, None)
        if attr is not None and hasattr(attr, "__get__"):
            funcs.add(attr.__get__)
            if hasattr(attr, "__set__"):
                funcs.add(attr.__set__)
    for name in _METADATA_METHODS:
        attr = getattr(torch.Tensor, name, None)
        if attr is not None:
            funcs.add(attr)
    return frozenset(funcs)


_NO_WAIT = _metadata_functions()


class WaitObserver(Protocol):
    """Sees every AsyncTensor being made and every first wait (``scheduler.replay`` records with it).

    ``on_issue`` runs right after a result is wrapped; ``on_wait`` right before its one wait, with
    the torch function about to use it (``None`` for an explicit :func:`wait_tensor`). ``on_wait``
    may raise (verify mode): the tensor then stays pending. Neither may run ops on the tensor.
    """

    def on_issue(self, pending: "AsyncTensor", kind: str, group: str) -> None: ...

    def on_wait(self, pending: "AsyncTensor", func: Optional[Callable]) -> None: ...


_observer: Optional[WaitObserver] = None


def set_observer(observer: Optional[WaitObserver]) -> Optional[WaitObserver]:
    """Install ``observer`` (``None``: none) for this process; returns the previous one."""
    global _observer
    previous, _observer = _observer, observer
    return previous


class _HiddenFromPendingTensors:
    """A class attribute that pending tensors do not have: looking it up raises ``AttributeError``
    (see [Note: DLPack export])."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: object, owner: Optional[type] = None) -> Any:
        raise AttributeError(f"a pending AsyncTensor has no {self._name}: it exports through __dlpack__, "
                             f"which waits for the collective first")


class AsyncTensor(torch.Tensor):
    """A tensor whose data is being produced by a collective; waits at its first use.

    Build one with :meth:`AsyncTensor.wrap`. The object turns into a plain ``torch.Tensor`` (same
    object, same storage, same autograd history) once it has waited.
    """

    _overlap_completion: Completion
    if hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):  # DLPack's C exchange API (newer torch)
        __dlpack_c_exchange_api__ = _HiddenFromPendingTensors()

    @staticmethod
    def wrap(result: torch.Tensor, completion: Completion, kind: str = "collective", group: str = "") -> "AsyncTensor":
        """A new AsyncTensor sharing ``result``'s storage, bound to ``completion``.

        ``result`` must carry no autograd history (a buffer made under no_grad). A differentiable
        result is wrapped inside ``torch.autograd.Function.forward``, where autograd then attaches
        its history to the AsyncTensor itself. ``kind`` and ``group`` name the collective for a
        :class:`WaitObserver` (recorded schedules).
        """
        pending = torch.Tensor._make_subclass(AsyncTensor, result, False)
        pending._overlap_completion = completion
        if _observer is not None:
            _observer.on_issue(pending, kind, group)
        return pending

    def _overlap_wait(self, func: Optional[Callable] = None) -> None:
        if "_overlap_completion" not in self.__dict__:  # already waited, or waiting higher up the stack
            return
        if _observer is not None:
            _observer.on_wait(self, func)
        completion = self.__dict__.pop("_overlap_completion")
        try:
            completion.wait()
        except BaseException:
            self._overlap_completion = completion  # still pending: a later use must not read it
            raise
        self.__class__ = torch.Tensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _NO_WAIT:
            flat, _ = tree_flatten((args, kwargs))
            for arg in flat:
                if type(arg) is AsyncTensor:
                    arg._overlap_wait(func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def is_pending(t: object) -> bool:
    """True if ``t`` is an AsyncTensor that has not waited yet."""
    return type(t) is AsyncTensor


def wait_tensor(t: Any) -> Any:
    """Wait for ``t`` if it is a pending AsyncTensor; lists, tuples and dicts are waited element-wise.

    Returns its argument, now safe to read from any code path. Waiting twice is a no-op.
    """
    flat, _ = tree_flatten(t)
    for leaf in flat:
        if type(leaf) is AsyncTensor:
            leaf._overlap_wait()
    return t


_torch_to_dlpack = torch._C._to_dlpack


def to_dlpack(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.dlpack.to_dlpack`` that waits for a pending AsyncTensor first (see [Note: DLPack
    export]); returns torch's DLPack capsule, sharing the tensor's memory. Other arguments go to
    torch's function unchanged."""
    if type(tensor) is AsyncTensor:
        tensor._overlap_wait()
    return _torch_to_dlpack(tensor, *args, **kwargs)


def _patch_to_dlpack() -> None:
    """Point ``torch.utils.dlpack.to_dlpack`` and ``torch.to_dlpack`` at :func:`to_dlpack` where they
    still hold torch's own function (a replacement made by someone else is left alone)."""
    import torch.utils.dlpack as dlpack

    for module in (dlpack, torch):
        if getattr(module, "to_dlpack", None) is _torch_to_dlpack:
            module.to_dlpack = to_dlpack


_patch_to_dlpack()
