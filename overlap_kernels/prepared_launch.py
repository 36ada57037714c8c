"""Prepared launches: a repeated call of a packing op checks one fingerprint and launches.

Contract: a ``Fingerprint`` stands for one op configuration (layout, the op's scalar arguments,
the flat buffer's device and dtype: the ``config`` tuple an op builds) and one kind of
parameter-side list (each tensor's exact type, device, dtype, shape and strides, all contiguous).
``find`` returns the fingerprint a list matches, in one C call over the list; ``remember`` makes
one for a list the op has just checked (its check result kept with it); ``launch`` reads the list's
data addresses (one C-level pass) and runs the ``PreparedLaunch`` (``overlap_kernels._launch``: tables,
grid, constexprs, the arguments after the flat buffer) made for those addresses, making it on the
first call. ``launch_packed`` does the same in O(1) for a ``PackedPlacement``'s views, keyed on
the storage's address. ``uncached()`` turns all of it off (tests compare the two paths bitwise;
``benchmarks/bench_kernels.py`` times both in one run).

[Note: prepared launches]
On a GPU the host time of a packing op is what the overlap must hide behind ([Note: host cost of a
launch] in ``overlap_kernels._launch``). Without this module a repeated call read each tensor once per
rule (type, device, dtype, shape, contiguity, address: five to seven C-level passes over the list),
then hashed the address list, looked the block table up, rebuilt the vector width, the constexprs
and a ``KernelCall``. Now:

* **checks**: a list is described once by a ``Guard``: a native description ([Note: native
  passes] in ``overlap_kernels.native_passes``: exact Python type, dispatch keys, device, dtype,
  ``requires_grad``, sizes, strides, compared in one C++ loop, about 8 ns a tensor on the 2-core CI
  box) or, where the extension is not built, torch's C++ ``TensorGuards`` (Dynamo's guard for
  tensor arguments, the same properties, about 55 ns a tensor from Python). A list whose guard
  passes has every property the op's checks read, so their result (kept in the fingerprint) holds
  again; a list that fails every guard of its configuration is checked in full and, when it is
  plain contiguous tensors, remembered (``MAX_FINGERPRINTS`` per configuration, oldest dropped).
  Without either (or with a ``TensorGuards`` constructor that differs) every call takes the full checks.
* **launch**: the data addresses (one native pass, about 6 ns a tensor; a ``map`` of ``data_ptr``,
  about 55 ns, without the extension) key the
  prepared launch; storage offsets are inside the addresses, dtypes and strides inside the
  fingerprint. The ``MAX_LAUNCHES`` newest address sets per fingerprint are kept.

Why a stale entry cannot launch on freed memory: nothing here holds a tensor, and a prepared launch
is a pure function of its key — the configuration, the guarded metadata and the *current* addresses
read from the tensors of this call, which are alive while the call runs. A tensor freed and another
allocated at the same address with the same metadata gets the same, correct, prepared launch; one
changed in place (``set_``, ``resize_``, ``as_strided_``, ``.data =``) fails its guard or changes
its address, and is checked again or gets another launch. Holding the tensors instead would have
kept hundreds of gradients alive per cached entry. The packed key is the storage's current address
and the placement, whose size is checked against the storage at every call (a storage freed by
``resize_(0)`` is refused before any launch, as ``packed_pointer_table`` does).

What stays per call and per tensor: the guard and the address pass (public ops), the address pass
alone for the runtime's copy-ins ([Note: lists the runtime owns]), nothing at all for packed
placements (the runtime's copy-out into its unsharded parameters, and the reduce-scatter copy-out
into new gradients). On the 2-core CI box, 300 parameters: about 2.5 + 1.8 µs for the two passes
natively, 17 + 17 µs with the Python passes.

[Note: lists the runtime owns]
The runtime's copy-ins read lists it made itself: a group's shards (the local tensors of the
DTensor parameters it created) and its unsharded gradients (what autograd accumulated into the
unsharded parameters it created, or zeros it made). What the guard checks of them is fixed by the
group: the exact type (it made them), the shapes (the layout's; autograd refuses a gradient of
another shape, the ``.grad`` setter too), the dtypes (``orig_dtypes``, or the unsharded
parameters' gradient dtypes: the ``.grad`` setter refuses another, and the zeros the group puts
where a gradient is missing are made in that dtype too). Those change only when the group re-reads its
shards (``ParamGroup._read_dtypes``: at creation and in ``rebind_sharded``, after ``module._apply``,
``to_empty``, ``load_state_dict(assign=True)``), which calls ``OwnedLists.changed()`` and forgets
every owned fingerprint. So ``launch_owned`` keeps, per group, layout and op configuration, one
fingerprint without a guard, and a call reads one thing per tensor: its data address (one C-level
pass, about 55 ns a tensor), which keys the prepared launch as before. A *new* address set is
checked before its launch is made, as the guard would have: every tensor contiguous, each of the
fingerprint's dtypes (and of the caller's ``dtypes`` when it hands them, which the uncached path
would read the memory as); a list that fails goes the uncached path, and a list of other dtypes gets
a new fingerprint. So a shard swapped for another tensor (``.data =``, ``set_`` to other memory, a
new object), a gradient at new addresses, a reallocation at the same address with the same dtype
(the same, correct, launch) all launch what the uncached path launches. What a hit trusts is that a
tensor keeps its strides and dtype while it keeps its address and the group does not re-read: the
in-place ops that change strides at the same address (``t_``, ``as_strided_``, ``set_`` onto its own
storage, ``.data =`` a restrided view of its own memory) on a shard's local tensor or on an
unsharded gradient are outside that contract (nothing in torch or the runtime does them; the
public ops, whose lists are the caller's, keep the guard). At 300 parameters this takes the runtime's
copy-ins from ~52 / 48 µs to ~27 / 26 µs on the CI box (``benchmarks/bench_kernels.py``, the
"before" column is the guarded path, still what a list without an owner gets). Those are hits: the
shards keep their addresses, but on CPU autograd's gradients come at new addresses every step, so
there the reduce-scatter copy-in misses every step ([Note: a miss of a prepared launch]). The
group reads the gradients' dtypes anyway (one C pass: they choose the reduce dtype) and hands them
in (``dtypes_read``), so a new address set of its gradients has only its contiguity read (a
``.grad`` a user assigned may be strided: nothing in autograd promises the layout there).

[Note: a miss of a prepared launch]
A new address set of a fingerprint needs nothing its fingerprint does not already settle but the
addresses: the configuration and the dtypes fix the block table, the grid, the constexprs (vector
width, compute dtype), the arguments after the flat buffer and the pointer table's dtype-group
column. So ``launch`` makes the launch of a new address set from one the fingerprint already has
(``PreparedLaunch.moved``: one host array of ``(address, group)`` rows filled from the address
tuple it has just read, uploaded as a table later launches may read) and calls ``build`` only for
a fingerprint's first address set. Before, a miss built the ``KernelCall`` again: a second address
pass, the dtype groups, the pointer-table key hashed over the addresses and dtypes and an insert
into the layout's table cache (evicting the public ops' tables), the vector width and the compute
dtype. Launches made this way are not in the layout's cache; the fingerprint keeps the
``MAX_LAUNCHES`` newest (the oldest, with its tables, dropped), so a list at new addresses every
call keeps at most that many tables alive (tests/packing/test_prepared_launch.py). What a miss of
the runtime's reduce-scatter copy-in costs at 300 parameters, launch stubbed, a fresh list per
call (benchmarks/RESULTS.md, "host-cost5"): the address pass, the contiguity pass (~16 µs warm,
about a hit's address pass again) and the table (~10 µs warm: ~6 µs to write 300 Python ints into
an int64 array, the upload, two small objects) on top of a hit; on a GPU the upload is a pinned
staging copy, an asynchronous host-to-device copy and an event (not measured here).
"""
from __future__ import annotations

import contextlib
import dataclasses
import struct
from collections.abc import Callable, Iterator, Sequence

import torch

from overlap_kernels import _launch, native_passes
from overlap_kernels.layout import ShardLayout

MAX_FINGERPRINTS = 4
"""Kinds of list remembered per op configuration (a list alternating between two stride patterns
of a size-1 dimension, or ``requires_grad`` on and off, keeps hitting)."""

MAX_LAUNCHES = _launch.POINTER_CACHE_SIZE
"""Address sets kept per fingerprint (the runtime's gradients move between a few addresses)."""

_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
_TensorGuards = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None), "TensorGuards", None)
_enabled = True


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """While active (process-wide), the ops check every tensor and build every launch at every call,
    as they did before this module: the reference the cached path is tested and timed against."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def enabled() -> bool:
    return _enabled


def scale_key(scale: float | None) -> bytes | None:
    """A scale as a configuration key: its float64 bits (``0.0`` and ``-0.0`` differ, NaN equals itself)."""
    return None if scale is None else struct.pack("<d", scale)


@dataclasses.dataclass(eq=False)
class Fingerprint:
    """One kind of list under one op configuration: its guard, what the op's checks returned for it
    (``checked``), each tensor's dtype in order, and its prepared launches by address set."""

    guard: Guard | None  # None: an owned list's ([Note: lists the runtime owns])
    size: int
    dtypes: tuple[torch.dtype, ...]
    checked: object
    launches: dict[native_passes.Addresses, _launch.PreparedLaunch] = dataclasses.field(default_factory=dict)


class Guard:
    """Whether a list still has every property a fingerprint recorded of it: exact Python type,
    dispatch keys, device, dtype, ``requires_grad``, sizes and strides of each tensor, and the
    list's length. Native (``native_passes.Description``: one C++ loop) where that is built, else
    torch's ``TensorGuards``. A fingerprint is matched only while the passes are those it was made
    under (``native``), so that the two are timed apart in one process (``bench_kernels``)."""

    __slots__ = ("matches", "native")

    def __init__(self, matches: Callable[[Sequence[torch.Tensor]], bool], native: bool) -> None:
        self.matches, self.native = matches, native


def _guard(tensors: Sequence[torch.Tensor]) -> Guard | None:
    """A guard of ``tensors`` (exact ``torch.Tensor`` / ``nn.Parameter`` objects), ``None`` when this
    torch has no usable ``TensorGuards`` and the native passes are unavailable."""
    description = native_passes.describe(tensors)
    if description is not None:
        return Guard(description.matches, True)
    if _TensorGuards is None:
        return None
    try:
        guard = _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                              dynamic_dims_strides=[list(t.stride()) for t in tensors])
        if not guard.check(*tensors):  # a guard that refuses its own list would never hit
            return None
    except (TypeError, RuntimeError, SystemError):  # another torch's constructor: no fast path
        return None
    check = guard.check
    return Guard(lambda listed: check(*listed), False)


def _slot(layout: ShardLayout, config: tuple) -> list[Fingerprint]:
    slot = layout._device_cache.get(config)
    if slot is None:
        slot = layout._device_cache[config] = []
    return slot


def find(layout: ShardLayout, config: tuple, tensors: object) -> Fingerprint | None:
    """The fingerprint ``tensors`` match under ``config`` (``None``: not seen, not a list, or the
    cache is off); one guard call per fingerprint of the configuration, newest first."""
    if not _enabled:
        return None
    slot = layout._device_cache.get(config)
    if not slot or type(tensors) not in (list, tuple):
        return None
    n, native = len(tensors), native_passes.active()
    for fingerprint in slot:
        if fingerprint.size == n and fingerprint.guard.native is native and fingerprint.guard.matches(tensors):
            return fingerprint
    return None


def remember(layout: ShardLayout, config: tuple, tensors: Sequence[torch.Tensor],
             dtypes: tuple[torch.dtype, ...] | None = None, checked: object = None) -> Fingerprint | None:
    """A fingerprint of ``tensors`` (which the caller has checked, or vouches for; ``dtypes``: each
    one's, in order, when the checks read them) under ``config``; ``None`` when it cannot be made:
    the cache is off, an item is not exactly a ``torch.Tensor`` / ``nn.Parameter``, one is not
    contiguous, or there is no guard (no native passes and no usable ``TensorGuards``)."""
    if not _enabled or not set(map(type, tensors)) <= _PLAIN:
        return None
    if not native_passes.contiguous(tensors):
        return None
    guard = _guard(tensors)
    if guard is None:
        return None
    fingerprint = Fingerprint(guard, len(tensors), native_passes.dtypes(tensors) if dtypes is None else dtypes, checked)
    slot = _slot(layout, config)
    if len(slot) >= MAX_FINGERPRINTS:
        slot.pop()
    slot.insert(0, fingerprint)
    return fingerprint


def launch_list(layout: ShardLayout, config: tuple, tensors: Sequence[torch.Tensor], flat: torch.Tensor,
                build: Callable[[tuple[torch.dtype, ...]], _launch.KernelCall],
                fingerprint: Fingerprint | None = None) -> bool:
    """The runtime launchers' path: launch over ``tensors`` into ``flat`` through ``fingerprint`` (the
    public op's, which matched) or the one ``tensors`` match under ``config`` (made now if none
    does); ``False`` when no fingerprint can be made (the caller then launches uncached)."""
    if fingerprint is None:
        if not _enabled:
            return False
        fingerprint = find(layout, config, tensors) or remember(layout, config, tensors)
        if fingerprint is None:
            return False
    return launch(fingerprint, tensors, flat, build)


class OwnedLists:
    """The prepared launches of the lists one owner hands in (the runtime's shards of a group, its
    unsharded gradients): fingerprints without a guard, one per layout and op configuration
    ([Note: lists the runtime owns]). ``changed()`` forgets them all."""

    __slots__ = ("_fingerprints",)

    def __init__(self) -> None:
        self._fingerprints: dict[tuple[int, tuple], tuple[ShardLayout, Fingerprint]] = {}

    def changed(self) -> None:
        """The owner replaced its tensors' storage, dtype or shape (a parameter swapped, the dtypes
        re-read): the next call of each op checks its list again."""
        self._fingerprints.clear()

    def __len__(self) -> int:
        return len(self._fingerprints)


def launch_owned(owned: OwnedLists, layout: ShardLayout, config: tuple, tensors: Sequence[torch.Tensor],
                 flat: torch.Tensor, build: Callable[[tuple[torch.dtype, ...]], _launch.KernelCall],
                 dtypes: tuple[torch.dtype, ...] | None = None, dtypes_read: bool = False) -> bool:
    """The runtime launchers' path for a list ``owned`` stands for: launch over ``tensors`` into
    ``flat`` through the prepared launch of their addresses, checking them (contiguous, each of the
    dtype in ``dtypes``, read when ``None``) only when the address set is new ([Note: lists the
    runtime owns]); ``dtypes_read``: ``dtypes`` are the tensors' own, read by the caller in this
    call, so a new address set needs only its contiguity read. ``False`` when the cache is off or a
    tensor is not contiguous (the caller then launches uncached)."""
    if not _enabled:
        return False
    key = (id(layout), config)
    entry = owned._fingerprints.get(key)
    if (entry is not None and entry[1].size == len(tensors) and (dtypes is None or dtypes == entry[1].dtypes)
            and launch(entry[1], tensors, flat, build, dtypes_read=dtypes_read and dtypes is not None)):
        return True
    if not native_passes.contiguous(tensors):
        return False
    read = dtypes if dtypes_read and dtypes is not None else native_passes.dtypes(tensors)
    if dtypes is not None and read != dtypes:  # the uncached path reads them as ``dtypes``: let it
        return False
    fingerprint = Fingerprint(None, len(tensors), read, None)
    owned._fingerprints[key] = (layout, fingerprint)  # the layout held: its id stays its own
    return launch(fingerprint, tensors, flat, build, dtypes_read=True)


def _describes(fingerprint: Fingerprint, tensors: Sequence[torch.Tensor], dtypes_read: bool) -> bool:
    """Does an owned ``fingerprint`` hold for ``tensors`` (contiguous, its dtypes; ``dtypes_read``:
    the caller has just read them)? Read once per new address set."""
    return native_passes.contiguous(tensors) and (dtypes_read or native_passes.dtypes(tensors) == fingerprint.dtypes)


def launch(fingerprint: Fingerprint, tensors: Sequence[torch.Tensor], flat: torch.Tensor,
           build: Callable[[tuple[torch.dtype, ...]], _launch.KernelCall], dtypes_read: bool = False) -> bool:
    """Launch over ``tensors`` (matching ``fingerprint``) into ``flat``: the prepared launch of their
    current addresses, made the first time from one the fingerprint has (``PreparedLaunch.moved``,
    [Note: a miss of a prepared launch]) or, for its first address set, by ``build(dtypes)`` (the
    op's ``KernelCall`` over ``tensors``). An owned fingerprint (no guard: ``launch_owned``) first
    checks a new address set as the guard would have: every tensor contiguous and of the
    fingerprint's dtypes (not read again when ``dtypes_read``), else nothing launches and ``False``
    is returned."""
    addresses = native_passes.addresses(tensors)
    launches = fingerprint.launches
    prepared = launches.get(addresses)
    if prepared is None:
        if fingerprint.guard is None and not _describes(fingerprint, tensors, dtypes_read):
            return False
        template = next(iter(launches.values()), None)
        if template is not None and template.blocks.device == flat.device:
            prepared = template.moved(addresses)
        else:
            prepared = _launch.PreparedLaunch.of(build(fingerprint.dtypes))
        if len(launches) >= MAX_LAUNCHES:
            del launches[next(iter(launches))]
        if not prepared.in_graph:
            launches[addresses] = prepared
    prepared.launch(flat)
    return True


def launch_packed(layout: ShardLayout, config: tuple, storage: torch.UntypedStorage,
                  placement: _launch.PackedPlacement, flat: torch.Tensor,
                  build: Callable[[], _launch.KernelCall]) -> None:
    """Launch over ``placement``'s views of ``storage`` into ``flat``, keyed on the storage's current
    address (O(1); a storage smaller than the placement is refused before anything launches)."""
    _launch.check_packed_storage("packed launch", storage, placement)
    if not _enabled:
        build().launch()
        return
    key = (config, "packed", storage.data_ptr(), placement)
    cache = layout._device_cache
    prepared = cache.get(key)
    if prepared is None:
        prepared = _launch.PreparedLaunch.of(build())
        if not prepared.in_graph:
            keys = cache.setdefault("prepared packed keys", [])
            if len(keys) >= MAX_LAUNCHES:
                cache.pop(keys.pop(0), None)
            cache[key] = prepared
            keys.append(key)
    prepared.launch(flat)
