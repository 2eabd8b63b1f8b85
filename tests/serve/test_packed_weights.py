"""MKL-packed weights for full decode batches (mlm.inference.packed_weights) and the host
allocator settings of CPU serving (mlm.inference.host_memory).

The packed product must be the plain one (the same sgemm over the same operands: compared to
1e-6 absolute on logits of magnitude ~1, and greedy tokens equal), must really be what runs at
the packed row count, must not be used once its weight has changed (trained, loaded, converted),
must be made again for a later engine on the same model, and must apply only on the CPU in fp32.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from mlm.config import ModelConfig
from mlm.inference import packed_weights
from mlm.inference.engine import Engine, EngineConfig
from mlm.inference.packed_weights import PackedLinearOp, pack_weights, packing_applies
from mlm.inference.sampling import SamplingParams
from mlm.model.gpt import GPT
from mlm.parallel.tensor import OpLinear
from tests.helpers.common import ROOT

pytestmark = pytest.mark.skipif(
    not packing_applies(torch.device("cpu"), torch.float32), reason="this torch has no MKL"
)

ROWS = 4


@pytest.fixture(autouse=True)
def pack_small_weights(monkeypatch, request):
    """This test model's weights are far below `MIN_ELEMENTS`: pack them all the same (but in the
    test of that threshold)."""
    if request.node.name != "test_small_weights_stay_plain":
        monkeypatch.setattr(packed_weights, "MIN_ELEMENTS", 0)


TOL = 1e-6  # absolute, on logits of magnitude ~1
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def model(tie: bool = False) -> GPT:
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=160,
        vocab_size=300,
        max_position_embeddings=128,
        tie_embeddings=tie,
    )
    gpt = GPT(cfg).eval()
    gpt.init_weights(seed=5)
    return gpt


def logits(gpt: GPT, rows: int) -> torch.Tensor:
    with torch.inference_mode():
        return gpt(torch.arange(rows)[None] * 7 % gpt.cfg.vocab_size)


@pytest.mark.parametrize("tie", [False, True])
def test_packed_products_are_the_plain_ones(tie):
    gpt = model(tie)
    before = {rows: logits(gpt, rows) for rows in (ROWS, ROWS + 3)}
    nbytes = pack_weights(gpt, ROWS)
    linears = [m for m in gpt.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 * 7 and all(isinstance(m, OpLinear) for m in linears)  # q k v out gate up down
    assert all(isinstance(m.linear_op, PackedLinearOp) for m in linears)
    assert isinstance(gpt.output_op, PackedLinearOp)
    assert nbytes == sum(m.weight.nbytes for m in linears) + gpt.output_weight().nbytes
    for rows, ref in before.items():
        assert (logits(gpt, rows) - ref).abs().max() <= TOL
    with torch.enable_grad():  # training through a packed model: the plain product, with gradients
        gpt(torch.arange(ROWS)[None]).sum().backward()
    assert gpt.layers["0"].attn.q.weight.grad is not None


def test_small_weights_stay_plain():
    gpt = model()
    gpt.output.weight = torch.nn.Parameter(torch.randn(2000, 64) * 0.1)  # 128,000 elements
    gpt.cfg.vocab_size = 2000
    assert pack_weights(gpt, ROWS) == gpt.output.weight.nbytes  # only the output layer
    assert isinstance(gpt.output_op, PackedLinearOp)
    assert all(m.linear_op is F.linear for m in gpt.layers.modules() if isinstance(m, OpLinear))


def test_the_packed_copy_is_what_runs_at_its_row_count():
    gpt = model()
    pack_weights(gpt, ROWS)
    before = {rows: logits(gpt, rows) for rows in (ROWS, ROWS + 1)}
    down = gpt.layers["1"].mlp.down
    down.linear_op.packed = torch.ops.mkl._mkl_reorder_linear_weight(2 * down.weight.detach(), ROWS)
    assert (logits(gpt, ROWS) - before[ROWS]).abs().max() > 1e-3  # the (doubled) packed copy runs
    assert (logits(gpt, ROWS + 1) - before[ROWS + 1]).abs().max() <= TOL  # the weight itself
    pack_weights(gpt, ROWS)  # packed again: the weight's own copy
    assert (logits(gpt, ROWS) - before[ROWS]).abs().max() <= TOL


def test_engines_pack_on_cpu_fp32_and_give_the_same_tokens():
    gpt = model()
    ps = [[(13 * i + 5 * j) % 300 for j in range(3 + 9 * i)] for i in range(ROWS)]
    plain = Engine(gpt, None, EngineConfig(max_seqs=ROWS, packed_weights=False))
    assert plain.runner.packed_bytes == 0
    reference = [r.token_ids for r in plain.generate(ps, GREEDY)]
    packed = Engine(gpt, None, EngineConfig(max_seqs=ROWS))
    assert packed.runner.packed_bytes > 0
    assert [r.token_ids for r in packed.generate(ps, GREEDY)] == reference
    # the engine's full decode batches multiply by the packed copies: a negated one shows
    output_op = gpt.output_op
    output_op.packed = torch.ops.mkl._mkl_reorder_linear_weight(-gpt.output_weight().detach(), ROWS)
    assert [r.token_ids[1:] for r in packed.generate(ps, GREEDY)] != [t[1:] for t in reference]
    output_op.packed = torch.ops.mkl._mkl_reorder_linear_weight(gpt.output_weight().detach(), ROWS)
    # a later engine with another batch size packs again, for its own row count
    again = Engine(gpt, None, EngineConfig(max_seqs=2))
    assert gpt.layers["0"].attn.q.linear_op.rows == gpt.output_op.rows == 2
    assert [r.token_ids for r in again.generate(ps, GREEDY)] == reference
    # and one with packing off drops the copies: plain products again
    Engine(gpt, None, EngineConfig(max_seqs=ROWS, packed_weights=False))
    assert gpt.layers["0"].attn.q.linear_op is F.linear and gpt.output_op is F.linear
    assert [r.token_ids for r in plain.generate(ps, GREEDY)] == reference
    assert Engine(model().to(torch.bfloat16), None, EngineConfig(max_seqs=ROWS)).runner.packed_bytes == 0


def test_weights_changed_after_serving_are_not_multiplied_stale():
    """A model served (packed), then trained, loaded into or converted: its products use the
    weights as they are now, at every row count, in any later engine or plain forward."""
    gpt, fresh = model(), model()
    Engine(gpt, None, EngineConfig(max_seqs=ROWS))
    with torch.no_grad():  # as an optimizer step or a load_state_dict would
        for m in (gpt, fresh):
            m.layers["1"].mlp.down.weight.mul_(2)
            m.output.weight.add_(0.5)
    assert (logits(gpt, ROWS) - logits(fresh, ROWS)).abs().max() <= 10 * TOL  # logits ~5 now (stale: ~5 off)
    ps = [[(13 * i + 5 * j) % 300 for j in range(3 + 9 * i)] for i in range(ROWS)]
    reference = [r.token_ids for r in Engine(fresh, None, EngineConfig(max_seqs=ROWS)).generate(ps, GREEDY)]
    unpacked = Engine(gpt, None, EngineConfig(max_seqs=ROWS, packed_weights=False))
    assert [r.token_ids for r in unpacked.generate(ps, GREEDY)] == reference
    half = gpt.to(torch.bfloat16)  # converted: no longer fp32, nothing for MKL's packed copy
    assert (logits(half, ROWS).float() - logits(fresh.to(torch.bfloat16), ROWS).float()).abs().max() == 0


@pytest.mark.parametrize("freed_before", [0, 1 << 20])
def test_keep_freed_memory_keeps_a_freed_block_in_the_heap(freed_before):
    """In a fresh process (glibc's thresholds untouched): a freed 8 MiB block goes back to the
    kernel by default (mmap'd); after `keep_freed_memory` a 16 MiB one stays in the heap's free
    bytes, whatever the heap held free before (`freed_before`: a block freed just before, as any
    library call may leave). 16 MiB: glibc's own dynamic threshold, raised to 8 MiB by the first
    free, would keep another 8 MiB block without `keep_freed_memory`, not a 16 MiB one."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc: Linux only")
    script = textwrap.dedent(
        """
        import ctypes, ctypes.util, sys
        from mlm.inference.host_memory import keep_freed_memory

        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        if not hasattr(libc, "mallinfo2"):
            print("no-glibc"); sys.exit()
        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in
                        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
        libc.mallinfo2.restype = Info
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]

        def freed_kept(size):  # not mmap'd while held, and in the heap's free bytes once freed
            mapped = libc.mallinfo2().hblkhd
            p = libc.malloc(size)
            ctypes.memset(p, 1, size)
            mapped = libc.mallinfo2().hblkhd - mapped >= size
            libc.free(p)
            return not mapped and libc.mallinfo2().fordblks >= size

        first, kept = freed_kept(8 << 20), keep_freed_memory()
        libc.free(libc.malloc(int(sys.argv[1])))
        print(first, kept, freed_kept(16 << 20))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(freed_before)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    if out.strip() == "no-glibc":
        pytest.skip("malloc is not glibc's")
    assert out.split() == ["False", "True", "True"]
