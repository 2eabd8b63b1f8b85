"""Peak memory of building one rank of a large model: per-shard init (`mlm.model.init`) against
the full-tensor init it replaced, in the same run, against the rank's parameter bytes.

    .venv/bin/python bench/init_memory.py                 # both cases: ~20 min on 2 cores, <= 14 GB
    .venv/bin/python bench/init_memory.py --cases deepseek-v3 --dtype bfloat16

Cases: llama3-405b at tp 8 × pp 16 (7 / 8 × 14 / 7 layers, the planner's split: `stage_split`),
its first stage (the embedding, whose full fp32 tensor is 8.4 GB) and a middle one (the most
parameters); deepseek-v3 at the layout `mlm plan --preset deepseek-v3 --gpus 2048 --seq-length
4096 --global-batch 15360` picks (docs/plan-parallel.md): tp 2 × pp 16 (3 / 4 × 14 / 2) × dp 64, ep 8, SP,
the stage with the most parameters. Each is one rank without torch.distributed (a `Mesh` holding
its coordinates: building and initialising read nothing else), built by `build_rank_model` in
`--dtype` and initialised, in a fresh subprocess: peak resident set (VmHWM, reset through
/proc/self/clear_refs) above the resident set before the build.

The old init drew each parameter's full fp32 tensor while the previous one was still referenced;
its peak is counted from the shapes (`full_tensor_peak`: two consecutive full tensors and the
parameters written so far, "counted") and measured too where that fits in `--cap` GB and in the
memory available, under an address-space limit of `--cap` GB so that a wrong count fails rather
than swaps.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_cross_entropy import _rss  # noqa: E402  (bench/linear_cross_entropy.py: the resident-set reader)

from mlm.build import build_rank_model  # noqa: E402
from mlm.config import load_config  # noqa: E402
from mlm.model.gpt import VOCAB_ROWS  # noqa: E402
from mlm.parallel.mesh import Mesh  # noqa: E402
from mlm.plan.search import stage_split  # noqa: E402

SEED = 1234
CASES = {
    "llama3-405b": ("llama3-405b", dict(tp=8, pp=16, dp=1), ("first", "most")),
    "deepseek-v3": (
        "deepseek-v3",
        dict(tp=2, pp=16, dp=64, ep=8, sequence_parallel=True, first_stage_layers=3, last_stage_layers=2),
        ("most",),
    ),
}


def case_config(name: str):
    """The run config of a case (with the planner's stage split where pp does not divide the layers)."""
    preset, mesh, _ = CASES[name]
    cfg = load_config(None, [f"preset={preset}"])
    first, last = stage_split(cfg.model.num_layers, mesh["pp"], 1)
    sets = {k: v for k, v in mesh.items() if k != "dp"}
    if "first_stage_layers" not in sets and first is not None:
        sets.update(first_stage_layers=first, last_stage_layers=last)
    overrides = [f"preset={preset}"] + [f"parallel.{k}={str(v).lower()}" for k, v in sets.items()]
    return load_config(None, overrides), mesh["dp"]


def rank_mesh(cfg, dp: int, pp_rank: int) -> Mesh:
    """Coordinates of (pp_rank, dp 0, cp 0, tp 0): what building and initialising a rank read."""
    p = cfg.parallel
    world = p.tp * p.pp * p.cp * dp
    rank = pp_rank * dp * p.cp * p.tp
    return Mesh(world_size=world, rank=rank, tp=p.tp, pp=p.pp, dp=dp, cp=p.cp, ep=p.ep, pp_rank=pp_rank)


def pick_ranks(name: str, dtype: torch.dtype) -> dict[str, int]:
    """{"first" / "most": pp rank}: the first stage and the stage with the most parameters (on meta)."""
    cfg, dp = case_config(name)
    sizes = []
    for r in range(cfg.parallel.pp):
        model = build_rank_model(
            cfg.model, cfg.parallel, rank_mesh(cfg, dp, r), torch.device("meta"), dtype=dtype
        )
        sizes.append(sum(p.numel() for p in model.parameters()))
    return {"first": 0, "most": max(range(len(sizes)), key=sizes.__getitem__)}


@torch.no_grad()
def full_tensor_init(model, seed: int) -> None:
    """The init this bench compares with (`GPT.init_weights` before per-shard drawing): every
    parameter's full fp32 tensor drawn from one stream per name, then this rank's slice kept."""
    cfg = model.cfg
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
    for module_name, module in model.named_modules():
        described = getattr(module, "placements", {})
        for local, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{local}" if module_name else local
            if p.ndim == 1 and name.endswith(("norm.weight", "bias")):
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
                continue
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            s = out_std if name.endswith(("attn.out.weight", "down.weight")) else std
            place = described.get(local)
            shape = place.global_shape if place else p.shape
            full = torch.zeros(shape, dtype=torch.float32)
            rows = cfg.vocab_size if name in VOCAB_ROWS else shape[0]
            full[:rows].normal_(0.0, s, generator=gen)
            p.copy_(place.slice_of(full) if place else full)


def full_tensor_peak(model) -> int:
    """Bytes resident at `full_tensor_init`'s peak: when it allocates a parameter's full fp32
    tensor, the previous one is still referenced, and the parameters written so far are resident
    (the others, allocated by `to_empty` but not yet touched, are not); at the end, all of them."""
    written = previous = peak = 0
    for module_name, module in model.named_modules():
        described = getattr(module, "placements", {})
        for local, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{local}" if module_name else local
            if not (p.ndim == 1 and name.endswith(("norm.weight", "bias"))):
                place = described.get(local)
                full = math.prod(place.global_shape if place else p.shape) * 4
                peak = max(peak, written + previous + full)
                previous = full
            written += p.numel() * p.element_size()
    return max(peak, written)


def child(name: str, pp_rank: int, method: str, dtype: torch.dtype) -> dict:
    """Build and initialise one rank in this process; its peak above the resident set before."""
    cfg, dp = case_config(name)
    mesh = rank_mesh(cfg, dp, pp_rank)
    base = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    t = time.perf_counter()
    model = build_rank_model(cfg.model, cfg.parallel, mesh, torch.device("cpu"), dtype=dtype)
    if method == "per-shard":
        model.init_weights(SEED)
    else:
        full_tensor_init(model, SEED)
    seconds = time.perf_counter() - t
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak": _rss("VmHWM") - base, "params": params, "seconds": seconds}


def run_child(name: str, pp_rank: int, method: str, dtype: str, cap_gb: float) -> dict | None:
    """`child` in a fresh process under an address-space limit of `cap_gb`; None if it failed."""
    cap = int(cap_gb * 1e9)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    argv = [sys.executable, __file__, "--child", name, str(pp_rank), method, "--dtype", dtype]
    out = subprocess.run(argv, capture_output=True, text=True, preexec_fn=limit)
    if out.returncode:
        print(f"  {method}: failed under the {cap_gb:g} GB limit: {out.stderr.strip().splitlines()[-1]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def available() -> int:
    """MemAvailable of this machine, in bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--cap", type=float, default=18.0, help="GB: the most a measured run may take")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=3, metavar=("CASE", "PP_RANK", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.child:
        name, pp_rank, method = args.child
        print(json.dumps(child(name, int(pp_rank), method, dtype)))
        return
    print(f"{args.dtype} parameters, torch {torch.__version__}, {args.threads} threads; GB = 1e9 bytes")
    for name in args.cases.split(","):
        cfg, dp = case_config(name)
        p = cfg.parallel
        layout = f"tp {p.tp} × pp {p.pp} × dp {dp}" + (f", ep {p.ep}" if p.ep > 1 else "")
        ranks = pick_ranks(name, dtype)
        for which in CASES[name][2]:
            r = ranks[which]
            meta = build_rank_model(cfg.model, p, rank_mesh(cfg, dp, r), torch.device("meta"), dtype=dtype)
            params = sum(q.numel() * q.element_size() for q in meta.parameters())
            counted = full_tensor_peak(meta)
            print(f"{name} at {layout}, pp rank {r} ({which}): {params / 1e9:.2f} GB of parameters")
            new = run_child(name, r, "per-shard", args.dtype, args.cap)
            if new:
                print(
                    f"  per-shard:   peak {new['peak'] / 1e9:6.2f} GB = {new['peak'] / new['params']:.3f} x "
                    f"parameters, {new['seconds']:5.1f} s  (target <= 1.3 x)"
                )
            room = min(args.cap * 1e9, available() - 2e9)
            print(f"  full-tensor: counted {counted / 1e9:6.2f} GB = {counted / params:.3f} x parameters")
            if counted * 1.05 < room:
                old = run_child(name, r, "full-tensor", args.dtype, args.cap)
                if old:
                    print(
                        f"  full-tensor: peak {old['peak'] / 1e9:6.2f} GB = {old['peak'] / old['params']:.3f} x "
                        f"parameters, {old['seconds']:5.1f} s (measured)"
                    )
                    if new:
                        print(f"  ratio per-shard / full-tensor peak: {new['peak'] / old['peak']:.3f}")
            else:
                print(
                    f"  full-tensor: not run (needs ~{counted / 1e9:.1f} GB; {room / 1e9:.1f} GB allowed here)"
                )
                if new:
                    print(f"  ratio per-shard peak / full-tensor counted: {new['peak'] / counted:.3f}")


if __name__ == "__main__":
    main()
