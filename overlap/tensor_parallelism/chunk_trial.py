"""Timing a collective matmul's candidate chunk counts directly: the trial that settles a choice the
chunk-count model is unsure of ([Note: choosing the chunk count] in ``chunks``).

Contract. :func:`trial_seconds` runs, for every count it is given, up to ``rounds + 1`` forward +
backward passes of the layer's collective matmul (the same autograd function a parallelized layer
runs: ``collective_matmul``'s four) on synthetic operands of the workload's shapes, and returns
this rank's wall seconds of each timed pass, unagreed: the first pass of each count is untimed (a
first use's one-time costs), then the counts take turns pass by pass, so a loaded machine's drifts
fall on all alike; the caller's ``go_on`` (an agreement) may end it after any round. It issues the
layer's collectives on ``info``'s group, behind whatever emulated link is active (the link the
choice is for), so every rank of the group must call it together with the same arguments (the
chunk-count choice does: its keys are global sizes and agreed figures).

Isolation. The passes run on a helper thread, joined before returning: autograd's thread-local
state of the caller (grad mode, saved-tensor hooks such as activation checkpointing's, dispatch
modes) never sees the trial's graph, and the caller's own graph never sees the trial. The thread
takes the caller's intra-op thread count (a fresh thread's OpenMP team would take every core and
spin beside gloo's threads: 100-300 ms passes where the caller's took 11-16 ms). The sibling
gather a real layer holds ([Note: sibling layers share one gather]) is kept. Nothing the caller
owns is read or written, torch's default random generators included.

Shapes (``w`` ranks; ``lead = gemm_rows / (w rows)``, at least 1; the weight ``out x in`` as the
workload's):

===============  =====================================  ===================================
kind             input                                  function
===============  =====================================  ===================================
gather           ``(lead, rows, in)``, dim 1 sharded    ``AllGatherMatmul``
scatter          ``(lead, w rows, in)``                 ``MatmulReduceScatter`` (dim 1)
all_reduce       ``(gemm_rows, in)``                    ``MatmulAllReduce``
all_reduce_grad  ``(gemm_rows, in)``                    ``LinearAllReduceGrad``
===============  =====================================  ===================================
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from overlap.groups import GroupInfo
from overlap.tensor_parallelism import collective_matmul as cm

__all__ = ["trial_seconds"]

_FUNCTIONS = {"gather": cm.AllGatherMatmul, "scatter": cm.MatmulReduceScatter,
              "all_reduce": cm.MatmulAllReduce, "all_reduce_grad": cm.LinearAllReduceGrad}


def _operands(work: Any, info: GroupInfo, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(input, weight, layout)`` of one synthetic pass of ``work`` (see the module's shape table);
    the layout is ``(sizes, dim)`` for the sequence kinds, None for row blocks. The values come from
    a generator of the trial's own: the caller's random streams (dropout, init) are not advanced."""
    w = info.size
    generator = torch.Generator(device=device)
    generator.manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=generator).to(work.dtype)

    weight = randn(work.out_features, work.in_features)
    if work.kind in ("gather", "scatter"):
        lead = max(1, round(work.gemm_rows / max(1, w * work.rows)))
        seq = work.rows if work.kind == "gather" else w * work.rows
        return randn(lead, seq, work.in_features), weight, ([work.rows] * w, 1)
    return randn(work.gemm_rows, work.in_features), weight, None


def _one_pass(work: Any, chunks: int, info: GroupInfo, x: torch.Tensor, weight: torch.Tensor, layout: Any,
              device: torch.device) -> float:
    seq = cm.SeqLayout(layout[0], layout[1], chunks, info.rank) if layout is not None else None
    call = cm.Call(info, chunks, "overlap::tp_trial_forward", "overlap::tp_trial_backward", seq)
    x = x.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    y = _FUNCTIONS[work.kind].apply(x, weight, None, call)
    torch.autograd.backward(y, torch.ones_like(y))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def trial_seconds(work: Any, counts: Sequence[int], info: GroupInfo, device: torch.device, rounds: int,
                  go_on: Optional[Callable[[float], bool]] = None) -> list[list[float]]:
    """This rank's seconds of each of up to ``rounds`` timed forward + backward passes of ``work`` (a
    ``chunks.Workload``) at each of ``counts``: ``[round][index in counts]``, unagreed (see the
    module docstring: collectives every rank of ``info``'s group must make together). After each
    timed round but the last, ``go_on(seconds since the start)`` says whether to run another; it
    runs on the trial's thread and must answer alike on every rank (an agreement)."""
    if work.kind not in _FUNCTIONS:
        raise ValueError(f"work.kind must be one of {tuple(_FUNCTIONS)}, got {work.kind!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds!r}")
    out: list[list[float]] = []
    failure: list[BaseException] = []
    intra_op = torch.get_num_threads()  # a new thread's OpenMP team would take every core (and spin)
    cuda_index = 0
    if device.type == "cuda":  # the caller's device, where the index leaves it to the current one
        cuda_index = device.index if device.index is not None else torch.cuda.current_device()

    def run() -> None:
        try:
            torch.set_num_threads(intra_op)
            with torch.enable_grad(), cm.shared_gather_kept():
                if device.type == "cuda":  # a new thread starts on device 0
                    torch.cuda.set_device(cuda_index)
                start = time.perf_counter()
                x, weight, layout = _operands(work, info, device)
                for c in counts:  # the first use of each count's path: untimed
                    _one_pass(work, c, info, x, weight, layout, device)
                while len(out) < rounds:
                    out.append([_one_pass(work, c, info, x, weight, layout, device) for c in counts])
                    if len(out) < rounds and go_on is not None and not go_on(time.perf_counter() - start):
                        break
        except BaseException as e:  # re-raised on the caller's thread
            failure.append(e)

    thread = threading.Thread(target=run, name="overlap-tp-chunk-trial", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return out
