"""The client models of the real-client test level, described the same way (:class:`Client`), with
the single-process references they are checked against.

A client is what a training script needs to know about its model: how to build it, which modules
are its blocks (sharded first, then the root), its loss, its batches, how its own code initialises
it after a meta-device build, what that initialisation should produce, and which state-dict API
its checkpoints go through.

The references (:func:`reference`) run in the test process, on one thread, from
``models.SEED``: the unsharded training run every sharded run is compared with.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from llama3 import ModelArgs, Transformer, ffn_hidden_dim, llama_blocks, llama_loss, trunc_normal_std
from models import SEED, make_batch, make_optimizer, single_threaded
from nanogpt import GPT, GPTConfig, gpt_blocks, gpt_loss

__all__ = [
    "CLIENTS", "CLIP_NORM", "GLOBAL_BATCH", "RESUME_STEPS", "SAVE_AFTER", "Client", "InitSpec", "named_optimizer_state",
    "reference",
    "reference_f64_logits",
]

# 6 sequences: divisible by 1, 2 and 3 ranks (equal slices, so the mean of the ranks' mean losses is
# the global loss; see models.py [Note: global loss]).
GLOBAL_BATCH = 6
# Gradient clipping threshold: below every step's gradient norm on these models (initial norms
# ~1-4), so clip_grad_norm_ really scales the gradients. test_clients checks that it does.
CLIP_NORM = 0.25
SAVE_AFTER = 3  # steps trained before the checkpoint
RESUME_STEPS = 2  # steps trained after loading it


@dataclasses.dataclass(frozen=True)
class InitSpec:
    """What a client's init code should give a parameter: a constant (``value``), or random values
    with mean 0 and standard deviation ``std`` (after truncation, where the init truncates)."""

    value: Optional[float] = None
    std: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Client:
    """A model as its training script sees it (see the module docstring)."""

    name: str
    build: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], list[nn.Module]]
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # the forward the loss runs on the same tokens
    seq: int  # tokens per row of a batch (make_batch's seq + 1)
    vocab: int
    init: Callable[[nn.Module], None]  # the client's own init code, run after to_empty
    init_spec: Callable[[str], InitSpec]  # by parameter name
    # "torch": torch.distributed.checkpoint.state_dict's get/set_model_state_dict work on the model.
    # "module": the model's state-dict hooks rename keys, which get_model_state_dict cannot follow
    # (it maps every key to a parameter by attribute lookup): the model part goes through
    # module.state_dict / load_state_dict, the optimizer part through get/set_optimizer_state_dict.
    state_dict_api: str = "torch"
    # Activation-checkpointing forms exercised: "wrap_then_shard" (checkpoint_wrapper(block), then
    # shard the wrapper: torchtitan), "shard_then_wrap" (shard the block, then checkpoint_wrapper),
    # "in_forward" (HF's activation_checkpointing_enable: checkpoint inside forward, hooks outside).
    ac_forms: tuple[str, ...] = ("wrap_then_shard", "shard_then_wrap")
    needs: Optional[str] = None  # a module to import first (pytest.importorskip)
    resume_world: int = 3  # world size the world-2 checkpoint is loaded at

    def batch(self, step: int) -> torch.Tensor:
        """The global batch of ``step``: (GLOBAL_BATCH, seq) tokens, a function of ``step`` only."""
        return make_batch(step, GLOBAL_BATCH, self.seq - 1, self.vocab)


# --------------------------------------------------------------------------- nanoGPT
def _gpt_init_spec(name: str) -> InitSpec:
    if name.endswith("bias"):
        return InitSpec(value=0.0)
    if name == "logit_scale" or ".ln_" in name or name.startswith("transformer.ln_f"):
        return InitSpec(value=1.0)
    if name.endswith("c_proj.weight"):
        return InitSpec(std=0.02 / math.sqrt(2 * GPTConfig.n_layer))
    return InitSpec(std=0.02)


NANOGPT = Client(
    "nanogpt", build=lambda: GPT(GPTConfig()), blocks=gpt_blocks, loss=gpt_loss,
    logits=lambda m, tokens: m(tokens[:, :-1])[0], seq=GPTConfig.block_size + 1,
    vocab=GPTConfig.vocab_size, init=lambda m: m.init_weights(), init_spec=_gpt_init_spec,
)


# --------------------------------------------------------------------------- torchtitan-style Llama 3
def _llama_init_spec(name: str) -> InitSpec:
    args = ModelArgs()
    if name.endswith("norm.weight"):
        return InitSpec(value=1.0)
    if name == "tok_embeddings.weight":
        return InitSpec(std=1.0)
    if name == "output.weight":
        return InitSpec(std=trunc_normal_std(args.dim ** -0.5))
    layer = int(name.split(".")[1])
    layer_std = 0.02 / (2 * (layer + 1)) ** 0.5
    if name.endswith("wqkv.weight"):  # Xavier-style std from the full (rows, cols)
        rows = (args.n_heads + 2 * args.n_kv_heads) * (args.dim // args.n_heads)
        return InitSpec(std=trunc_normal_std((2.0 / (rows + args.dim)) ** 0.5))
    if name.endswith("w1.weight"):
        hidden = ffn_hidden_dim(args)
        return InitSpec(std=trunc_normal_std((2.0 / (hidden + args.dim)) ** 0.5))
    return InitSpec(std=trunc_normal_std(layer_std))


LLAMA3 = Client(
    "llama3", build=lambda: Transformer(ModelArgs()), blocks=llama_blocks, loss=llama_loss,
    logits=lambda m, tokens: m(tokens[:, :-1]),
    seq=ModelArgs.max_seq_len + 1, vocab=ModelArgs.vocab_size,
    init=lambda m: m.init_weights(buffer_device=torch.device("cpu")), init_spec=_llama_init_spec,
    state_dict_api="module", resume_world=1,
)


# --------------------------------------------------------------------------- Hugging Face transformers
def _hf(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import hf_models

        return getattr(hf_models, name)()

    return build


def _hf_blocks(model: nn.Module) -> list[nn.Module]:
    import hf_models

    return hf_models.hf_blocks(model)


def _hf_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    import hf_models

    return hf_models.hf_loss(model, tokens)


def _hf_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, use_cache=False).logits


def _hf_init_spec(name: str) -> InitSpec:
    """HF's ``_init_weights``: normal(0, initializer_range=0.02), GPT-2's residual projections
    ``c_proj`` scaled by 1 / sqrt(2 n_layer), biases 0, norms 1."""
    if name.endswith("bias"):
        return InitSpec(value=0.0)
    if "norm" in name or ".ln_" in name or name.startswith("transformer.ln_f"):
        return InitSpec(value=1.0)
    if name.endswith("c_proj.weight"):
        return InitSpec(std=0.02 / math.sqrt(2 * 2))
    return InitSpec(std=0.02)


# seq / vocab: hf_models.HF_SEQ / HF_VOCAB (hf_models imports transformers, which is optional).
HF_GPT2 = Client(
    "hf_gpt2", build=_hf("gpt2"), blocks=_hf_blocks, loss=_hf_loss, logits=_hf_logits, seq=8, vocab=127,
    init=lambda m: m.init_weights(), init_spec=_hf_init_spec, ac_forms=("in_forward",), needs="transformers",
)
HF_LLAMA = Client(
    "hf_llama", build=_hf("llama"), blocks=_hf_blocks, loss=_hf_loss, logits=_hf_logits, seq=8, vocab=127,
    init=lambda m: m.init_weights(), init_spec=_hf_init_spec, ac_forms=("in_forward",), needs="transformers",
    resume_world=1,
)

CLIENTS: dict[str, Client] = {c.name: c for c in (NANOGPT, LLAMA3, HF_GPT2, HF_LLAMA)}


# --------------------------------------------------------------------------- references
def named_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """A copy of ``opt.state`` by parameter name (read directly, not through a state-dict API)."""
    return {name: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
            for name, p in model.named_parameters()}


@functools.cache
def reference(client_name: str) -> dict[str, Any]:
    """The unsharded run: ``SAVE_AFTER + RESUME_STEPS`` AdamW steps with ``clip_grad_norm_(CLIP_NORM)``
    on the global batches. Returns the initial state dict (``init_state``), per-step ``losses`` and
    ``norms``, and at the checkpoint (after ``SAVE_AFTER`` steps) the parameters (``saved_params``), the
    state dict (``saved_state``: the model's own keys),
    the last step's clipped gradients (``saved_grads``) and the optimizer state (``saved_optim``), by
    parameter name; and the final parameters (``final_params``)."""
    client = CLIENTS[client_name]
    with single_threaded():
        torch.manual_seed(SEED)
        model = client.build()
        out: dict[str, Any] = {"init_state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
        opt = make_optimizer(model.parameters())
        losses, norms = [], []
        for step in range(SAVE_AFTER + RESUME_STEPS):
            opt.zero_grad(set_to_none=True)
            loss = client.loss(model, client.batch(step))
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM).item())
            if step == SAVE_AFTER - 1:
                out["saved_grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            losses.append(loss.item())
            if step == SAVE_AFTER - 1:
                out["saved_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
                out["saved_state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
                out["saved_optim"] = named_optimizer_state(model, opt)
        out.update(losses=losses, norms=norms, final_params={n: p.detach().clone() for n, p in model.named_parameters()})
        return out


@functools.cache
def reference_f64_logits(client_name: str) -> torch.Tensor:
    """The unsharded initial model's logits on batch 0, in float64 (``model.to(torch.float64)``)."""
    client = CLIENTS[client_name]
    with single_threaded(), torch.no_grad():
        torch.manual_seed(SEED)
        model = client.build().to(torch.float64)
        return client.logits(model, client.batch(0))
