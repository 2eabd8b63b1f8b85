"""The layout grammar of `mlm parity --layouts`: `tp2pp2dp2sp` → a `Layout` and its `--set` items.

    parse_layouts("tp1,tp2,dp2zero1")
    # [Layout('tp1'), Layout('tp2', tp=2), Layout('dp2zero1', dp=2, zero1=True)]

A layout is terms written together, `tp<N>`, `pp<N>`, `vpp<N>`, `dp<N>`, `cp<N>`, `ep<N>`, `sp`,
`zero1`, and with cp one of `p2p` / `ag` (parallel.cp_comm_type p2p / all_gather; without either
the config's); missing sizes are 1 and the world size is tp × pp × dp × cp. Expert parallelism
folds over each pipeline stage's dp × cp × tp ranks (`mlm.parallel.mesh`), so it adds no ranks:
where `ep<N>` comes without `dp<N>`, dp is the smallest that ep folds over, N / gcd(N, tp × cp)
(`ep2` is dp 2, `tp2ep2` and `cp2ep2` dp 1). Junk is an MlmError naming the bad term.

`mlm plan --layout` reads the same terms (`parse_terms`) plus two of its own, `mb<N>` (the
micro-batch) and `rcnone` / `rcsel` / `rcfull` (recompute none, selective, full); `mlm parity`
refuses those two: its runs take both from the config.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mlm.errors import MlmError

TERMS_HELP = "use tp<N>, pp<N>, vpp<N>, dp<N>, cp<N>, ep<N>, sp, zero1, p2p, ag"
PLAN_TERMS_HELP = TERMS_HELP + ", mb<N> (micro-batch), rcnone, rcsel, rcfull (recompute)"
_TERM = re.compile(r"(vpp|tp|pp|dp|cp|ep|mb)(\d*)|rc(none|sel|full)|sp|zero1|p2p|ag")
RECOMPUTE_TERMS = {"none": "none", "sel": "selective", "full": "full"}
"""`rc<X>` → the recompute it chooses (model.recompute)."""
COMM_TERMS = {"p2p": "p2p", "ag": "all_gather"}
"""The layout terms that choose parallel.cp_comm_type."""


@dataclass(frozen=True)
class Layout:
    """One parallel layout to compare, e.g. `tp2dp2sp` (missing sizes are 1; dp with ep, see above)."""

    name: str
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    cp: int = 1
    """parallel.cp: each sequence split over cp ranks"""
    ep: int = 1
    """parallel.ep: the MoE layers' experts spread over ep of each stage's dp × cp × tp ranks"""
    sp: bool = False
    """parallel.sequence_parallel"""
    zero1: bool = False
    """parallel.distributed_optimizer"""
    cp_comm_type: str | None = None
    """parallel.cp_comm_type ("p2p", "all_gather"); None: the config's"""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def overrides(self) -> list[str]:
        """`--set` items for `mlm train` (dp follows from the world size)."""
        sets = [
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.vpp={self.vpp}",
            f"parallel.cp={self.cp}",
            f"parallel.ep={self.ep}",
            f"parallel.sequence_parallel={str(self.sp).lower()}",
            f"parallel.distributed_optimizer={str(self.zero1).lower()}",
        ]
        if self.cp_comm_type is not None:
            sets.append(f'parallel.cp_comm_type="{self.cp_comm_type}"')
        if self.pp == 1:  # stage sizes of the user's config mean nothing without a pipeline
            sets += ["parallel.first_stage_layers=none", "parallel.last_stage_layers=none"]
        return sets


@dataclass(frozen=True)
class Terms:
    """A layout's terms as written: `sizes` ({"tp": 2, ...}, only those given), `flags` ({"sp", ...}),
    `recompute` (None unless an rc term is given)."""

    name: str
    sizes: dict[str, int]
    flags: frozenset[str]
    recompute: str | None = None

    @property
    def micro_batch(self) -> int | None:
        return self.sizes.get("mb")

    @property
    def cp_comm_type(self) -> str | None:
        comms = sorted(self.flags & COMM_TERMS.keys())
        return COMM_TERMS[comms[0]] if comms else None


def parse_terms(text: str, planner: bool = False) -> Terms:
    """'tp2dp2sp' → its terms; `planner`: also mb<N> and rc<X> (`mlm plan --layout`). MlmError
    naming the bad term otherwise."""
    name, sizes, flags, recompute, i = text.strip(), {}, set(), None, 0
    option, terms_help = ("--layout", PLAN_TERMS_HELP) if planner else ("--layouts", TERMS_HELP)
    if not name:
        raise MlmError(f"empty layout in {option}; {terms_help}, e.g. tp2dp2")
    while i < len(name):
        m = _TERM.match(name, i)
        if m is None:
            j = next((j for j in range(i + 1, len(name)) if _TERM.match(name, j)), len(name))
            raise MlmError(f"layout {name!r}: unknown term {name[i:j]!r}; {terms_help}")
        term, (dim, digits, rc) = m.group(0), m.groups()
        key = "rc" if rc else dim or term
        if not planner and key in ("mb", "rc"):
            raise MlmError(
                f"layout {name!r}: {term!r} is a term of `mlm plan --layout`; mlm parity takes the "
                "micro-batch and recompute from the config: --set train.micro_batch_size=N, "
                "--set model.recompute=full"
            )
        if key in sizes.keys() | flags or key == "rc" and recompute:
            raise MlmError(f"layout {name!r}: {'recompute' if key == 'rc' else key} is given twice")
        if rc:
            recompute = RECOMPUTE_TERMS[rc]
        elif dim is None:
            flags.add(term)
        elif not digits or int(digits) < 1:
            raise MlmError(f"layout {name!r}: {term!r} needs a size of at least 1, e.g. {dim}2")
        else:
            sizes[dim] = int(digits)
        i = m.end()
    comms = sorted(flags & COMM_TERMS.keys())
    if len(comms) > 1:
        raise MlmError(f"layout {name!r}: p2p and ag both choose parallel.cp_comm_type; give one")
    if comms and sizes.get("cp", 1) < 2:
        raise MlmError(
            f"layout {name!r}: {comms[0]} chooses context parallelism's attention "
            f"(parallel.cp_comm_type) and needs cp<N> with N ≥ 2, e.g. cp2{comms[0]}"
        )
    return Terms(name, sizes, frozenset(flags), recompute)


def parse_layout(text: str) -> Layout:
    """'tp2dp2sp' → Layout(tp=2, dp=2, sp=True); MlmError naming the bad term otherwise."""
    terms = parse_terms(text)
    sizes, flags = dict(terms.sizes), terms.flags
    if "ep" in sizes and "dp" not in sizes:  # the fewest ranks ep folds over (it adds none)
        sizes["dp"] = sizes["ep"] // math.gcd(sizes["ep"], sizes.get("tp", 1) * sizes.get("cp", 1))
    return Layout(
        terms.name, **sizes, sp="sp" in flags, zero1="zero1" in flags, cp_comm_type=terms.cp_comm_type
    )


def layout_text(
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    dp: int = 1,
    cp: int = 1,
    ep: int = 1,
    sp: bool = False,
    zero1: bool = False,
    cp_comm_type: str | None = None,
    micro_batch: int | None = None,
    recompute: str | None = None,
) -> str:
    """The terms `parse_terms(..., planner=True)` reads back as these values, e.g. 'tp8pp2vpp2dp32sp'."""
    text = f"tp{tp}pp{pp}" + (f"vpp{vpp}" if vpp > 1 else "") + f"dp{dp}"
    if cp > 1:
        text += f"cp{cp}" + next((t for t, c in COMM_TERMS.items() if c == cp_comm_type), "")
    text += (f"ep{ep}" if ep > 1 else "") + ("sp" if sp else "") + ("zero1" if zero1 else "")
    text += f"mb{micro_batch}" if micro_batch is not None else ""
    return text + next((f"rc{t}" for t, r in RECOMPUTE_TERMS.items() if r == recompute), "")


def parse_layouts(text: str) -> list[Layout]:
    """'tp1,tp2,dp2' → layouts in order (the first is the reference)."""
    layouts = [parse_layout(t) for t in text.split(",")]
    names = [lay.name for lay in layouts]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise MlmError(f"--layouts lists {', '.join(dupes)} more than once")
    return layouts
