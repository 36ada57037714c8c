"""Tiny Hugging Face ``transformers`` models built from config objects (no hub access, no weights):
the client models of ``test_client_hf.py``.

GPT-2 (``GPT2LMHeadModel``: Conv1D layers whose weights are stored (in, out), so dim-0 sharding
splits the input features; ``wte`` tied to ``lm_head``) and Llama (``LlamaForCausalLM``: RMSNorm,
RoPE, grouped-query attention, SwiGLU, untied head), 2 layers, hidden 32, vocab 127 (prime: uneven
shards on 2 and 3 ranks), dropout off, SDPA attention. Both are ``GradientCheckpointingLayer``
models: ``activation_checkpointing_enable`` checkpoints each layer's ``forward`` (not ``__call__``),
so module hooks stay outside the checkpoint.

Importing this module imports ``transformers``; test modules call ``pytest.importorskip`` first.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

__all__ = ["HF_VOCAB", "HF_SEQ", "gpt2", "hf_blocks", "hf_loss", "llama", "set_activation_checkpointing"]

HF_VOCAB = 127
HF_SEQ = 8  # tokens per training sequence (inputs and labels are the same sequence; HF shifts inside)


def gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=HF_VOCAB, n_positions=HF_SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)


def llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=HF_SEQ, attention_dropout=0.0, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def hf_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, the modules a client shards one by one (before the root)."""
    if isinstance(model, GPT2LMHeadModel):
        return list(model.transformer.h)
    return list(model.model.layers)


def hf_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """HF's own causal-LM loss of ``tokens`` (b, HF_SEQ): labels are the inputs, shifted inside."""
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def set_activation_checkpointing(model: nn.Module, use_reentrant: bool) -> None:
    """Turn on HF's activation checkpointing (``activation_checkpointing_enable`` in transformers
    5.x; ``gradient_checkpointing_enable``, now its deprecated alias, before)."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
