"""Shared test set-up.

Without a GPU, Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``); it must be set
before ``triton.jit`` decorates anything, so it is set here, before test modules import ``kernels``.
Spawned ranks inherit it through the environment.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def distributed():
    """``overlap.testing.run_distributed``: ``distributed(fn, world_size, *args, **kwargs)`` runs
    ``fn(rank, world_size, *args, **kwargs)`` on gloo ranks (``fn`` at module level in the test file)
    and returns the per-rank results."""
    from overlap.testing import run_distributed

    return run_distributed
