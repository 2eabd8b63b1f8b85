"""A recurrent mixer kind defined in this file and nowhere else — its module and its spec — mixed
by a layer pattern with gqa attention, dense MLPs and MoE layers: it trains under tp 2, pp 2, dp 2
with the distributed optimizer and ep 2 as one process does, `mlm plan` counts it from its spec,
context parallelism refuses it by name, and serving decodes it from per-sequence state slots with
the training forward's logits through prefill, chunked prefill, decode and preemption.

The kind, "gated conv recurrence" (pattern symbol R), per channel c of W:

    u = in_x(x), g = in_g(x)                        (column-parallel: each tp rank its channels)
    k_t = Σ_j conv[c, j] · u_{t−j}                  (causal depthwise convolution, K taps)
    h_t = a · h_{t−1} + (1 − a) · k_t,  a = sigmoid(decay[c])
    y = out(silu(g) · h)                            (row-parallel)

Its state between serving steps: the last K − 1 inputs u and h. Packed documents reset both.
Every rank is a real gloo process; tolerances fp32: 1e-5 relative (test_parallel_training's).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mlm.config import load_config
from mlm.errors import MlmError
from mlm.model.kinds import register
from mlm.model.kinds.spec import Flops, MixerSpec, Param, PartWork, StateCache
from mlm.model.layers import TP_INPUT
from mlm.model.ops import Ops
from tests.helpers.common import engine_checking_logits, saved_storages
from tests.helpers.distributed import run_ranks
from tests.helpers.parallel import assert_matches, reference_run, run_sets, train_rank

WIDTH, TAPS = 32, 4


def conv_scan(u_BTW, conv_WK, a_W, window_BWJ, h_BW):
    """The kind's math from a state: (h [B, T, W], the next window [B, W, K − 1], the last h)."""
    K, T = conv_WK.shape[1], u_BTW.shape[1]
    full_BXW = torch.cat([window_BWJ.transpose(1, 2), u_BTW], dim=1)  # X = K − 1 + T
    k_BTW = sum(conv_WK[:, j] * full_BXW[:, K - 1 - j : K - 1 - j + T] for j in range(K))
    hs = []
    for t in range(T):
        h_BW = a_W * h_BW + (1 - a_W) * k_BTW[:, t]
        hs.append(h_BW)
    return torch.stack(hs, 1), full_BXW[:, T:].transpose(1, 2), h_BW


class ConvScan(torch.autograd.Function):
    """`conv_scan` from zeros, saving its inputs only (the backward recomputes), as a fused kernel would."""

    @staticmethod
    def forward(ctx, u_BTW, conv_WK, a_W):
        ctx.save_for_backward(u_BTW, conv_WK, a_W)
        B, W, K = u_BTW.shape[0], conv_WK.shape[0], conv_WK.shape[1]
        return conv_scan(u_BTW, conv_WK, a_W, u_BTW.new_zeros(B, W, K - 1), u_BTW.new_zeros(B, W))[0]

    @staticmethod
    def backward(ctx, grad_BTW):
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            h = ConvScan.forward(ctx, *inputs)
        return torch.autograd.grad(h, inputs, grad_BTW)


class GatedConvRecurrence(nn.Module):
    residual_projections = ("out",)
    tp_plan = {
        TP_INPUT: "enter",
        "in_x": "column",
        "in_g": "column",
        "conv": "channels",
        "decay": "channels",
        "out": "row",
    }

    def __init__(self, cfg, layer: int = 0, ops=None):
        super().__init__()
        self.ops = ops or Ops()
        D = cfg.hidden_size
        self.layer = layer
        self.in_x = nn.Linear(D, WIDTH, bias=False)
        self.in_g = nn.Linear(D, WIDTH, bias=False)
        self.conv = nn.Parameter(torch.empty(WIDTH, TAPS))
        self.decay = nn.Parameter(torch.empty(WIDTH))
        self.out = nn.Linear(WIDTH, D, bias=False)

    def forward(self, x_BTD, rope=None, cache=None, documents_BT=None):
        u_BTW, g_BTW = self.in_x(x_BTD), self.in_g(x_BTD)
        a_W = torch.sigmoid(self.decay)
        if cache is not None:
            h_BTW = self._from_states(cache.state(self.layer), u_BTW, a_W)
        elif documents_BT is None:
            h_BTW = ConvScan.apply(u_BTW, self.conv, a_W)
        else:  # each packed document from zeros
            h_BTW = torch.cat([self._documents(u, d, a_W) for u, d in zip(u_BTW, documents_BT, strict=True)])
        return self.out(self.ops.swiglu(g_BTW, h_BTW))

    def _documents(self, u_TW, documents_T, a_W):
        starts = [
            0,
            *(torch.nonzero(documents_T[1:] != documents_T[:-1]).flatten() + 1).tolist(),
            len(documents_T),
        ]
        runs = [
            ConvScan.apply(u_TW[None, a:b], self.conv, a_W) for a, b in zip(starts, starts[1:], strict=False)
        ]
        return torch.cat(runs, dim=1)

    def _from_states(self, view, u_1TW, a_W):
        """The step's segments, each from its slot's state (zeros at a sequence's start)."""
        window_SWJ, h_SW = view.load("conv"), view.load("h")
        outs, windows, last = [], [], []
        for i, (offset, n) in enumerate(view.segments):
            h, w, hl = conv_scan(
                u_1TW[:, offset : offset + n], self.conv, a_W, window_SWJ[i : i + 1], h_SW[i : i + 1]
            )
            outs.append(h)
            windows.append(w)
            last.append(hl)
        view.store("conv", torch.cat(windows))
        view.store("h", torch.cat(last))
        return torch.cat(outs, dim=1)


@register
class GatedConvRecurrenceSpec(MixerSpec):
    """What the planner, the FLOP count and serving ask of the kind."""

    name, symbol, module = "gated_conv_recurrence", "R", GatedConvRecurrence

    def check_parallel(self, m, tp, ep, sequence_parallel):
        if WIDTH % tp:
            raise MlmError(f"gated_conv_recurrence: its {WIDTH} channels do not split over tp={tp}")

    def params(self, m, prefix, tp):
        D, W = m.hidden_size, WIDTH // tp
        return [
            Param(f"{prefix}.in_x.weight", W * D, linear=True),
            Param(f"{prefix}.in_g.weight", W * D, linear=True),
            Param(f"{prefix}.conv", W * TAPS),
            Param(f"{prefix}.decay", W),
            Param(f"{prefix}.out.weight", D * W, linear=True),
        ]

    def flops(self, m, seq_length):
        """in_x, in_g and out; the convolution's K and the recurrence's 2 multiply-adds per channel."""
        return Flops(tp=6 * (3 * m.hidden_size * WIDTH + (TAPS + 2) * WIDTH))

    def saved(self, m, mb):
        """The normed input in_x and in_g share; u (the scan's input: it recomputes the rest), g and
        h (SwiGLU's inputs), out's input; the decay's sigmoid [W]."""
        W = WIDTH / mb.tp
        return {
            "linear inputs": mb.e * m.hidden_size * mb.A,
            "recurrence": 4 * mb.e * W * mb.A,
            "decay": W * 4,
        }

    def work(self, m, mb, sw, times):
        W = WIDTH / mb.tp
        part = PartWork(gemms=3, fp8=[(m.hidden_size + W, 2 * W + m.hidden_size, mb.e)])
        part.work.add((2 + TAPS, 4 + TAPS, 2, 4), W, mb.e, mb.A, times.full)  # convolution and scan
        part.work.add((3, 5, 1, 1), W, mb.e, mb.A, times.norm_act)  # the gate
        return part

    def cache(self, m, tp):
        W = WIDTH // tp
        return StateCache(
            {"conv": (W, TAPS - 1), "h": (W,)}, description="gated conv recurrence: window and state"
        )


# ---------------------------------------------------------------- the model

HYBRID = {
    "model.num_layers": 4,
    "model.layer_pattern": "'R-*ER-*E'",
    "model.moe.num_experts": 4,
    "model.moe.ffn_hidden_size": 48,
    "model.moe.router_topk": 2,
    "model.moe.aux_loss_coeff": 1e-2,
    "train.train_iters": 3,
}
DISTOPT = {"parallel.distributed_optimizer": "true", "parallel.bucket_size_mb": 0.02}


def _train_with_the_recurrent_kind(rank, world, sets):
    """A rank's training; defined here so that the rank imports this module, registering the kind."""
    return train_rank(rank, world, sets)


@pytest.fixture(scope="module")
def hybrid_reference(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("hybrid")
    return (*reference_run(tmp, tiny_data, **HYBRID), tmp / "one" / "ckpt")


@pytest.mark.parametrize(
    "world,parallel",
    [
        (2, {"parallel.tp": 2}),
        (2, {"parallel.pp": 2}),
        (2, DISTOPT),
        (2, {"parallel.ep": 2}),
    ],
    ids=["tp2", "pp2", "dp2-distopt", "ep2"],
)
def test_a_recurrent_hybrid_trains_in_parallel_as_one_process(
    tmp_path, tiny_data, hybrid_reference, world, parallel
):
    losses, weights, _ = hybrid_reference
    sets = run_sets(tmp_path, tiny_data, "mesh", **HYBRID, **parallel)
    assert_matches(tmp_path, run_ranks(world, _train_with_the_recurrent_kind, sets), losses, weights)
    assert weights["layers.0.attn.conv"].shape == (WIDTH, TAPS)  # saved whole, whatever the layout


def test_context_parallelism_refuses_the_kind_by_name(tmp_path, tiny_data):
    with pytest.raises(
        MlmError, match="parallel.cp=2 with the mixer kind.*gated_conv_recurrence: they are not"
    ):
        load_config(None, run_sets(tmp_path, tiny_data, "cp", **HYBRID, **{"parallel.cp": 2}))


# ---------------------------------------------------------------- the planner


def _config(tiny_data, tmp_path, **extra):
    return load_config(None, run_sets(tmp_path, tiny_data, "plan", **HYBRID, **extra))


def test_the_planner_counts_the_kind_from_its_spec(tmp_path, tiny_data):
    from mlm.flops import flops_per_token
    from mlm.model import build_model, parameter_counts
    from mlm.plan import memory

    cfg = _config(tiny_data, tmp_path)
    assert memory.parameter_counts(cfg) == parameter_counts(cfg.model)
    m, S = cfg.model, cfg.data.seq_length
    dense = 6 * (
        2 * m.hidden_size * m.head_dim * (m.num_attention_heads + m.query_groups) + 2 * S * m.hidden_size
    )
    mlp = 6 * 3 * m.hidden_size * m.ffn_size
    moe = 6 * 3 * m.hidden_size * 2 * 48 + 6 * m.hidden_size * 4
    recurrence = 6 * (3 * m.hidden_size * WIDTH + (TAPS + 2) * WIDTH)
    logits = 6 * m.hidden_size * m.padded_vocab_size()
    assert flops_per_token(m, S) == 2 * (recurrence + mlp) + 2 * (dense + moe) + logits

    # what one recurrent layer saves (fp32, one rank), counted as tests/plan/test_activation_memory.py counts
    from mlm.layout import Layout

    layout = Layout(1, 1, 1, 2, 2)
    planned = sum(memory.layer_activation_bytes(cfg, layout, m.layer_specs()[0]).values())
    model = build_model(m, "cpu", seed=1).train()
    x = torch.randn(2, S, m.hidden_size, requires_grad=True)
    with saved_storages(model) as saved:
        out = model.layers["0"](x)
    out.sum().backward()
    assert planned == pytest.approx(sum(saved.values()), rel=0.01), (planned, sum(saved.values()))


def test_mlm_plan_evaluates_a_layout_of_the_hybrid(tmp_path, tiny_data):
    from mlm.hardware import PROFILES
    from mlm.layout import Layout
    from mlm.plan.candidates import evaluate
    from mlm.plan.job import Job
    from mlm.plan.search import check_layout

    cfg = _config(tiny_data, tmp_path, **{"train.precision": "bf16"})
    job = Job(cfg, 8, 8, PROFILES["h100-80g"])
    layout = Layout(2, 2, 2, 1, 8, sequence_parallel=True)
    check_layout(job, layout)
    c = evaluate(job, layout)
    assert c.memory.total > 0 and 0 < c.timing.mfu < 1
    assert c.timing.terms["tp collectives"] > 0


# ---------------------------------------------------------------- serving


def test_serving_decodes_from_state_slots_with_the_training_forwards_logits(tmp_path, tiny_data):
    from mlm.inference.engine import EngineConfig
    from mlm.inference.sampling import SamplingParams
    from mlm.model import build_model

    cfg = _config(tiny_data, tmp_path)
    model = build_model(cfg.model, "cpu", seed=7).eval()
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 4 * i)] for i in range(4)]
    # 4 blocks of 8 tokens for 4 sequences of up to 29 tokens: some are preempted and recompute;
    # 12 tokens a step: the longer prompts prefill in chunks, continuing from their state
    config = EngineConfig(
        max_seqs=4, max_tokens_per_step=12, block_size=8, num_blocks=5, packed_weights=False
    )
    engine, checked = engine_checking_logits(model, config)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in outs)
    assert engine.stats.preemptions > 0 and len(checked) >= 4 * 16
    pool = engine.runner.states
    assert pool is not None and pool.num_free == pool.num_slots  # every slot back
    assert not engine.scheduler.prefix_caching  # a cached block does not hold the state
    # alone, each prompt decodes the same tokens (its numbers do not depend on the batch)
    for prompt, out in zip(prompts, outs, strict=True):
        alone, _ = engine_checking_logits(model, EngineConfig(max_seqs=1, packed_weights=False))
        assert alone.generate([prompt], SamplingParams(max_tokens=16))[0].token_ids == out.token_ids


def test_mlm_generate_decodes_a_trained_hybrid(hybrid_reference, capsys):
    """`mlm generate` (in this process, where the kind is registered) on the one-process run's checkpoint."""
    from typer.testing import CliRunner

    from cli.main import app

    *_, ckpt = hybrid_reference
    r = CliRunner().invoke(app, ["generate", str(ckpt), "-p", "def main(", "--max-tokens", "8"])
    assert r.exit_code == 0, r.output
    assert "def main(" in r.output
