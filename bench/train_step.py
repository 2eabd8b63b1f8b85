"""Benchmark one training step of mlm's GPT against transformers' LlamaForCausalLM, same weights;
on CPU or CUDA, optionally with the layers compiled (train.compile), with MFU.

    .venv/bin/python bench/train_step.py [--preset tiny-llama] [--batch 8] [--seq 256] [--steps 10]
                                         [--warmup 2] [--dtype fp32|bf16] [--device cpu|cuda]
                                         [--compile] [--set key=value ...] [--hf | --no-hf]
                                         [--vs-eager] [--hardware h100-80g]
    # MFU of a ~1B Llama (Llama-3.2-1B's shape) at seq 4096 in bf16 on one GPU:
    .venv/bin/python bench/train_step.py --device cuda --preset llama3-1b --batch 1 --seq 4096 \
        --dtype bf16 --compile --set model.kernels=triton --no-hf

In one process: builds the preset's model the way `mlm train` does on one process
(`mlm.build.build_rank_model`: recompute as `model.recompute` says, initialised
weights), sets the attention backend and `model.kernels`, and with `--compile` (or `--set
train.compile=true`) compiles each layer (`mlm.build.compile_layers`); `--vs-eager` times the same
model uncompiled beside it (the compile speed-up). `--set` takes any config override, as `mlm train
--set` does (`model.kernels=triton`, `model.recompute=full`, `model.fused_cross_entropy=true`,
...). Only what takes effect through these steps (the config, the model's build, `set_kernels`,
`compile_layers`, fp8's `apply_fp8`, the trainer's optimizer) reaches the model here: a setting
the trainer applies elsewhere (in `Trainer.__init__`, say) needs a line in `build_mlm`. The loss is the model's own
(`GPT.head_loss`). With HF (the default on CPU) it exports the weights with `mlm.convert.hf.mlm_to_hf` and
loads them into `LlamaForCausalLM` (attn_implementation="sdpa"). Then times full training steps
(forward, the cross-entropy, backward, AdamW step, zero_grad; mlm with its trainer's optimizer, HF
with torch.optim.AdamW as a transformers loop uses it) on the same batch of random tokens,
alternating the two models step by step (and which goes first) so that both see the same machine
state; warm-up steps (the first compiles) are not timed; torch's default thread count. HF is called
with use_cache=False, as a training loop does. bf16 means torch.autocast for both (mlm: also
train.precision=bf16; weights stay fp32 unless `--set train.param_dtype=bf16`, Megatron's bf16
parameters with fp32 main weights; `--set train.fp8.format=hybrid` adds fp8 linears). Prints tokens/s of each (from the median step time), MFU (Megatron's model
FLOPs, `mlm.flops.flops_per_token`, over the dense bf16 peak of `--hardware`,
`mlm.train.metrics.peak_flops`; on CPU the measured fp32 matmul rate), on CUDA each model's peak
memory (`torch.cuda.max_memory_allocated` over its steps), and the ratio mlm / HF (target >= 1.0).
The defaults run in well under 2 minutes on 2 CPU cores.
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

from mlm.build import build_rank_model  # noqa: E402
from mlm.config import load_config  # noqa: E402
from mlm.convert.hf import mlm_to_hf  # noqa: E402
from mlm.errors import MlmError  # noqa: E402
from mlm.flops import flops_per_token  # noqa: E402
from mlm.hardware import profile_of_gpu  # noqa: E402
from mlm.parallel import Mesh  # noqa: E402
from mlm.train.metrics import peak_flops  # noqa: E402
from mlm.train.optimizer import TrainOptimizer  # noqa: E402


def build_mlm(preset: str, seq: int, device: torch.device, sets: list[str], seed: int = 1234):
    """(mlm GPT in train mode, Config, its training step's state): the preset with `sets` applied,
    built as `mlm train` builds it on one process (parameters in train.param_dtype, fp8 linears
    under train.fp8), with the config's attention backend and kernels, compiled with train.compile;
    the state is the trainer's optimizer (gradient buffer, fp32 main weights) and the fp8 state."""
    cfg = load_config(overrides=[f"preset={preset}", f"data.seq_length={seq}", f"train.seed={seed}", *sets])
    if cfg.model.position_embedding != "rope":
        raise MlmError(f"--preset {preset}: this benchmark compares Llama models; pick a llama preset")
    mesh = Mesh.build(cfg.parallel, device.type)
    model = build_rank_model(
        cfg.model, cfg.parallel, mesh, device, seed=cfg.train.seed, train=cfg.train
    ).train()
    return model, cfg, (TrainOptimizer(model, cfg, mesh, device), model.fp8)


def build_hf(mlm, cfg, device: torch.device):
    """transformers' LlamaForCausalLM with the weights of `mlm` (exported through `mlm.convert.hf`)."""
    import transformers

    hf_state, hf_config = mlm_to_hf({k: v.cpu() for k, v in mlm.state_dict().items()}, cfg.model, "llama")
    config = transformers.AutoConfig.for_model(**hf_config)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    missing, unexpected = hf.load_state_dict(hf_state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf.to(device).train()


def mlm_step(model, cfg, state, autocast):
    """The trainer's step on one process: backward into the fp32 gradient buffer, fp8's amax
    bookkeeping, clipping, AdamW on the main weights (cast into the parameters), zeroing."""
    opt, fp8 = state

    def step(x_BT: torch.Tensor, y_BT: torch.Tensor) -> float:
        with autocast():
            loss = model.head_loss(model.hidden_states(x_BT), y_BT)
        loss.backward()
        if fp8:
            fp8.finish_step()
        opt.all_grads.finish()
        opt.clip(cfg.optimizer.clip_grad)
        opt.step(cfg.optimizer.lr, cfg.optimizer.weight_decay)
        opt.zero_grad()
        return loss.item()

    return step


def make_step(loss_fn, autocast, opt):
    def step(x_BT: torch.Tensor, y_BT: torch.Tensor) -> float:
        with autocast():
            loss = loss_fn(x_BT, y_BT)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def hardware_of(device: torch.device, given: str | None) -> str:
    """The MFU peak's profile: `given`, cpu on CPU, else the GPU's by its name."""
    if given or device.type == "cpu":
        return given or "cpu"
    name = torch.cuda.get_device_name(device)
    profile = profile_of_gpu(name)
    if profile is None:
        raise MlmError(
            f"no hardware profile for {name!r}: pass --hardware (a100-40g, a100-80g, h100-80g, h200, b200)"
        )
    return profile


def measure(
    preset: str = "tiny-llama",
    batch: int = 8,
    seq: int = 256,
    steps: int = 20,
    warmup: int = 2,
    dtype: str = "fp32",
    device: str = "cpu",
    compile: bool = False,
    sets: tuple[str, ...] = (),
    hf: bool | None = None,
    vs_eager: bool = False,
    hardware: str | None = None,
    log=print,
) -> dict:
    """Time the models (see the module doc); prints as it goes through `log`, returns the figures:
    per model tokens/s, median and min step seconds, MFU, first loss, peak memory (CUDA)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MlmError("--device cuda, but torch sees no CUDA device; run with --device cpu")
    with_hf = hf if hf is not None else dev.type == "cpu"

    torch.manual_seed(0)
    sets = [f"train.precision={dtype}", *sets, *(["train.compile=true"] if compile else [])]
    mlm, cfg, state = build_mlm(preset, seq, dev, sets)
    if dtype == "bf16":
        autocast = lambda: torch.autocast(dev.type, dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    V = cfg.model.vocab_size
    # each with its own trainer's optimizer: mlm's (TrainOptimizer: fused AdamW, Megatron's
    # no-decay groups, fp32 main weights under train.param_dtype=bf16) and the torch.optim.AdamW a
    # transformers training loop uses
    step_fns = {"mlm": mlm_step(mlm, cfg, state, autocast)}
    if vs_eager:
        if not cfg.train.compile:
            raise MlmError("--vs-eager compares the compiled layers with eager ones: add --compile")
        eager, _, eager_state = build_mlm(preset, seq, dev, [*sets, "train.compile=false"])
        step_fns["eager"] = mlm_step(eager, cfg, eager_state, autocast)
    if with_hf:
        hf_model = build_hf(mlm, cfg, dev)

        def hf_loss(x, y):
            logits_BTV = hf_model(input_ids=x, use_cache=False).logits
            return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y.flatten())

        step_fns["HF"] = make_step(
            hf_loss, autocast, torch.optim.AdamW(hf_model.parameters(), lr=3e-4, weight_decay=0.1)
        )
    tokens = torch.randint(0, V, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    x_BT, y_BT = tokens[:, :-1].contiguous().to(dev), tokens[:, 1:].contiguous().to(dev)
    cuda = dev.type == "cuda"
    hardware = hardware_of(dev, hardware)
    where = f"{torch.cuda.get_device_name(dev)}" if cuda else f"{torch.get_num_threads()} threads"
    params = sum(p.numel() for p in mlm.parameters())
    log(
        f"preset {preset}: {params / 1e6:.2f} M parameters, "
        f"batch {batch} x seq {seq}, {dtype}, {dev.type} ({where}), torch {torch.__version__}; "
        f"compile {cfg.train.compile}, kernels {cfg.model.kernels}, recompute {cfg.model.recompute}, "
        f"parameters {cfg.train.param_dtype}" + (f"; --set {' '.join(sets[1:])}" if sets[1:] else "")
    )
    times: dict[str, list[float]] = {name: [] for name in step_fns}
    first: dict[str, tuple[float, float]] = {}
    peak_mem: dict[str, int] = dict.fromkeys(step_fns, 0)
    order = list(step_fns)
    for i in range(warmup + steps):
        for name in order if i % 2 == 0 else order[::-1]:
            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = time.perf_counter()
            loss = step_fns[name](x_BT, y_BT)  # .item() waits for the device
            dt = time.perf_counter() - t0
            if cuda:
                peak_mem[name] = max(peak_mem[name], torch.cuda.max_memory_allocated(dev))
            first.setdefault(name, (loss, dt))
            if i >= warmup:
                times[name].append(dt)
    log(
        "first step: "
        + ", ".join(f"{name} loss {loss:.6f} in {dt:.1f} s" for name, (loss, dt) in first.items())
        + (" (same weights and batch)" if len(step_fns) > 1 else "")
    )
    # tokens/s from the median step: this runs on shared 2-core VMs where a neighbour's burst can
    # stall single steps by 3-8x (measured), which would swamp a mean over 10 steps.
    peak = peak_flops(hardware)
    flops_per_step = flops_per_token(cfg.model, seq) * batch * seq
    out: dict = {"preset": preset, "parameters": params, "batch": batch, "seq": seq, "dtype": dtype}
    out |= {"hardware": hardware, "peak_flops": peak, "kernels": cfg.model.kernels}
    out |= {"compile": cfg.train.compile, "param_dtype": cfg.train.param_dtype, "models": {}}
    for name, ts in times.items():
        median = statistics.median(ts)
        tps = batch * seq / median
        mfu = flops_per_step / median / peak
        out["models"][name] = {
            "tokens_per_s": tps,
            "median_s": median,
            "min_s": min(ts),
            "mfu": mfu,
            "first_loss": first[name][0],
            **({"peak_memory_bytes": peak_mem[name]} if cuda else {}),
        }
        mean = batch * seq * len(ts) / sum(ts)
        log(
            f"{name:>4}: {tps:8,.0f} tokens/s  (median of {len(ts)} steps {median * 1e3:6.1f} ms, "
            f"min {min(ts) * 1e3:6.1f} ms; mean {mean:,.0f} tokens/s); MFU {mfu:.1%} of {hardware} "
            f"({peak / 1e12:.1f} TFLOP/s{' bf16' if hardware != 'cpu' else ' measured fp32 matmul'})"
            + (f"; peak memory {peak_mem[name] / 2**30:.2f} GiB" if cuda else "")
        )
    models = out["models"]
    if vs_eager:
        out["compiled_vs_eager"] = models["mlm"]["tokens_per_s"] / models["eager"]["tokens_per_s"]
        log(f"ratio compiled / eager: {out['compiled_vs_eager']:.3f}")
    if with_hf:
        out["mlm_vs_hf"] = models["mlm"]["tokens_per_s"] / models["HF"]["tokens_per_s"]
        log(f"ratio mlm / HF: {out['mlm_vs_hf']:.3f}  (target >= 1.0)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-llama")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per model")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per model (the first compiles)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--compile", action="store_true", help="train.compile=true: torch.compile each layer")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable"
    )
    ap.add_argument(
        "--hf", action=argparse.BooleanOptionalAction, default=None, help="default: on for cpu, off for cuda"
    )
    ap.add_argument(
        "--vs-eager",
        action="store_true",
        help="also time the same model uncompiled (same weights), alternating: the compile speed-up",
    )
    ap.add_argument(
        "--hardware", default=None, help="MFU peak profile; default: from the GPU's name, cpu on CPU"
    )
    a = ap.parse_args()
    measure(
        **{k: v for k, v in vars(a).items() if k != "set"},
        sets=tuple(a.set),
    )


if __name__ == "__main__":
    try:
        main()
    except MlmError as e:
        sys.exit(f"error: {e}")
