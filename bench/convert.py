"""Resharding and Hugging Face import throughput, each next to its I/O baseline, in the same run.

    .venv/bin/python bench/convert.py [--gb 2.0] [--dir /tmp] [--rounds 2]

Resharding: a synthetic fp32 checkpoint of about --gb GB shaped like a Llama (layers of q/k/v/out
and gate/up/down matrices, the embedding and output, Adam moments for each: model + optim
groups); timed, alternately: `shutil.copytree` of the checkpoint directory (the I/O-bound
baseline) and `mlm.convert.reshard` to tp=2 without the logit check (read every tensor and
check its chunk checksums, re-chunk, write with new checksums).

Import: a Llama-shaped `model.safetensors` of about --gb GB (config.json beside it); timed,
alternately: reading every tensor into memory with safetensors' own `load_file` (the baseline) and
`mlm.convert.hf.folder.import_hf` without the logit check (read, map, write the mlm checkpoint).

Prints GB/s of each and the ratios (target: ≥ 0.5 of the baseline). The page cache is warm for
all (the inputs were just written); each output is deleted before the next run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlm.checkpoint.keys import MOMENTS, moment_key  # noqa: E402
from mlm.checkpoint.manager import save_streaming  # noqa: E402
from mlm.config import Config, ModelConfig  # noqa: E402
from mlm.convert.hf.folder import import_hf  # noqa: E402
from mlm.convert.reshard import reshard, target_chunk  # noqa: E402
from mlm.model.gpt import GPT  # noqa: E402

HIDDEN, FFN, VOCAB = 2048, 5632, 32000
PER_LAYER = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN  # q, k, v, out; gate, up, down


def synthetic(root: Path, gb: float) -> tuple[Path, int]:
    layers = max(1, int(gb * 1e9 / 4 / 3 / PER_LAYER))  # weights + 2 moments, fp32
    model = ModelConfig(
        num_layers=layers,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=16,
        num_query_groups=16,
        vocab_size=VOCAB,
        normalization="rmsnorm",
        activation="swiglu",
        position_embedding="rope",
        add_bias=False,
        tie_embeddings=False,
    )
    cfg = dataclasses.replace(Config(), model=model)
    with torch.device("meta"):  # the shapes of every parameter, from the model itself
        shapes = {k: tuple(p.shape) for k, p in GPT(model).named_parameters()}

    def tensors():
        gen = torch.Generator().manual_seed(0)
        for name, shape in shapes.items():
            for group, key in [("model", name)] + [("optim", moment_key(m, name)) for m in MOMENTS]:
                yield group, key, torch.randn(shape, generator=gen), target_chunk(None, shape, 1)

    extra = {"config": cfg.to_dict(), "mesh": {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "world_size": 1}}
    it = save_streaming(root, 1, tensors(), extra, ["model", "optim"])
    nbytes = sum(f.stat().st_size for f in it.rglob("*") if f.is_file())
    return root, nbytes


def hf_folder(root: Path, gb: float) -> int:
    """A Llama-shaped model.safetensors of about `gb` GB (fp32) and its config.json; its bytes."""
    import transformers
    from safetensors.torch import save_file

    layers = max(1, int((gb * 1e9 / 4 - 2 * VOCAB * HIDDEN) / PER_LAYER))
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
    )
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    state = {k: torch.randn(shape, generator=gen) for k, shape in shapes.items()}
    root.mkdir(parents=True)
    save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(root)
    return (root / "model.safetensors").stat().st_size


def best_of(rounds: int, runs: dict, out: Path) -> dict[str, float]:
    """Each run, alternately, `rounds` times, `out` removed (and synced) between runs, outside the
    timing; the best time of each."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            os.sync()  # start each run without the previous one's dirty pages
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
            shutil.rmtree(out)
    return {k: min(v) for k, v in times.items()}


def report(nbytes: int, best: dict[str, float], ours: str, base: str, rounds: int) -> None:
    for k, t in best.items():
        print(f"{k:<14} best of {rounds}: {t:6.2f} s = {nbytes / t / 1e9:.2f} GB/s")
    print(f"ratio {ours} / {base} throughput: {best[base] / best[ours]:.2f} (target >= 0.5)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        src, nbytes = synthetic(tmp / "ckpt", args.gb)
        print(f"checkpoint: {nbytes / 1e9:.2f} GB in {sum(1 for _ in src.rglob('zarr.json'))} arrays")

        def copy() -> None:
            shutil.copytree(src, tmp / "out")

        def resharding() -> None:
            reshard(src, tmp / "out", tp=2, pp=1, verify=False)  # the I/O path; the logit check is extra

        best = best_of(args.rounds, {"copy": copy, "reshard": resharding}, tmp / "out")
        report(nbytes, best, "reshard", "copy", args.rounds)
        shutil.rmtree(src)

        hf_bytes = hf_folder(tmp / "hf", args.gb)
        print(f"safetensors: {hf_bytes / 1e9:.2f} GB")

        def read() -> None:
            from safetensors.torch import load_file

            # load_file maps the file: copying each tensor out reads every byte into memory
            state = {k: t.clone() for k, t in load_file(str(tmp / "hf" / "model.safetensors")).items()}
            assert sum(t.numel() for t in state.values()) * 4 <= hf_bytes
            (tmp / "out").mkdir()  # for best_of's cleanup

        def importing() -> None:
            import_hf(tmp / "hf", tmp / "out", verify=False)

        def copy_hf() -> None:
            shutil.copytree(tmp / "hf", tmp / "out")

        best = best_of(args.rounds, {"read": read, "copy": copy_hf, "import": importing}, tmp / "out")
        report(hf_bytes, best, "import", "read", args.rounds)
        print(f"ratio import / copy throughput: {best['copy'] / best['import']:.2f}")


if __name__ == "__main__":
    main()
