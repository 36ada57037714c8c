"""torch.compile with sharded client models (issue 12, item 5), ``overlap.shard`` beside FSDP2.

Two ways clients compile, on 2 gloo ranks, 4 clipped AdamW steps each, compiled and eager:

- ``per_block``: torchtitan's way -- ``block.compile(fullgraph=True)`` on each block, then shard
  the blocks and the root. The sharding hooks, registered after ``compile``, run inside the
  compiled ``_call_impl``; ``fullgraph=True`` turns any graph break into an error.
- ``whole_model``: ``torch.compile(model)`` after sharding. With a sharded root (FSDP2's or
  overlap's), Dynamo meets the compiler-disabled pre-forward hook, breaks the graph, and falls back
  to eager for the root's forward frame (the break is in its loop over blocks); each block's forward
  is then compiled on its own, as one graph.

Checks: compiled losses equal eager within 1e-5 relative (Inductor reorders and fuses float32
arithmetic; measured <= 1e-6); compiled overlap equals compiled FSDP2 bitwise (same graphs, same
kernels); the blocks' code lands in exactly one graph (both blocks share it; a graph break inside a
block would split it: :class:`GraphRecorder` keeps each compiled graph's source lines); per_block
compiles nothing else; no graph is compiled after step 2 (no recompiles).

Compile is slow on 2 cores (Dynamo + Inductor + a C++ build: ~15-20 s per rank function, less
with a warm Inductor cache), so the default run has one client in one mode; the rest is ``slow``.
"""
from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

from client_zoo import CLIENTS, Client
from models import max_rel_dev
from side_by_side import RUNTIMES, Env, build, build_sharded, outcome, per_runtime, shard, train

pytestmark = pytest.mark.torch_kernels  # [Note: packing at the client level] in test_clients.py

COMPILE_RTOL = 1e-5  # compiled vs eager losses (see the module docstring)
STEPS = 4
WARM_STEPS = 2  # recompiles are counted after these
_FRAME = re.compile(r'File "(.+)", line (\d+), in (\w+)')


class GraphRecorder:
    """A compile backend (Inductor; ``inductor=False``: run the graph as it is) that keeps, for every
    graph it compiles, the source frames of its ops."""

    def __init__(self, inductor: bool = True) -> None:
        self.inductor = inductor
        self.graphs: list[set[tuple[str, int, str]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        frames = set()
        for node in gm.graph.nodes:
            for file, line, name in _FRAME.findall(node.meta.get("stack_trace") or ""):
                frames.add((file, int(line), name))
        self.graphs.append(frames)
        return compile_fx(gm, example_inputs) if self.inductor else gm.forward


def _forward_lines(block: torch.nn.Module) -> tuple[str, int, int]:
    """(file, first line, last line) of the block class's ``forward``. Every op of a block has it in
    its stack (Dynamo's resume functions after a break keep its lines, under another name), while a
    module that also runs outside blocks (Llama 3's final RMSNorm) does not."""
    code = type(block).forward.__code__
    lines = [line for _, _, line in code.co_lines() if line is not None]
    return code.co_filename, code.co_firstlineno, max(lines)


def _block_graphs(graphs: list[set[tuple[str, int, str]]], span: tuple[str, int, int]) -> int:
    """How many graphs hold ops of a block's forward (a graph break inside a block makes it 2 or more)."""
    file, first, last = span
    return sum(any(f == file and first <= line <= last for f, line, _ in frames) for frames in graphs)


def _compiled(runtime: str, client: Client, env: Env, mode: str) -> dict[str, Any]:
    """``STEPS`` steps with ``mode``'s compile, then the same steps eagerly."""
    import torch._dynamo

    torch._dynamo.reset()  # each runtime compiles from scratch (the Inductor cache may hit)
    recorder = GraphRecorder()
    model = build(client)
    blocks = client.blocks(model)
    span = _forward_lines(blocks[0])
    if mode == "per_block":
        for block in blocks:
            block.compile(backend=recorder, fullgraph=True)
        shard(runtime, model, blocks, env)
        forward = model
    else:
        shard(runtime, model, blocks, env)
        forward = torch.compile(model, backend=recorder)
    opt, losses, warm = None, [], 0
    for step in range(STEPS):
        if step == WARM_STEPS:
            warm = len(recorder.graphs)
        opt, loss, _ = train(forward, client, env, 1, start=step, opt=opt)
        losses += loss
    eager = train(build_sharded(runtime, client, env), client, env, STEPS)[1]
    return {"losses": losses, "eager": eager, "graphs": len(recorder.graphs), "recompiled": len(recorder.graphs) - warm,
            "block_graphs": _block_graphs(recorder.graphs, span), "breaks": _break_reasons()}


def _rank_compiled(rank: int, world: int, client_name: str, mode: str) -> dict[str, Any]:
    return per_runtime(rank, world, client_name, "compiled", functools.partial(_compiled, mode=mode))


def _break_reasons() -> list[str]:
    from torch._dynamo.utils import counters

    return [reason.splitlines()[0] for key in ("graph_break", "unimplemented") for reason in counters[key]]


CASES = [
    pytest.param("nanogpt", "per_block", id="nanogpt-per_block"),
    pytest.param("nanogpt", "whole_model", id="nanogpt-whole_model", marks=pytest.mark.slow),
    pytest.param("llama3", "per_block", id="llama3-per_block", marks=pytest.mark.slow),
    pytest.param("llama3", "whole_model", id="llama3-whole_model", marks=pytest.mark.slow),
]
_results: dict[tuple[str, str], list[dict[str, Any]]] = {}


@pytest.fixture
def compiled_runs(distributed):
    def get(client: str, mode: str) -> list[dict[str, Any]]:
        if (client, mode) not in _results:
            _results[client, mode] = distributed(_rank_compiled, 2, client, mode, timeout=280, pg_timeout=120)
        return _results[client, mode]

    return get


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("client_name, mode", CASES)
def test_compiled_training_matches_eager(compiled_runs, client_name: str, mode: str, runtime: str) -> None:
    results = compiled_runs(client_name, mode)
    got = outcome(results, f"{runtime}/compiled")
    for rank, r in enumerate(got):
        assert max_rel_dev(r["losses"], r["eager"]) <= COMPILE_RTOL, (rank, r["losses"], r["eager"])
        # The blocks share one graph; a graph break inside a block would split it.
        assert r["block_graphs"] == 1, f"rank {rank}: block code in {r['block_graphs']} graphs; breaks: {r['breaks']}"
        assert r["recompiled"] == 0, f"rank {rank}: {r['recompiled']} graphs compiled after step {WARM_STEPS}"
        if mode == "per_block":
            assert r["graphs"] == 1 and r["breaks"] == [], (r["graphs"], r["breaks"])
    if runtime == "overlap":
        fsdp2 = outcome(results, "fsdp2/compiled")[0]
        assert got[0]["losses"] == fsdp2["losses"], ("compiled overlap vs compiled FSDP2", got[0]["losses"], fsdp2["losses"])
        assert got[0]["graphs"] == fsdp2["graphs"], ("graphs compiled, overlap vs FSDP2", got[0]["graphs"], fsdp2["graphs"])


def test_block_graph_count_sees_a_break_inside_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph-break check above can fail: a break inside nanoGPT's MLP puts the block's forward
    in 2 graphs (one process, no sharding, graphs run uncompiled)."""
    import torch._dynamo

    import nanogpt

    client = CLIENTS["nanogpt"]
    tokens = client.batch(0)[:, :-1]
    for broken, want in ((False, 1), (True, 2)):
        torch._dynamo.reset()
        model = build(client)
        if broken:
            forward = nanogpt.MLP.forward

            def mlp_with_break(self, x: torch.Tensor) -> torch.Tensor:
                torch._dynamo.graph_break()
                return forward(self, x)

            monkeypatch.setattr(nanogpt.MLP, "forward", mlp_with_break)
        recorder = GraphRecorder(inductor=False)
        for block in client.blocks(model):
            block.compile(backend=recorder)
        model(tokens)
        assert _block_graphs(recorder.graphs, _forward_lines(client.blocks(model)[0])) == want
    torch._dynamo.reset()
