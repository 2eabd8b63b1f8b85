"""A mesh layout: one frozen value (`Layout`) and its one text form, e.g. `tp8pp4vpp2dp16spzero1mb1rcsel`.

    Layout.parse("tp2pp2dp2sp")     # Layout(tp=2, pp=2, dp=2, sequence_parallel=True, ...)
    str(layout)                     # the canonical text: parse(str(x)) == x
    Layout.from_config(cfg, 8)      # a run config on 8 ranks; layout.overrides(): its --set items

The grammar (docs/layout.md): terms written together in any order, each at most once.

    tp<N> pp<N> vpp<N> dp<N> cp<N> ep<N>   sizes (missing: 1, but dp: what the world size leaves)
    first<N> last<N>                       layers on the first / last pipeline stage (missing: even)
    sp nosp                                sequence parallelism on / off
    zero1 nozero1                          optimizer sharded over dp × cp (distributed) / replicated
    fsdp hsdp<N> nofsdp                    parameters, gradients and optimizer sharded over dp × cp
                                           (FSDP) / over groups of N of them (HSDP) / not
    p2p ag                                 cp's attention: p2p ring / all_gather (needs cp<N>, N ≥ 2)
    mb<N> gb<N>                            micro-batch, global batch (samples)
    rcnone rcsel rcfull                    recompute none / selective / full

A term that is not written leaves its field open (None): the command using the layout completes it
(`mlm plan` with the fastest choice that fits, `mlm train` and `mlm parity` with the run config's).
Fields meaningless for the mesh are closed instead: sequence parallelism is off at tp 1, the
optimizer replicated and FSDP off on one dp × cp rank, cp's attention p2p at cp 1. zero1 and fsdp
exclude each other, so each closes the other (`nozero1`, a replicated optimizer, means no FSDP
too). `str` prints the terms in one order, sizes of 1 and open fields left out (a layout with
nothing to print is `tp1`).

Expert parallelism folds over each pipeline stage's dp × cp × tp ranks (`mlm.parallel.mesh`), so
ep adds no ranks: the world size is tp × pp × dp × cp. Torch-free: the planner imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mlm.errors import MlmError

if TYPE_CHECKING:
    from mlm.config import Config, ParallelConfig

TERMS_HELP = (
    "use tp<N>, pp<N>, vpp<N>, dp<N>, cp<N>, ep<N>, sp, zero1, fsdp, hsdp<N> (fsdp sharded over N "
    "of the dp × cp ranks), p2p, ag, mb<N> (micro-batch), rcnone, rcsel, rcfull (recompute), gb<N> "
    "(global batch), first<N>, last<N> (layers on the first/last pipeline stage), nosp, nozero1, "
    "nofsdp (off); see docs/layout.md"
)
_TERM = re.compile(
    r"(vpp|tp|pp|dp|cp|ep|mb|gb|first|last|hsdp)(\d*)|rc(none|sel|full)|(no)?(sp|zero1|fsdp)|p2p|ag"
)
_SIZES = {
    "mb": "micro_batch",
    "gb": "global_batch",
    "first": "first_stage_layers",
    "last": "last_stage_layers",
}
"""Sized terms whose field is not the term's own name (tp<N> → tp, ...)."""
_RECOMPUTE = {"none": "none", "sel": "selective", "full": "full"}
"""`rc<X>` → the recompute it chooses (model.recompute)."""
_COMM = {"p2p": "p2p", "ag": "all_gather"}
"""The terms that choose parallel.cp_comm_type."""
_FLAGS = {"sp": "sequence_parallel", "zero1": "distributed_optimizer", "fsdp": "fsdp"}


@dataclass(frozen=True)
class Layout:
    """A mesh and the per-rank choices that go with it. cp splits each sequence over cp ranks
    (`cp_comm_type`: how attention reaches the other ranks' keys and values); gradients are
    reduced over dp × cp (`dp_cp`). ep folds over each pipeline stage's dp × cp × tp ranks
    (`edp` = dp·cp·tp / ep hold the same experts). None: open (see the module docstring); the
    planner's layouts are complete."""

    tp: int
    pp: int
    dp: int | None
    """None: what the world size leaves (`with_world`)"""
    micro_batch: int | None
    global_batch: int | None
    vpp: int = 1
    sequence_parallel: bool | None = False
    recompute: str | None = "none"
    """none, selective or full (model.recompute)"""
    distributed_optimizer: bool | None = False
    first_stage_layers: int | None = None
    """None: an even share (parallel.first_stage_layers)"""
    last_stage_layers: int | None = None
    cp: int = 1
    ep: int = 1
    cp_comm_type: str | None = "p2p"
    """p2p (a ring of key/value exchanges) or all_gather; p2p at cp = 1, where it means nothing."""
    fsdp: bool | None = False
    """Parameters, gradients and Adam state sharded over dp × cp (parallel.fsdp, ZeRO-3)."""
    fsdp_shard: int | None = None
    """HSDP: shard over groups of this many dp × cp ranks, replicated across the groups
    (parallel.fsdp_shard_size); None: over all dp × cp ranks."""

    def __post_init__(self):
        if self.fsdp_shard is not None and (self.fsdp is False or self.fsdp_shard < 1):
            raise MlmError(f"hsdp{self.fsdp_shard}: needs fsdp on and a shard size of at least 1")
        if self.distributed_optimizer and self.fsdp:
            raise MlmError(
                f"{'hsdp' + str(self.fsdp_shard) if self.fsdp_shard else 'fsdp'} with zero1: FSDP shards "
                "the optimizer state already (with the parameters and gradients); give one of them"
            )
        closed: dict[str, object] = {}
        if self.tp == 1 and self.sequence_parallel is None:
            closed["sequence_parallel"] = False
        if self.fsdp_shard is not None or self.fsdp:
            closed["fsdp"] = True
            closed["distributed_optimizer"] = False  # FSDP shards the optimizer itself
        elif self.fsdp is None and self.distributed_optimizer is not None:
            closed["fsdp"] = False  # zero1 excludes it; nozero1 (replicated) too
        W = None if self.dp is None else self.dp * self.cp
        if W == 1:
            closed.update(fsdp=False, fsdp_shard=None)
            if self.distributed_optimizer is None:
                closed["distributed_optimizer"] = False
        elif W is not None and self.fsdp_shard is not None:
            if W % self.fsdp_shard:
                raise MlmError(
                    f"hsdp{self.fsdp_shard} does not divide dp({self.dp}) × cp({self.cp}) = {W}, the "
                    f"ranks FSDP shards over; choose one of {', '.join(_divisors(W))}"
                )
            if self.fsdp_shard == W:  # sharded over all of them: plain fsdp
                closed["fsdp_shard"] = None
        if self.cp == 1:
            closed["cp_comm_type"] = "p2p"
        for name, value in closed.items():
            object.__setattr__(self, name, value)

    @property
    def num_micro(self) -> int:
        """Micro-batches per step per data-parallel rank."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def gpus(self) -> int:
        """The world size, tp × pp × dp × cp (ranks: GPUs, or CPU processes)."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def dp_cp(self) -> int:
        """The ranks that reduce the dense gradients (and shard them under the distributed
        optimizer): cp ranks hold other tokens of the same sequences, so they act as dp."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the ranks of a stage holding the same experts."""
        return self.dp * self.cp * self.tp // self.ep

    @classmethod
    def parse(cls, text: str) -> Layout:
        """'tp2dp2sp' → Layout(tp=2, dp=2, sequence_parallel=True, the rest open); MlmError naming
        the bad term and the valid ones otherwise."""
        name, i = text.strip(), 0
        fields: dict[str, object] = {}
        if not name:
            raise MlmError(f"empty layout; give terms such as tp2dp2 ({TERMS_HELP})")
        while i < len(name):
            m = _TERM.match(name, i)
            if m is None:
                j = next((j for j in range(i + 1, len(name)) if _TERM.match(name, j)), len(name))
                raise MlmError(f"layout {name!r}: unknown term {name[i:j]!r}; {TERMS_HELP}")
            term, (dim, digits, rc, no, flag) = m.group(0), m.groups()
            if dim == "hsdp":  # fsdp, sharded over groups of N ranks
                field, value = "fsdp", True
                fields["fsdp_shard"] = int(digits or 0)
            elif dim:
                field, value = _SIZES.get(dim, dim), int(digits or 0)
            elif rc:
                field, value = "recompute", _RECOMPUTE[rc]
            elif flag:
                field, value = _FLAGS[flag], not no
            else:
                field, value = "cp_comm_type", _COMM[term]
            if field in fields:
                if field == "cp_comm_type" and fields[field] != value:
                    raise MlmError(f"layout {name!r}: p2p and ag both choose parallel.cp_comm_type; give one")
                if field == "fsdp":
                    raise MlmError(
                        f"layout {name!r}: fsdp, hsdp<N> and nofsdp each choose parallel.fsdp; give one"
                    )
                raise MlmError(
                    f"layout {name!r}: {'recompute' if rc else dim or flag or term} is given twice"
                )
            if dim and (fields.get("fsdp_shard", 1) if dim == "hsdp" else value) < 1:
                raise MlmError(f"layout {name!r}: {term!r} needs a size of at least 1, e.g. {dim}2")
            fields[field] = value
            i = m.end()
        if fields.get("distributed_optimizer") and fields.get("fsdp"):
            fsdp = f"hsdp{fields['fsdp_shard']}" if "fsdp_shard" in fields else "fsdp"
            raise MlmError(
                f"layout {name!r}: zero1 shards the optimizer state, {fsdp} shards it with the "
                "parameters and gradients; give one of them"
            )
        comm = next((t for t, c in _COMM.items() if c == fields.get("cp_comm_type")), None)
        if comm and fields.get("cp", 1) < 2:
            raise MlmError(
                f"layout {name!r}: {comm} chooses context parallelism's attention "
                f"(parallel.cp_comm_type) and needs cp<N> with N ≥ 2, e.g. cp2{comm}"
            )
        open_ = (
            "dp",
            "micro_batch",
            "global_batch",
            "sequence_parallel",
            "recompute",
            "distributed_optimizer",
            "fsdp",
        )
        return cls(**{"tp": 1, "pp": 1, **dict.fromkeys(open_), "cp_comm_type": None, **fields})

    def __str__(self) -> str:
        """The canonical text: `Layout.parse` reads it back to this value."""
        text = "".join(f"{d}{getattr(self, d)}" for d in ("tp", "pp", "vpp") if getattr(self, d) > 1)
        text += f"first{self.first_stage_layers}" if self.first_stage_layers is not None else ""
        text += f"last{self.last_stage_layers}" if self.last_stage_layers is not None else ""
        text += f"dp{self.dp}" if self.dp is not None else ""
        if self.cp > 1:
            text += f"cp{self.cp}" + next((t for t, c in _COMM.items() if c == self.cp_comm_type), "")
        text += f"ep{self.ep}" if self.ep > 1 else ""
        one_rank = self.dp is not None and self.dp * self.cp == 1  # a replicated optimizer goes unsaid
        for flag, on, unsaid in (
            ("sp", self.sequence_parallel, self.tp == 1),
            ("zero1", self.distributed_optimizer, one_rank or bool(self.fsdp)),
            # nozero1 and zero1 each say no FSDP already
            ("fsdp", self.fsdp, one_rank or self.distributed_optimizer is not None),
        ):
            if on and flag == "fsdp" and self.fsdp_shard is not None:
                flag = f"hsdp{self.fsdp_shard}"
            text += flag if on else f"no{flag}" if on is False and not unsaid else ""
        text += f"mb{self.micro_batch}" if self.micro_batch is not None else ""
        if self.recompute is not None:
            text += next(f"rc{t}" for t, r in _RECOMPUTE.items() if r == self.recompute)
        text += f"gb{self.global_batch}" if self.global_batch is not None else ""
        return text or "tp1"

    @classmethod
    def from_parallel(cls, parallel: ParallelConfig, world_size: int) -> Layout:
        """The mesh of a `[parallel]` config on `world_size` ranks (dp what they leave; MlmError
        showing the product when they cannot hold it); batching and recompute open."""
        p = parallel
        return cls(
            p.tp,
            p.pp,
            None,
            None,
            None,
            p.vpp,
            p.sequence_parallel,
            None,
            p.distributed_optimizer,
            p.first_stage_layers,
            p.last_stage_layers,
            p.cp,
            p.ep,
            p.cp_comm_type,
            p.fsdp,
            p.fsdp_shard_size if p.fsdp else None,
        ).with_world(world_size)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> Layout:
        """The complete layout of a run config on `world_size` ranks."""
        return replace(
            cls.from_parallel(cfg.parallel, world_size),
            micro_batch=cfg.train.micro_batch_size,
            global_batch=cfg.train.global_batch_size,
            recompute=cfg.model.recompute,
        )

    def with_world(self, world_size: int) -> Layout:
        """This layout on `world_size` ranks: dp what tp × pp × cp leave where it is open; MlmError
        showing the product when they do not make `world_size`, or when ep does not divide a
        pipeline stage's dp × cp × tp ranks."""
        tp, pp, cp, ep = self.tp, self.pp, self.cp, self.ep
        if self.dp is not None and self.gpus != world_size:
            raise MlmError(
                f"tp({tp}) × pp({pp}) × dp({self.dp}) × cp({cp}) = {self.gpus} ≠ world size {world_size}; "
                f"run on {self.gpus} ranks, or leave dp out of the layout to take what the world size leaves"
            )
        inner = tp * pp * cp
        if world_size % inner:
            raise MlmError(
                f"tp({tp}) × pp({pp}) × cp({cp}) = {inner} does not divide world size {world_size}; "
                "choose sizes whose product divides the number of processes"
            )
        dp = world_size // inner
        if self.fsdp_shard is not None and (dp * cp) % self.fsdp_shard:
            raise MlmError(
                f"hsdp{self.fsdp_shard} does not divide dp({dp}) × cp({cp}) = {dp * cp}, the ranks FSDP "
                f"shards over; choose one of {', '.join(_divisors(dp * cp))}"
            )
        if (dp * cp * tp) % ep:
            raise MlmError(
                f"ep({ep}) must divide dp({dp}) × cp({cp}) × tp({tp}) = {dp * cp * tp}, the ranks of a "
                "pipeline stage that experts are spread over; choose an ep that divides it"
            )
        return replace(self, dp=dp)

    def mesh(self) -> Layout:
        """The mesh alone (sizes, stage split, cp's attention): the per-rank choices open."""
        return replace(
            self,
            micro_batch=None,
            global_batch=None,
            sequence_parallel=None,
            recompute=None,
            distributed_optimizer=None,
            fsdp=None,
            fsdp_shard=None,
        )

    def overrides(self) -> list[str]:
        """`--set` items that give a run this layout: every size and the stage split (dp follows
        from the world size), and each choice that is not open."""
        sets = [f"parallel.{d}={getattr(self, d)}" for d in ("tp", "pp", "vpp", "cp", "ep")]
        for name in ("first_stage_layers", "last_stage_layers"):
            n = getattr(self, name)
            sets.append(f"parallel.{name}={'none' if n is None else n}")
        for key, value in (
            ("parallel.sequence_parallel", self.sequence_parallel),
            ("parallel.distributed_optimizer", self.distributed_optimizer),
            ("parallel.fsdp", self.fsdp),
            ("parallel.cp_comm_type", self.cp_comm_type if self.cp > 1 else None),
            ("train.micro_batch_size", self.micro_batch),
            ("train.global_batch_size", self.global_batch),
            ("model.recompute", self.recompute),  # quoted: a bare none would unset it
        ):
            if value is not None:
                sets.append(f"{key}={str(value).lower() if isinstance(value, bool) else _quoted(value)}")
        if self.fsdp is not None:  # none: over all dp × cp ranks (and unset where FSDP is off)
            sets.append(f"parallel.fsdp_shard_size={'none' if self.fsdp_shard is None else self.fsdp_shard}")
        return sets

    @property
    def fsdp_shard_size(self) -> int:
        """The ranks of an FSDP shard group (HSDP's `fsdp_shard`, else dp × cp: needs dp); 1 without FSDP."""
        return (self.fsdp_shard or self.dp * self.cp) if self.fsdp else 1


def _divisors(n: int) -> list[str]:
    return [str(d) for d in range(1, n + 1) if n % d == 0]


def _quoted(value) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)
