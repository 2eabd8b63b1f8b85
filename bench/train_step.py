"""Benchmark one training step of mlm's GPT against transformers' LlamaForCausalLM, same weights.

    .venv/bin/python bench/train_step.py [--preset tiny-llama] [--batch 8] [--seq 256] [--steps 10]
                                         [--warmup 2] [--dtype fp32|bf16]

In one process: builds the preset as mlm's GPT (`load_config` + `build_model`), exports it with
`mlm.hf.mlm_to_hf` and loads the same weights into `LlamaForCausalLM` (attn_implementation="sdpa").
Then times full training steps (forward, the same cross-entropy, backward, AdamW step, zero_grad;
mlm with its trainer's optimizer, HF with torch.optim.AdamW as a transformers loop uses it)
on the same batch of random tokens, alternating the two models step by step (and which goes first)
so that both see the same machine state; warm-up steps are not timed; torch's default thread count.
HF is called with use_cache=False, as a training loop does. bf16 means torch.autocast on the CPU
(weights and optimizer stay fp32) for both. Prints tokens/s of each (from the median step time)
and the ratio mlm / HF (target >= 1.0). The defaults run in well under 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlm.config import OptimizerConfig, load_config  # noqa: E402
from mlm.errors import MlmError  # noqa: E402
from mlm.hf import mlm_to_hf  # noqa: E402
from mlm.model import build_model  # noqa: E402
from mlm.train.adamw import make_optimizer  # noqa: E402


def build_pair(preset: str, seq: int, seed: int = 1234):
    """(mlm GPT, HF LlamaForCausalLM, ModelConfig) with identical weights, both in train mode."""
    import transformers

    cfg = load_config(overrides=[f"preset={preset}", f"data.seq_length={seq}"]).model
    if cfg.position_embedding != "rope":
        raise MlmError(f"--preset {preset}: this benchmark compares Llama models; pick a llama preset")
    mlm = build_model(cfg, "cpu", seed=seed).train()
    hf_state, hf_config = mlm_to_hf(mlm.state_dict(), cfg, "llama")
    config = transformers.AutoConfig.for_model(**hf_config)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().train()
    missing, unexpected = hf.load_state_dict(hf_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return mlm, hf, cfg


def make_step(model, logits_fn, vocab: int, autocast, opt):

    def step(x_BT: torch.Tensor, y_BT: torch.Tensor) -> float:
        with autocast():
            logits_BTV = logits_fn(x_BT)
            if logits_BTV.shape[-1] != vocab:  # mlm's padded vocabulary
                logits_BTV = logits_BTV[..., :vocab]
            loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-llama")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per model")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per model")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()

    torch.manual_seed(0)
    mlm, hf, cfg = build_pair(args.preset, args.seq)
    if args.dtype == "bf16":
        autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    steps = {
        # each with its own trainer's optimizer: mlm's (fused AdamW, Megatron's no-decay groups)
        # and the torch.optim.AdamW a transformers training loop uses
        "mlm": make_step(
            mlm, mlm, cfg.vocab_size, autocast, make_optimizer(mlm, OptimizerConfig(), torch.device("cpu"))
        ),
        "HF": make_step(
            hf,
            lambda x: hf(input_ids=x, use_cache=False).logits,
            cfg.vocab_size,
            autocast,
            torch.optim.AdamW(hf.parameters(), lr=3e-4, weight_decay=0.1),
        ),
    }
    tokens = torch.randint(
        0, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0)
    )
    x_BT, y_BT = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    print(
        f"preset {args.preset}: {sum(p.numel() for p in mlm.parameters()) / 1e6:.2f} M parameters, "
        f"batch {args.batch} x seq {args.seq}, {args.dtype}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    times: dict[str, list[float]] = {name: [] for name in steps}
    first_loss: dict[str, float] = {}
    order = list(steps)
    for i in range(args.warmup + args.steps):
        for name in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            loss = steps[name](x_BT, y_BT)
            dt = time.perf_counter() - t0
            first_loss.setdefault(name, loss)
            if i >= args.warmup:
                times[name].append(dt)
    print(f"first-step loss: mlm {first_loss['mlm']:.6f}, HF {first_loss['HF']:.6f} (same weights and batch)")
    # tokens/s from the median step: this runs on shared 2-core VMs where a neighbour's burst can
    # stall single steps by 3-8x (measured), which would swamp a mean over 10 steps.
    tps = {}
    for name, ts in times.items():
        tps[name] = args.batch * args.seq / statistics.median(ts)
        mean = args.batch * args.seq * len(ts) / sum(ts)
        print(
            f"{name:>4}: {tps[name]:8,.0f} tokens/s  (median of {len(ts)} steps {statistics.median(ts) * 1e3:6.1f} ms, "
            f"min {min(ts) * 1e3:6.1f} ms; mean {mean:,.0f} tokens/s)"
        )
    print(f"ratio mlm / HF: {tps['mlm'] / tps['HF']:.3f}  (target >= 1.0)")


if __name__ == "__main__":
    try:
        main()
    except MlmError as e:
        sys.exit(f"error: {e}")
