"""Resharding throughput next to a plain copy of the same checkpoint directory, in the same run.

    .venv/bin/python bench/convert.py [--gb 2.0] [--dir /tmp]

Writes a synthetic fp32 checkpoint of about --gb GB shaped like a Llama (layers of q/k/v/out and
gate/up/down matrices, the embedding and output, Adam moments for each: model + optim groups),
then times, alternately: `shutil.copytree` of the checkpoint directory (the I/O-bound baseline)
and `mlm.convert.reshard` to tp=2 without the logit check (read every tensor, re-chunk, write).
Prints GB/s of
each and their ratio (target: reshard ≥ 0.5 × copy). The page cache is warm for both (the
checkpoint was just written); each output is deleted before the next run.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlm.checkpoint.manager import save_streaming  # noqa: E402
from mlm.config import Config, ModelConfig  # noqa: E402
from mlm.convert.reshard import reshard, target_chunk  # noqa: E402


def synthetic(root: Path, gb: float) -> tuple[Path, int]:
    hidden, ffn, vocab = 2048, 5632, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn
    layers = max(1, int(gb * 1e9 / 4 / 3 / per_layer))  # weights + 2 moments, fp32
    model = ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=16,
        num_query_groups=16,
        vocab_size=vocab,
        normalization="rmsnorm",
        activation="swiglu",
        position_embedding="rope",
        add_bias=False,
        tie_embeddings=False,
    )
    cfg = dataclasses.replace(Config(), model=model)
    V = model.padded_vocab_size()
    shapes = {"embed.weight": (V, hidden), "output.weight": (V, hidden), "final_norm.weight": (hidden,)}
    for i in range(layers):
        for n, s in {
            "attn.q.weight": (hidden, hidden),
            "attn.k.weight": (hidden, hidden),
            "attn.v.weight": (hidden, hidden),
            "attn.out.weight": (hidden, hidden),
            "mlp.gate.weight": (ffn, hidden),
            "mlp.up.weight": (ffn, hidden),
            "mlp.down.weight": (hidden, ffn),
            "attn_norm.weight": (hidden,),
            "mlp_norm.weight": (hidden,),
        }.items():
            shapes[f"layers.{i}.{n}"] = s

    def tensors():
        gen = torch.Generator().manual_seed(0)
        for name, shape in shapes.items():
            for group, key in (
                ("model", name),
                ("optim", f"exp_avg.{name}"),
                ("optim", f"exp_avg_sq.{name}"),
            ):
                yield group, key, torch.randn(shape, generator=gen), target_chunk(name, shape, 1, False)

    extra = {"config": cfg.to_dict(), "mesh": {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "world_size": 1}}
    it = save_streaming(root, 1, tensors(), extra, ["model", "optim"])
    nbytes = sum(f.stat().st_size for f in it.rglob("*") if f.is_file())
    return root, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        src, nbytes = synthetic(Path(tmp) / "ckpt", args.gb)
        print(f"checkpoint: {nbytes / 1e9:.2f} GB in {sum(1 for _ in src.rglob('zarr.json'))} arrays")
        times: dict[str, list[float]] = {"copy": [], "reshard": []}
        for _ in range(args.rounds):
            for name in times:
                out = Path(tmp) / f"out-{name}"
                t0 = time.perf_counter()
                if name == "copy":
                    shutil.copytree(src, out)
                else:
                    reshard(src, out, tp=2, pp=1, verify=False)  # the I/O path; verification is extra
                times[name].append(time.perf_counter() - t0)
                shutil.rmtree(out)
        best = {k: min(v) for k, v in times.items()}
        for k, t in best.items():
            print(f"{k:<8} best of {args.rounds}: {t:6.2f} s = {nbytes / t / 1e9:.2f} GB/s")
        print(f"ratio reshard / copy throughput: {best['copy'] / best['reshard']:.2f} (target >= 0.5)")


if __name__ == "__main__":
    main()
