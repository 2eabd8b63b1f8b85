"""What the `mlm serve` tests share: the tiny Llama served over real HTTP with the API key KEY
(`serving`), waiting for its engine to go idle (`wait_idle`), and the check of an error in
OpenAI's shape (`assert_api_error`)."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from mlm.inference.engine import Engine, EngineConfig
from mlm.serve.app import Limits, ServerState, create_app
from mlm.serve.server import ServerThread, load_into
from tests.helpers.inference import tiny_llama_checkpoint

if TYPE_CHECKING:
    import httpx

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "tiny-llama"


@contextlib.contextmanager
def serving(root, tokenizer_json, limits: Limits):
    """(server thread, its state): the tiny Llama checkpoint served with the API key KEY."""
    _, ckpt = tiny_llama_checkpoint(root, tokenizer_json)
    state = ServerState(NAME, api_key=KEY, limits=limits)
    engine = load_into(state, str(ckpt), EngineConfig(max_seqs=16, max_tokens_per_step=256), device="cpu")
    try:
        with ServerThread(create_app(state)) as server:
            yield server, state
    finally:
        engine.stop()


def wait_idle(engine: Engine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_work() or engine.num_running:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)


def assert_api_error(r: httpx.Response, status: int, *, param: str | None = None, code: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == code, err
    return err
