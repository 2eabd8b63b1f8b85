"""One Mamba-2 layer's forward + backward tokens/s: mlm's against transformers' on the same weights.

    .venv/bin/python bench/hybrid_layer.py [--hidden 256] [--heads 8] [--head-dim 64] [--state 64]
                                           [--groups 2] [--chunk 128] [--batch 2] [--seq 1024]
                                           [--rounds 5] [--dtype fp32]

Builds transformers' `Mamba2Mixer` (its torch path: `mamba2_chunk_scan`, `causal_conv1d_fn`,
the gated RMSNorm; mamba_ssm is not installed on CPU) and mlm's `mamba` mixer, copies the HF
weights into mlm's (in_proj split into z, x, B, C, dt, conv1d into x, B, C), checks that both
give the same output (max |diff| printed; the bench exits 1 above 1e-4 of the largest value in
fp32), then times, alternating, `rounds` forward + backward passes of each on the same input
(the loss: the output's sum) after one warm-up, and prints the median tokens/s of each and
mlm's over transformers'. Both run eagerly on the CPU threads torch is given (`torch.get_num_threads()`).
mlm's torch scan saves only its inputs and recomputes itself in the backward; transformers'
keeps autograd's intermediates: the peak of saved bytes is printed too (saved_tensors_hooks,
distinct storages).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `kernels` the package, not bench/kernels.py

from mlm.config import MambaConfig, ModelConfig  # noqa: E402
from mlm.model.kinds.mamba.module import Mamba  # noqa: E402


def build(args):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    hf_cfg = transformers.Mamba2Config(
        hidden_size=args.hidden,
        num_heads=args.heads,
        head_dim=args.head_dim,
        expand=args.heads * args.head_dim // args.hidden,
        state_size=args.state,
        n_groups=args.groups,
        chunk_size=args.chunk,
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    hf = Mamba2Mixer(hf_cfg, layer_idx=0).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
        hf.norm.weight.add_(1.0)
        hf.A_log.uniform_(0.0, 1.5)
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=args.hidden,
        layer_pattern="M",
        norm_eps=hf_cfg.layer_norm_epsilon,
        mamba=MambaConfig(
            num_heads=args.heads,
            head_dim=args.head_dim,
            state_dim=args.state,
            num_groups=args.groups,
            chunk_size=args.chunk,
        ),
    )
    ours = Mamba(cfg).to(dtype)
    d, gn = args.heads * args.head_dim, args.groups * args.state
    with torch.no_grad():
        pieces = hf.in_proj.weight.split([d, d, gn, gn, args.heads])
        for name, w in zip(("z", "x", "B", "C", "dt"), pieces, strict=True):
            getattr(ours, f"in_{name}").weight.copy_(w)
        for name, w, b in zip(
            "xBC", hf.conv1d.weight.split([d, gn, gn]), hf.conv1d.bias.split([d, gn, gn]), strict=True
        ):
            getattr(ours, f"conv_{name}").weight.copy_(w)
            getattr(ours, f"conv_{name}").bias.copy_(b)
        for name in ("A_log", "D", "dt_bias"):
            getattr(ours, name).copy_(getattr(hf, name))
        ours.norm.weight.copy_(hf.norm.weight)
        ours.out.weight.copy_(hf.out_proj.weight)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    return hf, ours, x


def saved_bytes(fn, x) -> int:
    """Distinct storages autograd keeps for fn(x)'s backward."""
    seen: dict[int, int] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x.detach().requires_grad_())
    out.sum().backward()
    return sum(seen.values())


def step_seconds(fn, x) -> float:
    t0 = time.perf_counter()
    fn(x.detach().requires_grad_()).float().sum().backward()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("hidden", 256), ("heads", 8), ("head-dim", 64), ("state", 64), ("groups", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("chunk", 128), ("batch", 2), ("seq", 1024), ("rounds", 5)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()
    hf, ours, x = build(args)
    runs = {"transformers": lambda t: hf(t), "mlm": lambda t: ours(t)}
    with torch.no_grad():
        want, got = runs["transformers"](x).float(), runs["mlm"](x).float()
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    print(f"outputs: max |diff| {diff:.2e} (max |value| {scale:.3g})")
    if args.dtype == "fp32" and diff > 1e-4 * scale:
        print("error: the two layers disagree; the timing would compare different computations")
        return 1
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        step_seconds(fn, x)  # warm-up
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(step_seconds(fn, x))
    tokens = args.batch * args.seq
    rate = {name: tokens / statistics.median(ts) for name, ts in times.items()}
    saved = {name: saved_bytes(fn, x) for name, fn in runs.items()}
    print(
        f"Mamba-2 layer, hidden {args.hidden}, {args.heads} heads × {args.head_dim}, state {args.state}, "
        f"{args.groups} groups, chunk {args.chunk}, batch {args.batch} × {args.seq} tokens, {args.dtype}, "
        f"{torch.get_num_threads()} threads; forward + backward, median of {args.rounds}"
    )
    for name in runs:
        print(
            f"  {name:>12}: {rate[name]:10,.0f} tokens/s   saved for backward {saved[name] / 2**20:8.1f} MiB"
        )
    print(
        f"  mlm / transformers: {rate['mlm'] / rate['transformers']:.2f}× tokens/s, "
        f"{saved['mlm'] / saved['transformers']:.2f}× saved bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
