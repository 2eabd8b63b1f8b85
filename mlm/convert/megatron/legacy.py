"""Reading Megatron-LM's legacy per-rank checkpoints (`--ckpt-format torch`) as the global tensors a
torch_dist save of the same model holds, per layer (`decoder.layers.<N>.<sub>`), behind the
interface of `MegatronCheckpoint`: `LegacyCheckpoint(path).read(key)`. The layout and how the
shards join are in docs/formats-foreign.md ("Megatron-LM legacy per-rank checkpoint"). Every rank file is
memory-mapped, so a `read` holds one global tensor; the optimizer (`optimizer_keys`) is read by
`mlm.convert.megatron.optim` through `rank_folder` and `rank_state`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

from mlm.convert.layouts import tp_join, tp_join_pair
from mlm.convert.megatron.args import saved_args
from mlm.convert.megatron.unpickle import load_megatron_pickle
from mlm.errors import MlmError

FILE = "model_optim_rng.pt"
ROWS, HALVES, COLS, WHOLE = "rows", "halves", "cols", "whole"
"""How Megatron's tp ranks hold a tensor: cut along its rows (column-parallel), per half of
[gate; up] along its rows (each rank [gate_r; up_r]), along its columns (row-parallel), or whole."""
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.(.+)|(linear_fc[12]\.(?:weight|bias))(\d+))$")


def _expert(key: str) -> tuple[int, str] | None:
    """(local expert, its sub-key such as `linear_fc1.weight`) for an expert's tensor, else None:
    `mlp.experts.local_experts.<j>.<sub>` (SequentialMLP) or `mlp.experts.<sub><j>` (grouped GEMM)."""
    m = _EXPERT.search(key)
    if m is None:
        return None
    return (int(m.group(1)), m.group(2)) if m.group(1) else (int(m.group(4)), m.group(3))


def is_legacy(path: Path) -> bool:
    """Whether `path` (an iteration folder) holds the legacy layout's mp_rank_* folders."""
    return any(p.is_dir() for p in path.glob("mp_rank_*"))


def tp_rule(sub: str, gated: bool) -> str:
    """How the tp ranks' shards of `sub` (a key without layer and expert prefixes) make the whole."""
    module, _, param = sub.rpartition(".")
    module = module.rpartition(".")[2]
    if param in ("weight", "bias"):
        if module in ("word_embeddings", "output_layer", "linear_qkv"):
            return ROWS
        if module == "linear_fc1":
            return HALVES if gated else ROWS
        if module in ("linear_proj", "linear_fc2") and param == "weight":
            return COLS
    return WHOLE


def tp_dim(rule: str) -> int | None:
    """The dim the tp ranks cut under `rule` (None: whole on every rank)."""
    return None if rule == WHOLE else int(rule == COLS)


def join_tp(parts: list[torch.Tensor], rule: str) -> torch.Tensor:
    """The whole tensor from every tp rank's shard, in rank order (a new tensor)."""
    if rule == WHOLE or len(parts) == 1:
        return parts[0].clone()
    if rule == HALVES:
        return torch.cat(tp_join_pair(parts, 0))
    return tp_join(parts, tp_dim(rule))


def _tensor_paths(obj: object, prefix: str) -> Iterator[str]:
    """Dotted paths of the tensors inside nested dicts / lists."""
    if isinstance(obj, torch.Tensor):
        yield prefix
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensor_paths(v, f"{prefix}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensor_paths(v, f"{prefix}.{i}")


class LegacyCheckpoint:
    """An iteration folder of the legacy layout, read as the global tensors torch_dist would hold
    (the interface of `mlm.convert.megatron.dcp.MegatronCheckpoint`)."""

    def __init__(self, path: Path):
        self.path = path
        dirs = sorted(p.name for p in path.glob("mp_rank_*") if p.is_dir())
        held = [d for d in dirs if (path / d / FILE).is_file()]
        if not held:
            raise MlmError(
                f"{path}: holds {', '.join(dirs)} but no {FILE} in them; copy the whole iteration folder "
                "as Megatron-LM wrote it"
            )
        first = self._load(held[0])
        args = saved_args(first)
        sizes = [args.get(f"{n}_model_parallel_size") or 1 for n in ("tensor", "pipeline", "expert")]
        if not all(type(n) is int and n >= 1 for n in sizes):
            raise MlmError(
                f"{path}/{held[0]}/{FILE}: the Megatron args' tensor/pipeline/expert parallel sizes "
                f"{', '.join(str(n)[:20] for n in sizes)} are not positive integers; the checkpoint is damaged"
            )
        tp, pp, ep = sizes
        if tp * pp * ep > len(dirs) + 8:  # more missing folders than are worth naming one by one
            raise MlmError(
                f"{path}: the Megatron args say tp {tp} · pp {pp} · ep {ep}, so {tp * pp * ep} rank folders, but "
                f"it holds {len(dirs)}; copy the whole iteration folder as Megatron-LM wrote it"
            )
        names = {
            (t, p, e): f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
            for t in range(tp)
            for p in range(pp)
            for e in range(ep)
        }
        missing = [f"{n}/{FILE} missing" for n in names.values() if not (path / n / FILE).is_file()]
        extra = sorted(set(dirs) - set(names.values()))
        if missing or extra:
            found = "; ".join([*missing, *([f"it also holds {', '.join(extra)}"] if extra else [])])
            raise MlmError(
                f"{path}: the Megatron args say tp {tp} · pp {pp} · ep {ep}, so it should hold "
                f"{', '.join(names.values())}; {found}. Copy the whole iteration folder as Megatron-LM wrote it"
            )
        self._first, self._names = first, names
        self._files = {rank: first if name == held[0] else self._load(name) for rank, name in names.items()}
        self._index(args, tp, pp, ep)
        self.optimizer_keys = [k for rank, name in names.items() for k in self._optimizer_keys(rank, name)]

    def _optimizer_keys(self, rank: tuple[int, int, int], name: str) -> list[str]:
        """The optimizer tensors of rank folder `name`, in `model_optim_rng.pt` and `distrib_optim.pt`."""
        keys = list(_tensor_paths(self._files[rank].get("optimizer"), f"{name}/{FILE}:optimizer"))
        distrib = self.path / name / "distrib_optim.pt"
        if distrib.exists():
            keys += _tensor_paths(load_megatron_pickle(distrib, mmap=True), f"{name}/{distrib.name}:")
        return keys

    def _load(self, name: str) -> dict:
        state = load_megatron_pickle(self.path / name / FILE, mmap=True)
        if not isinstance(state, dict) or not any(
            k == "model" or re.fullmatch(r"model\d+", k) for k in state
        ):
            raise MlmError(
                f"{self.path / name / FILE}: holds no `model` state dict; not a Megatron-LM checkpoint"
            )
        return state

    @staticmethod
    def _chunks(state: dict) -> list[dict]:
        """The rank's model state dicts in virtual-pipeline order (`model`, or `model0`, `model1`, …)."""
        if "model" in state:
            return [state["model"]]
        return [state[f"model{v}"] for v in range(sum(bool(re.fullmatch(r"model\d+", k)) for k in state))]

    def _offsets(self, args: dict, pp: int) -> dict[tuple[int, int], int]:
        """(virtual chunk, stage) → the global number of its first layer: the layers of every chunk
        before it in pipeline order (chunk 0 of stages 0 … pp-1, then chunk 1, …)."""
        order = [(v, p) for v in range(len(self._chunks(self._files[0, 0, 0]))) for p in range(pp)]
        offsets, total = {}, 0
        for v, p in order:
            numbers = [
                int(m.group(1)) for k in self._chunks(self._files[0, p, 0])[v] if (m := _LAYER.match(k))
            ]
            offsets[v, p], total = total, total + max(numbers, default=-1) + 1
        if args.get("num_layers") not in (None, total):
            raise MlmError(
                f"{self.path}: the pipeline chunks hold {total} layers but the Megatron args say "
                f"num_layers={args['num_layers']}; the checkpoint is incomplete"
            )
        return offsets

    def _index(self, args: dict, tp: int, pp: int, ep: int) -> None:
        """self._parts[key][expert or None]: the (rank, chunk, local key) of each tp rank's shard of a
        global key; self._rules[key]: how they join; self.tensors[key]: its dtype and global shape."""
        offsets = self._offsets(args, pp)
        gated = args.get("swiglu")
        if gated is None and tp > 1:
            raise MlmError(
                f"{self.path}: the Megatron args lack `swiglu`, needed to join linear_fc1's tp shards; copy the "
                "rank files as Megatron-LM wrote them (their args included)"
            )
        etp = args.get("expert_tensor_parallel_size")
        tied = args.get("untie_embeddings_and_output_weights") is False
        self._parts: dict[str, dict[int | None, list]] = {}
        self._rules: dict[str, str] = {}
        for (t, p, e), state in self._files.items():
            for v, sd in enumerate(self._chunks(state)):
                per_rank = len({_expert(k)[0] for k in sd if _expert(k)})
                for local, value in sd.items():
                    if "._extra_state" in local or (tied and local == "output_layer.weight"):
                        continue
                    if not isinstance(value, torch.Tensor):
                        where = self.path / self._names[t, p, e] / FILE
                        raise MlmError(
                            f"{where}: {local} is a {type(value).__name__}, not a tensor; not a Megatron-LM "
                            "model state dict (copy the file as Megatron-LM wrote it)"
                        )
                    key, sub, expert = local, local, None
                    if (m := _LAYER.match(local)) is not None:
                        layer, sub = offsets[v, p] + int(m.group(1)), m.group(2)
                        key = f"decoder.layers.{layer}.{sub}"
                        if (x := _expert(sub)) is not None:
                            if tp > 1 and etp not in (None, tp):
                                raise MlmError(
                                    f"{self.path}: expert_tensor_parallel_size={etp} differs from the tp size "
                                    f"{tp}; mlm reads legacy checkpoints whose experts are split like the other layers"
                                )
                            expert, sub = e * per_rank + x[0], x[1]
                            key = f"decoder.layers.{layer}.mlp.experts.experts.{sub}"
                    if expert is None and e > 0:
                        continue  # the same on every ep rank
                    self._rules[key] = tp_rule(sub, bool(gated))
                    self._parts.setdefault(key, {}).setdefault(expert, [None] * tp)[t] = ((t, p, e), v, local)
        self.tensors: dict[str, TensorStorageMetadata] = {}
        for key, by_expert in self._parts.items():
            experts = sorted(by_expert, key=lambda x: -1 if x is None else x)
            if experts != [None] and experts != list(range(len(experts))):
                raise MlmError(
                    f"{self.path}: {key} has experts {experts}, not 0 … {len(experts) - 1}; copy every "
                    "expert-parallel rank folder (mp_rank_*_NNN) as Megatron-LM wrote it"
                )
            holes = [t for x in experts for t, part in enumerate(by_expert[x]) if part is None]
            if holes:
                raise MlmError(
                    f"{self.path}: {key} lacks the shard of tp rank {holes[0]}; copy every rank folder as "
                    "Megatron-LM wrote it"
                )
            shards = [self._shard(*part) for part in by_expert[experts[0]]]
            shape, dim = [*shards[0].shape], tp_dim(self._rules[key])
            if dim is not None:  # the tp ranks' shards laid end to end
                shape[dim] = sum(t.shape[dim] for t in shards)
            shape = shape if experts == [None] else [len(experts), *shape]
            self.tensors[key] = TensorStorageMetadata(
                TensorProperties(shards[0].dtype), torch.Size(shape), []
            )

    def rank_folder(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> Path:
        """The folder of model-parallel rank (tp_rank, pp_rank, ep_rank), e.g. `mp_rank_01_000`."""
        return self.path / self._names[tp_rank, pp_rank, ep_rank]

    def rank_state(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict:
        """That rank's `model_optim_rng.pt` (memory-mapped)."""
        return self._files[tp_rank, pp_rank, ep_rank]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def _shard(self, rank: tuple[int, int, int], chunk: int, local: str) -> torch.Tensor:
        """Local tensor `local` of virtual pipeline chunk `chunk` in rank `rank`'s file (memory-mapped)."""
        return self._chunks(self._files[rank])[chunk][local]

    def read(self, key: str) -> torch.Tensor:
        """The global tensor `key`: its tp shards joined (and its experts stacked)."""
        joined = []
        for expert in sorted(self._parts[key], key=lambda x: -1 if x is None else x):
            joined.append(join_tp([self._shard(*p) for p in self._parts[key][expert]], self._rules[key]))
        return torch.stack(joined) if len(joined) > 1 or None not in self._parts[key] else joined[0]

    def common(self) -> dict:
        """The first rank file's entries other than the model and optimizer (`args`, `iteration`,
        `checkpoint_version`, …): what a torch_dist checkpoint keeps in common.pt."""
        return {k: v for k, v in self._first.items() if not re.fullmatch(r"model\d*|optimizer", k)}
