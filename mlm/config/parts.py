"""The model's parts, each a table of [model]: RoPE (`model.rope`), MoE (`model.moe`), MLA
(`model.mla`), Mamba-2 (`model.mamba`) and Gated DeltaNet (`model.gdn`)."""

from __future__ import annotations

from dataclasses import dataclass

from mlm.config.checks import choice, ensure


@dataclass
class RopeConfig:
    """Rotary position embeddings (position_embedding = "rope"): the base frequency and the
    scaling of a context extended past the pretraining one (HF's rope_theta and rope_scaling,
    Megatron's --rotary-base and --rope-scaling-factor)."""

    base: float = 10000.0
    """RoPE base frequency (theta)."""
    scaling_factor: float | None = None
    """RoPE frequency scaling factor (Llama-3.1's 8.0, DeepSeek-V3's YaRN 40.0); unset means none."""
    scaling_type: str = "llama3"
    """What scaling_factor does: llama3 (Llama-3.1's frequency bands) or yarn (YaRN, as DeepSeek-V3 configures it)."""
    low_freq_factor: float = 1.0
    """Llama-3.1 scaling: low-frequency factor."""
    high_freq_factor: float = 4.0
    """Llama-3.1 scaling: high-frequency factor."""
    original_max_position_embeddings: int = 8192
    """RoPE scaling: the context length the model was pretrained with."""
    yarn_beta_fast: float = 32.0
    """YaRN: rotations below which dims are extrapolated (beta_fast)."""
    yarn_beta_slow: float = 1.0
    """YaRN: rotations above which dims are interpolated (beta_slow)."""
    yarn_mscale: float = 1.0
    """YaRN: cos and sin × (0.1·mscale·ln(factor) + 1) / (the same with mscale_all_dim) when both are nonzero; else × (0.1·ln(factor) + 1)."""
    yarn_mscale_all_dim: float = 0.0
    """YaRN: mscale_all_dim; nonzero also scales MLA's softmax by (0.1·it·ln(factor) + 1)² (DeepSeek); 0: off."""

    def __post_init__(self):
        s = "model.rope"
        choice(s, "scaling_type", self.scaling_type, ("llama3", "yarn"))
        ensure(
            self.scaling_factor is None or self.scaling_factor >= 1.0,
            f"{s}.scaling_factor={self.scaling_factor}: must be >= 1 (or unset)",
        )


@dataclass
class MoEConfig:
    """Mixture of experts (the layers whose mlp kind is "moe"): Megatron's --moe-* options."""

    num_experts: int = 0
    """Routed experts per MoE layer (Megatron's num_moe_experts, HF's num_local_experts)."""
    ffn_hidden_size: int | None = None
    """Each expert's MLP width (moe_ffn_hidden_size, HF's moe_intermediate_size); unset: model.ffn_hidden_size."""
    router_topk: int = 2
    """Experts each token goes to (k)."""
    router_score_function: str = "softmax"
    """softmax or sigmoid over the router logits (computed in fp32)."""
    router_pre_softmax: bool = False
    """softmax over all experts before top-k, weights not renormalised (Qwen2-MoE); else top-k, then softmax over the k."""
    router_num_groups: int | None = None
    """Group-limited routing: experts form this many groups (DeepSeek's n_group); unset: off."""
    router_group_topk: int | None = None
    """Group-limited routing: the groups each token may use (DeepSeek's topk_group)."""
    router_topk_scaling_factor: float | None = None
    """Multiply the top-k weights by this (DeepSeek's routed_scaling_factor); unset: 1."""
    router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias used only to select experts, updated once per step."""
    router_bias_update_rate: float = 1e-3
    """Expert bias update: bias += rate · sign(mean load − load), per global batch."""
    aux_loss_coeff: float = 0.0
    """Load-balancing loss (Switch/GShard, per micro-batch) coefficient; 0: off."""
    seq_aux_loss_coeff: float = 0.0
    """Sequence-wise load-balancing loss (DeepSeek-V2/V3) coefficient; 0: off."""
    z_loss_coeff: float = 0.0
    """Router z-loss (mean logsumexp² of the logits) coefficient; 0: off."""
    capacity_factor: float | None = None
    """Token dropping: each expert takes at most ceil(tokens · k / experts · factor) tokens per micro-batch; unset: dropless."""
    pad_to_capacity: bool = False
    """With capacity_factor: every expert computes exactly its capacity (padded), for static shapes."""
    token_drop_policy: str = "probs"
    """Which tokens an over-full expert keeps: probs (the highest weights) or position (the first ones)."""
    shared_expert_ffn_hidden_size: int | None = None
    """Shared experts' total MLP width (moe_shared_expert_intermediate_size); unset: none."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x · w) (Qwen2-MoE's shared_expert_gate)."""
    token_dispatcher: str = "alltoall"
    """Expert parallelism's token exchange: alltoall (tokens to their experts' ranks) or allgather (all tokens to all ranks)."""
    experts_impl: str = "auto"
    """Expert matmuls: grouped_mm (torch._grouped_mm), bmm (padded batched matmul), loop (one per expert) or auto."""

    def __post_init__(self):
        s = "model.moe"
        ensure(self.num_experts >= 0, f"{s}.num_experts={self.num_experts}: must be >= 0")
        for name in ("ffn_hidden_size", "shared_expert_ffn_hidden_size"):
            n = getattr(self, name)
            ensure(n is None or n > 0, f"{s}.{name}={n}: must be positive (or unset)")
        ensure(self.router_topk >= 1, f"{s}.router_topk={self.router_topk}: must be at least 1")
        choice(s, "router_score_function", self.router_score_function, ("softmax", "sigmoid"))
        ensure(
            not (self.router_pre_softmax and self.router_score_function == "sigmoid"),
            f"{s}.router_pre_softmax=true needs router_score_function=softmax (a sigmoid has no 'before top-k')",
        )
        ensure(
            not self.router_enable_expert_bias or self.router_score_function == "sigmoid",
            f"{s}.router_enable_expert_bias=true needs router_score_function=sigmoid (the bias selects "
            "among sigmoid scores, as in DeepSeek-V3 and Megatron)",
        )
        choice(s, "token_drop_policy", self.token_drop_policy, ("probs", "position"))
        choice(s, "token_dispatcher", self.token_dispatcher, ("alltoall", "allgather"))
        choice(s, "experts_impl", self.experts_impl, ("auto", "grouped_mm", "bmm", "loop"))
        ensure(
            self.capacity_factor is None or self.capacity_factor > 0,
            f"{s}.capacity_factor={self.capacity_factor}: must be positive (or unset for dropless)",
        )
        ensure(
            not self.pad_to_capacity or self.capacity_factor is not None,
            f"{s}.pad_to_capacity=true needs {s}.capacity_factor (the capacity to pad to)",
        )
        for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "router_bias_update_rate"):
            ensure(getattr(self, name) >= 0, f"{s}.{name}={getattr(self, name)}: must be >= 0")
        groups, group_topk = self.router_num_groups, self.router_group_topk
        ensure(
            (groups is None) == (group_topk is None),
            f"{s}.router_num_groups={groups}, router_group_topk={group_topk}: set both (group-limited routing) or neither",
        )
        if not self.num_experts:
            return
        E, k = self.num_experts, self.router_topk
        ensure(
            k <= E,
            f"{s}.router_topk={k} exceeds {s}.num_experts={E}: a token cannot go to more experts than exist",
        )
        if groups is not None:
            ensure(
                groups >= 1 and E % groups == 0,
                f"{s}.router_num_groups={groups} does not divide {s}.num_experts={E}; choose a divisor of {E}",
            )
            ensure(
                1 <= group_topk <= groups,
                f"{s}.router_group_topk={group_topk} exceeds {s}.router_num_groups={groups}: "
                f"a token can use at most all {groups} groups",
            )
            ensure(
                k % group_topk == 0 and k // group_topk <= E // groups,
                f"{s}.router_topk={k} over router_group_topk={group_topk} groups: k must be a multiple of "
                f"group_topk with at most {E // groups} (experts per group) from each group",
            )


@dataclass
class MLAConfig:
    """Multi-Latent Attention (attention_kind = "mla"; DeepSeek-V2/V3, Megatron's MLATransformerConfig):
    keys and values come up from one compressed latent per token, queries optionally from another,
    and each head's query/key has a part without position (nope) and a RoPE part shared by all heads."""

    q_lora_rank: int | None = None
    """Query down-projection width (HF's q_lora_rank); unset: queries projected straight from the hidden state."""
    kv_lora_rank: int = 512
    """Key/value latent width (HF's kv_lora_rank): what serving caches per token, with the rope key."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims without position (Megatron's qk_head_dim)."""
    qk_rope_head_dim: int = 64
    """Per-head query/key dims with RoPE, the key part shared by all heads (Megatron's qk_pos_emb_head_dim)."""
    v_head_dim: int = 128
    """Per-head value dims."""
    rope_interleave: bool = True
    """RoPE on adjacent pairs of the rope dims (DeepSeek's layout, HF's rope_interleave); false: rotate-half."""

    def __post_init__(self):
        s = "model.mla"
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            ensure(getattr(self, name) > 0, f"{s}.{name}={getattr(self, name)}: must be positive")
        ensure(
            self.q_lora_rank is None or self.q_lora_rank > 0,
            f"{s}.q_lora_rank={self.q_lora_rank}: must be positive (or unset: no query down-projection)",
        )
        ensure(
            self.qk_rope_head_dim % 2 == 0,
            f"{s}.qk_rope_head_dim={self.qk_rope_head_dim}: RoPE rotates pairs of dims; make it even",
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class MambaConfig:
    """Mamba-2 layers (mixer kind "mamba", pattern symbol M; Megatron's MambaMixer, HF's Mamba2 and
    Nemotron-H): an input projection to z, x, B, C and dt, a causal depthwise convolution over x, B
    and C, the chunked state-space scan (SSD), a gated RMSNorm per group, an output projection."""

    num_heads: int | None = None
    """SSM heads (Megatron's mamba_num_heads); unset: 2 × hidden_size / head_dim (expand 2)."""
    head_dim: int = 64
    """Channels per head P (mamba_head_dim); the inner width is num_heads × head_dim."""
    state_dim: int = 128
    """State width N per head (mamba_state_dim, HF's state_size)."""
    num_groups: int = 8
    """Groups of B and C (mamba_num_groups, HF's n_groups); consecutive heads share a group."""
    conv_kernel: int = 4
    """Taps of the causal depthwise convolution (HF's conv_kernel)."""
    chunk_size: int = 128
    """Tokens per chunk of the scan (HF's chunk_size); changes rounding, not the result."""
    dt_min: float = 0.001
    """Init: the time step is drawn log-uniform in [dt_min, dt_max] (dt_bias = its inverse softplus)."""
    dt_max: float = 0.1
    """Init: the largest drawn time step."""
    dt_init_floor: float = 0.0001
    """Init: drawn time steps below this are raised to it."""
    dt_limit_min: float = 0.0
    """The time step after softplus is clamped to at least this (HF's time_step_limit[0])."""
    dt_limit_max: float | None = None
    """The time step is clamped to at most this (HF's time_step_limit[1]); unset: no upper limit."""
    A_init_min: float = 1.0
    """Init: −A per head drawn uniform in [A_init_min, A_init_max] (A_log = its log)."""
    A_init_max: float = 16.0
    """Init: the largest drawn −A."""

    def __post_init__(self):
        s = "model.mamba"
        for name in ("head_dim", "state_dim", "num_groups", "conv_kernel", "chunk_size"):
            ensure(getattr(self, name) > 0, f"{s}.{name}={getattr(self, name)}: must be positive")
        ensure(
            self.num_heads is None or self.num_heads > 0,
            f"{s}.num_heads={self.num_heads}: must be positive (or unset for 2 × hidden_size / head_dim)",
        )
        ensure(
            0 < self.dt_min <= self.dt_max,
            f"{s}.dt_min={self.dt_min}, dt_max={self.dt_max}: need 0 < dt_min <= dt_max",
        )
        ensure(
            self.dt_limit_max is None or self.dt_limit_min < self.dt_limit_max,
            f"{s}.dt_limit_min={self.dt_limit_min} >= dt_limit_max={self.dt_limit_max}: the clamp would be empty",
        )
        ensure(
            0 < self.A_init_min <= self.A_init_max,
            f"{s}.A_init_min={self.A_init_min}, A_init_max={self.A_init_max}: need 0 < min <= max",
        )

    def heads(self, hidden_size: int) -> int:
        return self.num_heads or 2 * hidden_size // self.head_dim

    def inner(self, hidden_size: int) -> int:
        """The inner width d_inner = heads × head_dim."""
        return self.heads(hidden_size) * self.head_dim

    def conv_width(self, hidden_size: int) -> int:
        """Channels the convolution runs over: x, B and C."""
        return self.inner(hidden_size) + 2 * self.num_groups * self.state_dim


@dataclass
class GatedDeltaNetConfig:
    """Gated DeltaNet layers (mixer kind "gdn", pattern symbol G; Qwen3-Next's linear attention,
    Megatron's GatedDeltaNet, HF's Qwen3NextGatedDeltaNet): projections to q, k (key heads), v, z
    (value heads), b and a (one each per value head), a causal depthwise convolution over q, k and
    v, the chunked gated delta rule, a gated RMSNorm per value head, an output projection.
    Defaults: Qwen3-Next-80B-A3B's heads and dims, the 4 taps and 64-token chunks of HF and FLA, −A
    drawn as Megatron's GatedDeltaNet draws it."""

    num_key_heads: int = 16
    """Heads of q and k (HF's linear_num_key_heads); each serves num_value_heads / num_key_heads value heads."""
    num_value_heads: int = 32
    """Heads of v, z, the state and the output (HF's linear_num_value_heads)."""
    key_head_dim: int = 128
    """Channels d_k per query and key head (HF's linear_key_head_dim); the state is d_k × d_v per value head."""
    value_head_dim: int = 128
    """Channels d_v per value head (HF's linear_value_head_dim)."""
    conv_kernel: int = 4
    """Taps of the causal depthwise convolution over q, k and v (HF's linear_conv_kernel_dim)."""
    chunk_size: int = 64
    """Tokens per chunk of the delta rule (FLA's and HF's 64); changes rounding, not the result."""
    A_init_min: float = 1.0
    """Init: −A per value head drawn uniform in [A_init_min, A_init_max] (A_log = its log); Megatron's (1, 16), HF draws from (0.01, 16)."""
    A_init_max: float = 16.0
    """Init: the largest drawn −A."""

    def __post_init__(self):
        s = "model.gdn"
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            ensure(getattr(self, name) > 0, f"{s}.{name}={getattr(self, name)}: must be positive")
        ensure(self.chunk_size > 0, f"{s}.chunk_size={self.chunk_size}: must be positive")
        ensure(
            self.num_value_heads % self.num_key_heads == 0,
            f"{s}.num_value_heads={self.num_value_heads} is not a multiple of num_key_heads="
            f"{self.num_key_heads}: each key head serves a whole number of value heads (Qwen3-Next's 16 and 32)",
        )
        ensure(
            0 < self.A_init_min <= self.A_init_max,
            f"{s}.A_init_min={self.A_init_min}, A_init_max={self.A_init_max}: need 0 < min <= max",
        )

    @property
    def key_dim(self) -> int:
        """Width of q (and of k): num_key_heads × key_head_dim."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of v, z and the output: num_value_heads × value_head_dim."""
        return self.num_value_heads * self.value_head_dim
