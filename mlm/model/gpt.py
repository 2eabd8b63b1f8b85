"""A plain decoder-only transformer, GPT-2 or Llama style from the same config, its layers built
from per-layer specs (`ModelConfig.layer_specs`, kinds in `mlm.model.kinds`).

Parallelism is applied from outside (`mlm.parallel.parallelize` reads each module's `tp_plan`;
`mlm.parallel.recompute` wraps layers for activation recompute); this file knows nothing of ranks.

Shape legend: B batch, T sequence, D hidden, H attention heads, G key/value groups,
K head dim, F ffn hidden, V (padded) vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mlm.config import ModelConfig
from mlm.errors import MlmError
from mlm.model.attention import resolve_backend
from mlm.model.aux_loss import AuxLosses
from mlm.model.contract import declaring
from mlm.model.init import init_parameters
from mlm.model.kinds.mtp.module import MTPLayer, MTPTargets
from mlm.model.layers import Block, make_norm, to_residual
from mlm.model.ops import Ops, resolve_kernels
from mlm.model.rope import inv_frequencies, rope_tables
from mlm.parallel.cross_entropy import cross_entropy, linear_cross_entropy

# Parameters whose rows are the vocabulary, padded to a multiple of make_vocab_size_divisible_by × tp
# (the padding rows are zeros and stay zero in training).
VOCAB_ROWS = ("embed.weight", "output.weight")


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
    """tokens [B, T] → logits [B, T, V] (V = padded vocabulary), or the mean loss against labels.

    `layers` is keyed by global layer number, so a pipeline stage that keeps only some layers
    (`keep_chunks`) names its parameters as the whole model does. `chunks` lists what a
    `forward(x, chunk=c)` call runs; the whole model is one chunk. The same forward serves
    training, evaluation, sampling and serving: `positions` (default 0 .. T - 1) place the tokens,
    and a KV `cache` (serving's paged cache) gives attention its past keys and values."""

    # Megatron-style tensor parallelism, applied from outside by `mlm.parallel.parallelize`
    # (styles in `mlm.model.layers`): the embedding and the output projection split by vocabulary,
    # the sequence split on entering the layers under sequence parallelism, the output layer's
    # input entering the tp region, the loss computed from vocabulary shards.
    tp_plan = {
        "embed": "vocab",
        "pos_embed": "full_sequence",
        "enter_layers": "scatter_sequence",
        "final_norm": "replicated",
        "enter_output": "enter",
        "output": "column",
        "cross_entropy": "vocab_loss",
        "linear_cross_entropy": "vocab_linear_loss",
    }
    padded_rows = VOCAB_ROWS  # checkpoint tensors whose rows are padded per tp (load across paddings)
    output_op = staticmethod(F.linear)  # the output projection's product (see `project`)

    def __init__(self, cfg: ModelConfig, padded_vocab: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.ops = ops = Ops()  # the implementation switch every module shares (`mlm.model.ops`)
        V = self.padded_vocab = padded_vocab or cfg.padded_vocab_size()
        self.embed = nn.Embedding(V, cfg.hidden_size)
        self.pos_embed = (
            nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            if cfg.position_embedding == "learned"
            else None
        )
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        # Placeholders for tensor/sequence parallelism (identity here): into the layers (scatter
        # the sequence over tp ranks) and into the output projection (enter the tp region).
        self.enter_layers: nn.Module = nn.Identity()
        self.enter_output: nn.Module = nn.Identity()
        specs = cfg.layer_specs()
        self.layers = nn.ModuleDict({str(i): Block(cfg, spec, i, ops) for i, spec in enumerate(specs)})
        self.final_norm = make_norm(cfg, ops=ops)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, V, bias=False)
        # multi-token prediction depths (on the last pipeline stage, with an embedding copy there)
        self.mtp = (
            nn.ModuleDict(
                {str(d): MTPLayer(cfg, specs[-1], cfg.num_layers + d, ops) for d in range(cfg.mtp_num_layers)}
            )
            if cfg.mtp_num_layers
            else None
        )
        # loss of (logits, labels, vocab_size, weights=None): the mean, or with weights the weighted
        # sum (MTP); vocabulary-parallel under tensor parallelism
        self.cross_entropy = cross_entropy
        # the same from the normed hidden states and the output weight, chunked over the tokens
        # (model.fused_cross_entropy: the [B, T, V] logits are never held); vocabulary-parallel under tp
        self.linear_cross_entropy = linear_cross_entropy
        # auxiliary losses the modules attach (e.g. MoE balancing), shared with every module
        # that declares `aux_losses` (`mlm.model.contract`)
        self.aux_losses = AuxLosses()
        for _, module, _ in declaring(self, "aux_losses"):
            module.aux_losses = self.aux_losses
        self.chunks = [Chunk(list(self.layers))]
        # Hidden states between chunks are [B, T / sequence_shards, D] (tp under sequence parallelism).
        self.sequence_shards = 1
        self._inv_freq: torch.Tensor | None = None  # RoPE frequencies, computed once per device
        self._rope = cfg.position_embedding == "rope" and cfg.rope_dim is not None

    def set_attention_backend(self, requested: str, device: torch.device) -> str:
        """Run every attention core with `model.attention_backend`'s choice on `device`
        (`resolve_backend`, in the model's `Ops`); returns it."""
        self.ops.attention_backend = resolve_backend(requested, device)
        return self.ops.attention_backend

    def set_kernels(self, requested: str, device: torch.device) -> str:
        """Run every norm, MLP activation and RoPE with `model.kernels`' choice on `device`
        (`resolve_kernels`, in the model's `Ops`, which every module shares); returns it."""
        self.ops.kernels = resolve_kernels(requested, device)
        return self.ops.kernels

    # ------------------------------------------------------------------ pipeline stages

    def keep_chunks(self, chunks: list[Chunk]) -> None:
        """Keep only the layers of `chunks` (a pipeline rank's virtual stages), the embedding where
        a chunk is first (or, where one is last, a copy: the tied output weight, or MTP's inputs),
        the final norm, output and MTP depths where one is last; parameter names stay those of the
        whole model."""
        keep = {k for c in chunks for k in c.layers}
        for key in [k for k in self.layers if k not in keep]:
            del self.layers[key]
        has_first, has_last = any(c.first for c in chunks), any(c.last for c in chunks)
        if not has_first:
            self.pos_embed = None
            if not (has_last and self._embedding_on_last_stage):  # the last stage keeps a copy
                self.embed = None
        if not has_last:
            self.final_norm = None
            self.output = None
            self.mtp = None
        self.chunks = chunks

    @property
    def _embedding_on_last_stage(self) -> bool:
        """The last stage uses the embedding too: as the output layer (tied) or for MTP's inputs."""
        return self.cfg.tie_embeddings or self.cfg.mtp_num_layers > 0

    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of an embedding that another stage also holds (first and last
        pipeline stage: tied to the output layer, or MTP's): its gradient must be summed with the
        other copy's; else None."""
        first, last = any(c.first for c in self.chunks), any(c.last for c in self.chunks)
        if not self._embedding_on_last_stage or self.embed is None or (first and last):
            return None
        return self.embed.weight

    def tied_copy(self) -> nn.Parameter | None:
        """The last stage's copy of the embedding (tied, or MTP's), not the first stage's original; or None."""
        if self.embed is None or any(c.first for c in self.chunks):
            return None
        return self.embed.weight

    # ------------------------------------------------------------------ weights

    def init_weights(self, seed: int) -> None:
        """Megatron's init, each rank drawing only its own slices (`placements`) so that every
        mesh starts from the weights of one process (`mlm.model.init`)."""
        init_parameters(self, seed, self.cfg, () if self.cfg.train_padded_vocab else VOCAB_ROWS)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache=None,
        chunk: int = 0,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run chunk `chunk`: tokens [B, T] in if it is first, else hidden states [B, T', D]; logits
        [B, T, V] (sharded over the vocabulary under tp) out if it is last, else hidden states
        (T' = T / sequence_shards), in the parameters' dtype: the pipeline passes hidden states in
        it (under autocast the cast from the bf16 residual stream is exact)."""
        h = self.hidden_states(x, positions, cache, chunk, documents)
        if self.chunks[chunk].last:
            return self.logits(h)
        return h.to(next(self.parameters()).dtype)

    def hidden_states(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache=None,
        chunk: int = 0,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The chunk's layers over tokens (first chunk) or hidden states; before the final norm.
        `documents` [B, T]: the document index of every token, when attention stays within the
        packed documents of a sequence (data.reset_attention_mask). The layers run in the residual
        stream's dtype (`to_residual`): autocast's under autocast, fp32 with
        model.fp32_residual_connection."""
        spec = self.chunks[chunk]
        T = x.shape[1] if spec.first else x.shape[1] * self.sequence_shards
        if spec.first:
            if cache is None:  # under a KV cache the serving runner checks on the host (no device sync)
                self.check_position(
                    T - 1 if positions is None else int(positions.max()) if positions.numel() else 0
                )
            x_BTD = self.embed(x)
            if self.pos_embed is not None:
                x_BTD = x_BTD + self.pos_embed(
                    torch.arange(T, device=x.device) if positions is None else positions
                )
            x_BTD = self.enter_layers(self.residual(self.dropout(x_BTD)))
        else:
            x_BTD = self.residual(x)
        rope = self.rope(T, x.device, positions) if spec.layers else None
        for key in spec.layers:
            x_BTD = self.layers[key](x_BTD, rope, cache, documents)
        return x_BTD

    def check_position(self, last: int) -> None:
        """Refuse a position the model has no embedding or RoPE range for."""
        limit = self.cfg.max_position_embeddings
        if last >= limit:
            raise MlmError(
                f"position {last} (a sequence of {last + 1} tokens) is beyond "
                f"model.max_position_embeddings={limit}; shorten it or raise the limit"
            )

    def residual(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Hidden states entering the layers, in the residual stream's dtype (`to_residual`)."""
        return to_residual(x_BTD, self.cfg.fp32_residual_connection)

    def rope(self, T: int, device, positions: torch.Tensor | None = None):
        """(cos, sin) of the rotary embedding for T tokens (or `positions`); None with learned
        positions, or when no layer's mixer uses RoPE."""
        if not self._rope:
            return None
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = inv_frequencies(self.cfg).to(device)
        return rope_tables(self.cfg, T, device, positions, self._inv_freq)

    def logits(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection: [..., D] → [..., V] (V / tp columns under tp)."""
        return self.project(self.final_norm(h_BTD))

    def project(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """The output projection of normed hidden states (shared by the MTP depths), by
        `output_op`: `F.linear` unless replaced from outside (`mlm.inference.packed_weights`)."""
        return self.output_op(self.enter_output(h_BTD), self.output_weight())

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight [V, D] (V / tp rows under tp): its own, or the tied embedding."""
        return self.embed.weight if self.output is None else self.output.weight

    def loss_of_normed(
        self, h_BTD: torch.Tensor, labels_BT: torch.Tensor, weights_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Cross-entropy of the output layer on normed hidden states: the mean, or with
        `weights_BT` the weighted sum; from the logits, or with model.fused_cross_entropy chunked
        over the tokens without ever holding them (`mlm.parallel.cross_entropy`)."""
        V = self.padded_vocab if self.cfg.train_padded_vocab else self.cfg.vocab_size
        if self.cfg.fused_cross_entropy:
            return self.linear_cross_entropy(
                self.enter_output(h_BTD), self.output_weight(), labels_BT, V, weights_BT
            )
        return self.cross_entropy(self.project(h_BTD), labels_BT, V, weights_BT)

    def head_loss(
        self, h_BTD: torch.Tensor, labels_BT: torch.Tensor, weights_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The last stage's loss: mean cross-entropy of the logits of `h_BTD` against `labels_BT`,
        or with `weights_BT` the weighted sum (vocabulary-parallel under tp: the logits are never
        gathered)."""
        return self.loss_of_normed(self.final_norm(h_BTD), labels_BT, weights_BT)

    def mtp_losses(
        self,
        h_BTD: torch.Tensor,
        targets: MTPTargets,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of every MTP depth [D] from the main model's last hidden states `h_BTD` (before
        the final norm): depth k joins the normed hidden state of the depth before with the
        embedding of the token k ahead, runs its layer, and predicts the token k + 1 ahead with the
        shared output layer (`mlm.model.kinds.mtp.module`)."""
        T = h_BTD.shape[1] * self.sequence_shards
        rope = self.rope(T, h_BTD.device, positions)
        h_BTD = self.final_norm(h_BTD)
        losses = []
        for k, depth in enumerate(self.mtp.values(), start=1):
            e_BTD = self.enter_layers(self.residual(self.dropout(self.embed(targets.inputs(k)))))
            h_BTD = depth(e_BTD, h_BTD, rope, documents)
            losses.append(self.loss_of_normed(h_BTD, targets.labels(k), targets.weights(k)))
        return torch.stack(losses)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 1234) -> GPT:
    """Build on the meta device, materialise on `device`, initialise (torchtitan's order)."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model
