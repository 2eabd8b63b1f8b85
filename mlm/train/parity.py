"""`mlm parity`: does the same training run give the same losses and weights on every parallel layout?

From one seed checkpoint (written once, in this process, at step 0) and one data order, each
layout (`tp2`, `tp2dp2`, `pp2vpp2`, ...) runs K steps of `mlm train` under torchrun; its per-step
losses (from `metrics.jsonl`) and final weights (from its checkpoint, read whole) are compared
with the first layout's, against a tolerance that depends on `train.precision`. See docs/parity.md.

    from mlm.train.parity import parse_layouts, render, run_parity
    result = run_parity("run.toml", [], parse_layouts("tp1,tp2,dp2"), steps=5, out="runs/parity")
    render(result)              # the report; result.passed is False when a layout is out of tolerance

Not bitwise: another layout sums the same numbers in another order (tp partial sums, the dp
all-reduce, the sharded optimizer), so fp32 agrees to rounding, and bf16/fp16 to their own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlm.config import Config, load_config, to_toml
from mlm.errors import MlmError
from mlm.fileio import atomic_write_text

TERMS_HELP = "use tp<N>, pp<N>, vpp<N>, dp<N>, sp, zero1"
_TERM = re.compile(r"(vpp|tp|pp|dp)(\d*)|sp|zero1")


@dataclass(frozen=True)
class Layout:
    """One parallel layout to compare, e.g. `tp2dp2sp` (missing sizes are 1)."""

    name: str
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    sp: bool = False
    """parallel.sequence_parallel"""
    zero1: bool = False
    """parallel.distributed_optimizer"""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def overrides(self) -> list[str]:
        """`--set` items for `mlm train` (dp follows from the world size)."""
        sets = [
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.vpp={self.vpp}",
            f"parallel.sequence_parallel={str(self.sp).lower()}",
            f"parallel.distributed_optimizer={str(self.zero1).lower()}",
        ]
        if self.pp == 1:  # stage sizes of the user's config mean nothing without a pipeline
            sets += ["parallel.first_stage_layers=none", "parallel.last_stage_layers=none"]
        return sets


def parse_layout(text: str) -> Layout:
    """'tp2dp2sp' → Layout(tp=2, dp=2, sp=True); MlmError naming the bad term otherwise."""
    name, sizes, flags, i = text.strip(), {}, set(), 0
    if not name:
        raise MlmError(f"empty layout in --layouts; {TERMS_HELP}, e.g. tp2dp2")
    while i < len(name):
        m = _TERM.match(name, i)
        if m is None:
            j = next((j for j in range(i + 1, len(name)) if _TERM.match(name, j)), len(name))
            raise MlmError(f"layout {name!r}: unknown term {name[i:j]!r}; {TERMS_HELP}")
        term, (dim, digits) = m.group(0), m.groups()
        if (dim or term) in sizes.keys() | flags:
            raise MlmError(f"layout {name!r}: {dim or term} is given twice")
        if dim is None:
            flags.add(term)
        elif not digits or int(digits) < 1:
            raise MlmError(f"layout {name!r}: {term!r} needs a size of at least 1, e.g. {dim}2")
        else:
            sizes[dim] = int(digits)
        i = m.end()
    return Layout(name, **sizes, sp="sp" in flags, zero1="zero1" in flags)


def parse_layouts(text: str) -> list[Layout]:
    """'tp1,tp2,dp2' → layouts in order (the first is the reference)."""
    layouts = [parse_layout(t) for t in text.split(",")]
    names = [lay.name for lay in layouts]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise MlmError(f"--layouts lists {', '.join(dupes)} more than once")
    return layouts


# ---------------------------------------------------------------- tolerances


@dataclass(frozen=True)
class Tolerance:
    loss_rel: float
    """Largest |loss − loss_ref| / loss_ref at any step."""
    weight_rel: float
    """Largest ‖w − w_ref‖ / ‖w_ref‖ over the final weight tensors."""
    why: str


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
# the losses, and more with every step (tests/test_parallel_training.py measures this too): 1e-3 in
# fp32 is 5× the largest measured. In bf16/fp16 the bound (0.3, 0.15) catches only gross errors,
# such as a shard in the wrong place (≈ √2); a matrix left untrained would differ by 0.27-0.9 here
# and a norm weight by 0.007-0.04, so check correctness in fp32 and read bf16/fp16 by their losses.
TOLERANCES = {
    "fp32": Tolerance(1e-5, 1e-3, "fp32 rounding, summed in another order; Adam amplifies it in the weights"),
    "bf16": Tolerance(
        1e-2, 0.3, "bf16 unit roundoff 2^-8 ≈ 3.9e-3 per matmul; weights only catch gross errors"
    ),
    "fp16": Tolerance(
        5e-3, 0.15, "fp16 unit roundoff 2^-11 ≈ 4.9e-4 per matmul; weights only catch gross errors"
    ),
}


# ---------------------------------------------------------------- comparison


@dataclass
class LayoutResult:
    layout: Layout
    losses: list[float]
    loss_rel: list[float]
    """|loss − loss_ref| / |loss_ref| per step."""
    weight_rel: dict[str, float]
    """‖w − w_ref‖ / ‖w_ref‖ per model tensor (absolute norm where ‖w_ref‖ = 0)."""
    passed: bool
    seconds: float = 0.0
    run_dir: str = ""
    checkpoint: str = ""
    log: str = ""

    @property
    def max_loss_rel(self) -> float:
        return max(self.loss_rel, default=0.0)

    @property
    def worst_step(self) -> int:
        return 1 + max(range(len(self.loss_rel)), key=self.loss_rel.__getitem__) if self.loss_rel else 0

    @property
    def max_weight_rel(self) -> float:
        return max(self.weight_rel.values(), default=0.0)

    @property
    def worst_tensor(self) -> str:
        return max(self.weight_rel, key=self.weight_rel.__getitem__) if self.weight_rel else ""

    def to_json(self) -> dict:
        return {
            **dataclasses.asdict(self.layout),
            "world_size": self.layout.world,
            "passed": self.passed,
            "losses": self.losses,
            "loss_rel": self.loss_rel,
            "max_loss_rel": self.max_loss_rel,
            "worst_step": self.worst_step,
            "max_weight_rel": self.max_weight_rel,
            "worst_tensor": self.worst_tensor,
            "weight_rel": self.weight_rel,
            "seconds": self.seconds,
            "run_dir": self.run_dir,
            "checkpoint": self.checkpoint,
            "log": self.log,
        }


def compare(
    layout: Layout,
    losses: list[float],
    weights: dict,
    ref_losses: list[float],
    ref_weights: dict,
    tol: Tolerance,
) -> LayoutResult:
    """Per-step relative loss differences and per-tensor relative weight differences against the
    reference; passed when every one is within `tol` (a Tolerance)."""
    import torch

    if len(losses) != len(ref_losses):
        raise MlmError(
            f"layout {layout.name!r} logged {len(losses)} steps, the reference {len(ref_losses)}; "
            "see its run_dir/metrics.jsonl"
        )
    if missing := sorted(ref_weights.keys() ^ weights.keys()):
        raise MlmError(
            f"layout {layout.name!r}: tensors {', '.join(missing[:5])} are not in both checkpoints"
        )
    loss_rel = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(losses, ref_losses, strict=True)]
    weight_rel = {}
    for key, ref in ref_weights.items():
        ref64 = ref.double()
        norm = float(torch.linalg.vector_norm(ref64))
        weight_rel[key] = float(torch.linalg.vector_norm(weights[key].double() - ref64)) / (norm or 1.0)
    ok = all(r <= tol.loss_rel for r in loss_rel) and all(r <= tol.weight_rel for r in weight_rel.values())
    ok = ok and all(math.isfinite(x) for x in [*losses, *loss_rel, *weight_rel.values()])
    return LayoutResult(layout, list(losses), loss_rel, weight_rel, ok)


@dataclass
class ParityResult:
    precision: str
    tolerance: Tolerance
    steps: int
    layouts: list[LayoutResult]
    warnings: list[str] = field(default_factory=list)
    out: str = ""

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.layouts)

    def to_json(self) -> dict:
        return {
            "passed": self.passed,
            "precision": self.precision,
            "tolerance": dataclasses.asdict(self.tolerance),
            "steps": self.steps,
            "reference": self.layouts[0].layout.name if self.layouts else None,
            "warnings": self.warnings,
            "out": self.out,
            "layouts": [r.to_json() for r in self.layouts],
        }


# ---------------------------------------------------------------- running


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def resolve(config: str | Path | None, overrides: list[str], steps: int, out: Path) -> Config:
    """The user's config with the parity settings forced: K steps, a record every step, no
    evaluation, samples, TensorBoard or intermediate checkpoints."""
    if steps < 1:
        raise MlmError(f"--steps {steps}: must be at least 1")
    forced = [
        f"train.train_iters={steps}",
        "train.train_tokens=none",
        "train.eval_interval=0",
        "logging.log_interval=1",
        "logging.tensorboard=false",
        'logging.sample_prompt=""',
        "checkpoint.save_interval=0",
        'checkpoint.load=""',
        f"run_dir={_toml_str(str(out / 'run'))}",
        f"checkpoint.save={_toml_str(str(out / 'seed'))}",
    ]
    return load_config(config, [*overrides, *forced])


def _check_layouts(cfg: Config, layouts: list[Layout], resolve_with) -> None:
    """Everything that would make a layout's run fail at start, before anything is run or written.
    `resolve_with(overrides)` is the resolved config with more `--set` items."""
    from mlm.parallel import Mesh
    from mlm.train.trainer import check_supported, pick_device

    device = pick_device(cfg.train.device)
    pad = cfg.model.padded_vocab_size(1)
    for lay in layouts:
        try:
            lcfg = resolve_with(lay.overrides())
            shape = Mesh.shape_for(lcfg.parallel, lay.world * lcfg.parallel.cp)
            check_supported(Mesh(world_size=lay.world, rank=0, **shape), lcfg)
        except MlmError as e:
            raise MlmError(f"layout {lay.name!r}: {e}") from None
        if lcfg.model.padded_vocab_size(lay.tp) != pad:
            m, tps = cfg.model.make_vocab_size_divisible_by, {1, *(x.tp for x in layouts)}
            divisors = [d for d in range(m, 0, -1) if m % d == 0]  # the nicer suggestions first
            others = [d for d in range(m, 0, -1) if m % d]
            v = cfg.model.vocab_size
            fits = [d for d in divisors + others if len({math.ceil(v / (d * t)) * d * t for t in tps}) == 1]
            hint = f"--set model.make_vocab_size_divisible_by={fits[0]}" if fits else "another vocab size"
            raise MlmError(
                f"layout {lay.name!r}: the vocabulary pads to {lcfg.model.padded_vocab_size(lay.tp)} rows at "
                f"tp={lay.tp} but to {pad} in the one-process seed checkpoint, so the seed cannot load; "
                f"use {hint} so that every layout pads to the same size"
            )
        if device.type == "cuda":
            import torch

            if lay.world > torch.cuda.device_count():
                raise MlmError(
                    f"layout {lay.name!r} needs {lay.world} GPUs (one per rank); "
                    f"{torch.cuda.device_count()} are visible"
                )


def _write_seed(cfg: Config, out: Path) -> Path:
    """Step 0 of one process (the same init every mesh starts from), saved once."""
    from mlm.train.trainer import Trainer

    single = dataclasses.replace(
        cfg.parallel,
        tp=1,
        pp=1,
        vpp=1,
        cp=1,
        ep=1,
        first_stage_layers=None,
        last_stage_layers=None,
        sequence_parallel=False,
        distributed_optimizer=False,
    )
    trainer = Trainer(dataclasses.replace(cfg, parallel=single))
    path = trainer.save(str(out / "seed"))
    if trainer.device.type == "cuda":  # leave the GPU memory to the ranks
        import torch

        del trainer
        torch.cuda.empty_cache()
    return path


def train_command(layout: Layout, resolved: Path, seed: Path, run_dir: Path, ckpt: Path) -> list[str]:
    """`mlm train` under torchrun for one layout, from the seed checkpoint."""
    sets = [
        *layout.overrides(),
        f"run_dir={_toml_str(str(run_dir))}",
        f"checkpoint.save={_toml_str(str(ckpt))}",
    ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={layout.world}",
        "--local-addr=127.0.0.1",  # the workers meet on loopback, whatever the host name resolves to
        "-m",
        "cli.main",
        "train",
        "--config",
        str(resolved),
        *[a for s in sets for a in ("--set", s)],
        "--load",
        str(seed),
    ]


def _env(world: int) -> dict[str, str]:
    import importlib.util

    env = dict(os.environ)
    root = str(Path(importlib.util.find_spec("cli.main").origin).parents[1])  # this mlm, whatever the cwd
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))  # ranks share the cores
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback, as --local-addr
    env.setdefault("COLUMNS", "200")  # one step line per line in the log
    return env


def _train_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r.get("split") == "train"]


def _tail(log: Path, n: int = 30) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    errors = [x for x in lines if x.lstrip().startswith("error:")]  # mlm's own message, if there was one
    return "\n".join([*errors[:3], *(["..."] if errors else []), *lines[-n:]])


def _run_layout(layout: Layout, cmd: list[str], log: Path, run_dir: Path, steps: int, progress) -> float:
    task = progress.add_task(f"{layout.name} (world {layout.world})", total=steps)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=_env(layout.world), stdin=subprocess.DEVNULL, stdout=f, stderr=f)
        try:
            while proc.poll() is None:
                progress.update(task, completed=len(_train_records(run_dir)))
                time.sleep(0.25)
        finally:
            if proc.poll() is None:  # Ctrl-C or an error here: torchrun passes SIGTERM on to the ranks
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    progress.update(task, completed=len(_train_records(run_dir)))
    if proc.returncode != 0:
        raise MlmError(
            f"layout {layout.name!r}: `mlm train` under torchrun exited with code {proc.returncode}; "
            f"last lines of {log}:\n{_tail(log)}"
        )
    return time.perf_counter() - t0


def _weights(ckpt: Path) -> dict:
    """The model tensors of a checkpoint in their global shapes (fp32), whatever mesh wrote them."""
    import torch

    from mlm.checkpoint import ShardedTensor, load_checkpoint, read_manifest, resolve_checkpoint

    it_dir = resolve_checkpoint(ckpt)
    tensors = read_manifest(it_dir)["tensors"]
    out = {
        k.removeprefix("model/"): torch.empty(v["shape"], dtype=torch.float32)
        for k, v in tensors.items()
        if k.startswith("model/")
    }
    load_checkpoint(it_dir, {"model": [ShardedTensor.full(k, v) for k, v in out.items()]})
    return out


def _warnings(cfg: Config) -> list[str]:
    m, found = cfg.model, []
    drop = {k: getattr(m, k) for k in ("hidden_dropout", "attention_dropout") if getattr(m, k) > 0}
    if drop:
        what = ", ".join(f"model.{k}={v}" for k, v in drop.items())
        found.append(
            f"{what}: each layout draws its own dropout masks, so losses differ by more than rounding; "
            "compare with --set model.hidden_dropout=0 --set model.attention_dropout=0"
        )
    return found


def run_parity(
    config: str | Path | None,
    overrides: list[str],
    layouts: list[Layout],
    steps: int = 5,
    out: str | Path | None = None,
) -> ParityResult:
    """Run every layout from one seed checkpoint and compare it with the first; writes OUT/parity.json.

    OUT holds config.toml (the resolved config each run reads), seed/ (the step-0 checkpoint) and
    per layout LAYOUT/train.log, LAYOUT/run/metrics.jsonl and LAYOUT/ckpt/.
    """
    from mlm.console import console

    if not layouts:
        raise MlmError("--layouts is empty; e.g. --layouts tp1,tp2,dp2")
    shown = Path(out or f"runs/parity-{time.strftime('%Y%m%d-%H%M%S')}")
    out = shown.absolute()  # every path handed to the runs is absolute
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MlmError(f"{shown} already exists and is not empty; pass a new --out DIR")
    cfg = resolve(config, overrides, steps, out)
    _check_layouts(cfg, layouts, lambda sets: resolve(config, [*overrides, *sets], steps, out))
    tol = TOLERANCES[cfg.train.precision]
    out.mkdir(parents=True, exist_ok=True)
    resolved = out / "config.toml"
    # preset "": the resolved [model] is complete, and a preset would refill its unset (None) fields
    cfg = dataclasses.replace(cfg, preset="")
    atomic_write_text(resolved, to_toml(cfg))
    assert load_config(resolved) == cfg, "the resolved config does not read back the same"

    console.print(
        f"[bold]mlm parity[/] {len(layouts)} layouts × {steps} steps, {cfg.train.precision}, "
        f"reference {layouts[0].name}; writing {shown}",
        highlight=False,
    )
    seed = _write_seed(cfg, shown).absolute()  # the folder as the user named it, in the "saved" line
    results: list[LayoutResult] = []
    ref_losses: list[float] = []
    ref_weights: dict = {}
    with _progress() as progress:
        for lay in layouts:
            d = out / lay.name
            d.mkdir()
            run_dir, ckpt, log = d / "run", d / "ckpt", d / "train.log"
            seconds = _run_layout(
                lay, train_command(lay, resolved, seed, run_dir, ckpt), log, run_dir, steps, progress
            )
            losses = [float(r["loss"]) for r in _train_records(run_dir)]
            if len(losses) != steps:
                raise MlmError(f"layout {lay.name!r} logged {len(losses)} of {steps} steps; see {log}")
            weights = _weights(ckpt)
            if not results:
                ref_losses, ref_weights = losses, weights
            r = compare(lay, losses, weights, ref_losses, ref_weights, tol)
            r.seconds, r.run_dir, r.checkpoint, r.log = seconds, str(run_dir), str(ckpt), str(log)
            results.append(r)
            verdict = "reference" if len(results) == 1 else "[green]PASS[/]" if r.passed else "[red]FAIL[/]"
            progress.console.print(
                f"{lay.name}: {len(losses)} steps in {seconds:.1f} s, final loss {losses[-1]:.6f}, {verdict}",
                highlight=False,
            )
    result = ParityResult(cfg.train.precision, tol, steps, results, _warnings(cfg), str(shown))
    atomic_write_text(out / "parity.json", json.dumps(result.to_json(), indent=2) + "\n")
    return result


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mlm.console import console

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps"),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
    )


# ---------------------------------------------------------------- report


def render(result: ParityResult, console=None) -> None:
    """The report: a summary table (one row per layout), the per-step losses, the tolerance."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    tol, ref = result.tolerance, result.layouts[0].layout.name
    summary = Table(title=f"mlm parity: {result.steps} steps, {result.precision}, against {ref}")
    for name in ("layout", "world", "|Δloss|/loss", "‖Δw‖/‖w‖"):  # the largest over steps / tensors
        summary.add_column(name, no_wrap=True, justify="left" if name == "layout" else "right")
    summary.add_column("in tensor", overflow="fold")
    summary.add_column("result", no_wrap=True)
    for i, r in enumerate(result.layouts):
        summary.add_row(
            r.layout.name,
            str(r.layout.world),
            f"{r.max_loss_rel:.2e}",
            f"{r.max_weight_rel:.2e}",
            r.worst_tensor if i else "",
            "ref" if i == 0 else "[green]PASS[/]" if r.passed else "[red]FAIL[/]",
        )
    steps = Table(title=f"per step: loss of {ref}, |Δloss|/loss of the others")
    for name in ("step", f"{ref} loss", *(r.layout.name for r in result.layouts[1:])):
        steps.add_column(name, justify="right")
    for i in range(result.steps):
        cells = [f"{result.layouts[0].losses[i]:.6f}"]
        cells += [f"{r.loss_rel[i]:.1e}" for r in result.layouts[1:]]
        steps.add_row(str(i + 1), *cells)
    console.print(summary)
    console.print(steps)
    console.print(
        f"tolerance for {result.precision}: |Δloss|/loss ≤ {tol.loss_rel:.0e} at every step, "
        f"‖Δw‖/‖w‖ ≤ {tol.weight_rel:.0e} for every tensor ({tol.why}; see docs/parity.md)",
        highlight=False,
    )
    for w in result.warnings:
        console.print(f"[bold yellow]warning:[/] {w}", highlight=False)
    failed = [r.layout.name for r in result.layouts if not r.passed]
    verdict = f"[red]FAIL[/]: {', '.join(failed)}" if failed else "[green]PASS[/]"
    console.print(f"{verdict}; details in {Path(result.out) / 'parity.json'}", highlight=False)
