"""An emulated interconnect: collectives complete no sooner than a modelled link allows.

``with emulated_link(gbps, latency_us) as link:`` replaces the collective functions on
``torch.distributed`` and ``torch.distributed.distributed_c10d`` with wrappers that delay completion,
and, with ``functional=True``, registers CPU kernels for torch's functional collectives
(``torch.ops._c10d_functional``: compiled code, DTensor) that do the same; leaving the context
restores the originals. Contexts nest (the innermost active link models every call; everything is
restored when the outermost exits) and may be entered from several threads. The patch is
process-wide while any link is active.

Timing model (``timing``): each process group has one FIFO link; a collective issued at ``t``
completes at ``max(t, busy_until) + latency + wire_bytes / bandwidth``, ``bandwidth = gbps * 1e9 /
8`` bytes/s (**gigabits** per second), ``wire_bytes`` what each rank receives (e.g. ``(w-1)/w`` of an
all-gather's output, ``2(w-1)/w`` of an all-reduce's tensor); a group of one rank is not delayed.

CPU tensors: a collective returns an :class:`EmulatedWork` whose ``wait()`` sleeps (``time.sleep``:
no CPU burnt) until the modelled completion time, then waits the real work; ``is_completed()`` and
``get_future()`` honour the completion time too; a blocking call waits before returning. Completion
is never earlier than the real collective's. Every such wait, functional ``wait_tensor`` included,
is bounded by its timeout, emulated delay included (see [Note: timeouts behind the link] in
``work``). CUDA tensors: ``torch.cuda._sleep`` on the current stream for the link time, just before
the real collective (``cuda_sleep``); the host is not blocked.

Not covered: functional collectives unless a link with ``functional=True`` is active, functional
collectives on CUDA tensors, calls inside ``dist._coalescing_manager``, and modules that bound a
collective with ``from torch.distributed import all_reduce`` before the link was entered. These run
at full speed and are not counted.

Statistics. ``link.stats()`` totals (count, wire bytes, emulated link seconds, calls per op) over
all groups since the link was created or :meth:`EmulatedLink.reset_stats`;
``link.stats_by_group()`` gives the same per process group name (functional ops are named
``_c10d_functional.<op>``). :func:`current_link` returns the innermost active link of this process
(e.g. inside ``run_distributed(fn, 2, link=(gbps, lat))``).

The package, one concern a module (each module's docstring states its contract and its op table):

=============  =====================================================================================
module         contract
=============  =====================================================================================
``timing``     the timing model; owns the link state (parameters, per-group FIFO, statistics):
               ``LinkModel.book`` is how every modelled call uses the link
``active``     which link is active (per process) and a thread's pass-through inside a modelled call
``eager``      the patch of ``torch.distributed``'s collective functions
``functional`` the CPU kernels of ``torch.ops._c10d_functional`` (opt-in: ``functional=True``)
``work``       :class:`EmulatedWork` and the timeout-bounded sleep until a delivery
``cuda_sleep`` keeping a CUDA stream busy for the link time
=============  =====================================================================================

This module activates links: the first entry installs the eager patch, a link with
``functional=True`` registers the functional kernels, the last exit removes both.
"""
from __future__ import annotations

from typing import Any, Mapping

from overlap.testing.emulated_link import active, eager, functional
from overlap.testing.emulated_link.active import current_link
from overlap.testing.emulated_link.timing import LinkModel, LinkStats
from overlap.testing.emulated_link.timing import check_number  # noqa: F401 (re-exported: its historical home)
from overlap.testing.emulated_link.work import EmulatedWork

__all__ = ["EmulatedLink", "EmulatedWork", "LinkStats", "current_link", "emulated_link"]


class EmulatedLink(LinkModel):
    """A modelled interconnect (``timing.LinkModel``); a context manager that activates it (see the
    module docstring). ``functional=True`` also models ``torch.ops._c10d_functional`` collectives."""

    def __init__(self, gbps: float, latency_us: float = 10.0, functional: bool = False, *,
                 gpus_per_node: int | None = None, inter_node: tuple[float, float] | None = None,
                 groups: Mapping[Any, tuple[float, float]] | None = None) -> None:
        if not isinstance(functional, bool):
            raise TypeError(f"functional must be a bool (also model torch.ops._c10d_functional collectives), got {functional!r}")
        super().__init__(gbps, latency_us, gpus_per_node=gpus_per_node, inter_node=inter_node, groups=groups)
        self.functional = functional

    def __repr__(self) -> str:
        tiers = ""
        if self.gpus_per_node is not None:
            tiers += f", gpus_per_node={self.gpus_per_node}, inter_node={self.inter_node}"
        if self.group_tiers:
            tiers += f", groups={self.group_tiers}"
        return f"EmulatedLink(gbps={self.gbps}, latency_us={self.latency_us}, functional={self.functional}{tiers})"

    def __enter__(self) -> EmulatedLink:
        _activate(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _deactivate(self)


def emulated_link(gbps: float, latency_us: float = 10.0, functional: bool = False, *,
                  gpus_per_node: int | None = None, inter_node: tuple[float, float] | None = None,
                  groups: Mapping[Any, tuple[float, float]] | None = None) -> EmulatedLink:
    """A link of ``gbps`` gigabits/s and ``latency_us`` µs per collective; use it with ``with``.
    ``gpus_per_node`` with ``inter_node``, and ``groups``, give groups other speeds (see [Note:
    two-tier links] in ``timing``).

    ``functional=True`` also models ``torch.ops._c10d_functional`` collectives (compiled code,
    DTensor). It is opt-in: a first version hung DTensor's ``full_tensor`` inside torch FSDP2
    state-dict code on gloo (torch 2.13), a GIL deadlock now understood and avoided (see
    [Note: calling torch's kernel without the GIL] in ``functional``), and timings taken without it
    stay comparable."""
    return EmulatedLink(gbps, latency_us, functional, gpus_per_node=gpus_per_node, inter_node=inter_node,
                        groups=groups)


def _activate(link: EmulatedLink) -> None:
    with active.state_lock:
        if current_link() is None:
            eager.install()
        if link.functional:
            functional.register()
        active.push(link)


def _deactivate(link: EmulatedLink) -> None:
    with active.state_lock:
        if active.remove(link):  # exits from threads need not be LIFO
            eager.uninstall()
            functional.unregister()
