"""bench/fsdp_comm.py's formula for FSDP's bytes per step, against a count by hand.

The bench asserts that formula against the bytes its ranks all-gather and reduce-scatter; this
pins the formula itself on shapes small enough to count: padding to ceil(n0 / S) rows per rank,
the units (layers, embedding, [final_norm, output], root), which of them are gathered again for
backward, the fp32 reduce-scatter and HSDP's all-reduce of one shard.
"""

from __future__ import annotations

import sys

from tests.helpers.common import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from fsdp_comm import formula  # noqa: E402

SHAPES = {
    "embed.weight": (5, 2),  # 5 rows over S=2: 3 per rank, 6 gathered → 12 elements
    "layers.0.attn.qkv.weight": (3, 4),  # 4 rows gathered → 16
    "layers.0.norm.weight": (4,),  # 4
    "layers.1.attn.qkv.weight": (3, 4),  # 16
    "layers.1.norm.weight": (4,),  # 4
    "final_norm.weight": (2,),  # 2
    "output.weight": (5, 2),  # 12
}
# units: embed 12, layers.0 20, layers.1 20, final_norm+output 14: 66 elements


def test_the_formula_counts_padded_units_per_pass():
    # reshard after forward: embed and the layers twice per micro-batch, [final_norm, output] once
    f = formula(SHAPES, False, 2, 1, 3, 2, True)
    assert f["units"] == {"embed": 12, "layers.0": 20, "layers.1": 20, "final_norm+output": 14}
    assert f["all_gather"] == 3 * (2 * (12 + 20 + 20) + 14) * 2
    assert f["reduce_scatter"] == 66 * 4
    assert f["all_reduce"] == 0
    # kept gathered after forward: every unit once per micro-batch
    assert formula(SHAPES, False, 2, 1, 3, 2, False)["all_gather"] == 3 * 66 * 2
    # HSDP, 2 replicas of S=2: each replica all-reduces its fp32 shard of the gradients
    assert formula(SHAPES, False, 2, 2, 1, 4, True)["all_reduce"] == 66 // 2 * 4


def test_tied_embeddings_leave_embedding_norm_and_output_in_the_root():
    f = formula(SHAPES, True, 2, 1, 1, 2, True)
    assert f["units"] == {"root": 12 + 14, "layers.0": 20, "layers.1": 20}
    assert f["all_gather"] == (2 * 40 + 26) * 2
