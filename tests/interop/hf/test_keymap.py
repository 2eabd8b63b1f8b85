"""The key-template mechanism of `mlm.convert.keymap` on a synthetic mixture-of-experts table: HF
tensors per expert stack into one mlm tensor and come back bit for bit; a missing or extra
expert is refused with the key named. (No MoE model exists yet: this tests the mechanism alone.)
"""

from __future__ import annotations

import pytest
import torch

from mlm.convert.keymap import KeyMap, Rule, copied, moved, stacked, transposed
from mlm.errors import MlmError

L, E, F, D = 2, 4, 6, 8
TABLE = {
    "model.embed_tokens.weight": "embed.weight",
    "model.layers.{layer}.mlp.gate.weight": "layers.{layer}.mlp.router.weight",
    "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight": stacked(
        "layers.{layer}.mlp.experts.gate.weight"
    ),
    "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight": stacked(
        "layers.{layer}.mlp.experts.down.weight", dim=1
    ),
    # fused per expert and stored [in, out]: transposed, split into w1 and w3, then stacked
    "model.layers.{layer}.mlp.experts.{expert}.w13.weight": Rule(
        ("layers.{layer}.mlp.experts.w1.weight", "layers.{layer}.mlp.experts.w3.weight"),
        transpose=True,
        stack="expert",
    ),
    "model.layers.{layer}.mlp.experts.{expert}.c_fc.weight": transposed(
        "layers.{layer}.mlp.fc{expert}.weight"
    ),
    "model.layers.{layer}.rotary.inv_freq": None,
}
SHAPES = {  # mlm key → shape (the sizes of the w13 split)
    **{f"layers.{i}.mlp.experts.w1.weight": torch.Size([E, F, D]) for i in range(L)},
    **{f"layers.{i}.mlp.experts.w3.weight": torch.Size([E, 2 * F, D]) for i in range(L)},
}


def hf_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(10, D, generator=g)}
    for i in range(L):
        state[f"model.layers.{i}.mlp.gate.weight"] = torch.randn(E, D, generator=g)
        state[f"model.layers.{i}.rotary.inv_freq"] = torch.randn(4, generator=g)
        for e in range(E):
            expert = f"model.layers.{i}.mlp.experts.{e}"
            state[f"{expert}.gate_proj.weight"] = torch.randn(F, D, generator=g).to(torch.bfloat16)
            state[f"{expert}.down_proj.weight"] = torch.randn(D, F, generator=g)
            state[f"{expert}.w13.weight"] = torch.randn(D, 3 * F, generator=g)
            state[f"{expert}.c_fc.weight"] = torch.randn(D, F, generator=g)
    return state


def to_mlm(km: KeyMap, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    units, stored = km.plan(hf)
    return dict(p for u in units for p in km.to_mlm(u, [hf[stored[k]] for k in u.hf], SHAPES))


def to_hf(km: KeyMap, mlm: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(p for u in km.units() for p in km.to_hf(u, [mlm[k] for k in u.mlm]))


def test_experts_stack_and_come_back_bitwise():
    km = KeyMap(TABLE, {"layer": L, "expert": E}, "synthetic")
    hf = hf_state()
    mlm = to_mlm(km, hf)
    experts = [f"model.layers.1.mlp.experts.{e}" for e in range(E)]
    gate = mlm["layers.1.mlp.experts.gate.weight"]
    assert gate.shape == (E, F, D) and gate.dtype == torch.bfloat16
    assert torch.equal(gate, torch.stack([hf[f"{x}.gate_proj.weight"] for x in experts]))
    down = mlm["layers.1.mlp.experts.down.weight"]  # stacked along dim 1
    assert down.shape == (D, E, F) and torch.equal(down[:, 2], hf[f"{experts[2]}.down_proj.weight"])
    w13 = [hf[f"{x}.w13.weight"].t() for x in experts]
    assert torch.equal(mlm["layers.1.mlp.experts.w1.weight"], torch.stack([w[:F] for w in w13]))
    assert torch.equal(mlm["layers.1.mlp.experts.w3.weight"], torch.stack([w[F:] for w in w13]))
    assert torch.equal(mlm["layers.0.mlp.fc3.weight"], hf["model.layers.0.mlp.experts.3.c_fc.weight"].t())
    assert not any("rotary" in k for k in mlm)  # dropped
    back = to_hf(km, mlm)
    assert back.keys() == {k for k in hf if "rotary" not in k}
    for k, t in back.items():
        assert t.dtype == hf[k].dtype and t.shape == hf[k].shape and torch.equal(t, hf[k]), k
    assert list(back)[:3] == ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight"] + [
        "model.layers.1.mlp.gate.weight"
    ]  # table order, then ascending indices


def test_a_missing_expert_is_named():
    km = KeyMap(TABLE, {"layer": L, "expert": E}, "Hugging Face synthetic")
    hf = hf_state()
    del hf["model.layers.1.mlp.experts.2.gate_proj.weight"]
    with pytest.raises(MlmError) as e:
        km.plan(hf)
    assert str(e.value) == (
        "Hugging Face synthetic state lacks model.layers.1.mlp.experts.2.gate_proj.weight "
        "(expert 2 of moe.num_experts=4, stacked into layers.1.mlp.experts.gate.weight)"
    )


def test_an_expert_beyond_the_count_and_an_unknown_key():
    km = KeyMap(TABLE, {"layer": L, "expert": E - 1}, "Hugging Face synthetic")
    with pytest.raises(MlmError, match=r"experts\.3\.gate_proj\.weight \(expert 3, but moe\.num_experts=3\)"):
        km.plan(hf_state())
    km = KeyMap(TABLE, {"layer": L, "expert": E}, "Hugging Face synthetic")
    with pytest.raises(MlmError, match=r"does not know: model\.layers\.0\.mlp\.experts\.0\.foo; known"):
        km.plan({**hf_state(), "model.layers.0.mlp.experts.0.foo": torch.zeros(1)})


def test_prefix_left_out_and_locate():
    km = KeyMap(
        {"transformer.h.{layer}.ln.weight": "layers.{layer}.norm.weight"}, {"layer": 3}, "x", "transformer."
    )
    assert km.locate("h.2.ln.weight") == (
        "transformer.h.{layer}.ln.weight",
        {"layer": 2},
        "transformer.h.2.ln.weight",
    )
    assert km.locate("h.x.ln.weight") is None
    units, stored = km.plan(["h.0.ln.weight"])
    assert units[0].mlm == ("layers.0.norm.weight",) and stored == {
        "transformer.h.0.ln.weight": "h.0.ln.weight"
    }


def test_depth_offset_moved_layers_and_copies():
    """DeepSeek-V3's MTP depth d is stored as layer num_layers + d: `{depth}` with an offset, a
    decoder layer's templates `moved` under it, and `copied` tensors (the embedding again)."""
    layer = {"model.layers.{layer}.norm.weight": "layers.{layer}.norm.weight"}
    table = {
        "model.embed_tokens.weight": "embed.weight",
        **layer,
        **moved(
            layer,
            ("model.layers.{layer}.", "model.layers.{depth}."),
            ("layers.{layer}.", "mtp.{depth}.layer."),
        ),
        "model.layers.{depth}.embed_tokens.weight": copied("embed.weight"),
    }
    km = KeyMap(table, {"layer": 3, "depth": 2}, "Hugging Face synthetic", offsets={"depth": 3})
    # the same key names a layer or a depth: the one within its count wins
    assert km.locate("model.layers.2.norm.weight")[:2] == ("model.layers.{layer}.norm.weight", {"layer": 2})
    assert km.locate("model.layers.4.norm.weight")[:2] == ("model.layers.{depth}.norm.weight", {"depth": 1})
    units = {u.hf[0]: u for u in km.units()}
    assert units["model.layers.3.norm.weight"].mlm == ("mtp.0.layer.norm.weight",)
    copy = units["model.layers.4.embed_tokens.weight"]
    assert copy.mlm == ("embed.weight",) and copy.rule.copy and not copy.rule.identity
    with pytest.raises(
        MlmError,
        match=r"model\.layers\.5\.norm\.weight \(layer 5, but num_layers=3; or depth 2, but mtp_num_layers=2\)",
    ):
        km.plan(["model.layers.5.norm.weight"])
