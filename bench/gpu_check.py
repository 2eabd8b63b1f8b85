"""One GPU check: every CUDA path of mlm against its CPU / torch reference, and the headline GPU
figures, in one command that fits a short GPU lease and always ends with a report.

    bash bench/gpu_check.sh [--out DIR] [--budget 480] [--only SECTION ...]   # a CUDA machine
    bash bench/gpu_check.sh --dry-run --out DIR                            # CPU, tiny shapes

(`just gpu-check ARGS` runs the same; `bench/gpu_check.sh` first installs what the GPU image
lacks from `.gpu-wheels/`, which `just gpu-wheels` fills.)

Sections, in this order, each in its own process (a CUDA error cannot take the rest down), each
timed and stopped at its cap or at what is left of `--budget` seconds, and skipped with a line in
the report when too little is left:

- env: GPU, capability, driver, CUDA, NCCL, torch, Triton, Python.
- tests: `pytest -m gpu` over the test files that hold gpu-marked tests (tests/unit/test_cuda.py: fp8,
  mixed precision, attention backends, compile, serving and CUDA graphs, the straggler clock; and
  the others) and tests/unit/test_kernels.py (the Triton kernels compiled), each against its reference.
- mfu: bench/train_step.py's measurement: llama3-1b (Llama-3.2-1B's shape) in bf16 at seq 4096
  with mlm's fastest settings (Triton kernels, bf16 parameters with fp32 main weights, compiled
  layers), beside transformers' LlamaForCausalLM training step (sdpa, autocast) on the same GPU.
- kernels: bench/kernels.py: each Triton kernel against torch eager, torch.compile and
  Liger-Kernel, forward + backward, with bytes/s against the GPU's memory bandwidth.
- serve: bench/serve.py: the engine on SmolLM2-135M's shape (random weights, bf16) against HF
  `generate` one at a time and as a padded batch, with and without CUDA graphs.
- nccl: world size 1 under NCCL (the distributed optimizer's step equal to the same step without
  a process group; each collective mlm uses, checked), and whether NCCL lets two ranks share the
  one GPU.
- memory: the peak allocated memory of training steps of llama3-1b against `mlm plan`'s
  prediction for the same layout.

Writes DIR/gpu_check.md (the report) and DIR/gpu_check.json (the figures). `--dry-run` runs every
section on CPU with tiny shapes (the test suite does, so that the script cannot rot between
leases): its figures are not measurements of anything, and the report says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after the root: `kernels` is the package, bench/kernels.py is _bench's


def _bench(name: str):
    """The module of bench/NAME.py (loaded by path: bench/kernels.py would shadow the kernels package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (name, cap in seconds on a GPU, the least worth starting with)
SECTIONS = (
    ("env", 60, 5),
    ("tests", 180, 30),
    ("mfu", 180, 60),
    ("kernels", 150, 30),
    ("serve", 120, 30),
    ("nccl", 90, 20),
    ("memory", 90, 30),
)
GOALS = {
    "mfu": "MFU >= 45% for the 1B Llama in bf16 (Megatron-LM reports 41-49% on H100 at scale); mlm >= 1.2x HF's step",
    "kernels": "each Triton kernel >= 1.0x torch.compile; >= 80% of memory bandwidth where bandwidth-bound",
    "serve": "mlm's engine >= 1.5x HF's padded batch",
}


def _log(lines: list[str]):
    def log(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    return log


def _device(dry: bool):
    import torch

    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(
            "error: no CUDA device is visible; run on a GPU machine, or pass --dry-run for the CPU check"
        )
    return torch.device("cuda")


# ---------------------------------------------------------------- sections (each in a child)


def section_env(dry: bool, log) -> dict:
    import torch

    figures = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
    }
    try:
        import triton

        figures["triton"] = triton.__version__
    except ImportError:
        figures["triton"] = None
    for name in ("transformers", "liger_kernel", "flash_attn", "transformer_engine"):
        try:
            module = __import__(name)
            figures[name] = getattr(module, "__version__", "installed")
        except Exception as e:  # noqa: BLE001  (a broken optional package is reported, not fatal)
            figures[name] = None if isinstance(e, ImportError) else f"broken: {e}"
    if not dry:
        p = torch.cuda.get_device_properties(0)
        figures |= {
            "gpu": p.name,
            "capability": f"{p.major}.{p.minor}",
            "memory_gib": round(p.total_memory / 2**30, 1),
            "multiprocessors": p.multi_processor_count,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        }
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        figures["driver"] = smi.stdout.strip() or f"nvidia-smi: {smi.stderr.strip()[:200]}"
    else:
        figures["gpu"] = (
            f"none (CPU dry run: {platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        )
    for k, v in figures.items():
        log(f"- {k}: {v}")
    return figures


def section_tests(dry: bool, log) -> dict:
    """pytest over the gpu-marked tests and the Triton kernels' tests; the counts from JUnit XML."""
    import xml.etree.ElementTree as ET

    marked = sorted(  # the subject folders (tests/unit/test_cuda.py); not tests/interop/*/
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").glob("*/test_*.py")
        if "pytest.mark.gpu" in p.read_text(encoding="utf-8")
    )
    runs = {"gpu-marked": ["-m", "gpu", *marked]}
    if dry:  # the suite itself runs tests/unit/test_kernels.py under the Triton interpreter
        log("- tests/unit/test_kernels.py: not run here (the CPU suite runs it under the Triton interpreter)")
    else:
        runs["kernels"] = ["tests/unit/test_kernels.py"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if dry:
        env["MLM_CUDA_TESTS_ON_CPU"] = "1"  # tests/unit/test_cuda.py runs on the CPU what exists there
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in runs.items():
            xml = Path(tmp) / f"{name}.xml"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - t0
            counts = {"passed": 0, "failed": 0, "skipped": 0}
            failed, skipped = [], []
            if xml.exists():
                for case in ET.parse(xml).getroot().iter("testcase"):
                    test = f"{case.get('classname')}::{case.get('name')}"
                    if case.find("failure") is not None or case.find("error") is not None:
                        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
                        counts["failed"] += 1
                        failed.append((test, (bad.get("message") or "")[:300]))
                    elif case.find("skipped") is not None:
                        counts["skipped"] += 1
                        skipped.append((test, (case.find("skipped").get("message") or "")[:200]))
                    else:
                        counts["passed"] += 1
            figures[name] = {**counts, "exit": proc.returncode, "seconds": round(seconds, 1)}
            figures[name]["failures"] = [t for t, _ in failed]
            log(
                f"- {name} ({' '.join(args)}): {counts['passed']} passed, {counts['failed']} failed, "
                f"{counts['skipped']} skipped, exit {proc.returncode}, {seconds:.0f} s"
            )
            for test, message in failed:
                log(f"  - FAILED {test}: {message}")
            for test, message in skipped:
                log(f"  - skipped {test}: {message}")
            if proc.returncode not in (0, 5) and not failed:  # no XML verdicts: collection broke
                log("  - pytest's last lines: " + " | ".join(proc.stdout.strip().splitlines()[-5:]))
    return figures


def section_mfu(dry: bool, log) -> dict:
    measure = _bench("train_step").measure

    if dry:
        return measure(
            "tiny-llama",
            batch=2,
            seq=64,
            steps=2,
            warmup=1,
            dtype="bf16",
            device="cpu",
            sets=("train.param_dtype=bf16",),  # the GPU run's Triton kernels and compile: not on CPU
            hf=True,
            log=log,
        )
    return measure(
        "llama3-1b",
        batch=4,
        seq=4096,
        steps=8,
        warmup=3,
        dtype="bf16",
        device="cuda",
        compile=True,
        sets=("model.kernels=triton", "train.param_dtype=bf16"),
        hf=True,
        log=log,
    )


def section_kernels(dry: bool, log) -> dict:
    import torch

    measure = _bench("kernels").measure

    from mlm.hardware import PROFILES, profile_of_gpu

    if dry:
        rows = measure(
            "cpu", "fp32", seq=64, hidden=64, ffn=128, heads=4, vocab=256, steps=2, warmup=1, log=log
        )
        return {"rows": rows}
    profile = profile_of_gpu(torch.cuda.get_device_name(0))
    bandwidth = PROFILES[profile].hbm_bandwidth if profile else None
    if bandwidth is None:
        log(f"- no hardware profile for {torch.cuda.get_device_name(0)!r}: no share of memory bandwidth")
    rows = measure("cuda", "bf16", steps=10, warmup=3, bandwidth=bandwidth, log=log)
    return {"rows": rows, "bandwidth": bandwidth, "profile": profile}


def section_serve(dry: bool, log) -> dict:
    import torch

    serve = _bench("serve")
    build, generate_bench = serve.build, serve.generate_bench

    if dry:
        a = argparse.Namespace(requests=3, new_tokens=4, repeat=1, device="cpu", cuda_graphs=False)
        hf, ours = build("tiny", "cpu", torch.float32)
    else:
        a = argparse.Namespace(requests=16, new_tokens=48, repeat=1, device="cuda", cuda_graphs=True)
        hf, ours = build("smollm2-135m", "cuda", torch.bfloat16)
    log(f"- shape {'tiny' if dry else 'smollm2-135m'}, {a.device}, {'fp32' if dry else 'bf16'}")
    return generate_bench(a, hf, ours, log=log)


def _nccl_two_ranks(rank: int, port: int, queue) -> None:
    """One of two ranks on cuda:0: an NCCL all-reduce (NCCL refuses two ranks on one GPU, by
    default; this records what this machine's NCCL says)."""
    import torch
    import torch.distributed as dist

    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        t = torch.ones(4, device="cuda") * (rank + 1)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        queue.put((rank, "ok", t.tolist()))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001  (the outcome is the figure)
        queue.put((rank, "error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def section_nccl(dry: bool, log) -> dict:
    import multiprocessing as mp

    import torch
    import torch.distributed as dist

    train_step = _bench("train_step")
    build_mlm, mlm_step = train_step.build_mlm, train_step.mlm_step

    device = _device(dry)
    backend = "gloo" if dry else "nccl"
    figures: dict = {"backend": backend}
    if dry:
        log("- two ranks on one GPU: not probed (CPU dry run)")
    else:
        ctx = mp.get_context("spawn")
        queue, port = ctx.Queue(), _free_port()
        procs = [ctx.Process(target=_nccl_two_ranks, args=(r, port, queue)) for r in range(2)]
        for p in procs:
            p.start()
        outcome = []
        for _ in procs:
            try:
                outcome.append(queue.get(timeout=60))
            except Exception:  # noqa: BLE001
                outcome.append((None, "error", "no answer in 60 s (hung)"))
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        figures["two_ranks_one_gpu"] = [list(o) for o in sorted(outcome, key=str)]
        ok = all(o[1] == "ok" for o in outcome)
        log(f"- two ranks on one GPU under NCCL: {'allowed' if ok else 'refused'}: {outcome}")

    # the distributed optimizer's steps with and without a (world size 1) process group
    sets = ["train.precision=fp32", "parallel.distributed_optimizer=true", "train.micro_batch_size=2"]
    sets += ["train.global_batch_size=2"]
    seq = 64

    def losses() -> list[float]:
        torch.manual_seed(0)
        model, cfg, state = build_mlm("tiny-llama", seq, device, sets)
        step = mlm_step(model, cfg, state, lambda: torch.autocast(device.type, enabled=False))
        g = torch.Generator().manual_seed(0)
        out = []
        for _ in range(3):
            tokens = torch.randint(0, cfg.model.vocab_size, (2, seq + 1), generator=g).to(device)
            out.append(step(tokens[:, :-1], tokens[:, 1:]))
        return out

    alone = losses()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend)
    try:
        grouped = losses()
        diff = max(abs(a - b) for a, b in zip(alone, grouped, strict=True))
        figures["distributed_optimizer_losses"] = {
            "without_group": alone,
            "with_group": grouped,
            "max_diff": diff,
        }
        log(f"- tiny-llama, fp32, distributed optimizer, 3 steps: losses without a process group {alone}")
        log(f"  with a {backend} process group of 1: {grouped}; max |difference| {diff:.2e} (expected 0)")
        checks = {}
        for name, fn in _collectives(device).items():
            try:
                checks[name] = "ok" if fn() else "wrong result"
            except Exception as e:  # noqa: BLE001
                checks[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        figures["collectives"] = checks
        log(f"- collectives on the {backend} group of 1: {checks}")
    finally:
        dist.destroy_process_group()
    return figures


def _collectives(device) -> dict:
    """Each collective mlm uses, on the default group, with its result checked (world size 1)."""
    import torch
    import torch.distributed as dist

    x = torch.arange(8, dtype=torch.float32, device=device)

    def all_reduce():
        t = x.clone()
        dist.all_reduce(t)
        return torch.equal(t, x)

    def reduce_scatter():
        out = torch.empty_like(x)
        dist.reduce_scatter_tensor(out, x.clone())
        return torch.equal(out, x)

    def all_gather():
        out = torch.empty_like(x)
        dist.all_gather_into_tensor(out, x.clone())
        return torch.equal(out, x)

    def all_to_all():
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.clone())
        return torch.equal(out, x)

    def broadcast():
        t = x.clone()
        dist.broadcast(t, 0)
        return torch.equal(t, x)

    def all_reduce_max():
        t = x.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return torch.equal(t, x)

    return {
        f.__name__: f for f in (all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, all_reduce_max)
    }


def section_memory(dry: bool, log) -> dict:
    import torch

    train_step = _bench("train_step")
    build_mlm, mlm_step = train_step.build_mlm, train_step.mlm_step

    from mlm.hardware import PROFILES, profile_of_gpu
    from mlm.layout import Layout
    from mlm.plan.memory import memory

    device = _device(dry)
    preset, seq, b = ("tiny-llama", 64, 2) if dry else ("llama3-1b", 4096, 2)
    sets = ["train.precision=bf16", "train.param_dtype=bf16", f"train.micro_batch_size={b}"]
    sets += [f"train.global_batch_size={b}"]
    model, cfg, state = build_mlm(preset, seq, device, sets)
    profile = "h100-80g" if dry else (profile_of_gpu(torch.cuda.get_device_name(0)) or "h100-80g")
    hbm = PROFILES[profile].hbm_bytes
    report = memory(cfg, Layout.from_config(cfg, 1), hbm)
    parts = {k: v for k, v in report.components.items() if k != "headroom"}
    predicted = sum(parts.values())
    figures = {
        "preset": preset,
        "seq": seq,
        "micro_batch": b,
        "predicted_bytes": predicted,
        "predicted": parts,
    }
    log(
        f"- {preset}, seq {seq}, micro-batch {b}, bf16 parameters, layout {Layout.from_config(cfg, 1)}: "
        f"mlm plan predicts {predicted / 2**30:.2f} GiB without headroom"
    )
    for k, v in parts.items():
        log(f"  - {k}: {v / 2**30:.3f} GiB")
    if dry:
        log("- measured: not on CPU (no allocator peak; the dry run checks only that the section runs)")
        return figures
    step = mlm_step(model, cfg, state, lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (b, seq + 1), generator=g).cuda()
    step(tokens[:, :-1], tokens[:, 1:])  # the optimizer's state exists after the first step
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        step(tokens[:, :-1], tokens[:, 1:])
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    figures |= {"measured_bytes": measured, "predicted_over_measured": predicted / measured}
    log(
        f"- measured peak (max_memory_allocated over two steps after the first): {measured / 2**30:.2f} GiB; "
        f"predicted / measured {predicted / measured:.3f}"
    )
    return figures


# ---------------------------------------------------------------- the parent: budget and report


def child(section: str, dry: bool, result: Path) -> None:
    lines: list[str] = []
    log = _log(lines)
    try:
        figures = globals()[f"section_{section}"](dry, log)
        status = "ok"
    except BaseException as e:  # noqa: BLE001  (the report says what broke)
        figures = {"error": f"{type(e).__name__}: {e}"}
        status = "failed"
        for line in traceback.format_exc().strip().splitlines()[-12:]:
            log(f"    {line}")
    result.write_text(json.dumps({"status": status, "figures": figures, "lines": lines}, default=str))


def run_section(section: str, dry: bool, seconds: float, tmp: Path) -> dict:
    result = tmp / f"{section}.json"
    cmd = [sys.executable, __file__, "--child", section, str(result), *(["--dry-run"] if dry else [])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-8:]
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {
            "status": f"stopped at {seconds:.0f} s",
            "figures": {},
            "lines": [*out.strip().splitlines()[-20:], f"(stopped: the section's {seconds:.0f} s ran out)"],
            "seconds": time.perf_counter() - t0,
        }
    if result.exists():
        r = json.loads(result.read_text())
    else:
        r = {"status": f"crashed (exit {proc.returncode})", "figures": {}, "lines": tail}
    r["seconds"] = time.perf_counter() - t0
    return r


def goal_lines(results: dict) -> list[str]:
    """The issue's goals against the figures, one line each."""
    lines = []
    mfu = results.get("mfu", {}).get("figures", {})
    if "models" in mfu:
        m = mfu["models"]["mlm"]["mfu"]
        lines.append(f"- MFU of mlm: {m:.1%} (goal >= 45%)")
        if "mlm_vs_hf" in mfu:
            lines.append(f"- mlm / HF train step: {mfu['mlm_vs_hf']:.2f}x (goal >= 1.2x)")
    rows = results.get("kernels", {}).get("figures", {}).get("rows", [])
    for r in rows:
        if r.get("impl") == "mlm" and r["kernel"] != "linear_cross_entropy" and "vs_compile" in r:
            bw = f", {r['of_bandwidth']:.0%} of bandwidth (goal >= 80%)" if r.get("of_bandwidth") else ""
            lines.append(f"- kernel {r['kernel']}: {r['vs_compile']:.2f}x torch.compile (goal >= 1.0x){bw}")
    serve = results.get("serve", {}).get("figures", {})
    for key in ("mlm_vs_hf_padded", "mlm_cuda_graphs_vs_hf_padded"):
        if key in serve:
            lines.append(
                f"- serving {key.removesuffix('_vs_hf_padded')} / HF padded batch: {serve[key]:.2f}x (goal >= 1.5x)"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dry-run", action="store_true", help="every section on CPU with tiny shapes; no figures claimed"
    )
    ap.add_argument("--out", default="gpu-check", help="folder of gpu_check.md and gpu_check.json")
    ap.add_argument(
        "--budget", type=float, default=480.0, help="seconds for all sections (a GPU lease is short)"
    )
    ap.add_argument("--only", nargs="+", choices=[s for s, _, _ in SECTIONS], help="these sections only")
    ap.add_argument("--child", nargs=2, metavar=("SECTION", "RESULT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], a.dry_run, Path(a.child[1]))
    if not a.dry_run:
        _device(False)  # a clear error before anything runs
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cap, least in SECTIONS:
            if a.only and name not in a.only:
                continue
            left = a.budget - (time.perf_counter() - start)
            if left < least:
                results[name] = {
                    "status": f"skipped: {left:.0f} s of the budget left, needs {least}",
                    "lines": [],
                }
                print(f"== {name}: {results[name]['status']}", flush=True)
                continue
            print(f"== {name} (at most {min(cap, left):.0f} s)", flush=True)
            results[name] = run_section(name, a.dry_run, min(cap, left), Path(tmp))
            print(f"== {name}: {results[name]['status']} in {results[name]['seconds']:.0f} s", flush=True)
    total = time.perf_counter() - start
    env = results.get("env", {}).get("figures", {})
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    md = [
        f"# mlm GPU check, {when}",
        "",
        (
            "**Dry run on CPU: tiny shapes; no figure here measures anything.**"
            if a.dry_run
            else f"GPU: {env.get('gpu')} (driver {env.get('driver')}), torch {env.get('torch')}, "
            f"CUDA {env.get('cuda_runtime')}, Triton {env.get('triton')}"
        ),
        "",
        f"Budget {a.budget:.0f} s; took {total:.0f} s. Command: `bash bench/gpu_check.sh {' '.join(sys.argv[1:])}`",
        "",
        "| section | status | seconds |",
        "| --- | --- | --- |",
        *(f"| {n} | {r['status']} | {r.get('seconds', 0):.0f} |" for n, r in results.items()),
        "",
    ]
    goals = goal_lines(results)
    if goals and not a.dry_run:
        md += ["## Against the goals", "", *goals, ""]
    for name, r in results.items():
        md += [f"## {name}", "", f"Status: {r['status']}.", "", *r["lines"], ""]
    (out / "gpu_check.md").write_text("\n".join(md), encoding="utf-8")
    figures = {"dry_run": a.dry_run, "when": when, "budget_s": a.budget, "total_s": total}
    figures["sections"] = {
        n: {k: r.get(k) for k in ("status", "seconds", "figures")} for n, r in results.items()
    }
    (out / "gpu_check.json").write_text(json.dumps(figures, indent=1, default=str), encoding="utf-8")
    print(f"report: {out / 'gpu_check.md'}; figures: {out / 'gpu_check.json'}")
    failed = [n for n, r in results.items() if r["status"] != "ok" and not r["status"].startswith("skipped")]
    tests = results.get("tests", {}).get("figures", {})
    failed += [f"tests {k}" for k, v in tests.items() if isinstance(v, dict) and v.get("failed")]
    if failed:
        print(f"not ok: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
