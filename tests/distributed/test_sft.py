"""Supervised fine-tuning on chat datasets: first-fit packing, the per-token loss over target
tokens, and packed sequences that train exactly as the conversations alone.

The equivalence runs use Adam with lr 1 and eps 1 for one step, no clipping, no weight decay:
the first update is then -g / (|g| + 1) elementwise, a smooth function of the gradient, so the
weights after the step compare the gradients. Tolerance: fp32; the loss to 1e-6 relative; the
weights to 1e-5 of their largest element (sums over other orders: packed sequences and
dp/pp reductions add the same terms differently).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mlm.config import load_config
from mlm.datasets.documents import PackedBatch
from mlm.datasets.gpt import GPTDatasetConfig
from mlm.datasets.indexed import IndexedDataset, IndexedDatasetWriter, data_paths
from mlm.datasets.meta import loss_mask_prefix, meta_path, new_meta
from mlm.datasets.sft import PackedSample, SFTDataset, first_fit
from mlm.errors import MlmError
from mlm.train.trainer import Trainer
from tests.helpers.common import checkpoint_weights, tiny_sets
from tests.helpers.distributed import run_ranks

SEQ = 32
LOSS_RTOL = 1e-6
WEIGHT_RTOL = 1e-5


def write_chat_dataset(prefix, conversations: list[tuple[np.ndarray, np.ndarray]]) -> str:
    """A chat dataset as `mlm data build --chat` lays it out: tokens, uint8 loss mask, PREFIX.json."""
    prefix = str(prefix)
    for p, arrays, dtype in (
        (prefix, [t for t, _ in conversations], np.uint16),
        (loss_mask_prefix(prefix), [m for _, m in conversations], np.uint8),
    ):
        w = IndexedDatasetWriter(*data_paths(p), dtype)
        w.add_documents(np.concatenate(arrays), np.array([len(a) for a in arrays]))
        w.finalize()
    tokenizer = {"path": "none", "sha256": "0" * 64, "vocab_size": 512, "eod_id": None}
    meta = new_meta(tokenizer=tokenizer, chat={"loss_mask": loss_mask_prefix(prefix).rsplit("/", 1)[-1]})
    meta_path(prefix).write_text(json.dumps(meta))
    return prefix


def conversations(seed: int, count: int, low: int, high: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random conversations of `low`..`high` tokens: alternating user (mask 0) and assistant
    (mask 1) turns of 2 to 6 tokens, starting with the user."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(low, high + 1))
        mask = np.zeros(n, np.uint8)
        at, assistant = 0, False
        while at < n:
            turn = int(rng.integers(2, 7))
            mask[at : at + turn] = assistant
            at, assistant = at + turn, not assistant
        out.append((rng.integers(1, 512, n).astype(np.uint16), mask))
    return out


# ---------------------------------------------------------------- packing


def test_first_fit_puts_each_item_in_the_first_bin_with_room():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 34, 500)
    bins = first_fit(lengths, 33)
    room: list[int] = []
    for length, b in zip(lengths.tolist(), bins.tolist(), strict=True):
        first = next((i for i, r in enumerate(room) if r >= length), len(room))
        assert b == first
        if b == len(room):
            room.append(33)
        room[b] -= length
    assert min(room) >= 0


@pytest.mark.parametrize("packing", ["first_fit", "none"])
def test_every_epoch_packs_every_conversation_once(tmp_path, packing):
    convs = conversations(1, 40, 3, SEQ + 1)
    prefix = write_chat_dataset(tmp_path / "chat", convs)
    cfg = GPTDatasetConfig(SEQ, seed=3, split="1", cache_dir=str(tmp_path / "cache"))
    ds = SFTDataset(IndexedDataset(prefix), "train", 100, cfg, packing)
    assert len(ds) >= 100
    lengths = np.array([len(t) for t, _ in convs])
    epoch, seen = [], []
    for i in range(len(ds)):
        docs = ds.pack_documents[ds.pack_index[i] : ds.pack_index[i + 1]].tolist()
        assert lengths[docs].sum() <= SEQ + 1
        assert packing == "first_fit" or len(docs) == 1
        epoch += docs
        if len(epoch) == len(convs):
            assert sorted(epoch) == list(range(len(convs)))
            seen.append(epoch)
            epoch = []
    assert len(seen) * len(convs) == len(ds.pack_documents)
    assert seen[0] != seen[1]  # each epoch shuffles anew
    sample = ds[0]
    docs = ds.pack_documents[ds.pack_index[0] : ds.pack_index[1]].tolist()
    n = lengths[docs].sum()
    assert np.array_equal(sample.tokens[:n], np.concatenate([convs[d][0] for d in docs]))
    assert np.array_equal(sample.targets[:n], np.concatenate([convs[d][1] for d in docs]))
    assert not sample.targets[n:].any()
    assert set(sample.documents[n:]) <= {len(docs)}
    if packing == "first_fit":
        one_each = lengths.sum() / (len(convs) * (SEQ + 1))
        assert ds.efficiency > 1.5 * one_each  # packing fills the sequences that one each leaves empty


def test_a_conversation_longer_than_the_sequence_is_named(tmp_path):
    convs = conversations(2, 5, 3, 10) + conversations(3, 1, SEQ + 2, SEQ + 2)
    prefix = write_chat_dataset(tmp_path / "chat", convs)
    cfg = GPTDatasetConfig(SEQ, split="1", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(MlmError, match=r"conversation 5 has 34 tokens .*seq_length \+ 1 = 33.*--seq-length"):
        SFTDataset(IndexedDataset(prefix), "train", 10, cfg)


def test_a_mask_of_another_build_is_refused(tmp_path):
    prefix = write_chat_dataset(tmp_path / "chat", conversations(4, 6, 3, 10))
    other = write_chat_dataset(tmp_path / "other", conversations(5, 6, 3, 10))
    for suffix in (".bin", ".idx"):
        (tmp_path / f"chat_loss_mask{suffix}").write_bytes(
            (tmp_path / f"other_loss_mask{suffix}").read_bytes()
        )
    cfg = GPTDatasetConfig(SEQ, split="1", cache_dir=str(tmp_path / "cache"))
    assert other
    with pytest.raises(MlmError, match="sequence lengths differ"):
        SFTDataset(IndexedDataset(prefix), "train", 10, cfg)


def test_packed_batch_counts_targets_within_each_conversation():
    tokens = np.array([5, 6, 7, 8, 9, 10, 11, 0, 0])
    targets = np.array([0, 1, 1, 1, 0, 1, 1, 0, 0], np.uint8)  # conversation 1 starts with a target
    documents = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2])
    b = PackedBatch.of([PackedSample(tokens, targets, documents)], torch.device("cpu"))
    assert b.inputs.tolist() == [[5, 6, 7, 8, 9, 10, 11, 0]]
    assert b.labels.tolist() == [[6, 7, 8, 9, 10, 11, 0, 0]]
    # 7 → 8 crosses into conversation 1: not a target though 8 is marked
    assert b.weights.tolist() == [[1, 1, 0, 0, 1, 1, 0, 0]]
    assert b.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert b.documents.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert int(b.targets) == 4


# ---------------------------------------------------------------- the loss


def _loss_and_grads(model, batch: PackedBatch):
    model.zero_grad()
    h = model.hidden_states(batch.inputs, batch.positions, documents=batch.documents)
    loss = model.head_loss(h, batch.labels, batch.weights)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_the_labels_of_user_turns_change_neither_the_loss_nor_any_gradient():
    from mlm.model.gpt import build_model

    cfg = load_config(None, tiny_sets("/tmp/unused", "x", **{"model.hidden_dropout": 0.0})).model
    model = build_model(cfg, seed=7)
    rng = np.random.default_rng(8)
    samples = []
    for _ in range(2):
        convs = conversations(int(rng.integers(1 << 30)), 2, 12, 16)
        tokens = np.concatenate([t for t, _ in convs]).astype(np.int64)
        targets = np.concatenate([m for _, m in convs])
        documents = np.repeat([0, 1], [len(t) for t, _ in convs])
        pad = SEQ + 1 - len(tokens)
        samples.append(
            PackedSample(
                np.pad(tokens, (0, pad)),
                np.pad(targets, (0, pad)),
                np.pad(documents, (0, pad), constant_values=2),
            )
        )
    batch = PackedBatch.of(samples, torch.device("cpu"))
    loss, grads = _loss_and_grads(model, batch)
    user = batch.weights == 0
    assert user.any() and (~user).any()
    other = torch.where(user, torch.randint(0, 512, batch.labels.shape), batch.labels)
    assert (other != batch.labels).any()
    loss2, grads2 = _loss_and_grads(model, batch._replace(labels=other))
    assert torch.equal(loss, loss2)
    for k, g in grads.items():
        assert torch.equal(g, grads2[k]), k
    # a target label does count
    changed = batch.labels.clone()
    changed[~user] = (changed[~user] + 1) % 512
    assert not torch.equal(_loss_and_grads(model, batch._replace(labels=changed))[0], loss)
    # and the loss is the sum over the targets alone
    everything = _loss_and_grads(model, batch._replace(weights=torch.ones_like(batch.weights)))[0]
    assert everything > loss


# ---------------------------------------------------------------- packed == unpacked

# 8 conversations of 12..16 tokens: any two share a sequence of 33, no three do, so first-fit
# packs exactly 4 sequences; one step of global batch 4 (packed) or 8 (one per sequence) is one
# epoch: the same targets in both
CONVERSATIONS = conversations(11, 8, 12, 16)
ONE_STEP = {
    "model.hidden_dropout": 0.0,
    "data.seq_length": SEQ,
    "data.split": "'1'",
    "train.train_iters": 1,
    "train.micro_batch_size": 1,
    "optimizer.lr": 1.0,
    "optimizer.min_lr": 1.0,
    "optimizer.warmup_iters": 0,
    "optimizer.adam_eps": 1.0,
    "optimizer.weight_decay": 0.0,
    "optimizer.clip_grad": 0.0,
}


def _sets(tmp, data, packing: str, **extra) -> list[str]:
    batch = 4 if packing == "first_fit" else 8
    return tiny_sets(
        tmp,
        data,
        **{
            **ONE_STEP,
            "data.packing": f"'{packing}'",
            "train.global_batch_size": batch,
            "checkpoint.save": f"'{tmp / 'ckpt'}'",
            **extra,
        },
    )


def _train_rank(rank, world, sets):
    return Trainer(load_config(None, sets)).train()


def _train(tmp, sets) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of a run and its final weights (read back through its checkpoint, global)."""
    trainer = Trainer(load_config(None, sets))
    losses = trainer.train()
    like = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    return losses, checkpoint_weights(tmp / "ckpt", like)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> str:
    return write_chat_dataset(tmp_path_factory.mktemp("chat") / "convs", CONVERSATIONS)


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory, chat_data):
    tmp = tmp_path_factory.mktemp("unpacked")
    return _train(tmp, _sets(tmp, chat_data, "none"))


def _assert_same(losses, state, ref_losses, ref_state):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    for k, v in ref_state.items():
        torch.testing.assert_close(
            state[k],
            v,
            rtol=WEIGHT_RTOL,
            atol=WEIGHT_RTOL * v.abs().max().item(),
            msg=lambda m, k=k: f"{k}: {m}",
        )


def test_packed_sequences_train_as_the_conversations_alone(tmp_path, chat_data, unpacked):
    packed = _train(tmp_path, _sets(tmp_path, chat_data, "first_fit"))
    _assert_same(*packed, *unpacked)
    start = Trainer(load_config(None, _sets(tmp_path / "init", chat_data, "first_fit"))).model.state_dict()
    assert any(not torch.equal(start[k], v) for k, v in packed[1].items())  # the step moved the weights


@pytest.mark.parametrize("parallel", [{}, {"parallel.pp": 2}], ids=["dp2", "pp2"])
def test_packed_on_a_mesh_trains_as_the_conversations_alone_on_one_process(
    tmp_path, chat_data, unpacked, parallel
):
    per_rank = run_ranks(2, _train_rank, _sets(tmp_path, chat_data, "first_fit", **parallel))
    assert per_rank[0] == per_rank[1]  # every rank logs the global loss
    _assert_same(per_rank[0], checkpoint_weights(tmp_path / "ckpt", unpacked[1]), *unpacked)


def test_parity_against_megatron_names_chat_data(tmp_path, chat_data):
    from mlm.train.parity.megatron import unsupported

    assert any(
        "chat datasets" in u for u in unsupported(load_config(None, _sets(tmp_path, chat_data, "none")))
    )
    assert not unsupported(load_config(None, tiny_sets(tmp_path, "x")))
