"""Dtype sanity on import: a weight stored as an integer or bool (a header that relabels float32
bytes as int32 keeps every size) is refused by name, not imported as "verified"."""

import pytest
import torch

from mlm.config import load_config
from mlm.convert.hf import hf_to_mlm, mlm_to_hf
from mlm.errors import MlmError
from mlm.model.gpt import GPT


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.bool])
def test_an_integer_weight_is_refused_by_name(dtype):
    cfg = load_config(None, ["preset=tiny-llama", "model.num_layers=1", "model.vocab_size=64"]).model
    state, _ = mlm_to_hf(GPT(cfg).state_dict(), cfg, "llama")
    assert torch.equal(hf_to_mlm(state, cfg)["final_norm.weight"], state["model.norm.weight"])
    w = state["model.norm.weight"]
    state["model.norm.weight"] = w.view(torch.int32) if dtype == torch.int32 else w.to(dtype)
    with pytest.raises(MlmError, match=rf"tensor model\.norm\.weight is stored as {dtype}: .*floating point"):
        hf_to_mlm(state, cfg)
