"""The runner of `mlm parity`: one seed checkpoint, then `mlm train` under torchrun per layout.

`parse_layouts` reads `--layouts` (`mlm.layout` texts, comma-separated). A layout runs on the ranks
it names, tp × pp × dp × cp: where it gives no dp, dp is 1, or with ep<N> the fewest ranks ep folds
over (ep / gcd(ep, tp × cp): `ep2` is dp 2, `tp2ep2` and `cp2ep2` dp 1). What it leaves open
(micro-batch, recompute, sp, ...) is the run config's.

`run_parity` resolves the run config with the parity settings forced, checks every layout before
anything runs, writes the step-0 seed checkpoint once in this process, trains each layout from it
(its log, metrics and final checkpoint under OUT/LAYOUT/) with one evaluation after the last step,
reads back its losses, gradient norms, learning rates, eval loss and whole weights, compares them
with the first layout's and writes OUT/parity.json. With `against="megatron"` it also exports the
seed to torch_dist, trains it in megatron-core (`mlm.train.parity.megatron`, torchrun of one
process), imports megatron-core's final weights back and compares them the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from mlm.config import Config, load_config, to_toml, toml_value
from mlm.datasets.gpt import parse_split
from mlm.errors import MlmError
from mlm.fileio import atomic_write_text
from mlm.layout import Layout
from mlm.train.parity.results import LayoutResult, Measured, ParityResult, compare
from mlm.train.parity.tolerances import TOLERANCES


def parse_layouts(text: str) -> list[Layout]:
    """'tp1,tp2,dp2' → the layouts in order (the first is the reference); MlmError naming an empty,
    invalid or repeated one."""
    parts = text.split(",")
    if not all(p.strip() for p in parts):
        raise MlmError(f"empty layout in --layouts {text!r}; separate layouts by one comma, e.g. tp1,tp2,dp2")
    layouts = [Layout.parse(p) for p in parts]
    names = [str(lay) for lay in layouts]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise MlmError(f"--layouts lists {', '.join(dupes)} more than once")
    return layouts


def world(layout: Layout) -> int:
    """The ranks `layout` runs on (see the module docstring)."""
    dp = layout.dp if layout.dp is not None else layout.ep // math.gcd(layout.ep, layout.tp * layout.cp)
    return layout.tp * layout.pp * dp * layout.cp


def resolve(config: str | Path | None, overrides: list[str], steps: int, out: Path) -> Config:
    """The user's config with the parity settings forced: K steps (the first K of the run: the
    learning rate decays over the run's length), a record every step, one evaluation after the last
    step (over at most K batches) where data.split has a validation share, no samples, TensorBoard
    or intermediate checkpoints."""
    if steps < 1:
        raise MlmError(f"--steps {steps}: must be at least 1")
    run = load_config(config, overrides)
    t = run.train
    length = t.train_iters or math.ceil(t.train_tokens / (t.global_batch_size * run.data.seq_length))
    o = run.optimizer  # the run's schedule, not K steps'
    forced = [] if o.decay_iters or o.decay_samples else [f"optimizer.decay_iters={length}"]
    forced += [
        f"train.train_iters={steps}",
        "train.train_tokens=none",
        "train.eval_interval=0",
        "logging.log_interval=1",
        "logging.tensorboard=false",
        'logging.sample_prompt=""',
        "checkpoint.save_interval=0",
        'checkpoint.load=""',
        f"run_dir={toml_value(str(out / 'run'))}",
        f"checkpoint.save={toml_value(str(out / 'seed'))}",
    ]
    cfg = load_config(config, [*overrides, *forced])
    if not _has_validation(cfg):
        return cfg
    # eval_iters ≤ K: the evaluation costs less than the training it checks
    evaluate = {"eval_interval": steps, "eval_iters": min(cfg.train.eval_iters, steps)}
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **evaluate))


def _has_validation(cfg: Config) -> bool:
    return parse_split(cfg.data.split)[1] > 0


def _check_layouts(cfg: Config, layouts: list[Layout], resolve_with) -> list[Layout]:
    """Every layout as it will run (complete, from the config it resolves to); MlmError on
    anything that would make its run fail at start, before anything is run or written.
    `resolve_with(overrides)` is the resolved config with more `--set` items."""
    from mlm.parallel import Mesh
    from mlm.parallel.expert import check_expert_parallel
    from mlm.parallel.launch import pick_device
    from mlm.train.trainer import check_supported

    device = pick_device(cfg.train.device)
    pad = cfg.model.padded_vocab_size(1)
    runs: list[Layout] = []
    for lay in layouts:
        name = str(lay)
        try:
            lcfg = resolve_with(lay.overrides())
            run = Layout.from_config(lcfg, world(lay))
            mesh = Mesh.of(run)
            check_supported(mesh, lcfg)
            check_expert_parallel(lcfg.model, mesh.ep, mesh.tp, lcfg.parallel.sequence_parallel)
            if mesh.cp > 1 and lcfg.model.attention_dropout > 0:  # apply_context_parallel's rule
                raise MlmError(
                    f"model.attention_dropout={lcfg.model.attention_dropout} with parallel.cp={mesh.cp}: "
                    "attention dropout is not built under context parallelism; set it to 0"
                )
        except MlmError as e:
            raise MlmError(f"layout {name!r}: {e}") from None
        if lcfg.model.padded_vocab_size(lay.tp) != pad:
            m, tps = cfg.model.make_vocab_size_divisible_by, {1, *(x.tp for x in layouts)}
            divisors = [d for d in range(m, 0, -1) if m % d == 0]  # the nicer suggestions first
            others = [d for d in range(m, 0, -1) if m % d]
            v = cfg.model.vocab_size
            fits = [d for d in divisors + others if len({math.ceil(v / (d * t)) * d * t for t in tps}) == 1]
            hint = f"--set model.make_vocab_size_divisible_by={fits[0]}" if fits else "another vocab size"
            raise MlmError(
                f"layout {name!r}: the vocabulary pads to {lcfg.model.padded_vocab_size(lay.tp)} rows at "
                f"tp={lay.tp} but to {pad} in the one-process seed checkpoint, so the seed cannot load; "
                f"use {hint} so that every layout pads to the same size"
            )
        if runs and run.global_batch != runs[0].global_batch:
            raise MlmError(
                f"layout {name!r} trains a global batch of {run.global_batch}, the reference "
                f"{str(layouts[0])!r} {runs[0].global_batch}: parity compares one run on several layouts; "
                "give every layout the same gb<N>, or none (the config's train.global_batch_size)"
            )
        if device.type == "cuda":
            import torch

            if run.gpus > torch.cuda.device_count():
                raise MlmError(
                    f"layout {name!r} needs {run.gpus} GPUs (one per rank); "
                    f"{torch.cuda.device_count()} are visible"
                )
        runs.append(run)
    return runs


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
    """`mlm train` under torchrun for one complete layout, from the seed checkpoint."""
    sets = [
        *layout.overrides(),
        f"run_dir={toml_value(str(run_dir))}",
        f"checkpoint.save={toml_value(str(ckpt))}",
    ]
    return torchrun(
        layout.gpus, "cli.main", "train", "--config", str(resolved), *[a for s in sets for a in ("--set", s)],
        "--load", str(seed),
    )  # fmt: skip


def torchrun(world: int, module: str, *args: str) -> list[str]:
    """`python -m module args` under torchrun in `world` processes on this machine."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "--local-addr=127.0.0.1",  # the workers meet on loopback, whatever the host name resolves to
        "-m",
        module,
        *args,
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


def _records(run_dir: Path, split: str) -> list[dict]:
    """The records of one split ("train", "valid") in RUN_DIR/metrics.jsonl, in order."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r.get("split") == split]


def _measured(name: str, run_dir: Path, ckpt: Path, log: Path, steps: int, evaluated: bool) -> Measured:
    """A finished layout's losses, eval loss (after step K, where `evaluated`) and final weights."""
    records = _records(run_dir, "train")
    losses = [float(r["loss"]) for r in records]
    if len(losses) != steps:
        raise MlmError(f"layout {name!r} logged {len(losses)} of {steps} steps; see {log}")
    eval_loss = None
    if evaluated:
        last = [float(r["loss"]) for r in _records(run_dir, "valid") if r.get("step") == steps]
        if not last:
            raise MlmError(f"layout {name!r} logged no eval loss at step {steps}; see {log}")
        eval_loss = last[-1]
    lrs, grads = ([float(r[k]) for r in records] for k in ("lr", "grad_norm"))
    return Measured(losses, eval_loss, _weights(ckpt), lrs, grads)


def _tail(log: Path, n: int = 30) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    errors = [x for x in lines if x.lstrip().startswith("error:")]  # mlm's own message, if there was one
    ranks = [x for x in lines if x.startswith("[rank")]  # a rank's traceback, before torchrun's own
    return "\n".join([*errors[:3], *(["..."] if errors else []), *(ranks or lines)[-n:]])


def _run_layout(name: str, ranks: int, cmd: list[str], log: Path, done, steps: int, progress) -> float:
    """Run `cmd` (torchrun of `ranks` processes), its output in `log`; `done()` counts the steps
    finished so far, for the progress bar. The seconds it took; MlmError with the end of its log
    where it fails."""
    task = progress.add_task(f"{name} (world {ranks})", total=steps)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=_env(ranks), stdin=subprocess.DEVNULL, stdout=f, stderr=f)
        try:
            while proc.poll() is None:
                progress.update(task, completed=done())
                time.sleep(0.25)
        finally:
            if proc.poll() is None:  # Ctrl-C or an error here: torchrun passes SIGTERM on to the ranks
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    progress.update(task, completed=done())
    if proc.returncode != 0:
        what = "megatron-core's run" if name == "megatron" else f"layout {name!r}: `mlm train`"
        raise MlmError(
            f"{what} under torchrun exited with code {proc.returncode}; last lines of {log}:\n{_tail(log)}"
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
    if not _has_validation(cfg):
        found.append(
            f"data.split={cfg.data.split!r} has no validation share, so no eval loss is compared; "
            "give it one, e.g. --set data.split='98,2,0'"
        )
    return found


def _megatron_sets(cfg: Config) -> list[str]:
    """`megatron.SETTINGS` as --set items, or MlmError naming what megatron-core cannot train as mlm."""
    from mlm.train.parity import megatron

    if not megatron.available():
        raise MlmError(
            "--against megatron needs megatron-core, which is not installed here; "
            "pip install megatron-core==0.16.1 (Python 3.11, or pip install -e '.[dev]')"
        )
    if refused := megatron.unsupported(cfg):
        raise MlmError(f"--against megatron cannot compare this run: {'; '.join(refused)}")
    return [f"{k}={toml_value(v)}" for k, v in megatron.SETTINGS.items()]


def _run_megatron(resolved: Path, seed: Path, out: Path, steps: int, evaluated: bool, progress) -> tuple:
    """megatron-core's run (`mlm.train.parity.megatron`) from the seed, exported to torch_dist, in
    OUT/megatron/; (what it measured, its final weights imported back, the seconds it took)."""
    from mlm.checkpoint.manager import iter_dir_name
    from mlm.convert.megatron.exporter import export_megatron
    from mlm.convert.megatron.importer import import_megatron

    d = out / "megatron"
    d.mkdir()
    export_megatron(seed, d / "seed")  # the same initial weights, as Megatron-LM loads them
    spec = {
        "config": str(resolved),
        "seed": str(d / "seed" / iter_dir_name(0)),
        "steps": steps,
        "out": str(d),
    }
    atomic_write_text(d / "spec.json", json.dumps(spec, indent=1) + "\n")
    cmd = torchrun(1, "mlm.train.parity.megatron", str(d / "spec.json"))
    done = lambda: steps if (d / "steps.json").exists() else 0  # noqa: E731
    seconds = _run_layout("megatron", 1, cmd, d / "train.log", done, steps, progress)
    r = json.loads((d / "steps.json").read_text())
    import_megatron(d / "ckpt", d / "mlm-ckpt", weights_only=True)  # its final weights in mlm's names
    eval_loss = r["eval_loss"] if evaluated else None
    return Measured(r["loss"], eval_loss, _weights(d / "mlm-ckpt"), r["lr"], r["grad_norm"]), seconds


def run_parity(
    config: str | Path | None,
    overrides: list[str],
    layouts: list[Layout],
    steps: int = 5,
    out: str | Path | None = None,
    against: str | None = None,
) -> ParityResult:
    """Run every layout from one seed checkpoint and compare it with the first; writes OUT/parity.json.
    `against="megatron"`: megatron-core trains the same run in one process as well, compared with
    the first layout (mlm run with `megatron.SETTINGS`).

    OUT holds config.toml (the resolved config each run reads), seed/ (the step-0 checkpoint) and
    per layout LAYOUT/train.log, LAYOUT/run/metrics.jsonl (its train and eval losses) and LAYOUT/ckpt/;
    with `against`, megatron/ (its log, spec, seed and final checkpoint in torch_dist, steps.json).
    """
    from mlm.console import console

    if not layouts:
        raise MlmError("--layouts is empty; e.g. --layouts tp1,tp2,dp2")
    if against not in (None, "megatron"):
        raise MlmError(f"--against {against!r}: the one reference framework is megatron")
    shown = Path(out or f"runs/parity-{time.strftime('%Y%m%d-%H%M%S')}")
    out = shown.absolute()  # every path handed to the runs is absolute
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MlmError(f"{shown} already exists and is not empty; pass a new --out DIR")
    cfg = resolve(config, overrides, steps, out)
    forced = _megatron_sets(cfg) if against else []
    overrides = [*overrides, *forced]
    cfg = resolve(config, overrides, steps, out)
    names = [str(lay) for lay in layouts]

    def resolve_with(sets: list[str]) -> Config:
        return resolve(config, [*overrides, *sets], steps, out)

    runs = _check_layouts(cfg, layouts, resolve_with)
    if against:  # megatron-core runs in one process
        one = _check_layouts(cfg, [Layout.parse("tp1")], resolve_with)
    tol = TOLERANCES[cfg.train.precision]
    out.mkdir(parents=True, exist_ok=True)
    resolved = out / "config.toml"
    # preset "": the resolved [model] is complete, and a preset would refill its unset (None) fields
    cfg = dataclasses.replace(cfg, preset="")
    atomic_write_text(resolved, to_toml(cfg))
    assert load_config(resolved) == cfg, "the resolved config does not read back the same"

    console.print(
        f"[bold]mlm parity[/] {len(layouts)} layout{'s' if len(layouts) > 1 else ''}"
        f"{' and megatron-core' if against else ''} × {steps} steps, "
        f"{cfg.train.precision}, reference {names[0]}; writing {shown}",
        highlight=False,
    )
    if forced:
        console.print(f"Megatron-LM's semantics in mlm: {', '.join(forced)}", highlight=False)
    seed = _write_seed(cfg, shown).absolute()  # the folder as the user named it, in the "saved" line
    results: list[LayoutResult] = []
    ref: Measured | None = None
    with _progress() as progress:
        for name, lay in zip(names, runs, strict=True):
            d = out / name
            d.mkdir()
            run_dir, ckpt, log = d / "run", d / "ckpt", d / "train.log"
            cmd = train_command(lay, resolved, seed, run_dir, ckpt)
            done = lambda d=run_dir: len(_records(d, "train"))  # noqa: E731
            seconds = _run_layout(name, lay.gpus, cmd, log, done, steps, progress)
            got = _measured(name, run_dir, ckpt, log, steps, evaluated=bool(cfg.train.eval_interval))
            ref = ref or got
            r = compare(name, lay, got, ref, tol)
            r.seconds, r.run_dir, r.checkpoint, r.log = seconds, str(run_dir), str(ckpt), str(log)
            results.append(_reported(r, got, len(results) == 0, progress))
        if against:
            got, seconds = _run_megatron(resolved, seed, out, steps, bool(cfg.train.eval_interval), progress)
            r = compare("megatron", one[0], got, ref, tol)
            d = out / "megatron"
            r.seconds, r.run_dir, r.checkpoint, r.log = seconds, str(d), str(d / "ckpt"), str(d / "train.log")
            results.append(_reported(r, got, False, progress))
    result = ParityResult(cfg.train.precision, tol, steps, results, _warnings(cfg), str(shown))
    atomic_write_text(out / "parity.json", json.dumps(result.to_json(), indent=2) + "\n")
    return result


def _reported(r: LayoutResult, got: Measured, reference: bool, progress) -> LayoutResult:
    """`r`, its line printed."""
    verdict = "reference" if reference else "[green]PASS[/]" if r.passed else "[red]FAIL[/]"
    eval_text = "" if got.eval_loss is None else f", eval loss {got.eval_loss:.6f}"
    progress.console.print(
        f"{r.name}: {len(got.losses)} steps in {r.seconds:.1f} s, final loss {got.losses[-1]:.6f}{eval_text}, "
        f"{verdict}",
        highlight=False,
    )
    return r


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
