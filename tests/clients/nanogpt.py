"""A nanoGPT-style GPT, small enough to train in milliseconds on a CPU: the client model of
``test_client_nanogpt.py``.

Written here in the style of Karpathy's nanoGPT (a fused ``c_attn`` query/key/value Linear, causal
``scaled_dot_product_attention``, a GELU MLP, the token embedding tied to ``lm_head``, and an
``_init_weights`` applied with ``Module.apply`` that uses ``normal_`` / ``zeros_``, plus the scaled
init of the residual projections). One addition: a learned output temperature ``logit_scale`` of
shape ``(1,)``, so that one parameter has fewer rows than ranks (an empty shard on every rank but
the first).

Shape table (defaults; dim-0 rows per rank, ``ceil(d / w)``, the last ranks fewer or none):

============================  =====  ========  ===========
parameter                     dim 0  w=2       w=3
============================  =====  ========  ===========
transformer.wte.weight (tied) 67     34, 33    23, 23, 21
transformer.wpe.weight        8      4, 4      3, 3, 2
h.*.attn.c_attn.weight/bias   96     48, 48    32 each
h.*.mlp.c_fc.weight/bias      128    64, 64    43, 43, 42
ln_*, c_proj.*                32     16, 16    11, 11, 10
logit_scale                   1      1, 0      1, 0, 0
============================  =====  ========  ===========
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig", "gpt_blocks", "gpt_loss"]


@dataclasses.dataclass
class GPTConfig:
    block_size: int = 8
    vocab_size: int = 67
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        heads = [z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2)]
        y = F.scaled_dot_product_attention(*heads, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``forward(idx (b, t), targets=None) -> (logits (b, t, vocab), loss or None)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.logit_scale = nn.Parameter(torch.empty(1))
        self.init_weights()

    def init_weights(self) -> None:
        """The model's own initialisation (the constructor calls it; after ``to_empty`` call it again)."""
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # scaled init of the residual projections (GPT-2 paper)
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
        nn.init.ones_(self.logit_scale)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        t = idx.shape[1]
        assert t <= self.config.block_size, f"sequence of {t} tokens, block size is {self.config.block_size}"
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x)) * self.logit_scale
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def gpt_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, the modules a client shards one by one (before the root)."""
    return list(model.transformer.h)


def gpt_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of ``tokens`` (b, block_size + 1)."""
    return model(tokens[:, :-1], tokens[:, 1:])[1]
