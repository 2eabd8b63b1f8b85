"""The MoE layer on one process: every router variant against its formula written out on fixed
inputs (top-k then softmax, pre-softmax, sigmoid with the selection-only bias, scaling,
group-limited top-k), the balancing losses, the aux-loss-free bias update, capacity dropping on
a batch built to overflow, the three expert implementations against each other, the layer
against a per-token sum, and the clear errors for impossible settings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlm.config import ModelConfig, MoEConfig
from mlm.errors import MlmError
from mlm.model import build_model
from mlm.model.kinds.moe import router as R
from mlm.model.kinds.moe.experts import GroupedExperts
from mlm.parallel.expert import apply_expert_parallel, expert_load_step
from mlm.parallel.mesh import Mesh

LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.5, -1.0, 0.0, 3.0, -2.0, 1.5],
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
        [-1.0, 4.0, 3.5, 0.0, 0.2, -0.5, 3.9, 1.0],
    ]
)


def _moe(**kw) -> MoEConfig:
    return MoEConfig(**{"num_experts": 8, "router_topk": 2, **kw})


def _tiny(layers: int = 1, **moe) -> ModelConfig:
    """A small model whose every layer is MoE with `moe` options."""
    return ModelConfig(
        num_layers=layers, hidden_size=32, num_attention_heads=4, mlp_kind="moe", moe=MoEConfig(**moe)
    )


def _sorted(probs, experts):
    """Rows as {expert: weight} for order-free comparison."""
    return [dict(zip(e.tolist(), p.tolist(), strict=True)) for p, e in zip(probs, experts, strict=True)]


def _assert_routes(got, want):
    assert [set(g) for g in got] == [set(w) for w in want]
    for g, w in zip(got, want, strict=True):
        for e in w:
            assert g[e] == pytest.approx(w[e], rel=1e-6), (g, w)


def test_softmax_topk_then_softmax_equals_softmax_all_then_renormalise():
    """Megatron's default = HF Mixtral / Qwen3-MoE: softmax over all, top-k, renormalise."""
    got = _sorted(*R.route(LOGITS, _moe()))
    p = LOGITS.softmax(-1)
    want = []
    for row in p:
        top = row.topk(2)
        want.append(
            {int(e): float(v / top.values.sum()) for v, e in zip(top.values, top.indices, strict=True)}
        )
    _assert_routes(got, want)


def test_pre_softmax_keeps_the_full_softmax_weights():
    """Qwen2-MoE (norm_topk_prob false): softmax over all experts, top-k, no renormalisation."""
    got = _sorted(*R.route(LOGITS, _moe(router_pre_softmax=True)))
    p = LOGITS.softmax(-1)
    want = [{int(e): float(row[e]) for e in row.topk(2).indices} for row in p]
    _assert_routes(got, want)


def test_sigmoid_with_bias_selects_by_the_bias_and_weighs_without_it():
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0])  # forces expert 4 in
    cfg = _moe(router_score_function="sigmoid", router_topk_scaling_factor=2.5)
    got = _sorted(*R.route(LOGITS, cfg, bias))
    s = LOGITS.sigmoid()
    want = []
    for row in s:
        chosen = (row + bias).topk(2).indices.tolist()
        assert 4 in chosen
        total = sum(float(row[e]) for e in chosen) + 1e-20
        want.append({e: 2.5 * float(row[e]) / total for e in chosen})
    _assert_routes(got, want)


def test_group_limited_topk_chooses_within_the_best_groups():
    """E 8 in 4 groups of 2, 2 groups per token, k 4 (k / group_topk = 2 per group, as HF's
    DeepSeek-V3 takes): group score = the sum of its top 2; the best 2 groups give the 4 experts."""
    cfg = _moe(router_topk=4, router_num_groups=4, router_group_topk=2, router_score_function="sigmoid")
    got = _sorted(*R.route(LOGITS, cfg))
    s = LOGITS.sigmoid()
    want = []
    for row in s:
        groups = row.view(4, 2).sum(-1)
        best = groups.topk(2).indices.tolist()
        experts = [2 * g + j for g in best for j in range(2)]
        total = sum(float(row[e]) for e in experts)
        want.append({e: float(row[e]) / total for e in experts})
    _assert_routes(got, want)
    # row 0: a plain top-4 would take experts 5, 0, 7, 1 (groups 2, 0, 3, 0): not two whole groups
    assert set(R.route(LOGITS, _moe(router_topk=4, router_score_function="sigmoid"))[1][0].tolist()) != set(
        got[0]
    )


def test_balancing_losses_match_their_formulas():
    torch.manual_seed(0)
    logits = torch.randn(12, 4)
    k, coeff = 2, 0.1
    scores = logits.softmax(-1)
    selected = R.sparse(*R.route(logits, MoEConfig(num_experts=4, router_topk=k)), 4)[1]
    counts = selected.sum(0).float()
    f = counts / (12 * k)  # share of the token copies per expert
    P = scores.mean(0)  # mean score per expert
    assert float(R.aux_loss(scores, selected, k, coeff)) == pytest.approx(
        coeff * 4 * float((f * P).sum()), rel=1e-6
    )
    # sequence-wise: the same per sequence (batch 3 of 4 tokens), averaged
    per_seq = [
        coeff
        * 4
        * float((selected[b * 4 : b * 4 + 4].sum(0) / (4 * k) * scores[b * 4 : b * 4 + 4].mean(0)).sum())
        for b in range(3)
    ]
    assert float(R.seq_aux_loss(scores, selected, 3, k, coeff)) == pytest.approx(sum(per_seq) / 3, rel=1e-6)
    z = coeff * float(torch.logsumexp(logits, -1).square().mean())
    assert float(R.z_loss(logits, coeff)) == pytest.approx(z, rel=1e-6)
    # perfectly balanced routing with uniform scores: the aux loss is the coefficient itself
    uniform = torch.full((8, 4), 0.25)
    balanced = torch.zeros(8, 4, dtype=torch.bool)
    balanced[torch.arange(8), torch.arange(8) % 4] = True
    balanced[torch.arange(8), (torch.arange(8) + 1) % 4] = True
    assert float(R.aux_loss(uniform, balanced, 2, coeff)) == pytest.approx(coeff)


def test_capacity_drops_the_overflow():
    """8 tokens, 2 experts, top-1, capacity factor 1: capacity ceil(8 · 1 / 2 · 1) = 4; six tokens
    choose expert 0, so two are dropped: the lowest weights ("probs") or the last ("position")."""
    weights = torch.tensor([0.9, 0.8, 0.3, 0.7, 0.2, 0.6, 0.55, 0.65])
    chosen0 = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    selected = torch.stack([chosen0, ~chosen0], 1)
    probs = torch.where(selected, weights[:, None], 0.0)
    cfg = MoEConfig(num_experts=2, router_topk=1, capacity_factor=1.0)
    assert R.capacity(8, cfg) == 4
    _, kept = R.drop_over_capacity(probs, selected, cfg)
    assert kept[:, 0].tolist() == [True, True, False, True, False, True, False, False]  # 0.3, 0.2 dropped
    assert kept[:, 1].tolist() == [False] * 6 + [True, True]
    _, kept = R.drop_over_capacity(
        probs,
        selected,
        MoEConfig(num_experts=2, router_topk=1, capacity_factor=1.0, token_drop_policy="position"),
    )
    assert kept[:, 0].tolist() == [True] * 4 + [False] * 4
    padded_probs, padded = R.drop_over_capacity(
        probs, selected, MoEConfig(num_experts=2, router_topk=1, capacity_factor=1.0, pad_to_capacity=True)
    )
    assert padded.sum(0).tolist() == [4, 4]  # every expert computes exactly its capacity
    assert padded_probs[~selected].abs().sum() == 0  # the padding rows weigh nothing


def test_the_load_counts_dropped_copies(tmp_path):
    cfg = _tiny(num_experts=4, router_topk=2, capacity_factor=0.5)
    model = build_model(cfg).train()
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    load = expert_load_step(model, Mesh.single())
    assert float(load["moe.dropped.0"]) > 0  # capacity 8 of 64 copies per expert: some dropped
    assert load["moe.load_max_mean.0"] >= 1.0


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_expert_implementations_agree(activation):
    torch.manual_seed(0)
    counts = [5, 0, 7, 4]  # an expert with no tokens
    x = torch.randn(sum(counts), 16)
    outs = {}
    for impl in ("loop", "bmm", "grouped_mm"):
        torch.manual_seed(1)
        experts = GroupedExperts(4, 16, 24, activation, impl)
        for w in experts.parameters():
            torch.nn.init.normal_(w, std=0.1)
        xi = x.clone().requires_grad_()
        y = experts(xi, counts)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs[impl] = (y.detach(), xi.grad, [p.grad for p in experts.parameters()])
    ref = outs["loop"]
    for impl in ("bmm", "grouped_mm"):
        torch.testing.assert_close(outs[impl][0], ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(outs[impl][1], ref[1], rtol=1e-5, atol=1e-6)
        for a, b in zip(outs[impl][2], ref[2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_layer_is_the_weighted_sum_of_its_experts_per_token():
    cfg = _tiny(
        num_experts=4,
        router_topk=2,
        ffn_hidden_size=24,
        shared_expert_ffn_hidden_size=16,
        shared_expert_gate=True,
    )
    moe = build_model(cfg).layers["0"].mlp.eval().requires_grad_(False)
    x = torch.randn(2, 5, 32)
    got = moe(x)
    w = moe.experts
    for b in range(2):
        for t in range(5):
            xt = x[b, t]
            logits = moe.router.weight @ xt
            top = logits.softmax(-1).topk(2)
            want = sum(
                float(p / top.values.sum())
                * (w.down.weight[e] @ (F.silu(w.gate.weight[e] @ xt) * (w.up.weight[e] @ xt)))
                for p, e in zip(top.values, top.indices, strict=True)
            )
            want = want + torch.sigmoid(moe.shared_gate.weight @ xt) * moe.shared(xt[None, None])[0, 0]
            torch.testing.assert_close(got[b, t], want, rtol=1e-5, atol=1e-6)


def test_expert_bias_moves_toward_balance():
    """Aux-loss-free balancing: after a step, bias += rate · sign(mean load − load)."""
    cfg = _tiny(
        num_experts=4,
        router_topk=1,
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        router_bias_update_rate=0.01,
    )
    model = build_model(cfg).train()
    moe = model.layers["0"].mlp
    assert not moe.router.expert_bias.requires_grad and moe.router.expert_bias.abs().sum() == 0
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    load = moe.load.clone()
    expert_load_step(model, Mesh.single())
    want = 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(moe.router.expert_bias.detach(), want)
    assert moe.load is None  # read once per step


def test_recompute_does_not_count_the_load_twice():
    from mlm.parallel.recompute import apply_recompute

    cfg = _tiny(num_experts=4, router_topk=2, aux_loss_coeff=0.1, layers=2)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    seen = []
    for mode in ("none", "full"):
        model = build_model(cfg).train()
        apply_recompute(model, mode)
        model(tokens).float().square().mean().backward()
        seen.append((model.layers["1"].mlp.load.clone(), model.aux_losses.pop()))
    torch.testing.assert_close(seen[0][0], seen[1][0])
    assert seen[0][1] == pytest.approx(seen[1][1])


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"router_topk": 9}, r"router_topk=9 exceeds model.moe.num_experts=8"),
        (
            {"router_num_groups": 4, "router_group_topk": 5},
            r"router_group_topk=5 exceeds model.moe.router_num_groups=4",
        ),
        (
            {"router_num_groups": 3, "router_group_topk": 1},
            r"router_num_groups=3 does not divide model.moe.num_experts=8",
        ),
        ({"router_num_groups": 4}, r"set both .* or neither"),
        ({"pad_to_capacity": True}, r"pad_to_capacity=true needs model.moe.capacity_factor"),
        (
            {"router_enable_expert_bias": True},
            r"router_enable_expert_bias=true needs router_score_function=sigmoid",
        ),
        ({"router_pre_softmax": True, "router_score_function": "sigmoid"}, r"router_pre_softmax=true needs"),
    ],
)
def test_impossible_router_settings_are_refused(kw, message):
    with pytest.raises(MlmError, match=message):
        _moe(**kw)


def test_moe_layers_need_experts_and_ep_must_divide_them():
    with pytest.raises(MlmError, match="model.mlp_kind=moe needs experts"):
        ModelConfig(mlp_kind="moe")
    cfg = ModelConfig(num_layers=1, mlp_kind="moe", moe=MoEConfig(num_experts=6, router_topk=2))
    with torch.device("meta"):
        from mlm.model import GPT

        model = GPT(cfg)
    mesh = Mesh(world_size=4, rank=0, dp=4, ep=4)
    with pytest.raises(MlmError, match=r"num_experts=6 is not divisible by parallel.ep=4.*divides 6"):
        apply_expert_parallel(model, mesh, False, "alltoall")
    with pytest.raises(MlmError, match=r"ep=2 with tp=2: .* set parallel.sequence_parallel=true"):
        apply_expert_parallel(model, Mesh(world_size=2, rank=0, tp=2, ep=2), False, "alltoall")
