"""What differs across the supported torch releases, in one place.

Supported: torch ``SUPPORTED_TORCH[0]`` through ``SUPPORTED_TORCH[1]`` (2.11 through 2.15), with the
Triton each pins (3.6 through 3.9); CI runs the suite on both ends (``.ci/run``) and pyproject
declares the same range. Code that depends on a name one of them lacks asks here instead of testing
``torch.__version__`` itself (the behaviours that differ: docs/DESIGN.md, "Torch versions"):

=====================================  ==========================  ==========================
what                                   torch 2.11                  torch 2.13 and later
=====================================  ==========================  ==========================
``dist`` all-gather / reduce-scatter   ``all_gather_into_tensor``  ``all_gather_single``
                                       ``reduce_scatter_tensor``   ``reduce_scatter_single``
functional (``funcol``) ones           ``all_gather_tensor``       ``all_gather_single``
                                       ``reduce_scatter_tensor``   ``reduce_scatter_single``
=====================================  ==========================  ==========================

The old names still exist on 2.13+ (deprecated, forwarding to the new ones); the new ones are used
where they exist, so nothing warns. :data:`DIST_ALL_GATHER` / :data:`DIST_REDUCE_SCATTER` name the
``torch.distributed`` functions that torch's own code (FSDP2, DTensor) calls on this version: the
emulated link and the profiler count collectives under those names. They are looked up by name at
call time (``getattr(dist, DIST_ALL_GATHER)``) because ``overlap.testing.emulated_link`` patches the
module attributes.

It lives in ``scheduler`` because ``scheduler`` must not import ``overlap`` and both need it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = ["SUPPORTED_TORCH", "TORCH_VERSION", "DIST_ALL_GATHER", "DIST_REDUCE_SCATTER", "funcol_all_gather",
           "funcol_reduce_scatter"]

SUPPORTED_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 15))
"""The oldest and the newest torch (major, minor) the suite runs on in CI (``.ci/run``) and
pyproject admits (tests/tools/test_torch_versions.py keeps the three the same)."""


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


TORCH_VERSION: tuple[int, int] = _major_minor(torch.__version__)
"""This torch's (major, minor)."""

DIST_ALL_GATHER: str = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
"""The name of ``torch.distributed``'s tensor all-gather (``(output, input, group=, async_op=)``)."""
DIST_REDUCE_SCATTER: str = ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
                            else "reduce_scatter_tensor")
"""The name of ``torch.distributed``'s tensor reduce-scatter (``(output, input, op=, group=, async_op=)``)."""

funcol_all_gather: Callable[..., Any] = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
"""The functional all-gather, ``(tensor, gather_dim, group)`` -> AsyncCollectiveTensor."""
funcol_reduce_scatter: Callable[..., Any] = (getattr(funcol, "reduce_scatter_single", None)
                                             or funcol.reduce_scatter_tensor)
"""The functional reduce-scatter, ``(tensor, reduceOp, scatter_dim, group)`` -> AsyncCollectiveTensor."""

