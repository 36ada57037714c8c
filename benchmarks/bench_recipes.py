"""Training recipes side by side: ``overlap.fully_shard`` vs torch FSDP2 vs plain training, collectives and values.

What is measured. Each recipe is a short training loop a user of FSDP2 writes (gradient accumulation,
a block whose output is dropped, a frozen block, layer drop, a no_grad forward between backward and
step, a state-dict round trip, ...). It runs on ``--world-size`` gloo ranks behind the counting link
(``overlap.testing``: every collective counted, no delay) three ways from one seed: the 4-block
test-suite ``TinyLM`` under ``overlap.fully_shard`` (the one-line swap), under torch's
``fully_shard``, and unsharded on the global batch in each rank (the reference). AdamW
(``foreach=False`` unless the recipe says, weight decay 0.1), ``--steps`` steps. Per recipe and
runtime:

* all-gathers and gradient reductions per step, from step 2 on (step 1 also agrees the forward
  order: one more all-gather), as ``a..b`` when steps differ;
* the largest absolute difference of any parameter from the plain run after the last step (both
  sharded runtimes differ from it by the reduction's summation order: a few 1e-6 on 2 ranks; a
  recipe one of them gets wrong shows as 1e-3 or more);
* whether overlap's losses and parameters are bitwise FSDP2's.

An error in a run is shown in its cells (its type and message start), and the others still run.
The recipes are where faults were found before (two forwards before one backward; FSDP2's
accumulation recipe; a gradient no rank produced): see ``docs/DESIGN.md``.

Usual command::

    python benchmarks/bench_recipes.py
    python benchmarks/bench_recipes.py --world-size 3 --recipes plain,discard
    python benchmarks/bench_recipes.py --mixed-precision   # every recipe with bf16 parameters, fp32 reductions
    python benchmarks/bench_recipes.py --shard-dim1        # every recipe with the matrices sharded on dim 1
"""
from __future__ import annotations

import traceback
from typing import Any, Optional, Sequence

import _common
import torch

import overlap
from models import COUNTING_LINK, SEED, TinyLM, all_gathers, gradient_reductions, local_batch, make_batch
from report import emit


class RecipeLM(TinyLM):
    """``TinyLM`` whose forward can run its blocks in another ``order`` (None: all, in order) and
    compute a block's output and drop it (``discard``)."""

    order: Optional[list[int]] = None
    discard: tuple[int, ...] = ()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for i in (self.order if self.order is not None else range(len(self.blocks))):
            y = self.blocks[i](x)
            if i not in self.discard:
                x = y
        return self.head(self.ln_f(x))


LAYERS = 4

# recipe -> what it does in a step, before / after the backward (see ``_step``)
RECIPES = {
    "plain": "one forward, one backward, step",
    "no_sync": "a micro-batch under set_requires_gradient_sync(False), then a synced one",
    "accumulate_synced": "two backwards per step, both synced",
    "two_forwards": "(loss(a) + loss(b)).backward()",
    "forward_without_backward": "a forward with grad enabled whose graph is dropped, then the step",
    "eval_no_grad_between": "a no_grad forward before each step's forward",
    "no_grad_forward_before_step": "a no_grad forward between backward and optimizer step",
    "discard": "steps 2-3: block 2's output computed and dropped",
    "freeze_mid": "step 3: block 0 frozen (requires_grad_(False))",
    "frozen_from_start": "the position embedding and block 1 frozen before sharding",
    "frozen_weights": "each block's matrices frozen before sharding, its norms and biases trained (LoRA's shape: "
                      "backward reads a frozen weight after its group's other gradients are in)",
    "layer_drop": "step 2: block 1 skipped",
    "layer_drop_alt": "every step skips block 1 or block 2, alternating",
    "reversed": "steps 3-4: blocks run in reverse order",
    "block_twice": "block 1 called twice per forward",
    "unshard_async": "blocks[0].unshard(async_op=True).wait() before each forward",
    "clip": "clip_grad_norm_(0.05) before each step",
    "zero_grad_keep": "zero_grad(set_to_none=False)",
    "state_dict_roundtrip": "get / set_model_state_dict after each step",
    "checkpoint": "checkpoint_wrapper on each block",
    "explicit_prefetch": "set_modules_to_forward / backward_prefetch on the blocks",
    "no_reshard_after_forward": "reshard_after_forward=False on the blocks",
    "reshard_after_step": "model.reshard() after each step",
    "divide_factor": "set_gradient_divide_factor(1.0) on every module (a summed gradient; the plain "
                     "loss times the rank count)",
    "mixed_precision": "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)",
    "hsdp": "a 2-D mesh: (2, ranks / 2) replicas x shards for an even count above 2, else (ranks, 1)",
    "hsdp_partial": "hsdp's mesh; a micro-batch under set_requires_all_reduce(False), then a synced one",
    "all_reduce_hook": "hsdp's mesh, sharded over its shard dim only; set_all_reduce_hook sums over the "
                       "replicas and divides (a replica tier of the user's own)",
    "custom_comms": "set_custom_all_gather / set_custom_reduce_scatter on every module: comms whose allocate "
                    "makes the buffers and whose call runs torch's collective",
    "process_group_memory": "set_allocate_memory_from_process_group_for_comm(True) on every module (gloo has no "
                            "allocator of its own: plain buffers)",
    "separate_reduce_group": "set_separate_reduce_scatter_group() on the root (FSDP2: where its torch has it, 2.15)",
    "reduce_input_cap": "set_reduce_scatter_max_input_buffers(1) on the root (FSDP2: where its torch has it, 2.15)",
    "manual_finalization": "set_manual_backward_finalization(True) on the root; two micro-batches under no_sync, then "
                           "sync on and finalize_backward() (FSDP2 where its torch has it, 2.15; else no_sync's loop)",
    "shard_dim1": "shard_placement_fn: each matrix sharded on dim 1 (Shard(1)), the vectors on dim 0",
    "foreach": "AdamW(foreach=True)",
    "optimizer_in_backward": "one AdamW per parameter, stepped in its post-accumulate-grad hook",
    "embedding_left_sharded": "the position embedding sharded on its own, set_unshard_in_backward(False)",
    "compile": "each block's forward compiled (module.compile(), Inductor; the plain model's too)",
}


class _CustomAllGather:
    """FSDP2's ``AllGather`` comm at its simplest: a new buffer, torch's all-gather."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _CustomReduceScatter(_CustomAllGather):
    """FSDP2's ``ReduceScatter`` comm at its simplest: torch's reduce-scatter with the op given."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any = None,
                 async_op: bool = False) -> Any:
        return torch.distributed.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                                       async_op=async_op)


def _build(runtime: str, recipe: str, world: int, variants: frozenset[str] = frozenset()) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(SEED)
    model = RecipeLM(layers=LAYERS)
    if recipe == "frozen_from_start":
        model.pos.weight.requires_grad_(False)
        model.blocks[1].requires_grad_(False)
    if recipe == "frozen_weights":
        for p in model.blocks.parameters():
            p.requires_grad_(p.dim() != 2)
    if recipe == "compile":
        for block in model.blocks:
            block.compile()
    if runtime == "plain":
        return model
    if recipe == "checkpoint":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i in range(LAYERS):
            model.blocks[i] = checkpoint_wrapper(model.blocks[i])
    fully_shard = overlap.fully_shard if runtime == "overlap" else torch_fully_shard
    if recipe in ("hsdp", "hsdp_partial", "all_reduce_hook"):
        shape = (2, world // 2) if world > 2 and world % 2 == 0 else (world, 1)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        if recipe == "all_reduce_hook":
            mesh, replicas = mesh["shard"], mesh.get_group("replicate")
    else:
        mesh = init_device_mesh("cpu", (world,))
    kwargs: dict[str, Any] = {"reshard_after_forward": False} if recipe == "no_reshard_after_forward" else {}
    if recipe == "mixed_precision" or "mixed_precision" in variants:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if recipe == "shard_dim1" or "shard_dim1" in variants:
        from torch.distributed.tensor import Shard

        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.dim() == 2 else None
    if recipe == "embedding_left_sharded":  # its backward reads the indices only
        fully_shard(model.pos, mesh=mesh, **kwargs)
        model.pos.set_unshard_in_backward(False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})
    if recipe == "divide_factor":  # gloo has no PREMUL_SUM: FSDP2 divides by a factor after a sum only
        for module in [*model.blocks, model]:
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    if recipe == "all_reduce_hook":
        def over_replicas(output: torch.Tensor) -> None:  # the shard group's average, then the replicas'
            torch.distributed.all_reduce(output, group=replicas)
            output.div_(shape[0])

        for module in [*model.blocks, model]:
            module.set_all_reduce_hook(over_replicas)
    if recipe == "custom_comms":
        gather, reduce = _CustomAllGather(), _CustomReduceScatter()
        for module in [*model.blocks, model]:
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(reduce)
    if recipe == "process_group_memory":
        for module in [*model.blocks, model]:
            module.set_allocate_memory_from_process_group_for_comm(True)
    if recipe == "separate_reduce_group" and hasattr(model, "set_separate_reduce_scatter_group"):
        model.set_separate_reduce_scatter_group()
    if recipe == "manual_finalization" and hasattr(model, "set_manual_backward_finalization"):
        model.set_manual_backward_finalization(True)
    if recipe == "reduce_input_cap" and hasattr(model, "set_reduce_scatter_max_input_buffers"):
        model.set_reduce_scatter_max_input_buffers(1)
    if recipe == "explicit_prefetch":
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
    return model


def _step(model: Any, opt: torch.optim.Optimizer, runtime: str, recipe: str, step: int, batch: torch.Tensor,
          world: int) -> float:
    """One training step of ``recipe``; returns the (last) loss."""
    sharded = runtime != "plain"
    model.order, model.discard = None, ()
    if recipe == "freeze_mid":
        model.blocks[0].requires_grad_(step != 2)
    if recipe == "layer_drop" and step == 1:
        model.order = [0, 2, 3]
    if recipe == "layer_drop_alt":
        model.order = [0, 2, 3] if step % 2 else [0, 1, 3]
    if recipe == "reversed" and step >= 2:
        model.order = [3, 2, 1, 0]
    if recipe == "block_twice":
        model.order = [0, 1, 1, 2, 3]
    if recipe == "discard" and step in (1, 2):
        model.discard = (2,)
    if recipe == "unshard_async" and sharded:
        model.blocks[0].unshard(async_op=True).wait()
    if recipe == "eval_no_grad_between":
        with torch.no_grad():
            model(batch[:, :-1])
    if recipe == "forward_without_backward":
        model(batch[:, :-1]).sum().item()
    manual = recipe == "manual_finalization" and hasattr(model, "finalize_backward")
    if recipe in ("no_sync", "manual_finalization"):
        if sharded:
            model.set_requires_gradient_sync(False)
        model.loss(batch.flip(0)).backward()
        if sharded:
            model.set_requires_gradient_sync(True)
    if recipe == "accumulate_synced":
        model.loss(batch.flip(0)).backward()
    if recipe == "hsdp_partial":  # reduce-scattered within the shards, summed over the replicas at the last
        if sharded:
            model.set_requires_all_reduce(False)
        model.loss(batch.flip(0)).backward()
        if sharded:
            model.set_requires_all_reduce(True)
    loss = model.loss(batch) + model.loss(batch.flip(0)) if recipe == "two_forwards" else model.loss(batch)
    if manual:
        model.set_requires_gradient_sync(False)
    if recipe == "divide_factor" and not sharded:  # the sharded gradients are summed over the ranks
        (loss * world).backward()
    else:
        loss.backward()
    if manual:  # the sum of both micro-batches, reduced once here
        model.set_requires_gradient_sync(True)
        model.finalize_backward()
    if recipe == "no_grad_forward_before_step":
        with torch.no_grad():
            model(batch[:, :-1])
    if recipe == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    opt.zero_grad(set_to_none=recipe != "zero_grad_keep")
    if recipe == "state_dict_roundtrip" and sharded:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        state = {k: v.detach().clone() for k, v in get_model_state_dict(model).items()}
        set_model_state_dict(model, state)
    if recipe == "reshard_after_step" and sharded:
        model.reshard()
    return loss.item()


class _StepInBackward:
    """torch's optimizer-in-backward recipe: one AdamW per parameter, stepped and zeroed in the
    parameter's post-accumulate-grad hook (on a sharded parameter: once its gradient is reduced).
    ``step`` and ``zero_grad`` do nothing; ``param_groups`` lists the parameters like an optimizer's."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.param_groups = [{"params": params}]
        self._optimizers = {p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, foreach=False) for p in params}
        for p in params:
            p.register_post_accumulate_grad_hook(self._step)

    def _step(self, p: torch.Tensor) -> None:
        self._optimizers[p].step()
        self._optimizers[p].zero_grad(set_to_none=True)

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _run(runtime: str, recipe: str, rank: int, world: int, steps: int,
         variants: frozenset[str] = frozenset()) -> dict[str, Any]:
    from overlap.testing import current_link

    link = current_link()
    model = _build(runtime, recipe, world, variants)
    params = [p for p in model.parameters() if p.requires_grad or recipe == "freeze_mid"]
    opt = (_StepInBackward(params) if recipe == "optimizer_in_backward"
           else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=recipe == "foreach"))
    gathers, reductions, losses = [], [], []
    for step in range(steps):
        before = link.stats()
        batch = make_batch(step)
        losses.append(_step(model, opt, runtime, recipe, step,
                            batch if runtime == "plain" else local_batch(batch, rank, world), world))
        after = link.stats()
        gathers.append(all_gathers(after) - all_gathers(before))
        reductions.append(gradient_reductions(after) - gradient_reductions(before))
    # the optimizer's parameters: the sharded ones, whatever a module holds after the step
    params = [p.full_tensor() if runtime != "plain" else p.detach().clone()
              for group in opt.param_groups for p in group["params"]]
    return {"gathers": gathers, "reductions": reductions, "losses": losses, "params": params}


def _rank(rank: int, world: int, recipes: Sequence[str], steps: int,
          variants: frozenset[str] = frozenset()) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for recipe in recipes:
        out[recipe] = {}
        for runtime in ("overlap", "fsdp2", "plain"):
            try:
                out[recipe][runtime] = _run(runtime, recipe, rank, world, steps, variants)
            except Exception as e:  # noqa: BLE001 - shown in the table, the other runs go on
                out[recipe][runtime] = {"error": f"{type(e).__name__}: {str(e)[:80]}",
                                        "trace": traceback.format_exc()[-2000:]}
    return out


def _per_step(counts: list[int]) -> str:
    later = counts[1:] or counts
    return str(later[0]) if min(later) == max(later) else f"{min(later)}..{max(later)}"


def _deviation(run: dict[str, Any], plain: dict[str, Any]) -> str:
    if "error" in run or "error" in plain:
        return "-"
    return f"{max((a - b).abs().max().item() for a, b in zip(run['params'], plain['params'])):.1e}"


def rows(results: dict[str, dict[str, Any]]) -> list[list[object]]:
    table: list[list[object]] = []
    for recipe, runs in results.items():
        ours, torchs, plain = runs["overlap"], runs["fsdp2"], runs["plain"]
        cells: list[object] = [recipe]
        for key in ("gathers", "reductions"):
            for run in (ours, torchs):
                cells.append(run["error"] if "error" in run else _per_step(run[key]))
        cells += [_deviation(ours, plain), _deviation(torchs, plain)]
        bitwise: object = "-"
        if "error" not in ours and "error" not in torchs:
            bitwise = "yes" if ours["losses"] == torchs["losses"] and all(
                torch.equal(a, b) for a, b in zip(ours["params"], torchs["params"])) else "no"
        cells.append(bitwise)
        table.append(cells)
    return table


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = _common.parser(__doc__)
    _common.add_world_size(p)
    p.add_argument("--steps", type=int, default=4, help="training steps per run (default 4)")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help=f"comma-separated recipes (default all: {', '.join(RECIPES)})")
    p.add_argument("--mixed-precision", action="store_true",
                   help="every recipe under MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) "
                        "(the plain run stays float32)")
    p.add_argument("--shard-dim1", action="store_true",
                   help="every recipe with each sharded matrix on dim 1 (shard_placement_fn: Shard(1))")
    args = _common.parse(p, argv)
    recipes = args.recipes.split(",")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        p.error(f"--recipes: unknown {unknown}; choose from {', '.join(RECIPES)}")
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (counts are from step 2 on), got {args.steps}")
    from overlap.testing import run_distributed

    variants = frozenset(name for name, on in (("mixed_precision", args.mixed_precision),
                                               ("shard_dim1", args.shard_dim1)) if on)
    results = run_distributed(_rank, args.world_size, recipes, args.steps, variants, link=COUNTING_LINK,
                              timeout=900)[0]
    header = ["recipe", "all-gathers / step: overlap", "FSDP2", "reductions / step: overlap", "FSDP2",
              "max abs(param - plain): overlap", "FSDP2", "overlap bitwise FSDP2"]
    under = (", all under MixedPrecisionPolicy(bfloat16, float32)" if args.mixed_precision else "") + (
        ", each matrix sharded on dim 1" if args.shard_dim1 else "")
    emit(f"Training recipes side by side, TinyLM ({LAYERS} blocks), {args.world_size} gloo ranks, "
         f"{args.steps} AdamW steps{under}; counts from step 2 on", header, rows(results), args.markdown)
    legend = "; ".join(f"{name}: {what}" for name, what in RECIPES.items() if name in recipes)
    print(f"recipes: {legend}")
    for recipe, runs in results.items():
        for runtime, run in runs.items():
            if "trace" in run:
                print(f"\n{recipe} / {runtime}:\n{run['trace']}")


if __name__ == "__main__":
    main()
