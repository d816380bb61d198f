"""Pre-LayerNorm transformer blocks shared by the GPT-2, BERT and translation models."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.workload import embed_params, init_table, output_params


class Block(nn.Module):
    """Self-attention (causal or not), optional cross-attention, then an MLP."""

    dim: int
    heads: int
    causal: bool = False
    cross: bool = False

    @nn.compact
    def __call__(self, x, memory=None):
        mask = nn.make_causal_mask(x[..., 0]) if self.causal else None
        attn = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.dim)
        x = x + attn(nn.LayerNorm()(x), mask=mask)
        if self.cross:
            cross = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.dim)
            x = x + cross(nn.LayerNorm()(x), memory)
        h = nn.Dense(4 * self.dim)(nn.LayerNorm()(x))
        return x + nn.Dense(self.dim)(nn.gelu(h))


class Stack(nn.Module):
    """``layers`` blocks and a final LayerNorm."""

    dim: int
    heads: int
    layers: int
    causal: bool = False
    cross: bool = False

    @nn.compact
    def __call__(self, x, memory=None):
        for _ in range(self.layers):
            x = Block(self.dim, self.heads, self.causal, self.cross)(x, memory)
        return nn.LayerNorm()(x)


def init_stack(stack: Stack, key, length: int, dim: int, memory_length: int = 0):
    """Parameters of ``stack`` for inputs of ``length`` positions."""
    memory = jnp.zeros((1, memory_length, dim)) if stack.cross else None
    return stack.init(key, jnp.zeros((1, length, dim)), memory)["params"]


def transformer_params(cfg, key, stacks: dict) -> dict:
    """``embed`` (V x D), learned positions ``pos`` (T x D), the output table (unless
    tied), and each named stack: ``stacks`` maps a name to ``(stack, memory_length)``."""
    keys = jax.random.split(key, 3 + len(stacks))
    params = {
        "embed": embed_params(keys[0], cfg.vocab, cfg.dim),
        "pos": init_table(keys[1], cfg.seq_len, cfg.dim),
        **output_params(cfg, keys[2]),
    }
    for k, (name, (stack, memory)) in zip(keys[3:], stacks.items(), strict=True):
        params[name] = init_stack(stack, k, cfg.seq_len, cfg.dim, memory)
    return params
