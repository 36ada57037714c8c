"""A tiny transformer LM and the reference training loops that sharded runtimes are checked against.

Used by the numerics tests (``shard/test_reference_fsdp2.py``, ``shard/test_shard_numerics.py`` and
others at every level).

The comparison method (see [Note: global loss]):

- :func:`unsharded_losses` trains :class:`TinyLM` in one process on the *global* batch of each step.
- A data-parallel rank trains on its contiguous slice ``global.chunk(world)[rank]``
  (:func:`local_batch`); its loss is the mean over its slice, and the *global* loss of a step is the
  mean of the ranks' losses (:func:`global_mean`), which equals the unsharded loss because every
  slice holds the same number of tokens.
- :func:`fsdp2_losses` is that rank loop with torch's own FSDP2 (``fully_shard``) doing the sharding.

Shape table (defaults; dim-0 size -> rows per rank ``ceil(d / w)``, the last ranks fewer or none):

=====================  ======  ==========  ============  ==================
parameter              dim 0   w=2         w=3           w=4
=====================  ======  ==========  ============  ==================
tok.weight (= head)    67      34, 33      23, 23, 21    17, 17, 17, 16
pos.weight             9       5, 4        3, 3, 3       3, 3, 3, 0
*.ln*.weight / bias    30      15, 15      10 each       8, 8, 8, 6
attn.qkv.weight        90      45, 45      30 each       23, 23, 23, 21
attn.proj.*, mlp.fc2.* 30      15, 15      10 each       8, 8, 8, 6
mlp.fc1.weight / bias  50      25, 25      17, 17, 16    13, 13, 13, 11
=====================  ======  ==========  ============  ==================
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "ACCUM_SEED", "BETAS", "BF16_LOSS_RTOL", "BF16_MIN_DEV", "COUNTING_LINK", "EPS", "GLOBAL_BATCH",
    "LOSS_RTOL", "LR", "MICRO_BATCHES", "PARAM_ATOL", "PARAM_RTOL", "SEED", "STEPS", "STEP_ATOL",
    "STEP_RTOL", "WEIGHT_DECAY",
    "Block", "TinyLM", "accumulation_batches", "accumulation_optimizer", "all_gathers", "assert_same_run", "block_absmax",
    "fsdp2_losses", "fsdp2_model", "global_mean", "gradient_reductions", "load_by_distribute_tensor", "local_batch",
    "make_batch", "make_optimizer", "max_rel_dev",
    "shard_rows", "single_threaded", "SMALL_SIZES", "small_step", "train_ranks", "unsharded_big_step", "unsharded_losses",
]

# [Note: odd sizes] The defaults are chosen so that dim-0 sharding is uneven on 2, 3 and 4 ranks:
# vocab 67 is prime; fc1's 50 rows split 17/17/16 on 3 ranks and 13/13/13/11 on 4; dim 30 and qkv's
# 90 rows split 8/8/8/6 and 23/23/23/21 on 4; and the 9 position rows split 3/3/3/0 on 4 ranks, so
# the last rank holds an *empty* shard. heads=3 divides dim=30 (head dim 10).
SEED = 1234
STEPS = 20
# 12 sequences: divisible by 1, 2, 3 and 4, so every rank's slice holds the same number of tokens.
GLOBAL_BATCH = 12
LR = 1e-2
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1


# [Note: tolerances] Measured on this model with torch 2.13 CPU, gloo, 20 AdamW steps, worlds 1-4.
# Relative loss deviation of a sharded fp32 run from the unsharded one: summation order differs
# (per-rank partial means, reduce-scatter sums), a few float32 ulps per step; FSDP2 measured <= 2.4e-7.
LOSS_RTOL = 1e-5
# Final parameters after 20 steps: rounding in the reduced gradient changes AdamW's g / sqrt(v) step
# by ~1e-7 relative, more for elements whose gradient is near eps or changing sign; FSDP2 measured
# max |delta| = 5.0e-6 (lr is 1e-2). atol 5e-5 is a 10x margin and 0.5% of one lr step.
PARAM_RTOL, PARAM_ATOL = 1e-5, 5e-5
# One accumulated step against one big step (accumulation_optimizer: SGD, lr 1). Gradients: rtol
# 1e-5 with atol 1e-5 x the tensor's max |g| (elements near 0 carry only rounding noise); FSDP2
# measured max |delta g| / max |g| = 9.0e-7 (micro-batching alone, world 1: 5.6e-7). Parameters:
# 1e-5 relative, atol 2e-7 for elements that land near 0 (|p| down to 8e-8); FSDP2 measured max
# |delta p| = 2.4e-8, while a step moves parameters by ~1e-3.
STEP_RTOL, STEP_ATOL = 1e-5, 2e-7
# bf16 parameters (float32 gradient reduction) against the float32 unsharded run: FSDP2 measured a
# max relative loss deviation over the 20 steps of 2.94e-3 (world 1), 2.89e-3 (2), 1.83e-3 (3) and
# 2.07e-3 (4); ~6e-6 at step 0, growing as the bf16 rounding of the updates accumulates. Bound: 2 u
# with u = 2^-8 = 3.9e-3, bf16's unit roundoff -- a 2.65x margin over the worst measured, room for
# another implementation's legitimately different cast points and reduction order.
BF16_LOSS_RTOL = 2 * 2.0**-8
# A bf16 run must also deviate by more than this, or bf16 compute did not happen: >10x above the
# fp32 runs' 2.4e-7 ... 1e-5 band and >10x below the bf16 runs' >= 1.8e-3.
BF16_MIN_DEV = 1e-4


class Attention(nn.Module):
    """Causal multi-head self-attention in plain ops (no fused SDPA, so every backend computes it alike)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads ({heads}) must divide dim ({dim})")
        self.heads = heads
        # No qkv bias: the key bias gets an exactly-zero gradient (it adds q.b_k to every score of a
        # query, which softmax ignores), so its float gradient is pure rounding noise that AdamW's
        # g / sqrt(v) turns into +-lr steps -- a parameter no two summation orders agree on.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        out = scores.softmax(dim=-1) @ v  # (b, heads, t, head_dim)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class NormedMLP(nn.Module):
    """A residual block, LayerNorm then Linear ``width`` -> ``2 width``, ``activation``, Linear back:
    the side-by-side tests' small block (``up`` and ``down`` are what weight subclasses replace)."""

    def __init__(self, width: int, activation: Callable[[torch.Tensor], torch.Tensor] = torch.tanh) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.activation = activation

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(self.activation(self.up(self.norm(h))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block; all parameters live in standard layers (``reset_parameters``)."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Token + learned position embeddings, ``layers`` :class:`Block` s, final LayerNorm, and an output
    head tied to the token embedding. ``forward(tokens (b, t<=seq)) -> logits (b, t, vocab)``.

    Initialisation is deterministic given ``torch.manual_seed``; sizes default to [Note: odd sizes].
    """

    def __init__(
        self, vocab: int = 67, dim: int = 30, heads: int = 3, layers: int = 2, seq: int = 9, hidden: int = 50
    ) -> None:
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        # N(0, 1) embeddings would give tied logits of std ~sqrt(dim); GPT-2's 0.02 keeps the first
        # loss near log(vocab).
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.seq:
            raise ValueError(f"sequence length {t} exceeds the model's {self.seq} positions")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of ``tokens`` (b, seq + 1), computed in float32 whatever the
        compute dtype of the logits (so a bf16 run's loss is not rounded to bf16)."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """One intra-op thread inside the block (restored after). The model is far too small to gain from
    threads, and on a shared 2-core machine OpenMP's barriers stall whenever a core is busy: a forward
    measured 0.4 ms on one thread and 1-200 ms on two. The thread count changes the last bits of the
    results (the reference on 1 and on 2 threads differs), so the reference and every rank function
    use one thread: world 1 then matches the reference bitwise."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_batch(seed: int, batch: int = GLOBAL_BATCH, seq: int = 9, vocab: int = 67) -> torch.Tensor:
    """``(batch, seq + 1)`` int64 tokens, a function of the arguments only: each row counts up from a
    random start by a random stride in {1, 2, 3} (mod ``vocab``), with 10% of tokens replaced at
    random, so there is something to learn and the loss keeps falling."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    noise = torch.rand(batch, seq + 1, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, vocab, (batch, seq + 1), generator=g), tokens)


def local_batch(tokens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of the global batch (equal slices; see [Note: global loss])."""
    if tokens.shape[0] % world_size:
        raise ValueError(f"global batch {tokens.shape[0]} is not divisible by world size {world_size}")
    return tokens.chunk(world_size)[rank]


def shard_rows(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` rows of a dim-0 size ``dim0`` held by ``rank``: ``ceil(dim0 / world_size)``
    rows per rank, the last ranks fewer or none (DESIGN.md, "Sharding rule"; also ``torch.chunk``'s)."""
    per = -(-dim0 // world_size)
    return min(dim0, rank * per), min(dim0, (rank + 1) * per)


def make_optimizer(params) -> torch.optim.Optimizer:
    """AdamW with the fixed hyper-parameters; the single-tensor (``foreach=False``) path, so sharded
    and unsharded runs update every element by the same arithmetic."""
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False)


def make_optimizer_in_backward(model: nn.Module) -> "overlap.OptimizerInBackward":  # noqa: F821
    """:func:`make_optimizer`'s AdamW, one per ``overlap.shard`` group of ``model`` (the sharded root),
    stepped in backward (``overlap.optimizer_in_backward``): the same update of every element."""
    import overlap

    return overlap.optimizer_in_backward(model, torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS,
                                         weight_decay=WEIGHT_DECAY, foreach=False)


def unsharded_losses(
    model_fn: Callable[[], nn.Module] = TinyLM,
    steps: int = STEPS,
    batch_fn: Callable[[int], torch.Tensor] = make_batch,
    lr: float = LR,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process reference: ``model_fn()`` built after ``torch.manual_seed(SEED)``, AdamW,
    ``steps`` steps on the global batch ``batch_fn(step)``; returns the per-step losses and the final
    ``state_dict`` (detached copies)."""
    with single_threaded():
        torch.manual_seed(SEED)
        model = model_fn()
        opt = make_optimizer(model.parameters())
        for group in opt.param_groups:
            group["lr"] = lr
        losses = []
        for step in range(steps):
            loss = model.loss(batch_fn(step))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# Gradient accumulation: MICRO_BATCHES micro-batches, each a global batch of GLOBAL_BATCH sequences
# (make_batch(ACCUM_SEED + i)), each loss scaled by 1 / MICRO_BATCHES, then one optimizer step. Equal
# micro-batch sizes make that the same step as one on their concatenation.
MICRO_BATCHES = 4
ACCUM_SEED = 100


# A link fast enough to cost nothing (1 Tbit/s, no latency), for ``run_distributed(..., link=)``: it
# only counts the collectives a rank issues (overlap.testing.emulated_link).
COUNTING_LINK = (1000.0, 0.0)


def all_gathers(stats) -> int:
    """All-gathers (plain and coalesced) among a link's counted calls (``overlap.testing.LinkStats``)."""
    return sum(n for op, n in stats.by_op.items() if "all_gather" in op)


def gradient_reductions(stats) -> int:
    """Gradient-reducing collectives (reduce-scatters, all-reduces, and the all-to-alls that carry
    reduce-scatters on gloo: [Note: gloo's reduce-scatter cannot say it is done]) among a link's
    counted calls (``overlap.testing.LinkStats``)."""
    return sum(n for op, n in stats.by_op.items() if "reduce" in op or "all_to_all" in op)


def accumulation_batches() -> list[torch.Tensor]:
    """The global micro-batches of the accumulation check."""
    return [make_batch(ACCUM_SEED + i) for i in range(MICRO_BATCHES)]


def accumulation_optimizer(params) -> torch.optim.Optimizer:
    """The accumulation check's optimizer: plain SGD with lr 1, whose step is linear in the gradient.

    Not AdamW: AdamW's first step is lr * g / (|g| + eps), whose slope peaks at lr / (4 eps) for the
    few elements with |g| ~ eps = 1e-8, so rounding noise of 5e-10 in such a gradient moves the
    parameter by ~1e-4 (FSDP2 measured 6.6e-5): a parameter check after an AdamW step measures eps,
    not accumulation. With SGD lr 1 the step is the gradient itself (~1e-3), and a parameter
    mismatch is exactly a gradient mismatch."""
    return torch.optim.SGD(params, lr=1.0, foreach=False)


def unsharded_big_step() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process reference for accumulation: from ``SEED``, one :func:`accumulation_optimizer`
    step on the concatenation of :func:`accumulation_batches`; returns (gradients, parameters after
    the step) by parameter name."""
    with single_threaded():
        torch.manual_seed(SEED)
        model = TinyLM()
        opt = accumulation_optimizer(model.parameters())
        model.loss(torch.cat(accumulation_batches())).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


# [Note: global loss] Rank r computes the mean loss over its slice of B/w sequences of equal length,
# so mean_r(loss_r) == the mean over all B sequences == the unsharded loss, and the gradient of
# mean_r(loss_r) is the average of the ranks' gradients -- what FSDP's reduce-scatter (sum / w)
# produces. The global loss is gathered for comparison only (it never feeds back into training).
def global_mean(value: torch.Tensor) -> float:
    """Mean of a scalar over the ranks of the default group (gloo has no ``ReduceOp.AVG``)."""
    import torch.distributed as dist

    t = value.detach().float().reshape(1).clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train_ranks(model: nn.Module, rank: int, world_size: int, steps: int = STEPS,
                after_step: Callable[[int], None] | None = None) -> list[float]:
    """The data-parallel loop every sharded runtime is checked with: AdamW over ``model.parameters()``,
    ``steps`` steps on this rank's slice of ``make_batch(step)``; returns the global loss per step.
    ``after_step(step)``, if given, runs after each optimizer step (a check on every rank)."""
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        loss = model.loss(local_batch(make_batch(step), rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(global_mean(loss))
        if after_step is not None:
            after_step(step)
    return losses


def fsdp2_model(world_size: int, mp_bf16: bool = False, reshard_after_forward: bool = True) -> nn.Module:
    """:class:`TinyLM` from ``SEED``, ``fully_shard`` on each block (with ``reshard_after_forward``)
    then on the root (torch FSDP2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(SEED)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mp_bf16 else None, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def fsdp2_losses(rank: int, world_size: int, steps: int = STEPS, mp_bf16: bool = False) -> list[float]:
    """Rank function: torch FSDP2's global loss per step (:func:`train_ranks` on :func:`fsdp2_model`).
    ``mp_bf16`` computes with bf16 parameters and reduces gradients in float32.

    Measured against :func:`unsharded_losses` ([Note: tolerances]): fp32 max relative deviation
    <= 2.4e-7 on worlds 1-4 (0 on world 1); bf16 2.94e-3 / 2.89e-3 / 1.83e-3 / 2.07e-3 on worlds
    1 / 2 / 3 / 4, hence ``BF16_LOSS_RTOL`` = 2^-7 = 7.8e-3."""
    with single_threaded():
        return train_ranks(fsdp2_model(world_size, mp_bf16), rank, world_size, steps)


def train_unfrozen(model: nn.Module, rank: int, width: int, steps: int, dtype: torch.dtype = torch.float32,
                   lr: float = 1e-2) -> list[torch.Tensor]:
    """Train the parameters of ``model`` that require a gradient (frozen ones stay out of the
    optimizer, as adapters are trained) with AdamW for ``steps`` steps, on 8 random rows of ``width``
    per step and rank in ``dtype``, loss the mean square of the output in float32; the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(100 * step + rank)).to(dtype)
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def run_of(losses: Sequence[torch.Tensor], model: nn.Module) -> dict:
    """A training run as :func:`assert_same_run` compares it: the losses stacked, and each (sharded)
    parameter's local tensor, a copy, by name."""
    return {"losses": torch.stack(list(losses)),
            "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()}}


def assert_same_run(a: dict, b: dict, what: object = None) -> None:
    """Two training runs ended bitwise alike: their ``"losses"`` tensors and every tensor of their
    ``"params"`` dicts (by name, ``a``'s names) are ``torch.equal``; ``what`` names the run in the
    failure message."""
    assert torch.equal(a["losses"], b["losses"]), (what, a["losses"], b["losses"])
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), (what, name)


def refusal(call: Callable[[], object], module: nn.Module) -> str:
    """What ``call`` (a sharding call on ``module``, expected to refuse) raised, as ``"Type: message |
    untouched=<bool>"``, where untouched says ``module`` kept its class and each parameter its type
    and values; ``"no error"`` if it raised nothing."""
    cls = type(module)
    before = {n: (type(p), p.detach().clone()) for n, p in module.named_parameters()}
    try:
        call()
    except Exception as exc:  # the caller checks the type
        untouched = type(module) is cls and all(
            type(p) is before[n][0] and torch.equal(p.detach(), before[n][1]) for n, p in module.named_parameters())
        return f"{type(exc).__name__}: {exc} | untouched={untouched}"
    return "no error"


def assert_refused(result: str, kind: str, message: str, what: object = None) -> None:
    """``result`` (:func:`refusal`'s) is a ``kind`` exception whose message holds ``message``, and
    nothing was changed."""
    assert result.startswith(f"{kind}: ") and message in result, (what, result)
    assert result.endswith("untouched=True"), (what, result)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern (an integer view of its bytes, one integer per element): equal bits are
    what "bitwise equal" means, -0.0 apart from 0.0 and a NaN equal to itself."""
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def load_by_distribute_tensor(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """The reference load of full tensors into a sharded ``model``: ``distribute_tensor`` per DTensor
    entry of its state dict (no communication), then ``load_state_dict``; what
    ``overlap.load_full_state_dict`` did for every entry before the layout's cut ([Note: loading a
    full tensor without distribute_tensor] in ``overlap/state_dict.py``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    local = {}
    for key, target in model.state_dict(keep_vars=True).items():
        value = values[key]
        if isinstance(target, DTensor):
            value = distribute_tensor(value.detach().to(target.device, target.dtype), target.device_mesh,
                                      target.placements, src_data_rank=None)
        local[key] = value
    model.load_state_dict(local)


def block_absmax(shard: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absmax (float32, ``shard``'s shape), computed from the shard alone: its
    flat elements cut into chunks of ``block`` from the first, as the quantized layouts cut a
    parameter's shard ([Note: quantized slots] in ``overlap_kernels/quantized_layout.py``). The independent
    reference the per-block error bounds are checked against."""
    flat = shard.reshape(-1).float().abs()
    n = flat.numel()
    padded = torch.zeros(-(-n // block) * block)
    padded[:n] = flat
    return padded.view(-1, block).amax(dim=1).repeat_interleave(block)[:n].view(shard.shape)


def max_rel_dev(got: Sequence[float], want: Sequence[float]) -> float:
    """``max |got - want| / |want|`` over paired values (lengths must match)."""
    if len(got) != len(want):
        raise ValueError(f"length mismatch: {len(got)} vs {len(want)}")
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


# The long runs (tests/reliability: 200 steps for leaks, a 500-step soak) train a smaller TinyLM.
SMALL_SIZES = dict(vocab=37, dim=12, heads=2, layers=2, seq=6, hidden=20)


def small_step(model: TinyLM, opt: torch.optim.Optimizer, step: int, rank: int, world: int, batch: int) -> float:
    """One step of a :data:`SMALL_SIZES` model (the long-run and soak tests) on this rank's slice of
    ``make_batch(step)``; returns the rank's loss."""
    tokens = make_batch(step, batch=batch, seq=SMALL_SIZES["seq"], vocab=SMALL_SIZES["vocab"]).chunk(world)[rank]
    loss = model.loss(tokens)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()
