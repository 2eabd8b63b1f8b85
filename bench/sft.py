"""SFT throughput against pretraining on the same model and the same tokens, and packing efficiency.

    .venv/bin/python bench/sft.py [--conversations 4000] [--seq 256] [--steps 20] [--warmup 3]
                                  [--set key=value ...]

Makes the SFT recipe's toy conversations and ChatML tokenizer (pipelines/sft/toy.py), then builds
two datasets of the same conversations: a chat dataset (`mlm data build --chat`: tokens and loss
mask, packed first-fit at training) and a plain one of the same rendered text (each conversation
a document, eod appended, cut across documents as pretraining does). The same model (a 4-layer
Llama, hidden 256, unless --set changes it) trains on each with `mlm train`'s Trainer in this
process, alternating pretraining and SFT runs twice; the step time is the median over the steps
after `--warmup` of both runs of a kind. Prints sequence positions/s of each, the ratio SFT /
pretraining, the packing efficiency (the share of positions that hold conversation tokens, for
first_fit and for none: one conversation per sequence), and the conversation tokens/s and target
(assistant) tokens/s that SFT trains on. On 2 CPU cores the defaults take about 2 minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "pipelines" / "sft"))

import toy  # noqa: E402

from mlm.chat import load_chat_template  # noqa: E402
from mlm.config import load_config  # noqa: E402
from mlm.data.build import BuildOptions, build_dataset  # noqa: E402
from mlm.data.conversations import SHAREGPT_ROLES  # noqa: E402
from mlm.datasets.gpt import GPTDatasetConfig  # noqa: E402
from mlm.datasets.indexed import IndexedDataset  # noqa: E402
from mlm.datasets.sft import SFTDataset  # noqa: E402
from mlm.tokenizer import load_tokenizer  # noqa: E402
from mlm.train.trainer import Trainer  # noqa: E402


def make_data(tmp: Path, count: int) -> tuple[str, str, int]:
    """(chat prefix, plain prefix, vocabulary size) of `count` toy conversations."""
    toy.main(tmp, count)
    tok = load_tokenizer(str(tmp / "hf-base"))
    template = load_chat_template(tok)
    convs = [json.loads(line) for line in (tmp / "conversations.jsonl").read_text().splitlines()]
    with open(tmp / "text.jsonl", "w") as f:
        for c in convs:
            messages = c.get("messages") or [
                {"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in c["conversations"]
            ]
            f.write(json.dumps({"text": template.render(messages, add_generation_prompt=False)}) + "\n")
    hf = str(tmp / "hf-base")
    chat, plain = str(tmp / "chat"), str(tmp / "plain")
    build_dataset(BuildOptions([str(tmp / "conversations.jsonl")], chat, hf, chat=True, progress=False))
    build_dataset(BuildOptions([str(tmp / "text.jsonl")], plain, hf, append_eod=True, progress=False))
    return chat, plain, tok.vocab_size


def step_times(tmp: Path, name: str, prefix: str, vocab: int, args) -> list[float]:
    run = tmp / name
    sets = [
        "preset='tiny-llama'",
        f"run_dir='{run}'",
        f"model.vocab_size={vocab}",
        "model.num_layers=4",
        "model.hidden_size=256",
        "model.ffn_hidden_size=768",
        f"model.max_position_embeddings={args.seq}",
        "model.hidden_dropout=0.0",
        f"data.data_path=['{prefix}']",
        f"data.seq_length={args.seq}",
        "data.split='1'",
        f"train.train_iters={args.steps}",
        "train.global_batch_size=16",
        "train.micro_batch_size=8",
        "logging.log_interval=1",
        "logging.tensorboard=false",
        "logging.sample_prompt=''",
        *args.set,
    ]
    Trainer(load_config(None, sets)).train()
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [x["step_time_s"] for x in lines if x.get("split") == "train"][args.warmup :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=4000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        chat, plain, vocab = make_data(tmp, args.conversations)
        times: dict[str, list[float]] = {"pretraining": [], "sft": []}
        for round_ in range(2):
            for kind, prefix in (("pretraining", plain), ("sft", chat)):
                times[kind] += step_times(tmp, f"{kind}{round_}", prefix, vocab, args)
        cfg = GPTDatasetConfig(args.seq, split="1", cache_dir=str(tmp / "cache"))
        n = args.steps * 16
        packed = SFTDataset(IndexedDataset(chat), "train", n, cfg, "first_fit")
        alone = SFTDataset(IndexedDataset(chat), "train", n, cfg, "none")
        meta = json.loads(Path(chat + ".json").read_text())
        target_share = meta["chat"]["assistant_tokens"] / meta["tokens"]
    positions = 16 * args.seq
    pre = positions / statistics.median(times["pretraining"])
    sft = positions / statistics.median(times["sft"])
    print(
        f"model: 4 layers, hidden 256, vocab {vocab}; seq {args.seq}, global batch 16, "
        f"{args.conversations} conversations ({meta['tokens']:,} tokens, {target_share:.1%} the assistant's)"
    )
    print(f"pretraining: {pre:10,.0f} positions/s (median of {len(times['pretraining'])} steps)")
    print(f"SFT:         {sft:10,.0f} positions/s (median of {len(times['sft'])} steps)")
    print(f"ratio SFT / pretraining: {sft / pre:.3f}")
    print(
        f"packing efficiency (positions holding tokens): first_fit {packed.efficiency:.1%}, "
        f"none {alone.efficiency:.1%}"
    )
    print(
        f"SFT conversation tokens/s: {sft * packed.efficiency:,.0f}; target tokens/s: "
        f"{sft * packed.efficiency * target_share:,.0f}"
    )


if __name__ == "__main__":
    main()
