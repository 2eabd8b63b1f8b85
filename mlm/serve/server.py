"""Run the app: `serve` (the `mlm serve` command: uvicorn in this thread, the model loading on
another, so /health answers 503 until it is ready; under torchrun, tensor-parallel: rank 0 serves
and the other ranks follow its steps) and `ServerThread` (uvicorn on a background thread on a free
port, for tests and benchmarks)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from pathlib import Path

import uvicorn

from mlm.chat import load_chat_template
from mlm.errors import MlmError
from mlm.inference.engine import Engine, EngineConfig, build_runner
from mlm.inference.host_memory import keep_freed_memory
from mlm.inference.loader import load_checkpoint_tokenizer, load_model, model_config
from mlm.inference.lockstep import serving_mesh, stop_followers
from mlm.parallel.launch import pick_device
from mlm.parallel.mesh import Mesh
from mlm.serve.app import Limits, ServerState, create_app
from mlm.serve.connections import ACCEPT_BATCH, LISTEN_BACKLOG, ConnectionLimits, Guard

log = logging.getLogger("mlm.serve")


def load_into(
    state: ServerState,
    ckpt: str,
    engine_config: EngineConfig,
    dtype: str = "fp32",
    device: str = "auto",
    tokenizer: str | None = None,
    chat_template: str | None = None,
    mesh: Mesh | None = None,
) -> Engine:
    """Load the checkpoint (this rank's shard of it on tp rank 0 of `mesh`), start its engine and
    make `state` serve it."""
    model, manifest, it_dir = load_model(ckpt, dtype, device, mesh)
    tok = load_checkpoint_tokenizer(manifest, it_dir, tokenizer)
    chat = load_chat_template(tok, chat_template)
    engine = Engine(model, tok, engine_config, mesh)
    engine.start()
    state.ready(engine, tok, chat)
    return engine


def model_name(ckpt: str) -> str:
    """The checkpoint DIR's name (DIR/iter_N counts as DIR)."""
    p = Path(ckpt).resolve()
    return p.parent.name if p.name.startswith("iter_") else p.name


def serve(
    ckpt: str,
    host: str,
    port: int,
    engine_config: EngineConfig,
    *,
    api_key: str | None = None,
    limits: Limits | None = None,
    connection_limits: ConnectionLimits | None = None,
    name: str | None = None,
    dtype: str = "fp32",
    device: str = "auto",
    tokenizer: str | None = None,
    chat_template: str | None = None,
    tp: int | None = None,
) -> None:
    """Serve until interrupted; a checkpoint that fails to load stops the server with its error.
    Under torchrun (tp = WORLD_SIZE unless given), every rank loads its tp shard; rank 0 serves
    HTTP and drives the others, which return when it stops."""
    dev = pick_device(device, "--device")
    if dev.type == "cpu":
        keep_freed_memory()
    mesh = serving_mesh(model_config(ckpt), tp, dev)
    if mesh.rank != 0:
        model, _, _ = load_model(ckpt, dtype, dev, mesh)
        build_runner(model, engine_config, mesh).follow()
        return
    state = ServerState(name or model_name(ckpt), api_key, limits)

    def stop() -> None:
        if state.engine is not None:
            state.engine.stop()
        elif mesh.tp > 1:  # loading failed or was interrupted: release the other ranks all the same
            stop_followers(mesh, dev)

    config = guarded_config(
        create_app(state),
        connection_limits or ConnectionLimits(),
        host=host,
        port=port,
        timeout_graceful_shutdown=5,
    )
    server = _Server(config, on_exit=stop)
    failure: list[BaseException] = []

    def load() -> None:
        start = time.perf_counter()
        try:
            engine = load_into(state, ckpt, engine_config, dtype, dev, tokenizer, chat_template, mesh)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failure.append(e)
            server.should_exit = True
            return
        log.warning("mlm serve: %s", engine.cache.summary())
        if engine.runner.packed_bytes:
            log.warning(
                "mlm serve: MKL-packed weights for decode batches of %d, %.1f MiB more memory "
                "(--no-packed-weights: off)",
                engine_config.max_seqs,
                engine.runner.packed_bytes / 2**20,
            )
        log.warning("mlm serve: %s ready in %.1f s", state.model_name, time.perf_counter() - start)

    threading.Thread(target=load, name="mlm-load", daemon=True).start()
    server.run()
    if failure:
        e = failure[0]
        raise e if isinstance(e, MlmError) else MlmError(f"loading {ckpt} failed: {type(e).__name__}: {e}")


def guarded_config(app, limits: ConnectionLimits, **kwargs) -> uvicorn.Config:
    """uvicorn's config for `app` behind the connection limits (`mlm.serve.connections`)."""
    return uvicorn.Config(
        app,
        http=Guard(limits, limits.cap()).protocol(),
        h11_max_incomplete_event_size=limits.max_header_bytes,
        backlog=ACCEPT_BATCH,
        **kwargs,
    )


class _Server(uvicorn.Server):
    """uvicorn's server with the kernel's listen queue at `LISTEN_BACKLOG` (asyncio accepts as
    many connections in one go as the backlog it was given, which `guarded_config` keeps small),
    calling `on_exit` once it has shut down, before it re-raises the signal that stopped it (a
    re-raised SIGTERM ends the process before any `finally` of ours runs)."""

    def __init__(self, config: uvicorn.Config, on_exit=lambda: None):
        super().__init__(config)
        self.on_exit = on_exit

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                with sock.dup() as listener:  # the same socket; asyncio's wrapper hides listen()
                    listener.listen(LISTEN_BACKLOG)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:
                self.on_exit()


class ServerThread:
    """`with ServerThread(app) as s:` serves `app` at `s.url` (127.0.0.1, a free port)."""

    def __init__(self, app, host: str = "127.0.0.1", limits: ConnectionLimits | None = None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        config = guarded_config(
            app,
            limits or ConnectionLimits(),
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self.server = _Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
