"""Run the overlap graph pass inside Inductor, as its ``post_grad_custom_post_pass``.

Inductor calls ``torch._inductor.config.post_grad_custom_post_pass`` on the post-grad
``torch.fx.Graph`` (a Graph, not a GraphModule; Inductor recompiles afterwards) of every graph it
compiles, forward and backward. :func:`install` puts an :class:`OverlapGraphPass` there; a pass the
user had set runs first, then the overlap pass (scheduling goes last, after any rewrite), then the
CPU all-gathers are routed through ``all_gather_into_tensor_out`` on a copy of their input
(``scheduler.cpu_all_gather``: gloo's coalesced all-gather cannot have two in flight, and Inductor
may reuse the out variant's input buffer before gloo has read it).
:func:`uninstall` puts the previous value back. :func:`inductor_overlap` is the pair as a context
manager. Installs nest: each ``uninstall`` undoes the latest ``install``.

FX graph cache: ``OverlapGraphPass.uuid()`` hashes this package's pass sources (``graph_pass``,
``bucketing``, ``collective_matmul``, ``summed_scatters``, ``per_chunk_ops``, ``canonical_waits``,
``cpu_all_gather``, ``fx_nodes`` and
this module), the options and the composed user passes' own uuids, so a cached graph is reused
only when all of those are the same, and a different ``max_inflight_bytes`` gives a different key.
A user pass that is a plain callable (no uuid) makes ``uuid()`` return None, which tells Inductor
to bypass the cache, as it would for that pass on its own.

The config is process-global and not thread-safe; install from one thread, before compiling.

[Note: torch.compile inside the block]
``torch.compile`` is lazy: ``with inductor_overlap(): step = torch.compile(train_step)`` compiles at
``step``'s first call, usually after the block, when the config is back to what it was. So while an
install is active, ``torch.compile`` (the attribute of the ``torch`` module) is wrapped: an Inductor
compile requested then gets the pass through ``options`` (:func:`compile_options`), which Inductor
applies to every graph that function compiles, whenever it compiles it: the forward, the backward
compiled lazily at the first ``backward()``, and recompiles, inside the block or after it. A ``mode``
is turned into its options (``torch.compile`` takes one or the other); options the call gives
itself win, and a ``post_grad_custom_post_pass`` among them runs before the overlap pass. Other
backends are left alone. The wrapper is removed when the last install is undone. Not covered: a name
bound with ``from torch import compile`` before the install (pass ``options=compile_options()``).

[Note: Inductor's peak-memory reorder]
After lowering, Inductor's scheduler runs ``reorder_for_peak_memory`` (on by default): it tries a
few topological orders and keeps the one with the lowest estimated peak memory. An overlapped order
holds each collective's result across the compute it overlaps, so it often costs more memory than
waiting at once, and that pass would put the wait back right after the collective (seen on torch
2.13: the FX order ``all_gather, mm, wait`` came out as ``all_gather, wait, sum, mm``). So
:func:`install` turns it off while installed (restored by :func:`uninstall`), for every graph
compiled meanwhile, with or without collectives; ``max_inflight_bytes`` is then the bound on the
extra memory held by in-flight collectives. ``keep_peak_memory_reorder=True`` leaves it on, for when
memory matters more than overlap.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch._inductor.config as inductor_config
from torch._inductor import custom_graph_pass as _cgp
from torch._inductor.custom_graph_pass import CustomGraphPass

from scheduler import bucketing as _bucketing
from scheduler import canonical_waits as _canonical_waits
from scheduler import collective_matmul as _collective_matmul
from scheduler import cpu_all_gather as _cpu_all_gather
from scheduler import fx_nodes as _fx_nodes
from scheduler import graph_pass as _graph_pass
from scheduler import per_chunk_ops as _per_chunk_ops
from scheduler import summed_scatters as _summed_scatters

__all__ = ["OverlapGraphPass", "compile_options", "inductor_overlap", "install", "uninstall"]

logger = logging.getLogger("scheduler")

# Bump when the pass's behaviour changes in a way the source hash would not show.
PASS_VERSION = 2

DEFAULT_COLLECTIVE_MATMUL_CHUNKS = 2
"""Chunks for all-gather -> mm and mm -> reduce-scatter (``scheduler.collective_matmul``)."""

# Inductor passes ``is_inference`` to passes of this type (a CustomGraphPass subclass) where torch
# has it; the overlap pass takes it so that it can hand it on to inference-aware user passes.
_InferenceAware: Optional[type] = getattr(_cgp, "CustomInferenceAwareGraphPass", None)
_PassBase: type = _InferenceAware if _InferenceAware is not None else CustomGraphPass
# The pass types whose uuid() Inductor's cache uses: every CustomGraphPass, and on torch >= 2.13 any
# subclass of their common base CustomPassBase (2.11 has no such base).
_HASHABLE_PASSES: tuple[type, ...] = tuple(
    t for t in (getattr(_cgp, "CustomPassBase", None), CustomGraphPass) if t is not None)


def _flatten(passes: Any) -> tuple[Any, ...]:
    """The config value as a tuple of passes (it may be None, one pass, or a list / tuple)."""
    if passes is None:
        return ()
    if isinstance(passes, (list, tuple)):
        return tuple(passes)
    return (passes,)


class OverlapGraphPass(_PassBase):  # type: ignore[valid-type,misc]
    """Inductor post-grad pass: the user's previous passes, then :func:`~scheduler.overlap_graph`.

    ``max_inflight_bytes``, ``bucket_bytes`` and ``collective_matmul_chunks`` (split all-gather ->
    mm and mm -> reduce-scatter into that many chunks, ``scheduler.collective_matmul``; None or 1:
    no split) are passed to the graph pass. ``previous`` is the
    config value this pass replaced (None, a pass, or a list / tuple of passes); each runs before
    the overlap pass.
    """

    def __init__(self, max_inflight_bytes: Optional[int] = None, previous: Any = None,
                 bucket_bytes: Optional[int] = None,
                 collective_matmul_chunks: Optional[int] = DEFAULT_COLLECTIVE_MATMUL_CHUNKS) -> None:
        _graph_pass.check_max_inflight_bytes(max_inflight_bytes)
        _bucketing.check_bucket_bytes(bucket_bytes)
        _collective_matmul.check_chunks(collective_matmul_chunks)
        for p in _flatten(previous):
            if not callable(p):
                raise TypeError(f"previous must hold callables taking a torch.fx.Graph, got {p!r}")
        self.max_inflight_bytes = max_inflight_bytes
        self.bucket_bytes = bucket_bytes
        self.collective_matmul_chunks = collective_matmul_chunks
        self.previous = previous

    def __call__(self, graph: torch.fx.Graph, is_inference: Optional[bool] = None) -> None:
        for p in _flatten(self.previous):
            if _InferenceAware is not None and isinstance(p, _InferenceAware):
                p(graph, is_inference=bool(is_inference))
            else:
                p(graph)
        _graph_pass.overlap_graph(graph, self.max_inflight_bytes, self.bucket_bytes, self.collective_matmul_chunks)
        # last, after every pass that reads or moves the out-of-place all-gathers
        _cpu_all_gather.use_out_variant_on_cpu(graph)

    def uuid(self) -> Optional[str]:
        """Stable id of this pass: sources + version + options + the composed passes' uuids.

        None (no caching) when a composed pass has no uuid of its own.
        """
        previous_ids = []
        for p in _flatten(self.previous):
            pid = p.uuid() if isinstance(p, _HASHABLE_PASSES) else None
            if pid is None:
                return None
            previous_ids.append(pid)
        sources = _cgp.get_hash_for_files((_graph_pass.__file__, _bucketing.__file__, _fx_nodes.__file__,
                                           _collective_matmul.__file__, _summed_scatters.__file__,
                                           _per_chunk_ops.__file__, _canonical_waits.__file__, _cpu_all_gather.__file__,
                                           __file__))
        h = hashlib.sha256(sources)
        h.update(repr((PASS_VERSION, self.max_inflight_bytes, self.bucket_bytes,
                       self.collective_matmul_chunks)).encode())
        h.update(pickle.dumps(previous_ids))
        return h.hexdigest()

    def __repr__(self) -> str:
        return (f"OverlapGraphPass(max_inflight_bytes={self.max_inflight_bytes}, bucket_bytes={self.bucket_bytes}, "
                f"collective_matmul_chunks={self.collective_matmul_chunks}, previous={self.previous!r})")


def _pass_options(graph_pass: OverlapGraphPass, keep_peak_memory_reorder: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"post_grad_custom_post_pass": graph_pass}
    if not keep_peak_memory_reorder:
        options["reorder_for_peak_memory"] = False  # see [Note: Inductor's peak-memory reorder]
    return options


def compile_options(
    max_inflight_bytes: Optional[int] = None, *, keep_peak_memory_reorder: bool = False,
    bucket_bytes: Optional[int] = None,
    collective_matmul_chunks: Optional[int] = DEFAULT_COLLECTIVE_MATMUL_CHUNKS,
) -> dict[str, Any]:
    """``torch.compile`` options that run the overlap pass on what that one call compiles, whenever it
    compiles: ``torch.compile(train_step, options=scheduler.compile_options())``.

    Arguments as for :func:`install`; the pass set in Inductor's config now (if any) runs first. The
    config is not touched. Raises ``TypeError`` / ``ValueError`` naming a bad argument.
    """
    _check_keep(keep_peak_memory_reorder)
    graph_pass = OverlapGraphPass(max_inflight_bytes, inductor_config.post_grad_custom_post_pass, bucket_bytes,
                                  collective_matmul_chunks)
    return _pass_options(graph_pass, keep_peak_memory_reorder)


def _check_keep(keep_peak_memory_reorder: object) -> None:
    if not isinstance(keep_peak_memory_reorder, bool):
        raise TypeError(
            f"keep_peak_memory_reorder must be a bool, got {type(keep_peak_memory_reorder).__name__}"
        )


@dataclass(frozen=True)
class _Installed:
    """One :func:`install`: the pass it set and the config values it replaced."""

    graph_pass: OverlapGraphPass
    previous_pass: Any
    previous_peak_memory: Optional[bool]  # None: left alone
    keep_peak_memory_reorder: bool


_installed: list[_Installed] = []  # latest last
_torch_compile: Optional[Callable[..., Any]] = None  # torch's own, while ours is in place


def _with_pass(entry: _Installed, bound: inspect.BoundArguments) -> None:
    """Add ``entry``'s pass to a ``torch.compile`` call's arguments (see [Note: torch.compile inside
    the block]); leaves calls for other backends, and calls that already carry one, as they are."""
    backend = bound.arguments.get("backend")
    if backend is None:
        try:
            from torch._dynamo.backends.registry import get_default_backend
        except ImportError:  # torch before the configurable default backend: it is Inductor
            backend = "inductor"
        else:
            backend = get_default_backend()
    if backend != "inductor":
        return
    options = dict(bound.arguments.get("options") or {})
    user_pass = options.get("post_grad_custom_post_pass")
    if isinstance(user_pass, OverlapGraphPass):
        return  # already ours (torch.compile's decorator form calls torch.compile again)
    mode = bound.arguments.get("mode")
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        options = {**list_mode_options(mode, bound.arguments.get("dynamic")), **options}
        bound.arguments["mode"] = None
    graph_pass = entry.graph_pass if user_pass is None else OverlapGraphPass(
        entry.graph_pass.max_inflight_bytes, user_pass, entry.graph_pass.bucket_bytes,
        entry.graph_pass.collective_matmul_chunks)
    bound.arguments["options"] = {**_pass_options(graph_pass, entry.keep_peak_memory_reorder), **options,
                                  "post_grad_custom_post_pass": graph_pass}


def _wrap_torch_compile() -> None:
    """Put a ``torch.compile`` that adds the latest install's pass in place (once, at the first install)."""
    global _torch_compile
    if _torch_compile is not None:
        return
    original = torch.compile
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile_with_overlap_pass(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        if _installed:
            _with_pass(_installed[-1], bound)
        return original(*bound.args, **bound.kwargs)

    _torch_compile = original
    torch.compile = compile_with_overlap_pass


def _unwrap_torch_compile() -> None:
    """Put torch's own ``torch.compile`` back (after the last uninstall)."""
    global _torch_compile
    if _torch_compile is None:
        return
    if getattr(torch.compile, "__wrapped__", None) is not _torch_compile:
        logger.warning("torch.compile was replaced while the overlap pass was installed; restoring torch's anyway")
    torch.compile = _torch_compile
    _torch_compile = None


def install(
    max_inflight_bytes: Optional[int] = None, *, keep_peak_memory_reorder: bool = False,
    bucket_bytes: Optional[int] = None,
    collective_matmul_chunks: Optional[int] = DEFAULT_COLLECTIVE_MATMUL_CHUNKS,
) -> OverlapGraphPass:
    """Set Inductor's ``post_grad_custom_post_pass`` to an :class:`OverlapGraphPass`; return it.

    The pass already set there (if any) is kept and runs first. ``collective_matmul_chunks``
    (default 2; None or 1: off) splits each all-gather -> mm and mm -> reduce-scatter (the
    tensor-parallel linears of sequence parallelism) into that many chunks before the waits are
    placed (``scheduler.collective_matmul``). Unless
    ``keep_peak_memory_reorder``, also turns ``reorder_for_peak_memory`` off (see
    [Note: Inductor's peak-memory reorder]). Until the matching :func:`uninstall`, functions given
    to ``torch.compile`` carry the pass wherever they compile (see [Note: torch.compile inside the
    block]). Raises ``TypeError`` / ``ValueError`` naming a bad argument, before changing anything.
    """
    _check_keep(keep_peak_memory_reorder)
    previous = inductor_config.post_grad_custom_post_pass
    p = OverlapGraphPass(max_inflight_bytes, previous, bucket_bytes, collective_matmul_chunks)
    previous_peak: Optional[bool] = None
    if not keep_peak_memory_reorder:
        previous_peak = inductor_config.reorder_for_peak_memory
        inductor_config.reorder_for_peak_memory = False
    inductor_config.post_grad_custom_post_pass = p
    _installed.append(_Installed(p, previous, previous_peak, keep_peak_memory_reorder))
    _wrap_torch_compile()
    return p


def uninstall() -> None:
    """Undo the latest :func:`install`: restore the config values it replaced.

    Raises ``RuntimeError`` if nothing is installed. If the pass config was changed since that
    install, it is restored anyway and a warning is logged.
    """
    if not _installed:
        raise RuntimeError("scheduler.inductor_hook.uninstall() without a matching install()")
    entry = _installed.pop()
    if inductor_config.post_grad_custom_post_pass is not entry.graph_pass:
        logger.warning(
            "post_grad_custom_post_pass was changed after install(); restoring %r anyway",
            entry.previous_pass,
        )
    inductor_config.post_grad_custom_post_pass = entry.previous_pass
    if entry.previous_peak_memory is not None:
        inductor_config.reorder_for_peak_memory = entry.previous_peak_memory
    if not _installed:
        _unwrap_torch_compile()


@contextlib.contextmanager
def inductor_overlap(
    max_inflight_bytes: Optional[int] = None, *, keep_peak_memory_reorder: bool = False,
    bucket_bytes: Optional[int] = None,
    collective_matmul_chunks: Optional[int] = DEFAULT_COLLECTIVE_MATMUL_CHUNKS,
) -> Iterator[OverlapGraphPass]:
    """Within the block, graphs compiled by Inductor get the overlap pass; yields the pass.

    Arguments as for :func:`install`. Affected: graphs compiled inside the block, and everything a
    function given to ``torch.compile`` inside the block compiles, also after it (see [Note:
    torch.compile inside the block])::

        with scheduler.inductor_overlap():
            step = torch.compile(train_step)
        step(batch)  # compiles here, with the pass

    The previous config (and ``torch.compile``) is restored on exit, also on error.
    """
    p = install(max_inflight_bytes, keep_peak_memory_reorder=keep_peak_memory_reorder, bucket_bytes=bucket_bytes,
                collective_matmul_chunks=collective_matmul_chunks)
    try:
        yield p
    finally:
        uninstall()
