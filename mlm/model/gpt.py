"""A plain decoder-only transformer, GPT-2 or Llama style from the same config.

Parallelism is applied from outside (a parallelize step swaps the linear and embedding
layers named in `TP_PLAN`); this file knows nothing of ranks.

Shape legend: B batch, T sequence, D hidden, H attention heads, G key/value groups,
K head dim, F ffn hidden, V (padded) vocabulary.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mlm.config import ModelConfig
from mlm.errors import MlmError
from mlm.model.attention import attention, resolve_backend
from mlm.model.rope import apply_rope, rope_tables

# name → Megatron-style parallel layer, used by the tensor-parallel step (q/k/v split by heads
# and groups, gate/up by columns, so GQA and SwiGLU shard with no layout changes).
TP_PLAN = {
    "embed": "vocab",
    "attn.q": "column",
    "attn.k": "column",
    "attn.v": "column",
    "attn.out": "row",
    "mlp.gate": "column",
    "mlp.up": "column",
    "mlp.down": "row",
    "output": "column",
}


# Parameters whose rows are the vocabulary, padded to a multiple of make_vocab_size_divisible_by × tp
# (the padding rows are zeros and stay zero in training).
VOCAB_ROWS = ("embed.weight", "output.weight")


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.normalization == "rmsnorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        K, H, G = cfg.head_dim, cfg.num_attention_heads, cfg.query_groups
        self.q = nn.Linear(cfg.hidden_size, H * K, bias=cfg.add_bias)
        self.k = nn.Linear(cfg.hidden_size, G * K, bias=cfg.add_bias)
        self.v = nn.Linear(cfg.hidden_size, G * K, bias=cfg.add_bias)
        self.out = nn.Linear(H * K, cfg.hidden_size, bias=cfg.add_bias)
        self.backend = "sdpa"
        # Where attention dropout draws its randomness: tensor parallelism sets this to
        # TensorParallelRNG.fork, so that tp ranks (holding different heads) drop differently.
        self.rng_region = contextlib.nullcontext

    def core(self, q, k, v):
        dropping = self.training and self.cfg.attention_dropout > 0
        with self.rng_region(q.device) if dropping else contextlib.nullcontext():
            return attention(q, k, v, self.backend, self.cfg.attention_dropout, self.training)

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        K = self.cfg.head_dim
        q_BTHK = self.q(x_BTD).view(B, T, -1, K)
        k_BTGK = self.k(x_BTD).view(B, T, -1, K)
        v_BTGK = self.v(x_BTD).view(B, T, -1, K)
        if rope is not None:
            q_BTHK, k_BTGK = apply_rope(q_BTHK, *rope), apply_rope(k_BTGK, *rope)
        if self.cfg.recompute == "selective" and self.training:
            o_BTHK = checkpoint(self.core, q_BTHK, k_BTGK, v_BTGK, use_reentrant=False)
        else:
            o_BTHK = self.core(q_BTHK, k_BTGK, v_BTGK)
        return self.out(o_BTHK.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.activation == "swiglu"
        D, F_ = cfg.hidden_size, cfg.ffn_size
        self.gate = nn.Linear(D, F_, bias=cfg.add_bias) if self.gated else None
        self.up = nn.Linear(D, F_, bias=cfg.add_bias)
        self.down = nn.Linear(F_, D, bias=cfg.add_bias)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h_BTF = F.silu(self.gate(x_BTD)) * self.up(x_BTD)
        else:
            h_BTF = F.gelu(self.up(x_BTD), approximate=self.approximate)
        return self.down(h_BTF)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x_BTD, rope):
        x_BTD = x_BTD + self.dropout(self.attn(self.attn_norm(x_BTD), rope))
        return x_BTD + self.dropout(self.mlp(self.mlp_norm(x_BTD)))


@dataclass
class Chunk:
    """A contiguous run of layers that one forward call runs (a pipeline stage's model chunk)."""

    layers: list[str]
    """Keys into `GPT.layers` (global layer numbers), in order."""
    first: bool = True
    """Starts from tokens: embedding (and positions), dropout, `enter_layers`."""
    last: bool = True
    """Ends with the final norm and the output projection (logits)."""


class GPT(nn.Module):
    """tokens [B, T] → logits [B, T, V] (V = padded vocabulary).

    `layers` is keyed by global layer number, so a pipeline stage that keeps only some layers (see
    `mlm.parallel.pipeline`) names its parameters as the whole model does. `chunks` lists what a
    `forward(x, chunk=c)` call runs; the whole model is one chunk."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int | None = None):
        super().__init__()
        self.cfg = cfg
        V = self.padded_vocab = padded_vocab or cfg.padded_vocab_size()
        self.embed = nn.Embedding(V, cfg.hidden_size)
        self.pos_embed = (
            nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            if cfg.position_embedding == "learned"
            else None
        )
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        # Hooks for tensor/sequence parallelism (identity here): into the layers (scatter the
        # sequence over tp ranks) and into the output projection (enter the tp region).
        self.enter_layers: nn.Module = nn.Identity()
        self.enter_output: nn.Module = nn.Identity()
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.final_norm = make_norm(cfg)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, V, bias=False)
        self.chunks = [Chunk(list(self.layers))]
        # Hidden states between chunks are [B, T / sequence_shards, D] (tp under sequence parallelism).
        self.sequence_shards = 1

    def set_attention_backend(self, requested: str, device: torch.device) -> str:
        backend = resolve_backend(requested, device)
        for layer in self.layers.values():
            layer.attn.backend = backend
        return backend

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Megatron's init: normal(0, σ); output projections σ / √(2 · layers); norms 1, biases 0.

        A sharded parameter (one with `global_shape` and `global_offset` attributes, set by the
        parallel layers) gets its slice of the full tensor drawn from the same stream, and the
        vocabulary's padding rows (whose number depends on tp) are zeros drawn from no stream, so
        every mesh starts from the same weights as one process. Each parameter draws from its own
        stream, seeded by `seed` and its name, so a pipeline stage gets its layers' weights too."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2.0 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1 and name.endswith(("norm.weight", "bias")):  # norm weights and biases
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
                continue
            # one stream per parameter name: a pipeline stage holding some layers draws what one
            # process draws for them
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            s = out_std if name.endswith(("attn.out.weight", "mlp.down.weight")) else std
            shape = getattr(p, "global_shape", p.shape)
            full = torch.zeros(shape, dtype=torch.float32)
            rows = self.cfg.vocab_size if name in VOCAB_ROWS else shape[0]
            full[:rows].normal_(0.0, s, generator=gen)
            offset = getattr(p, "global_offset", (0,) * p.ndim)
            p.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, p.shape, strict=True))])

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """Run chunk `chunk`: tokens [B, T] in if it is first, else hidden states [B, T', D]; logits
        [B, T, V] out if it is last, else hidden states (T' = T / sequence_shards)."""
        spec = self.chunks[chunk]
        if spec.first:
            T = x.shape[1]
            if T > self.cfg.max_position_embeddings:
                raise MlmError(
                    f"sequence of {T} tokens is longer than model.max_position_embeddings="
                    f"{self.cfg.max_position_embeddings}; shorten it or raise the limit"
                )
            x_BTD = self.embed(x)
            if self.pos_embed is not None:
                x_BTD = x_BTD + self.pos_embed(torch.arange(T, device=x.device))
            x_BTD = self.enter_layers(self.dropout(x_BTD))
        else:
            T, x_BTD = x.shape[1] * self.sequence_shards, x
        rope = None if self.pos_embed is not None or not spec.layers else rope_tables(self.cfg, T, x.device)
        for key in spec.layers:
            layer = self.layers[key]
            if self.cfg.recompute == "full" and self.training:
                x_BTD = checkpoint(layer, x_BTD, rope, use_reentrant=False)
            else:
                x_BTD = layer(x_BTD, rope)
        if not spec.last:
            return x_BTD
        x_BTD = self.enter_output(self.final_norm(x_BTD))
        weight = self.embed.weight if self.output is None else self.output.weight
        return F.linear(x_BTD, weight)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 1234) -> GPT:
    """Build on the meta device, materialise on `device`, initialise (torchtitan's order)."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
