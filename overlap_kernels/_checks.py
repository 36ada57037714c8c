"""Argument checks shared by the four ops' ``_check`` functions.

Contract: each check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong
value) with a message that names the op, the argument and what is allowed, and returns what it
established (the tensors' device, a dtype). An op runs all its checks before it allocates or
launches anything, so bad input changes nothing. The torch.library ops' fake implementations run the
same checks, so traced code fails as eager code does.

[Note: checks at C speed]
A group has hundreds of parameters, and on a GPU the host time of an op is what it costs
([Note: host cost of a launch] in ``overlap_kernels._launch``). So a list of tensors is checked by a few
passes of ``map`` over the list (types, devices, dtypes, shapes, contiguity), each calling a C
accessor per tensor with no Python bytecode in between; only when one of them fails does the
per-tensor loop run, to name the first bad tensor and what is wrong with it. Both paths accept and
refuse the same lists (tests/packing/test_launch_host_cost.py). Each property is read once per call
(``check_tensors`` hands the dtypes it read to the launch), and none is cached across calls: a
tensor object keeps its identity through ``resize_``, ``set_`` and ``.data =``, so nothing short
of reading its metadata tells that it still is what was checked (the type pass is the cheap one:
``type`` is no tensor accessor). That is four accessor passes for a read-only list, five for a
written one, plus the launch's address pass. A repeated call skips these passes when its list
matches the fingerprint of a list they passed ([Note: prepared launches] in
``overlap_kernels.prepared_launch``): a C++ guard reads every one of these properties of every tensor, in
one call, at every call.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from overlap_kernels._dtypes import MAX_DTYPE_GROUPS, SUPPORTED, TRITON_DTYPES
from overlap_kernels.layout import ShardLayout


def check_dtype(op: str, name: str, dtype: object) -> None:
    if dtype not in TRITON_DTYPES:
        raise TypeError(f"{op}: {name} must be one of {SUPPORTED}, got {dtype}")


def check_rank(op: str, rank: object, layout: ShardLayout) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{op}: rank must be an int in [0, {layout.world_size}), got {type(rank).__name__}")
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"{op}: rank must be an int in [0, {layout.world_size}), got {rank!r}")


def check_layout(op: str, layout: object) -> None:
    if not isinstance(layout, ShardLayout):
        raise TypeError(f"{op}: layout must be a overlap_kernels.ShardLayout, got {type(layout).__name__}")


PLAIN_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_DEVICE = operator.attrgetter("device")
DTYPE = operator.attrgetter("dtype")
"""A tensor's dtype, read at C speed by ``map`` (also the pointer-table key's reader in ``overlap_kernels._launch``)."""
_SHAPE = operator.attrgetter("shape")
_SUPPORTED_DTYPES = frozenset(TRITON_DTYPES)


def plain_tensors(tensors: Sequence[object]) -> bool:
    """Every item is a ``torch.Tensor`` or ``nn.Parameter`` exactly (no subclass, no other object)."""
    return set(map(type, tensors)) <= PLAIN_TENSOR_TYPES


def dtypes_in_order(tensors: Sequence[torch.Tensor]) -> tuple[torch.dtype, ...]:
    """Each tensor's dtype, in order (one C-level pass; a loop Dynamo can trace while it traces)."""
    if torch.compiler.is_compiling():
        return tuple(t.dtype for t in tensors)
    return tuple(map(DTYPE, tensors))


def _all_fine(
    tensors: Sequence[torch.Tensor], shapes: Sequence[torch.Size], device: torch.device | None, writable: bool
) -> tuple[torch.device, tuple[torch.dtype, ...]] | None:
    """The one device of ``tensors`` and each tensor's dtype, in order, when they pass
    ``check_tensors``' rules, by C-level passes ([Note: checks at C speed]); ``None`` when any rule
    fails or cannot be decided that way (also while Dynamo traces: it cannot trace ``attrgetter``,
    and traced checks cost nothing per call)."""
    if not tensors or torch.compiler.is_compiling() or not plain_tensors(tensors):
        return None
    devices = set(map(_DEVICE, tensors))
    if len(devices) != 1 or (device is not None and device not in devices):
        return None
    ordered = tuple(map(DTYPE, tensors))
    if not set(ordered) <= _SUPPORTED_DTYPES or tuple(map(_SHAPE, tensors)) != tuple(shapes):
        return None
    if writable and not all(map(torch.Tensor.is_contiguous, tensors)):
        return None
    return devices.pop(), ordered


class CheckedTensors(NamedTuple):
    """What ``check_tensors`` established about a list."""

    device: torch.device
    dtypes: tuple[torch.dtype, ...]
    """Each tensor's dtype, in order: what the launch keys its pointer table on (an op hands it to
    its launcher, which then does not read the dtypes again)."""
    distinct: set[torch.dtype]


def check_tensors(
    op: str,
    name: str,
    tensors: object,
    shapes: Sequence[torch.Size],
    device: torch.device | None = None,
    *,
    writable: bool = False,
) -> CheckedTensors:
    """A list of ``len(shapes)`` tensors of those shapes, supported dtypes (at most
    ``MAX_DTYPE_GROUPS`` distinct ones), one device; returns the device and the dtypes.

    ``writable`` tensors (outputs) must also be contiguous: the kernel writes them in place. Every
    tensor's type, device, dtype and shape (and strides, if ``writable``) is read at every call: a
    tensor may have been resized, re-pointed (``set_``, ``.data =``) or replaced since the last one.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{op}: {name} must be a list of tensors, got {type(tensors).__name__}")
    if len(tensors) != len(shapes):
        raise ValueError(f"{op}: {name} has {len(tensors)} tensors, the layout has {len(shapes)} parameters")
    fine = _all_fine(tensors, shapes, device, writable)
    if fine is None:
        for i, (t, shape) in enumerate(zip(tensors, shapes)):
            where = f"{op}: {name}[{i}]"
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where} must be a tensor, got {type(t).__name__}")
            device = t.device if device is None else device
            if t.device != device:
                raise ValueError(f"{where} is on {t.device}, expected {device} (all tensors on one device)")
            check_dtype(op, f"{name}[{i}].dtype", t.dtype)
            if t.shape != shape:
                raise ValueError(f"{where} has shape {tuple(t.shape)}, the layout expects {tuple(shape)}")
            if writable and not t.is_contiguous():
                raise ValueError(f"{where} must be contiguous (it is written in place)")
        assert device is not None
        fine = device, dtypes_in_order(tensors)
    distinct = set(fine[1])
    if len(distinct) > MAX_DTYPE_GROUPS:
        raise ValueError(
            f"{op}: {name} mixes {len(distinct)} dtypes, at most {MAX_DTYPE_GROUPS} per call are supported"
        )
    return CheckedTensors(fine[0], fine[1], distinct)


def check_flat(op: str, name: str, tensor: object, numel: int, device: torch.device | None) -> torch.device:
    """A contiguous buffer of exactly ``numel`` elements (any shape) of a supported dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(tensor).__name__}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{op}: {name} is on {tensor.device}, expected {device} (all tensors on one device)")
    check_dtype(op, f"{name}.dtype", tensor.dtype)
    if tensor.numel() != numel:
        raise ValueError(f"{op}: {name} has {tensor.numel()} elements, the layout needs exactly {numel}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")
    return tensor.device


def common_dtype(op: str, name: str, dtypes: set[torch.dtype]) -> torch.dtype:
    """The one dtype of a list (``dtypes``: its distinct dtypes); mixed lists need an explicit ``dtype``."""
    if len(dtypes) != 1:
        raise ValueError(f"{op}: {name} mixes dtypes {sorted(map(str, dtypes))}; pass dtype= to choose the buffer's")
    return next(iter(dtypes))


def check_scale(op: str, name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TypeError(f"{op}: {name} must be None or a float, got {type(value).__name__}")


def check_floating(op: str, what: str, dtypes: set[torch.dtype] | Sequence[torch.dtype]) -> None:
    """Scaling and accumulation need floating-point tensors; integer ones can only be copied."""
    bad = sorted({str(d) for d in dtypes if not d.is_floating_point})
    if bad:
        raise TypeError(f"{op}: {what} needs floating-point tensors, got integer dtypes {bad} (ints can only be copied)")
