"""Benchmark mlm's MoE layer against transformers' MixtralSparseMoeBlock on the same weights, and
measure the expert-parallel dispatchers' bytes against their formulas.

    .venv/bin/python bench/moe.py [--tokens 4096] [--hidden 256] [--ffn 512] [--experts 8] [--topk 2]
                                  [--steps 10] [--warmup 2] [--impl auto] [--ep 2]

Part 1, one process: mlm's MoE (`mlm.model.kinds.moe`, router + grouped experts, dropless) and HF's
sparse MoE block (transformers' default experts implementation) get identical weights (router,
w1/w3/w2 per expert); forward + backward of the same [1, tokens, hidden] input with a fixed
random output gradient, alternating the two step by step; tokens/s from the median step time,
and the ratio mlm / HF (target >= 1.0). Outputs are checked equal first (1e-5).

Part 2, `--ep` gloo ranks on this machine: one forward + backward of the MoE layer under each
dispatcher, with every collective's payload counted on the way out of each rank (rows sent to
other ranks, for all_to_all_single; (ep - 1) / ep of the gathered or reduce-scattered buffer,
as a ring moves it, for all-gather and reduce-scatter). The formulas, per rank per step
(forward + backward, D hidden, N tokens per rank, b bytes per element, hidden states only):

    alltoall   2 · (C_out + C_in) · b · D: C_out the token copies this rank routes to other
               ranks' experts, C_in those others route to its experts; out and back, forward
               and backward (4 · N · k · (ep − 1) / ep · b · D with balanced routing)
    allgather  4 · (ep − 1) · N · b · D, plus the gathered routing weights [N, E] fp32 and
               their gradient, 2 · (ep − 1) · N · 4 · E, and the routing mask, (ep − 1) · N · E
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlm.config import ModelConfig, MoEConfig  # noqa: E402
from mlm.model import build_model  # noqa: E402


def moe_config(args, dispatcher: str = "alltoall") -> ModelConfig:
    moe = MoEConfig(
        num_experts=args.experts,
        router_topk=args.topk,
        ffn_hidden_size=args.ffn,
        experts_impl=args.impl,
        token_dispatcher=dispatcher,
    )
    return ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=4, mlp_kind="moe", moe=moe)


def hf_block(moe, args):
    """transformers' MixtralSparseMoeBlock holding `moe`'s weights."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_local_experts=args.experts,
        num_experts_per_tok=args.topk,
    )
    block = MixtralSparseMoeBlock(cfg)
    state = block.state_dict()
    w = moe.experts
    mine = {"gate.weight": moe.router.weight}
    if "experts.gate_up_proj" in state:  # transformers v5: experts fused in memory
        mine["experts.gate_up_proj"] = torch.cat([w.gate.weight, w.up.weight], 1)
        mine["experts.down_proj"] = w.down.weight
    else:  # v4: one module per expert
        for e in range(args.experts):
            mine[f"experts.{e}.w1.weight"] = w.gate.weight[e]
            mine[f"experts.{e}.w3.weight"] = w.up.weight[e]
            mine[f"experts.{e}.w2.weight"] = w.down.weight[e]
    block.load_state_dict({k: v.detach().clone() for k, v in mine.items()})
    return block.train()


def throughput(args) -> None:
    torch.manual_seed(0)
    moe = build_model(moe_config(args)).layers["0"].mlp.train()
    hf = hf_block(moe, args)
    x = torch.randn(1, args.tokens, args.hidden)
    grad = torch.randn(1, args.tokens, args.hidden)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), hf(x), rtol=1e-5, atol=1e-5)
    times: dict[str, list[float]] = {"mlm": [], "hf": []}
    for step in range(args.warmup + args.steps):
        order = [("mlm", moe), ("hf", hf)][:: 1 if step % 2 == 0 else -1]
        for name, module in order:
            xi = x.clone().requires_grad_()
            t0 = time.perf_counter()
            module(xi).backward(grad)
            dt = time.perf_counter() - t0
            module.zero_grad(set_to_none=True)
            if step >= args.warmup:
                times[name].append(dt)
    rate = {k: args.tokens / statistics.median(v) for k, v in times.items()}
    impl = args.impl
    print(
        f"MoE layer fwd+bwd, {args.tokens} tokens, D {args.hidden}, F {args.ffn}, E {args.experts}, "
        f"top-{args.topk}, mlm experts {impl}, fp32, {torch.get_num_threads()} threads"
    )
    print(f"mlm MoE:               {rate['mlm']:>10,.0f} tokens/s")
    print(f"HF MixtralSparseMoeBlock {rate['hf']:>8,.0f} tokens/s")
    print(f"ratio mlm / HF: {rate['mlm'] / rate['hf']:.2f}  (target >= 1.0)")


# ------------------------------------------------------------------ dispatcher bytes

SENT: list[int] = []


def _count_collectives(rank: int, ep: int) -> None:
    import torch.distributed as dist

    from mlm.parallel import data_parallel

    a2a = dist.all_to_all_single

    def all_to_all_single(out, inp, out_splits=None, in_splits=None, group=None, **kw):
        row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        if in_splits is not None:  # rows for the other ranks
            SENT.append(row * (sum(in_splits) - in_splits[dist.get_rank(group)]))
        return a2a(out, inp, out_splits, in_splits, group=group, **kw)

    dist.all_to_all_single = all_to_all_single
    for name in (data_parallel.ALL_GATHER, data_parallel.REDUCE_SCATTER):
        real = getattr(dist, name)

        def ring(out, inp, group=None, _real=real, _gather=name == data_parallel.ALL_GATHER, **kw):
            full = out if _gather else inp
            SENT.append(full.numel() * full.element_size() * (ep - 1) // ep)
            return _real(out, inp, group=group, **kw)

        setattr(dist, name, ring)


def _dispatch_rank(rank: int, world: int, port: int, args, queue) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from mlm.build import build_rank_model
    from mlm.config import ParallelConfig
    from mlm.parallel.mesh import Mesh

    _count_collectives(rank, world)
    out = {}
    for dispatcher in ("alltoall", "allgather"):
        cfg = moe_config(args, dispatcher)
        parallel = ParallelConfig(ep=world)
        mesh = Mesh.build(parallel)
        model = build_rank_model(cfg, parallel, mesh, torch.device("cpu"), seed=1234)
        moe = model.layers["0"].mlp.train()
        x = torch.randn(1, args.tokens // world, args.hidden, generator=torch.Generator().manual_seed(rank))
        x.requires_grad_()
        SENT.clear()
        moe(x).backward(torch.ones_like(x))
        measured = sum(SENT)
        b, D, N, E = 4, args.hidden, x.shape[1], args.experts
        if dispatcher == "alltoall":
            loads = [torch.empty_like(moe.load) for _ in range(world)]
            dist.all_gather(loads, moe.load)  # copies per expert that each rank routed
            per_rank = torch.stack(loads).view(world, world, -1).sum(-1)  # [source, destination]
            away = int(per_rank[rank].sum() - per_rank[rank, rank])  # my copies to others
            into = int(per_rank[:, rank].sum() - per_rank[rank, rank])  # others' copies to me
            formula = 2 * (away + into) * b * D  # out and back, forward and backward
            expected = 4 * N * args.topk * (world - 1) / world * b * D
        else:
            formula = 4 * (world - 1) * N * b * D + 2 * (world - 1) * N * 4 * E + (world - 1) * N * E
            expected = formula
        out[dispatcher] = (measured, formula, expected)
    queue.put((rank, out))
    dist.destroy_process_group()


def dispatcher_bytes(args) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_dispatch_rank, args=(r, args.ep, port, args, queue)) for r in range(args.ep)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    print(
        f"\ndispatcher bytes per rank, one MoE layer forward + backward, ep {args.ep}, "
        f"{args.tokens // args.ep} tokens per rank, fp32:"
    )
    for dispatcher in ("alltoall", "allgather"):
        for rank in range(args.ep):
            measured, formula, expected = results[rank][dispatcher]
            print(
                f"  {dispatcher:<9} rank {rank}: measured {measured / 2**20:8.3f} MiB, formula "
                f"{formula / 2**20:8.3f} MiB (ratio {measured / formula:.3f}); balanced-routing "
                f"estimate {expected / 2**20:8.3f} MiB"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--impl", default="auto", choices=["auto", "grouped_mm", "bmm", "loop"])
    p.add_argument("--ep", type=int, default=2, help="ranks for the dispatcher measurement (0: skip)")
    args = p.parse_args()
    throughput(args)
    if args.ep > 1:
        dispatcher_bytes(args)


if __name__ == "__main__":
    main()
