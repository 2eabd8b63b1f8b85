"""The adapter base: what one Hugging Face architecture must say for mlm to convert it (its
key-template table and config.json both ways); `mlm.convert.hf.engine` does the rest for all."""

from __future__ import annotations

from abc import ABC, abstractmethod

from mlm.config import ModelConfig
from mlm.convert.common import attention_options
from mlm.convert.keymap import KeyMap, Target
from mlm.errors import MlmError


class Adapter(ABC):
    """How one Hugging Face architecture's config and state dict map onto mlm's."""

    model_type: str
    """config.json's `model_type`."""
    hf_class: str
    """The transformers class, written to config.json's `architectures`."""
    since: str = "4.46"
    """The first transformers release with `hf_class` (mlm's own floor: 4.46)."""
    from_hf: dict[str, Target]
    """HF key template → mlm key template(s) or rule, or None to drop the key."""
    prefix: str = ""
    """A prefix some checkpoints of this architecture leave out (GPT-2's `transformer.`)."""
    hint: str = ""
    """Said after the list of known templates when a state has keys none names."""
    copy_note: str = ""
    """Why the tensors of `copied` templates must equal their originals (said when one does not)."""
    mtp: bool = False
    """The architecture stores multi-token prediction depths (`model.mtp_num_layers`)."""
    float32_keys: tuple[str, ...] = ()
    """Endings of the keys an export writes in float32 whatever its dtype (as transformers holds them)."""

    @abstractmethod
    def config_from_hf(self, c: dict) -> ModelConfig:
        """The ModelConfig of a config.json dict; MlmError for what mlm cannot express."""

    @abstractmethod
    def config_to_hf(self, cfg: ModelConfig) -> dict:
        """config.json for `cfg` (transformers 4.x keys, which 5.x also reads); MlmError when
        this architecture cannot express `cfg`."""

    def counts(self, cfg: ModelConfig) -> dict[str, int]:
        """How many values each template placeholder takes (`{layer}`; `mlm.convert.hf.moe` adds `{expert}`)."""
        return {"layer": cfg.num_layers}

    def offsets(self, cfg: ModelConfig) -> dict[str, int]:
        """What Hugging Face keys add to a placeholder's value (none; DeepSeek-V3: `{depth}` + num_layers)."""
        return {}

    def keymap(self, cfg: ModelConfig) -> KeyMap:
        """The template table for `cfg`'s counts."""
        name = f"Hugging Face {self.model_type}"
        return KeyMap(self.from_hf, self.counts(cfg), name, self.prefix, self.hint, self.offsets(cfg))

    def config_for_keys(self, cfg: ModelConfig, keys) -> tuple[ModelConfig, str | None]:
        """`cfg` (from config.json) fitted to what a state with these Hugging Face `keys` holds,
        and a sentence saying why it changed (None: it did not). DeepSeek-V3: a config that counts
        MTP depths whose weights were left out (transformers saves none) loses them."""
        return cfg, None

    def shape_note(self, template: str, cfg: ModelConfig) -> str:
        """How `cfg` sizes the tensors of `template`, said when a stored one has another shape ("")."""
        return ""

    def get(self, c: dict, key: str):
        """config.json's `key`, which must be there."""
        if c.get(key) is None:
            raise MlmError(
                f"Hugging Face config (model_type {self.model_type!r}) has no {key!r}; "
                "is it a complete config.json?"
            )
        return c[key]

    def require(
        self,
        cfg: ModelConfig,
        rules: dict[str, object],
        mlp: tuple[str, ...] = ("dense",),
        attention: str = "gqa",
    ) -> None:
        """MlmError naming each `cfg` field that differs from what this architecture needs (`rules`:
        field → value, `moe.` fields of `cfg.moe` included), and each layer kind it lacks: attention
        must be `attention` (grouped-query unless said), the MLP one of `mlp` (an MoE adapter passes
        ("dense", "moe"), or ("moe",) when every layer has experts); MTP depths only where the
        architecture stores them."""
        bad = [f"model.{k}={_field(cfg, k)!r} (needs {v!r})" for k, v in rules.items() if _field(cfg, k) != v]
        bad += attention_options(cfg)
        kinds = {(s.mixer, s.mlp) for s in cfg.layer_specs()}
        if not kinds <= {(attention, m) for m in mlp}:
            needs = " or ".join(repr((attention, m)) for m in mlp)
            bad.append(f"layer kinds {sorted(kinds)} (needs only {needs})")
        if cfg.mtp_num_layers and not self.mtp:
            bad.append(
                f"model.mtp_num_layers={cfg.mtp_num_layers} (needs 0: no multi-token prediction layers)"
            )
        if bad:
            raise MlmError(
                f"this model cannot be written as Hugging Face {self.model_type}: {'; '.join(bad)}"
            )


def _field(cfg: ModelConfig, name: str):
    """`cfg`'s field `name`, a dotted one ("moe.router_topk") from its sub-config."""
    for part in name.split("."):
        cfg = getattr(cfg, part)
    return cfg
