"""The module contract: what a module of the model may declare, and which part of mlm reads it.

Parallel features, fp8, recompute and the model read these declarations through `declaring`,
never through `isinstance` checks or parameter-name patterns, so a new kind takes part in all of
them by declaring, with no edit to the reader. Class attributes unless said otherwise:

    tp_plan              dict[str, str]   `mlm.parallel.parallelize`: attribute → tensor-parallel
                                          style (the styles: `mlm.model.layers`)
    selective_recompute  bool             `mlm.parallel.recompute`: selective recompute re-runs
                                          this module in backward (the attention core)
    cp_attention         str              `mlm.parallel.context`: the attribute context
                                          parallelism sets to attention over the cp ranks' tokens
                                          (None meanwhile: attention over the local tokens)
    ep_plan              dict[str, str]   `mlm.parallel.expert`, `mlm.convert.reshard`: a submodule
                                          path → "experts" (its `weight`, experts stacked
                                          [E, ...], splits over ep along dim 0), an attribute →
                                          "dispatcher" (set to the token exchange over the ep
                                          group); such a module counts each expert's tokens
                                          (`take_load()`) and updates its own routing state from
                                          the step's load (`update_routing(load)`)
    residual_projections tuple[str, ...]  `mlm.model.init`: its linears (submodule paths) that project
                                          into the residual stream: their weights are drawn with
                                          init_std / √(2 · layers) (Megatron's scaled init)
    fp8_exempt           tuple[str, ...]  `mlm.parallel.fp8`: its linear children that stay in the
                                          compute dtype (every other linear of the layers runs in
                                          fp8 under train.fp8)
    aux_losses           instance, None   the model fills it with its `AuxLosses`, through which
                                          the module attaches auxiliary losses to its output
    inactive_parameters  method           `mlm.model.stats`: parameters one token's forward skips
    init_values          method           `mlm.model.init`: `init_values(local, global_shape, seed,
                                          name)` → the whole tensor of one of its own parameters
                                          drawn its own way (from a generator seeded by seed and
                                          name), or None for Megatron's normal rule; each rank
                                          copies its slice
    ops                  constructor arg  the model's `Ops` (`mlm.model.ops`): the one switch of
                                          norms, activations, RoPE and the attention backend

A mixer's or MLP's module is built as `module(cfg, layer, ops)`, a norm's as `module(cfg, size, ops)`.
What a kind costs, what it needs checked and what serving keeps for it are its spec's
(`mlm.model.kinds.spec`), not its module's.
"""

from __future__ import annotations

from torch import nn


def declaring(model: nn.Module, attribute: str) -> list[tuple[str, nn.Module, object]]:
    """(name, module, value) of every module of `model` (itself excepted) that declares
    `attribute`, in module order."""
    return [
        (name, m, getattr(m, attribute))
        for name, m in model.named_modules()
        if m is not model and hasattr(m, attribute)
    ]


def submodule(module: nn.Module, path: str) -> nn.Module | None:
    """The submodule at dotted `path` of `module`, or None where an attribute on the way is None
    (a part this configuration does not build)."""
    for attr in path.split("."):
        module = getattr(module, attr, None)
        if module is None:
            return None
    return module
