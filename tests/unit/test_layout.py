"""`mlm.layout`: one `Layout` and its text. Every layout the planner's search generates (dense,
MoE with ep, DeepSeek-V3 with cp, ep and uneven stage splits) prints to text that parses back to
it, as does any layout at all (hypothesis); bad text names the term and the valid ones; a run
config converts to a layout and back; the mesh is built from one; a plan file holds its text;
and `mlm plan --layout`, `mlm parity --layouts`, `mlm train --dry-run --layout` and
`mlm convert --layout` read the same text."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from mlm.config import load_config
from mlm.errors import MlmError
from mlm.layout import Layout
from mlm.parallel.mesh import Mesh
from mlm.plan.hardware import load_hardware
from mlm.plan.job import make_job
from mlm.plan.search import SHARDINGS, _divisors, _family_layouts, context_parallel_sizes
from tests.helpers.common import assert_error, mlm


def _generated(job):
    """Every layout the search generates for `job`, fitting or not (`search._family_layouts` over
    every (tp, pp) family whose cp sizes are valid, every sharding: none, zero1, hsdp, fsdp)."""
    n = job.gpus
    for tp in _divisors(n):
        for pp in _divisors(n // tp):
            try:
                cps = context_parallel_sizes(job.cfg, n // (tp * pp), tp)
            except MlmError:
                continue
            yield from _family_layouts(job, tp, pp, SHARDINGS["auto"], cps=tuple(cps))


@pytest.mark.parametrize(
    "preset,gpus,seq,batch",
    [
        ("llama3-8b", 8, 32768, 16),
        ("llama3-8b", 64, 8192, 64),
        ("llama3-70b", 512, 8192, 1024),
        ("mixtral-8x7b", 64, 4096, 512),
        ("qwen3-30b-a3b", 32, 4096, 256),
        ("deepseek-v3", 256, 4096, 1024),
    ],
)
def test_every_layout_the_planner_generates_round_trips(preset, gpus, seq, batch):
    job = make_job(None, [f"preset={preset}"], gpus, 8, load_hardware("h100-80g"), seq, batch)
    seen = {"vpp": 0, "cp": 0, "ag": 0, "ep": 0, "uneven": 0, "zero1": 0, "nozero1": 0, "fsdp": 0, "hsdp": 0}
    for lo in _generated(job):
        text = str(lo)
        assert Layout.parse(text) == lo, (text, lo)
        assert lo.dp is not None and f"dp{lo.dp}" in text and f"gb{batch}" in text
        seen["vpp"] += lo.vpp > 1
        seen["cp"] += lo.cp > 1
        seen["ag"] += lo.cp_comm_type == "all_gather"
        seen["ep"] += lo.ep > 1
        seen["uneven"] += lo.first_stage_layers is not None
        seen["zero1"] += bool(lo.distributed_optimizer)
        seen["nozero1"] += "nozero1" in text
        seen["fsdp"] += "fsdp" in text and "nofsdp" not in text
        seen["hsdp"] += "hsdp" in text
        assert not (lo.fsdp and lo.distributed_optimizer)
    moe = preset not in ("llama3-8b", "llama3-70b")
    mtp = preset == "deepseek-v3"  # FSDP is not built with MTP yet (`fsdp_refusals`): none offered
    unseen = set() if moe else {"ep"}
    unseen |= {"fsdp", "hsdp"} if mtp else set()
    unseen |= {"hsdp"} if gpus <= 8 else set()  # HSDP replicates over nodes
    assert all(n > 0 for k, n in seen.items() if k not in unseen), seen
    assert not mtp or seen["fsdp"] == seen["hsdp"] == 0, seen


def test_a_planned_layout_reads():
    lo = Layout(8, 16, 4, 1, 1024, 1, True, "full", True, 3, 2, 2, 8, "all_gather")
    assert str(lo) == "tp8pp16first3last2dp4cp2agep8spzero1mb1rcfullgb1024"
    assert (lo.gpus, lo.dp_cp, lo.edp, lo.num_micro) == (1024, 8, 8, 256)
    # any order, each term once; sizes of 1 and open fields are left out of the canonical text
    assert Layout.parse("zero1sptp8ep8cp2agdp4pp16gb1024rcfullmb1first3last2") == lo
    assert str(Layout.parse("tp1pp1")) == "tp1" and str(Layout.parse("ep2dp3")) == "dp3ep2"


def test_terms_not_given_are_open_and_meaningless_ones_closed():
    lo = Layout.parse("tp2pp2")
    assert (lo.dp, lo.micro_batch, lo.global_batch, lo.recompute) == (None, None, None, None)
    assert (lo.sequence_parallel, lo.distributed_optimizer, lo.cp_comm_type) == (None, None, "p2p")
    assert (
        Layout.parse("tp2nosp").sequence_parallel is False
        and Layout.parse("dp2nozero1").distributed_optimizer is False
    )
    one = Layout.parse("dp1")  # tp 1, one dp × cp rank, cp 1: nothing to choose
    assert (one.sequence_parallel, one.distributed_optimizer, one.cp_comm_type) == (False, False, "p2p")
    # built in code, a layout's choices are the planner's defaults, not open
    assert str(Layout(2, 1, None, None, None)) == "tp2nospnozero1rcnone"
    assert Layout.parse("pp4first3last2").mesh() == Layout.parse("pp4first3last2")
    assert str(Layout.parse("tp2dp4spzero1mb2rcselgb64").mesh()) == "tp2dp4"


def test_fsdp_terms_choose_the_sharding_and_close_zero1():
    """fsdp, hsdp<N> and nofsdp set parallel.fsdp (and fsdp_shard_size); FSDP shards the optimizer
    itself, so zero1 goes unsaid beside it, and zero1 or nozero1 (a replicated optimizer) say no
    FSDP; one dp × cp rank has nothing to shard; hsdp<N> over all dp × cp ranks is fsdp."""
    fsdp, hsdp = Layout.parse("tp2dp8fsdp"), Layout.parse("dp8hsdp4")
    assert (fsdp.fsdp, fsdp.fsdp_shard, fsdp.distributed_optimizer, fsdp.fsdp_shard_size) == (
        True,
        None,
        False,
        8,
    )
    assert (hsdp.fsdp, hsdp.fsdp_shard, hsdp.distributed_optimizer, hsdp.fsdp_shard_size) == (
        True,
        4,
        False,
        4,
    )
    assert (str(fsdp), str(hsdp)) == ("tp2dp8fsdp", "dp8hsdp4")
    assert Layout.parse("dp8hsdp8") == Layout.parse("dp8fsdp") and str(Layout.parse("dp8hsdp8")) == "dp8fsdp"
    assert Layout.parse("zero1").fsdp is False and Layout.parse("nozero1").fsdp is False
    assert (Layout.parse("nofsdp").fsdp, Layout.parse("nofsdp").distributed_optimizer) == (False, None)
    assert Layout.parse("tp2").fsdp is None and str(Layout.parse("nofsdp")) == "nofsdp"
    assert (Layout.parse("dp1fsdp").fsdp, str(Layout.parse("dp1fsdp"))) == (False, "dp1")
    assert str(Layout.parse("hsdp2").with_world(8)) == "dp8hsdp2"
    assert Layout.parse("hsdp2").mesh() == Layout.parse("tp1")
    # a run gets parallel.fsdp and its shard size, zero1 off
    sets = Layout.parse("dp8hsdp4").overrides()
    assert {
        "parallel.fsdp=true",
        "parallel.fsdp_shard_size=4",
        "parallel.distributed_optimizer=false",
    } <= set(sets)
    assert "parallel.fsdp_shard_size=none" in Layout.parse("fsdp").overrides()
    assert "parallel.fsdp=false" in Layout.parse("zero1").overrides()
    assert not any("fsdp" in s for s in Layout.parse("tp2").overrides())
    cfg = load_config(None, ["preset=tiny-llama", *Layout.parse("tp2dp4hsdp2").overrides()])
    assert (cfg.parallel.fsdp, cfg.parallel.fsdp_shard_size, cfg.parallel.distributed_optimizer) == (
        True,
        2,
        False,
    )
    assert Layout.from_config(cfg, 8) == replace(
        Layout.parse("tp2dp4hsdp2"),
        micro_batch=cfg.train.micro_batch_size,
        global_batch=cfg.train.global_batch_size,
        recompute=cfg.model.recompute,
        sequence_parallel=False,
        cp_comm_type="p2p",
    )
    with pytest.raises(
        MlmError,
        match=r"hsdp3 does not divide dp\(4\) × cp\(1\) = 4, the ranks FSDP shards over; choose one of 1, 2, 4",
    ):
        Layout.parse("hsdp3").with_world(4)
    with pytest.raises(MlmError, match="fsdp with zero1: FSDP shards the optimizer state already"):
        Layout(1, 1, 8, None, None, distributed_optimizer=True, fsdp=True)


sizes = st.integers(1, 64)
maybe = lambda s: st.none() | s  # noqa: E731


@given(
    st.fixed_dictionaries(
        {},
        optional={"fsdp": maybe(st.booleans()), "fsdp_shard": maybe(st.sampled_from([1, 2, 3, 4, 8]))},
    ),
    st.builds(
        Layout,
        tp=sizes,
        pp=sizes,
        dp=maybe(sizes),
        micro_batch=maybe(sizes),
        global_batch=maybe(st.integers(1, 1 << 20)),
        vpp=sizes,
        sequence_parallel=maybe(st.booleans()),
        recompute=maybe(st.sampled_from(["none", "selective", "full"])),
        distributed_optimizer=maybe(st.booleans()),
        first_stage_layers=maybe(sizes),
        last_stage_layers=maybe(sizes),
        cp=sizes,
        ep=sizes,
        cp_comm_type=maybe(st.sampled_from(["p2p", "all_gather"])),
    ),
)
def test_any_layout_round_trips(sharding, lo):
    try:  # with FSDP where it is consistent: not beside zero1, an hsdp<N> dividing dp × cp
        lo = replace(lo, **sharding)
    except MlmError:
        assume(False)
    text = str(lo)
    assert Layout.parse(text) == lo and str(Layout.parse(text)) == text


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "tp2x",
            "layout 'tp2x': unknown term 'x'; use tp<N>, pp<N>, vpp<N>, dp<N>, cp<N>, ep<N>, sp, zero1, fsdp, "
            "hsdp<N> (fsdp sharded over N of the dp × cp ranks), p2p, ag, mb<N> (micro-batch), rcnone, "
            "rcsel, rcfull (recompute), gb<N> (global batch), first<N>, last<N>",
        ),
        ("tp2foodp2", "unknown term 'foo'"),
        ("  ", "empty layout; give terms such as tp2dp2 (use tp<N>"),
        ("first", "layout 'first': 'first' needs a size of at least 1, e.g. first2"),
        ("mb0", "'mb0' needs a size of at least 1"),
        ("tp2tp4", "layout 'tp2tp4': tp is given twice"),
        ("tp2spnosp", "sp is given twice"),
        ("zero1nozero1", "zero1 is given twice"),
        ("fsdphsdp2", "fsdp, hsdp<N> and nofsdp each choose parallel.fsdp; give one"),
        ("nofsdpfsdp", "fsdp, hsdp<N> and nofsdp each choose parallel.fsdp; give one"),
        ("zero1hsdp2", "zero1 shards the optimizer state, hsdp2 shards it with the parameters and gradients"),
        ("hsdp", "'hsdp' needs a size of at least 1, e.g. hsdp2"),
        ("dp6hsdp4", "hsdp4 does not divide dp(6) × cp(1) = 6"),
        ("rcfullrcsel", "recompute is given twice"),
        ("cp2agp2p", "p2p and ag both choose parallel.cp_comm_type; give one"),
        (
            "ag",
            "ag chooses context parallelism's attention (parallel.cp_comm_type) and needs cp<N> with N ≥ 2",
        ),
    ],
)
def test_bad_text_names_the_term_and_the_valid_ones(text, message):
    with pytest.raises(MlmError) as e:
        Layout.parse(text)
    assert message in str(e.value)


def test_a_run_config_converts_to_a_layout_and_back():
    sets = [
        "preset=tiny-llama",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.vpp=2",
        "parallel.cp=2",
        'parallel.cp_comm_type="all_gather"',
        "parallel.sequence_parallel=true",
        "parallel.distributed_optimizer=true",
        "train.micro_batch_size=2",
        "train.global_batch_size=16",
        'model.recompute="selective"',
    ]
    cfg = load_config(None, sets)
    lo = Layout.from_config(cfg, 16)
    assert str(lo) == "tp2pp2vpp2dp2cp2agspzero1mb2rcselgb16"
    back = load_config(None, ["preset=tiny-llama", *lo.overrides()])
    assert back.parallel == cfg.parallel and back.train == cfg.train and back.model == cfg.model
    assert Layout.from_config(back, 16) == lo
    # open choices leave the config's: --set items for the mesh alone
    assert [s for s in lo.mesh().overrides() if not s.startswith("parallel.")] == []
    assert Layout.from_parallel(cfg.parallel, 16) == replace(
        lo, micro_batch=None, global_batch=None, recompute=None
    )
    with pytest.raises(MlmError, match=r"tp\(2\) × pp\(2\) × cp\(2\) = 8 does not divide world size 12"):
        Layout.from_config(cfg, 12)
    with pytest.raises(MlmError, match=r"tp\(2\) × pp\(1\) × dp\(2\) × cp\(1\) = 4 ≠ world size 8"):
        Layout.parse("tp2dp2").with_world(8)
    with pytest.raises(MlmError, match=r"ep\(4\) must divide dp\(1\) × cp\(1\) × tp\(2\) = 2"):
        Layout.parse("tp2ep4").with_world(2)


def test_the_mesh_is_built_from_a_layout():
    lo = Layout.parse("tp2pp2cp2ep4").with_world(16)  # dp 2
    for rank in range(16):
        mesh = Mesh.of(lo, rank)
        assert (mesh.tp, mesh.pp, mesh.dp, mesh.cp, mesh.ep, mesh.world_size) == (2, 2, 2, 2, 4, 16)
        coords = (mesh.pp_rank, mesh.dp_rank, mesh.cp_rank, mesh.tp_rank)
        assert ((coords[0] * 2 + coords[1]) * 2 + coords[2]) * 2 + coords[
            3
        ] == rank  # tp fastest, then cp, dp
    cfg = load_config(None, ["parallel.tp=2", "parallel.pp=2", "parallel.cp=2", "parallel.ep=4"])
    assert Mesh.shape_for(cfg.parallel, 16) == {"pp": 2, "dp": 2, "cp": 2, "tp": 2}
    assert Mesh.build(Layout.parse("tp1")).world_size == 1  # no process group: one process
    with pytest.raises(MlmError, match=r"= 2 ≠ world size 1"):
        Mesh.build(Layout.parse("dp2"))


def test_a_plan_file_holds_its_layout_text(tmp_path):
    from mlm.plan.report import plan_dict
    from mlm.plan.search import plan
    from mlm.planfile import layout, read_plan, train_overrides, write_plan

    job = make_job(None, ["preset=tiny-llama"], 8, 8, load_hardware("a100-80g"), 256, 64, None, "bf16")
    best = plan(job).ranked[0]
    path = tmp_path / "p.toml"
    write_plan(path, plan_dict(job, best, "tiny-llama", []))
    spec = read_plan(path)
    assert spec["mesh"]["layout"] == str(best.layout) and layout(spec) == best.layout
    assert Layout.from_config(load_config(None, train_overrides(spec)), 8) == best.layout
    spec["mesh"]["tp"] = 2 * best.layout.tp  # edited by hand: the tables and the text disagree
    with pytest.raises(MlmError, match=f"the plan's \\[mesh\\] layout = '{best.layout}' disagrees"):
        layout(spec)


TINY = ["--set", "preset=tiny-llama", "--set", "train.global_batch_size=8"]


def test_the_commands_read_the_same_text(tmp_path):
    """A layout as `mlm plan` prints it is read by plan --layout, parity --layouts, train --dry-run
    --layout and convert --layout; bad text is the same one-line error (exit 2) in each."""
    text = "tp2pp2dp2spzero1mb1rcselgb8"
    r = mlm("plan", "--preset", "tiny-llama", "--gpus", "8", "--global-batch", "8", "--layout", text)
    assert r.returncode == 0, r.stderr
    assert f"--layout {text}" in " ".join(r.stdout.split())  # the layout it explains prints as given
    r = mlm("train", "--dry-run", *TINY, "--layout", text)
    assert r.returncode == 0, r.stderr
    out = " ".join((r.stdout + r.stderr).split())
    assert (
        f"layout {text} " in out
        and "mesh tp=2 pp=2 dp=2 cp=1 (world 8); micro-batch 1, global batch 8" in out
    )
    assert_error(
        mlm("train", "--dry-run", *TINY, "--layout", text, "--world-size", "16"), "= 8 ≠ world size 16"
    )
    assert_error(
        mlm("train", "--dry-run", *TINY, "--layout", text, "--plan", tmp_path / "p.toml"),
        "both give the mesh and the batching; give one",
    )
    assert_error(
        mlm("parity", *TINY, "--layouts", f"tp1,{text}", "--steps", "0"), "--steps 0: must be at least 1"
    )
    r = mlm("convert", "reshard", tmp_path / "none", tmp_path / "out", "--layout", text)
    assert_error(r, "checkpoint")  # the text is read; the missing checkpoint is the error
    assert "note: --layout tp2pp2dp2spzero1mb1rcselgb8: a reshard applies its mesh, tp2pp2dp2;" in " ".join(
        r.stderr.split()
    )
    assert_error(
        mlm("convert", "reshard", tmp_path / "none", tmp_path / "out", "--layout", "tp2", "--tp", "2"),
        "mlm convert reshard --layout tp2 with --tp: both give the target mesh",
    )
    for args in (
        ["plan", "--preset", "tiny-llama", "--gpus", "8", "--layout", "tp2x"],
        ["parity", *TINY, "--layouts", "tp1,tp2x"],
        ["train", "--dry-run", *TINY, "--layout", "tp2x"],
        ["convert", "reshard", tmp_path / "none", tmp_path / "out", "--layout", "tp2x"],
    ):
        assert_error(mlm(*args), "layout 'tp2x': unknown term 'x'; use tp<N>")
