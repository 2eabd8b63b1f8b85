"""One tokenizer interface for the data, train and serve stages.

Three kinds load (`load_tokenizer` tells them apart from the path):

| kind | files | eod id (as Megatron-LM picks it) |
| --- | --- | --- |
| `sentencepiece` | a SentencePiece `.model` | the model's eos id |
| `huggingface` | a `tokenizer.json` (tokenizers library) | `eos_token` of a `tokenizer_config.json` beside it, else a known end token |
| `gpt2-bpe` | GPT-2 `vocab.json` + `merges.txt` | `<|endoftext|>` |

Every kind can be asked for another eod token by name (`eod_token=`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mlm.errors import MlmError

KNOWN_FORMATS = "a SentencePiece .model, a Hugging Face tokenizer.json, or GPT-2 vocab.json + merges.txt"
# End-of-text tokens in common vocabularies, tried in order when no tokenizer_config.json names one.
_END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "<|eod|>", "</s>", "<eos>", "<|im_end|>")


@dataclass(frozen=True)
class TokenizerInfo:
    """What a dataset records about the tokenizer that built it (see docs/formats.md)."""

    kind: str
    path: str
    sha256: str
    vocab_size: int
    eod_id: int | None
    bos_id: int | None
    pad_id: int | None


class Tokenizer(ABC):
    """Base class: encode/decode plus the special ids a trainer needs."""

    kind: str
    path: Path
    vocab_size: int
    eod_id: int | None = None
    bos_id: int | None = None
    pad_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` without the special tokens a post-processor adds (a Llama tokenizer's BOS):
        for text that holds its own, such as a rendered chat template."""
        return self.encode(text)

    @abstractmethod
    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(`encode_plain(text)`, each token's [start, end) character span in `text`)."""

    @abstractmethod
    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text; `num_threads` native threads share the work."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of a sequence of ids."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None when the vocabulary lacks it."""

    @abstractmethod
    def token_text(self, token_id: int) -> str:
        """The vocabulary's string of a token id (a special token's own text, e.g. "</s>")."""

    def _files(self) -> list[Path]:
        return [self.path]

    def info(self) -> TokenizerInfo:
        h = hashlib.sha256()
        for f in self._files():
            h.update(f.read_bytes())
        return TokenizerInfo(
            self.kind,
            str(self.path.resolve()),
            h.hexdigest(),
            self.vocab_size,
            self.eod_id,
            self.bos_id,
            self.pad_id,
        )

    def _set_eod(self, eod_token: str | None) -> None:
        if eod_token is None:
            return
        tid = self.token_to_id(eod_token)
        if tid is None:
            raise MlmError(
                f"{self.path}: eod token {eod_token!r} is not in the vocabulary; pick a token it has"
            )
        self.eod_id = tid


def _none_if_negative(i: int) -> int | None:
    return None if i < 0 else i


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: Path, eod_token: str | None = None):
        import sentencepiece as spm

        self.path = path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise MlmError(f"{path}: not a SentencePiece model ({e}); mlm reads {KNOWN_FORMATS}") from None
        self.vocab_size = self.sp.vocab_size()
        self.eod_id = _none_if_negative(self.sp.eos_id())
        self.bos_id = _none_if_negative(self.sp.bos_id())
        self.pad_id = _none_if_negative(self.sp.pad_id())
        self._set_eod(eod_token)

    def encode_batch(self, texts, num_threads=1):
        return self.sp.encode(list(texts), out_type=int, num_threads=num_threads)

    def encode_offsets(self, text):
        try:  # sentencepiece ≥ 0.2.1 names the proto "proto", 0.2.0 "immutable_proto"
            pieces = self.sp.encode(text, out_type="proto").pieces
        except (ValueError, TypeError, RuntimeError):
            pieces = self.sp.encode(text, out_type="immutable_proto").pieces
        char_of = []  # the character index of each UTF-8 byte offset of `text`
        for i, c in enumerate(text):
            char_of += [i] * len(c.encode())
        char_of.append(len(text))
        return [p.id for p in pieces], [(char_of[p.begin], char_of[p.end]) for p in pieces]

    def decode(self, ids):
        return self.sp.decode([int(i) for i in ids])

    def token_to_id(self, token):
        tid = self.sp.piece_to_id(token)
        return None if tid == self.sp.unk_id() and token != self.sp.id_to_piece(tid) else tid

    def token_text(self, token_id):
        return self.sp.id_to_piece(int(token_id))


class _TokenizersLibTokenizer(Tokenizer):
    """Shared code for tokenizers built on the Hugging Face `tokenizers` library."""

    add_special_tokens = True

    def _setup(self, tok) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts, num_threads=1):
        # Rayon's pool size is fixed at first use; RAYON_NUM_THREADS set before then decides it.
        os.environ.setdefault("RAYON_NUM_THREADS", str(num_threads))
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=self.add_special_tokens)]

    def encode_plain(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text):
        e = self.tok.encode(text, add_special_tokens=False)
        return e.ids, [tuple(o) for o in e.offsets]

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token):
        return self.tok.token_to_id(token)

    def token_text(self, token_id):
        return self.tok.id_to_token(int(token_id))

    def _find_end_token(self) -> int | None:
        for t in _END_TOKENS:
            tid = self.tok.token_to_id(t)
            if tid is not None:
                return tid
        return None


class HFTokenizer(_TokenizersLibTokenizer):
    """A `tokenizer.json`. Encodes like transformers' `tokenizer(text)`: with the
    tokenizer's own post-processor (a Llama tokenizer adds its BOS), as Megatron's
    HuggingFaceTokenizer does."""

    kind = "huggingface"

    def __init__(self, path: Path, eod_token: str | None = None):
        from tokenizers import Tokenizer as HFTok

        self.path = path
        try:
            tok = HFTok.from_file(str(path))
        except Exception as e:  # the library raises a plain Exception on a bad file
            raise MlmError(
                f"{path}: not a Hugging Face tokenizer.json ({e}); mlm reads {KNOWN_FORMATS}"
            ) from None
        self._setup(tok)
        cfg = _read_tokenizer_config(path.parent / "tokenizer_config.json")
        for field, attr in (("eos_token", "eod_id"), ("bos_token", "bos_id"), ("pad_token", "pad_id")):
            name = cfg.get(field)
            if isinstance(name, dict):
                name = name.get("content")
            if isinstance(name, str) and tok.token_to_id(name) is not None:
                setattr(self, attr, tok.token_to_id(name))
        if self.eod_id is None:
            self.eod_id = self._find_end_token()
        self._set_eod(eod_token)


def _read_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MlmError(f"{path}: not valid JSON ({e})") from None
    return cfg if isinstance(cfg, dict) else {}


class GPT2BPETokenizer(_TokenizersLibTokenizer):
    """GPT-2's byte-level BPE from `vocab.json` + `merges.txt` (Megatron's GPT2BPETokenizer)."""

    kind = "gpt2-bpe"
    add_special_tokens = False

    def __init__(self, vocab: Path, merges: Path, eod_token: str | None = None):
        from tokenizers import Tokenizer as HFTok
        from tokenizers import decoders, models, pre_tokenizers

        self.path, self.merges = vocab, merges
        try:
            bpe = models.BPE.from_file(str(vocab), str(merges))
        except Exception as e:
            raise MlmError(
                f"{vocab} + {merges}: not GPT-2 vocab.json + merges.txt ({e}); mlm reads {KNOWN_FORMATS}"
            ) from None
        tok = HFTok(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._setup(tok)
        self.eod_id = tok.token_to_id("<|endoftext|>")
        self._set_eod(eod_token)

    def _files(self):
        return [self.path, self.merges]


def load_tokenizer(
    path: str | os.PathLike, merges: str | os.PathLike | None = None, eod_token: str | None = None
) -> Tokenizer:
    """Load a tokenizer from a file or folder; the kind is told from what is there."""
    p = Path(path)
    if not p.exists():
        raise MlmError(
            f"tokenizer not found: {p}. Train one with `mlm data tokenizer train` or give {KNOWN_FORMATS}"
        )
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return HFTokenizer(p / "tokenizer.json", eod_token)
        if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
            return GPT2BPETokenizer(p / "vocab.json", p / "merges.txt", eod_token)
        models_ = sorted(p.glob("*.model"))
        if len(models_) == 1:
            return SentencePieceTokenizer(models_[0], eod_token)
        found = ", ".join(sorted(x.name for x in p.iterdir())[:10]) or "nothing"
        raise MlmError(f"{p}: no tokenizer in this folder (found {found}); it must hold {KNOWN_FORMATS}")
    if merges is not None or (p.name == "vocab.json" and (p.parent / "merges.txt").is_file()):
        return GPT2BPETokenizer(p, Path(merges) if merges else p.parent / "merges.txt", eod_token)
    if p.suffix == ".json":
        return HFTokenizer(p, eod_token)
    return SentencePieceTokenizer(p, eod_token)


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
"""What a tokenizer folder may hold, as Hugging Face names the files: copied with the model."""

VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""The files of `TOKENIZER_FILES` a tokenizer loads from (the rest only configure one)."""


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files found in `src` to `dst` (created if any); their names."""
    names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if names:
        dst.mkdir(parents=True, exist_ok=True)
        for n in names:
            shutil.copy2(src / n, dst / n)
    return names


_TOKENIZER_FILE_NAMES = {".model": "tokenizer.model", ".json": "tokenizer.json"}


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """`copy_tokenizer_files` of a folder, or one tokenizer file (a SentencePiece `.model` or a
    `tokenizer.json`, as `mlm train`'s `data.tokenizer` names it) under the name Hugging Face
    looks for; the names written."""
    if src.is_dir():
        return copy_tokenizer_files(src, dst)
    name = _TOKENIZER_FILE_NAMES.get(src.suffix)
    if name is None or not src.is_file():
        return []
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst / name)
    return [name]
