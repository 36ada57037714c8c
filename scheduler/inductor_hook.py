"""Run the overlap graph pass inside Inductor, as its ``post_grad_custom_post_pass``.

Inductor calls ``torch._inductor.config.post_grad_custom_post_pass`` on the post-grad
``torch.fx.Graph`` (a Graph, not a GraphModule; Inductor recompiles afterwards) of every graph it
compiles, forward and backward. :func:`install` puts an :class:`OverlapGraphPass` there; a pass the
user had set runs first, then the overlap pass (scheduling goes last, after any rewrite).
:func:`uninstall` puts the previous value back. :func:`inductor_overlap` is the pair as a context
manager. Installs nest: each ``uninstall`` undoes the latest ``install``.

FX graph cache: ``OverlapGraphPass.uuid()`` hashes this package's pass sources, the options and the
composed user passes' own uuids, so a cached graph is reused only when all of those are the same,
and a different ``max_inflight_bytes`` gives a different key. A user pass that is a plain callable
(no uuid) makes ``uuid()`` return None, which tells Inductor to bypass the cache, as it would for
that pass on its own.

The config is process-global and not thread-safe; install from one thread, before compiling.

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
import hashlib
import logging
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch._inductor.config as inductor_config
from torch._inductor import custom_graph_pass as _cgp
from torch._inductor.custom_graph_pass import CustomGraphPass

from scheduler import bucketing as _bucketing
from scheduler import graph_pass as _graph_pass

__all__ = ["OverlapGraphPass", "inductor_overlap", "install", "uninstall"]

logger = logging.getLogger("scheduler")

# Bump when the pass's behaviour changes in a way the source hash would not show.
PASS_VERSION = 1

# Inductor passes ``is_inference`` to passes of this type (a CustomGraphPass subclass) where torch
# has it; the overlap pass takes it so that it can hand it on to inference-aware user passes.
_InferenceAware: Optional[type] = getattr(_cgp, "CustomInferenceAwareGraphPass", None)
_PassBase: type = _InferenceAware if _InferenceAware is not None else CustomGraphPass


def _flatten(passes: Any) -> tuple[Any, ...]:
    """The config value as a tuple of passes (it may be None, one pass, or a list / tuple)."""
    if passes is None:
        return ()
    if isinstance(passes, (list, tuple)):
        return tuple(passes)
    return (passes,)


class OverlapGraphPass(_PassBase):  # type: ignore[valid-type,misc]
    """Inductor post-grad pass: the user's previous passes, then :func:`~scheduler.overlap_graph`.

    ``max_inflight_bytes`` and ``bucket_bytes`` are passed to the graph pass. ``previous`` is the
    config value this pass replaced (None, a pass, or a list / tuple of passes); each runs before
    the overlap pass.
    """

    def __init__(self, max_inflight_bytes: Optional[int] = None, previous: Any = None,
                 bucket_bytes: Optional[int] = None) -> None:
        _graph_pass.check_max_inflight_bytes(max_inflight_bytes)
        _bucketing.check_bucket_bytes(bucket_bytes)
        for p in _flatten(previous):
            if not callable(p):
                raise TypeError(f"previous must hold callables taking a torch.fx.Graph, got {p!r}")
        self.max_inflight_bytes = max_inflight_bytes
        self.bucket_bytes = bucket_bytes
        self.previous = previous

    def __call__(self, graph: torch.fx.Graph, is_inference: Optional[bool] = None) -> None:
        for p in _flatten(self.previous):
            if _InferenceAware is not None and isinstance(p, _InferenceAware):
                p(graph, is_inference=bool(is_inference))
            else:
                p(graph)
        _graph_pass.overlap_graph(graph, self.max_inflight_bytes, self.bucket_bytes)

    def uuid(self) -> Optional[str]:
        """Stable id of this pass: sources + version + options + the composed passes' uuids.

        None (no caching) when a composed pass has no uuid of its own.
        """
        previous_ids = []
        for p in _flatten(self.previous):
            pid = p.uuid() if isinstance(p, _cgp.CustomPassBase) else None
            if pid is None:
                return None
            previous_ids.append(pid)
        sources = _cgp.get_hash_for_files((_graph_pass.__file__, _bucketing.__file__, __file__))
        h = hashlib.sha256(sources)
        h.update(repr((PASS_VERSION, self.max_inflight_bytes, self.bucket_bytes)).encode())
        h.update(pickle.dumps(previous_ids))
        return h.hexdigest()

    def __repr__(self) -> str:
        return (f"OverlapGraphPass(max_inflight_bytes={self.max_inflight_bytes}, bucket_bytes={self.bucket_bytes}, "
                f"previous={self.previous!r})")


@dataclass(frozen=True)
class _Installed:
    """One :func:`install`: the pass it set and the config values it replaced."""

    graph_pass: OverlapGraphPass
    previous_pass: Any
    previous_peak_memory: Optional[bool]  # None: left alone


_installed: list[_Installed] = []  # latest last


def install(
    max_inflight_bytes: Optional[int] = None, *, keep_peak_memory_reorder: bool = False,
    bucket_bytes: Optional[int] = None,
) -> OverlapGraphPass:
    """Set Inductor's ``post_grad_custom_post_pass`` to an :class:`OverlapGraphPass`; return it.

    The pass already set there (if any) is kept and runs first. Unless
    ``keep_peak_memory_reorder``, also turns ``reorder_for_peak_memory`` off (see
    [Note: Inductor's peak-memory reorder]). Undo with :func:`uninstall`.
    """
    if not isinstance(keep_peak_memory_reorder, bool):
        raise TypeError(
            f"keep_peak_memory_reorder must be a bool, got {type(keep_peak_memory_reorder).__name__}"
        )
    previous = inductor_config.post_grad_custom_post_pass
    p = OverlapGraphPass(max_inflight_bytes, previous, bucket_bytes)
    previous_peak: Optional[bool] = None
    if not keep_peak_memory_reorder:
        previous_peak = inductor_config.reorder_for_peak_memory
        inductor_config.reorder_for_peak_memory = False
    inductor_config.post_grad_custom_post_pass = p
    _installed.append(_Installed(p, previous, previous_peak))
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


@contextlib.contextmanager
def inductor_overlap(
    max_inflight_bytes: Optional[int] = None, *, keep_peak_memory_reorder: bool = False,
    bucket_bytes: Optional[int] = None,
) -> Iterator[OverlapGraphPass]:
    """Within the block, graphs compiled by Inductor get the overlap pass; yields the pass.

    Arguments as for :func:`install`. Graphs compiled (not merely run) inside the block are
    affected; the previous config is restored on exit, also on error.
    """
    p = install(max_inflight_bytes, keep_peak_memory_reorder=keep_peak_memory_reorder, bucket_bytes=bucket_bytes)
    try:
        yield p
    finally:
        uninstall()
