"""How close two layouts must be, per `train.precision`, and the measurements behind each bound.

Not bitwise: another layout sums the same numbers in another order (tp partial sums, the dp
all-reduce, the sharded optimizer), so fp32 agrees to rounding, and bf16/fp16 to their own.
docs/parity.md has the same table and the reasoning at length.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    loss_rel: float
    """Largest |loss − loss_ref| / loss_ref at any step."""
    eval_rel: float
    """|eval − eval_ref| / eval_ref of the validation loss after the last step."""
    weight_rel: float
    """Largest ‖w − w_ref‖ / ‖w_ref‖ over the final weight tensors."""
    grad_rel: float
    """Largest |‖g‖ − ‖g_ref‖| / ‖g_ref‖ of the gradient norm (before clipping) at any step."""
    why: str


LR_REL = 1e-12
"""Largest |lr − lr_ref| / lr_ref at any step, for every precision: the learning rate is the
schedule's formula of the step alone, so it differs by the rounding of that formula at most
(mlm counts it in steps, megatron-core in samples)."""


# Measured on CPU (gloo), optimizer.adam_eps=1e-8 (the default), no dropout, 20 steps, the
# largest over tp2, tp2sp, dp2, dp2zero1 and tp2dp2zero1 against tp1 (docs/parity.md has the table):
#                 |Δloss|/loss          ‖Δw‖/‖w‖
#        small¹     tiny²         small¹    tiny²
#   fp32  2.8e-7     1.4e-7        2.0e-4    1.8e-5
#   bf16  2.7e-3     5.4e-5        1.7e-1    4.0e-2
#   fp16  1.2e-3     5.5e-6 (tp2)  5.8e-2    1.0e-2 (tp2)
# ¹ 2 layers, hidden 64, seq 32, batch 8, lr 1e-2 after 2 warm-up steps; ² pipelines/tiny/train.toml.
# Losses: fp32 agrees to a few ulps (1e-5 leaves 35× room). bf16 and fp16 round every matmul output
# (unit roundoff 2^-8 ≈ 3.9e-3 and 2^-11 ≈ 4.9e-4); tensor parallelism rounds partial sums before
# adding them, and a one-ulp change in a weight flips later roundings, so the gap is of the order of
# the unit roundoff: 1e-2 (2.5 u) for bf16, 5e-3 (10 u) for fp16. Weights: Adam's update
# m / (√v + eps) is ±lr for any gradient far above eps, so elements whose true gradient is ~0 step
# by lr in whichever direction their rounding error points; the weights drift apart far more than
# the losses, and more with every step (tests/distributed/test_parallel_training.py measures this too): 1e-3 in
# fp32 is 5× the largest measured. In bf16/fp16 the bound (0.3, 0.15) catches only gross errors,
# such as a shard in the wrong place (≈ √2); a matrix left untrained would differ by 0.27-0.9 here
# and a norm weight by 0.007-0.04, so check correctness in fp32 and read bf16/fp16 by their losses.
# Eval loss: one forward pass over the same `eval_iters` global batches at the final weights, so no
# optimizer step amplifies anything after it: fp32 1e-6 (after 5 steps on tiny², pp2 agrees with
# tp1 bitwise, tp2 and tp2pp2dp2 to 1.2e-7); bf16/fp16 get
# the training loss's bound, as they round the same matmuls.
# Gradient norms (before clipping), the largest over the steps: small¹ 20 steps fp32 4.1e-5 (tp2,
# tp2dp2zero1; dp2 2.8e-6), bf16 9.0e-2 (tp2; dp2zero1 5.2e-3); tiny² 5 steps bf16 2.0e-4, fp16
# 1.6e-5 (tp2, dp2). The norm sums the squares of every gradient element, the ones Adam's eps
# amplifies (below) included, so it drifts faster than the loss: 1e-3 in fp32 (24× the largest), and
# in bf16/fp16 the weights' bounds, which catch only gross errors (a gradient left unreduced over
# tp or dp changes the norm by about √2).
TOLERANCES = {
    "fp32": Tolerance(
        1e-5, 1e-6, 1e-3, 1e-3, "fp32 rounding, summed in another order; Adam amplifies it in the weights"
    ),
    "bf16": Tolerance(
        1e-2, 1e-2, 0.3, 0.3, "bf16 unit roundoff 2^-8 ≈ 3.9e-3 per matmul; weights only catch gross errors"
    ),
    "fp16": Tolerance(
        5e-3,
        5e-3,
        0.15,
        5e-2,
        "fp16 unit roundoff 2^-11 ≈ 4.9e-4 per matmul; weights only catch gross errors",
    ),
}
