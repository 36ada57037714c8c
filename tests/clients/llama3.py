"""A torchtitan-style Llama 3 at debug size: the client model of ``test_client_llama3.py``.

Written here in the style of torchtitan's Llama 3 (``ModelArgs``, RMSNorm, rotary position
embeddings, grouped-query attention, a SwiGLU feed-forward, ``layers`` as a ``ModuleDict``, and
``init_weights`` methods that a trainer calls after building the model on the meta device,
sharding it and ``to_empty``). Differences from torchtitan, on purpose:

- The attention's query/key/value projections are one fused Linear, ``wqkv``. The attention module
  keeps checkpoints in the unfused layout: a state-dict post-hook splits ``wqkv.weight`` into
  ``wq.weight`` / ``wk.weight`` / ``wv.weight``, and a load-state-dict pre-hook concatenates them
  back, as clients that fuse projections for speed do.
- RoPE uses real cos / sin buffers (rotate-half form) instead of complex ``freqs_cis``.
- The init code assumes full parameter shapes: ``wqkv`` and ``w1`` get a Xavier-style std computed
  from ``weight.shape`` (fan-in and fan-out), so a shard-shaped parameter would get the wrong std.

Shape table (``ModelArgs()`` defaults: dim 32, 4 heads of 8, 2 kv heads, ffn hidden 96, vocab 67):

==============================  =====  ========  ===========
parameter                       dim 0  w=2       w=3
==============================  =====  ========  ===========
tok_embeddings.weight           67     34, 33    23, 23, 21
layers.*.attention.wqkv.weight  64     32, 32    22, 22, 20
layers.*.attention.wo.weight    32     16, 16    11, 11, 10
layers.*.feed_forward.w1/w3     96     48, 48    32 each
layers.*.feed_forward.w2        32     16, 16    11, 11, 10
*norm.weight                    32     16, 16    11, 11, 10
output.weight                   67     34, 33    23, 23, 21
==============================  =====  ========  ===========
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ModelArgs", "Transformer", "ffn_hidden_dim", "llama_blocks", "llama_loss", "trunc_normal_std"]


@dataclasses.dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 67
    multiple_of: int = 32
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 8
    depth_init: bool = True


# init_weights draws from trunc_normal_(std=s, a=-TRUNC * s, b=TRUNC * s).
TRUNC = 3.0


def trunc_normal_std(std: float, cutoff: float = TRUNC) -> float:
    """The standard deviation of N(0, std^2) truncated to [-cutoff std, cutoff std]."""
    phi = torch.distributions.Normal(0.0, 1.0)
    c = torch.tensor(cutoff, dtype=torch.float64)
    mass = 2 * phi.cdf(c) - 1
    density = phi.log_prob(c).exp()
    return std * float((1 - 2 * c * density / mass).sqrt())


def _rope_tables(head_dim: int, seq: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (seq, head_dim)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (b, t, heads, head_dim) in rotate-half form."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    t = x.shape[1]
    return x * cos[:t, None, :] + rotated * sin[:t, None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Grouped-query attention with one fused ``wqkv`` projection, checkpointed as ``wq/wk/wv``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.qkv_rows = [args.n_heads * self.head_dim, args.n_kv_heads * self.head_dim, args.n_kv_heads * self.head_dim]
        self.wqkv = nn.Linear(args.dim, sum(self.qkv_rows), bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.register_state_dict_post_hook(_split_qkv)
        self.register_load_state_dict_pre_hook(_fuse_qkv)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).split(self.qkv_rows, dim=-1)
        q = _rotate(q.view(b, t, self.n_heads, self.head_dim), cos, sin)
        k = _rotate(k.view(b, t, self.n_kv_heads, self.head_dim), cos, sin)
        v = v.view(b, t, self.n_kv_heads, self.head_dim)
        repeat = self.n_heads // self.n_kv_heads
        k, v = (z.repeat_interleave(repeat, dim=2) for z in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def init_weights(self, init_std: float) -> None:
        fan_out, fan_in = self.wqkv.weight.shape  # assumes the full (unsharded) shape
        xavier_std = (2.0 / (fan_in + fan_out)) ** 0.5
        nn.init.trunc_normal_(self.wqkv.weight, mean=0.0, std=xavier_std, a=-TRUNC * xavier_std, b=TRUNC * xavier_std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std, a=-TRUNC * init_std, b=TRUNC * init_std)


def _split_qkv(module: Attention, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: ``wqkv.weight`` -> ``wq.weight``, ``wk.weight``, ``wv.weight`` (rows)."""
    fused = state_dict.pop(prefix + "wqkv.weight")
    for name, part in zip(("wq", "wk", "wv"), fused.split(module.qkv_rows, dim=0)):
        state_dict[f"{prefix}{name}.weight"] = part


def _fuse_qkv(module: Attention, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Load-state-dict pre-hook: ``wq/wk/wv.weight`` -> ``wqkv.weight`` (concatenated rows)."""
    names = [f"{prefix}{n}.weight" for n in ("wq", "wk", "wv")]
    if all(n in state_dict for n in names):
        state_dict[prefix + "wqkv.weight"] = torch.cat([state_dict.pop(n) for n in names], dim=0)


def ffn_hidden_dim(args: ModelArgs) -> int:
    """SwiGLU hidden size: 2/3 of 4 * dim (times ``ffn_dim_multiplier``), rounded up to ``multiple_of``."""
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        fan_out, fan_in = self.w1.weight.shape  # assumes the full (unsharded) shape
        xavier_std = (2.0 / (fan_in + fan_out)) ** 0.5
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=xavier_std, a=-TRUNC * xavier_std, b=TRUNC * xavier_std)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std, a=-TRUNC * init_std, b=TRUNC * init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args))
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.weight_init_std = 0.02 / (2 * ((layer_id + 1) if args.depth_init else args.n_layers)) ** 0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    """``forward(tokens (b, t)) -> logits (b, t, vocab)``. Build it anywhere (``torch.device("meta")``
    included), then call :meth:`init_weights` once the parameters have storage."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        cos, sin = _rope_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self, buffer_device: Optional[torch.device] = None) -> None:
        """Initialise every parameter and recompute the RoPE buffers (on ``buffer_device``, default
        where the buffers are); meant to run after ``to_empty`` on a model built on meta."""
        device = buffer_device or self.rope_cos.device
        if device.type != "meta":
            with torch.device(device):
                cos, sin = _rope_tables(self.args.dim // self.args.n_heads, self.args.max_seq_len, self.args.rope_theta)
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.dtype), sin.to(self.rope_sin.dtype)
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        final_out_std = self.args.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_out_std,
                              a=-TRUNC * final_out_std, b=TRUNC * final_out_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def llama_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, the modules a client shards one by one (before the root)."""
    return list(model.layers.values())


def llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of ``tokens`` (b, max_seq_len + 1), in float32."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
