"""`mlm train --dry-run`: check a run's mesh against its model and batch, and show its layout
(the text `--layout` reads, docs/layout.md), the pipeline (and, under context parallelism, how each
sequence is split).

Nothing is allocated and no data is read: the model is built on the meta device once per
pipeline rank to count each stage's parameters, and the schedule is simulated (one forward
of a whole stage = 1, a backward = 2) to draw it and measure its bubble.
"""

from __future__ import annotations

import torch
from rich.console import Group
from rich.table import Table
from rich.text import Text

from mlm.build import build_rank_model
from mlm.config import Config
from mlm.layout import Layout
from mlm.parallel.context import check_context_parallel
from mlm.parallel.expert import check_expert_parallel
from mlm.parallel.mesh import Mesh
from mlm.parallel.parallelize import check_tensor_parallel
from mlm.parallel.pipeline import stage_layer_counts
from mlm.parallel.schedule_view import describe_schedule, render_text, save_png, timeline
from mlm.parallel.schedules import micro_batches_per_step


def _layer_range(keys: list[str]) -> str:
    return f"{keys[0]}–{keys[-1]}" if len(keys) > 1 else keys[0]


def _params(n: int) -> str:
    return f"{n / 1e6:,.1f}M"


def context_parallel_line(cfg: Config, dp: int) -> str:
    """How context parallelism splits each sequence, e.g. "context parallel: each 4096-token
    sequence in 8 chunks of 512; cp rank r holds chunks r and 7−r (1024 tokens), attention p2p
    ring; …" (cp > 1)."""
    p, T = cfg.parallel, cfg.data.seq_length
    cp, chunks = p.cp, 2 * p.cp
    attention = {
        "p2p": "p2p ring (keys and values passed around the cp ranks, each transfer overlapped with a step of attention)",
        "all_gather": "all_gather (keys and values of every cp rank gathered before attention)",
    }[p.cp_comm_type]
    line = (
        f"context parallel: each {T}-token sequence in {chunks} chunks of {T // chunks}; cp rank r holds "
        f"chunks r and {chunks - 1}−r ({T // cp} tokens), attention {attention}; "
    )
    if p.sequence_parallel and p.tp > 1:
        line += f"between layers each tp rank keeps {T // cp // p.tp} of them (sequence parallel); "
    return line + f"gradients reduced over dp × cp = {dp * cp} ranks"


def dry_run(cfg: Config, world_size: int, png: str | None = None) -> Group:
    """Validate `cfg` on `world_size` ranks (MlmError on the first problem); the report to print."""
    p, t = cfg.parallel, cfg.train
    lo = Layout.from_config(cfg, world_size)
    padded = cfg.model.padded_vocab_size(p.tp)
    check_tensor_parallel(cfg.model, padded, p.tp)
    check_expert_parallel(cfg.model, p.ep, p.tp, p.sequence_parallel)
    check_context_parallel(cfg.data.seq_length, p.cp, p.tp if p.sequence_parallel else 1)
    num_micro = micro_batches_per_step(t.global_batch_size, t.micro_batch_size, lo.dp, p.pp, p.vpp)
    counts = stage_layer_counts(cfg.model.num_layers, p.pp, p.vpp, p.first_stage_layers, p.last_stage_layers)

    mesh_line = Text(
        f"layout {lo}\n"
        f"mesh tp={p.tp} pp={p.pp}{f' vpp={p.vpp}' if p.vpp > 1 else ''} dp={lo.dp} cp={p.cp}"
        f"{f' ({p.cp_comm_type})' if p.cp > 1 else ''}{f' ep={p.ep}' if p.ep > 1 else ''} "
        f"(world {world_size}); micro-batch {t.micro_batch_size}, global batch {t.global_batch_size}, "
        f"{num_micro} micro-batches per step per dp rank; layers per virtual stage {counts}"
    )
    stages = Table(title="pipeline stages", title_justify="left")
    for col in ("rank", "chunks: layers", "embedding", "output", "parameters per rank"):
        stages.add_column(col, justify="right" if col.startswith("parameters") else "left")
    for r in range(p.pp):
        model = build_rank_model(cfg.model, p, Mesh.of(lo, r * lo.gpus // lo.pp), torch.device("meta"))
        why = "tied" if cfg.model.tie_embeddings else "MTP"  # what the last stage's copy is for
        mtp = f" + MTP {len(model.mtp)}" if model.mtp is not None else ""
        stages.add_row(
            str(r),
            ", ".join(_layer_range(c.layers) for c in model.chunks),
            "yes" if any(c.first for c in model.chunks) else (f"copy ({why})" if model.embed else ""),
            f"yes{mtp}" if any(c.last for c in model.chunks) else "",
            _params(sum(q.numel() for q in model.parameters())),
        )
    parts = [mesh_line]
    if p.cp > 1:
        parts.append(Text(context_parallel_line(cfg, lo.dp)))
    parts += [stages, Text(describe_schedule(p.pp, num_micro, p.vpp))]
    if p.pp > 1:
        tl = timeline(p.pp, num_micro, p.vpp)
        parts.append(render_text(tl))
        if png:
            save_png(tl, png, title=describe_schedule(p.pp, num_micro, p.vpp))
            parts.append(Text(f"wrote {png}"))
    return Group(*parts)
