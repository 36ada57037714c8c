"""Host time of one ``overlap.load_full_state_dict``: the layout's cut vs ``distribute_tensor`` per parameter.

What is measured. One process joins a 1-rank gloo group (an in-memory store); a model is sharded
(each block, then the root) and loads its own full state dict (``overlap.full_state_dict``) again
and again, three ways, in interleaved rounds (the order rotates each round):

* ``distribute_tensor``: the path ``load_full_state_dict`` took before the layout's cut
  (``models.load_by_distribute_tensor``, the tests' reference): ``distribute_tensor`` per sharded
  entry, then ``load_state_dict`` (without the function's
  key and shape checks, so it is a little cheaper than the function was);
* ``load_full_state_dict``: the function as shipped, plain full tensors (the runtime's own
  parameters are cut by their group's layout: [Note: loading a full tensor without
  distribute_tensor] in ``overlap/state_dict.py``);
* ``load_full_state_dict, DTensor values``: the same dict after torch's ``set_model_state_dict(...,
  full_state_dict=True)`` loaded it (torch leaves DTensors in it), which takes ``distribute_tensor``.

Figures: the least and the median over every load of a mode (``--rounds`` x ``--loads``), in ms of
wall time (``perf_counter``) and of this thread's CPU time (``thread_time``, which a loaded box
disturbs less), and the ratio to ``distribute_tensor``'s least. Models (``--model``): ``linears``,
``--blocks`` blocks ``Linear(16, 16)`` (2 parameters each); or a client of ``tests/clients``
(``nanogpt``, ``llama3``, ``hf_gpt2``, ``hf_llama``; the HF ones need transformers).

Usual commands::

    OMP_NUM_THREADS=1 python benchmarks/bench_state_dict_load.py --model linears --blocks 150
    OMP_NUM_THREADS=1 python benchmarks/bench_state_dict_load.py --model hf_gpt2
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import _common
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import overlap
from models import load_by_distribute_tensor
from report import emit

MODES = ("distribute_tensor", "load_full_state_dict", "load_full_state_dict, DTensor values")


def _model(name: str, blocks: int) -> tuple[nn.Module, list[nn.Module]]:
    torch.manual_seed(0)
    if name == "linears":
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(blocks)])
        return model, list(model)
    sys.path.append(os.path.join(_common.TESTS, "clients"))
    from client_zoo import CLIENTS

    client = CLIENTS[name]
    model = client.build()
    return model, client.blocks(model)


def _loads(model: nn.Module) -> dict[str, Callable[[], None]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = overlap.full_state_dict(model, rank0_only=False)
    left_by_torch = dict(full)
    set_model_state_dict(model, left_by_torch, options=StateDictOptions(full_state_dict=True))
    if not any(isinstance(v, DTensor) for v in left_by_torch.values()):
        raise RuntimeError("set_model_state_dict left no DTensor in the dict: that mode would not measure its path")
    return {
        MODES[0]: lambda: load_by_distribute_tensor(model, full),
        MODES[1]: lambda: overlap.load_full_state_dict(model, full),
        MODES[2]: lambda: overlap.load_full_state_dict(model, left_by_torch),
    }


def measure(name: str, blocks: int, rounds: int, loads: int) -> tuple[int, dict[str, list[tuple[float, float]]]]:
    """Per mode, (wall s, thread CPU s) of every load; and the model's state-dict entry count."""
    model, units = _model(name, blocks)
    for unit in [*units, model]:
        overlap.shard(unit)
    calls = _loads(model)
    for call in calls.values():  # warm-up
        call()
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            for _ in range(loads):
                w0, c0 = time.perf_counter(), time.thread_time()
                calls[mode]()
                times[mode].append((time.perf_counter() - w0, time.thread_time() - c0))
    return len(model.state_dict()), times


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--model", default="linears", help="linears, nanogpt, llama3, hf_gpt2 or hf_llama (default linears)")
    p.add_argument("--blocks", type=int, default=150, help="Linear(16, 16) blocks of --model linears (default 150)")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    p.add_argument("--loads", type=int, default=3, help="loads per mode per round (default 3)")
    args = _common.parse(p, argv)
    for flag in ("blocks", "rounds", "loads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    with _common.single_rank_group():
        entries, times = measure(args.model, args.blocks, args.rounds, args.loads)
    base = min(w for w, _ in times[MODES[0]])
    rows: list[list[Any]] = []
    for mode in MODES:
        wall, cpu = [w for w, _ in times[mode]], [c for _, c in times[mode]]
        rows.append([mode, f"{1e3 * min(wall):.2f}", f"{1e3 * statistics.median(wall):.2f}",
                     f"{1e3 * min(cpu):.2f}", f"{1e3 * statistics.median(cpu):.2f}", f"{min(wall) / base:.2f}x"])
    model = f"{args.blocks} Linear(16, 16)" if args.model == "linears" else args.model
    emit(f"load_full_state_dict, {model} ({entries} entries), world size 1, {args.rounds} x {args.loads} loads",
         ["mode", "least ms", "median ms", "least CPU ms", "median CPU ms", "least vs distribute_tensor"],
         rows, args.markdown)


if __name__ == "__main__":
    main()
