"""The server protects itself (issue 36, item 3): slow and oversize requests are closed with
408/431, a connection past the limit closes the one waiting longest for its request (or gets a
503 when every connection is busy), and `mlm serve` under `ulimit -n 1024` keeps answering
`/health` within 1 s while 1,100 half-open connections are held.

The in-process cases serve a small ASGI app through the same guarded uvicorn as `mlm serve`
(`ServerThread`); the flood runs the real command in a process of its own, so that its open-file
limit can be lowered."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from mlm.serve.connections import ConnectionLimits
from mlm.serve.server import ServerThread
from tests.helpers.common import ROOT


def make_app():
    """Echoes the request body; `/slow` answers once `release` is set."""
    release = asyncio.Event()

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/slow":
            await release.wait()
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app, release


@contextlib.contextmanager
def guarded(**limits):
    app, release = make_app()
    with ServerThread(app, limits=ConnectionLimits(**limits)) as server:
        yield server, release


def connect(server, timeout: float = 5.0) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def answer(sock: socket.socket) -> tuple[int, dict, bytes]:
    """(status, headers, body) of the one response the server sends before it closes."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    return int(status_line.split()[1]), headers, body


def next_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of the next response on a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def request(path: str = "/", body: bytes = b"") -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body


def test_a_slow_body_gets_408_at_the_read_timeout():
    with guarded(read_timeout_s=0.5) as (server, _):
        sock = connect(server)
        start = time.monotonic()
        sock.sendall(request(body=b"x" * 100)[:-90])  # the head and 10 of 100 body bytes
        with contextlib.suppress(OSError):
            for _ in range(40):  # a byte every 0.1 s: 4 s to finish, if the server let it
                time.sleep(0.1)
                sock.sendall(b"x")
        status, headers, body = answer(sock)
        assert status == 408 and headers["connection"] == "close"
        assert "--read-timeout" in json.loads(body)["error"]["message"]
        assert time.monotonic() - start < 2.5


def test_slow_headers_get_408_at_the_read_timeout():
    with guarded(read_timeout_s=0.5) as (server, _):
        sock = connect(server)
        sock.sendall(b"GET / HTTP/1.1\r\n")
        with contextlib.suppress(OSError):
            for i in range(40):
                time.sleep(0.1)
                sock.sendall(f"x-{i}: y\r\n".encode())
        assert answer(sock)[0] == 408


def test_oversize_headers_get_431():
    with guarded(max_header_bytes=4096) as (server, _):
        sock = connect(server)
        with contextlib.suppress(OSError):
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n")
        status, _, body = answer(sock)
        assert status == 431 and "--max-header-bytes" in json.loads(body)["error"]["message"]


def test_a_kept_alive_connection_serves_requests_spaced_within_the_timeout():
    with guarded(read_timeout_s=1.0) as (server, _):
        sock = connect(server)
        for i in range(3):  # 1.2 s in all: the deadline restarts with each request
            time.sleep(0.4)
            sock.sendall(request(body=b"hello %d" % i))
            assert next_response(sock) == (200, b"hello %d" % i)


def test_one_connection_past_the_limit_closes_the_one_waiting_longest():
    with guarded(max_connections=4) as (server, _):
        waiting = [connect(server) for _ in range(4)]
        waiting[0].sendall(b"GET / HT")  # half a request line, on the oldest
        time.sleep(0.2)
        for sock in waiting[1:]:
            sock.sendall(b"GET / HT")
        time.sleep(0.2)
        fifth = connect(server)
        fifth.sendall(request(body=b"ok"))
        assert next_response(fifth) == (200, b"ok")
        status, headers, _ = answer(waiting[0])
        assert status == 503 and headers["retry-after"] == "1"
        for sock in waiting[1:]:  # the others are still open
            sock.settimeout(0.2)
            with pytest.raises(TimeoutError):
                sock.recv(1)


def test_a_connection_past_the_limit_gets_503_when_every_one_is_busy():
    with guarded(max_connections=2) as (server, release):
        busy = [connect(server) for _ in range(2)]
        for sock in busy:
            sock.sendall(request("/slow", b"done"))
        time.sleep(0.3)
        status, headers, body = answer(connect(server))
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(body)["error"]["type"] == "service_unavailable"
        asyncio.run_coroutine_threadsafe(_set(release), _loop(server)).result(5)  # the busy ones finish
        for sock in busy:
            assert next_response(sock) == (200, b"done")


async def _set(event: asyncio.Event) -> None:
    event.set()


def _loop(server) -> asyncio.AbstractEventLoop:
    return server.server.servers[0].get_loop()


def test_limits_are_checked():
    from mlm.errors import MlmError

    with pytest.raises(MlmError, match="--read-timeout 0 must be positive"):
        ConnectionLimits(read_timeout_s=0)


# ---- the flood, against `mlm serve` itself ------------------------------------------------------

FLOOD = 1100


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int, timeout: float) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as r:
        return r.status


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, hf_tokenizer_json):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from mlm.convert.hf.folder import import_hf
    from tests.helpers.hf_models import llama

    root = tmp_path_factory.mktemp("flood")
    vocab = Tokenizer.from_file(str(hf_tokenizer_json)).get_vocab_size()
    llama(tie=False, seed=3, vocab_size=vocab).save_pretrained(root / "hf")
    (root / "hf" / "tokenizer.json").write_bytes(hf_tokenizer_json.read_bytes())
    import_hf(root / "hf", root / "ckpt")
    return root / "ckpt"


def test_health_answers_within_1s_while_1100_half_open_connections_are_held(tiny_checkpoint, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FLOOD + 200
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"this machine's hard open-file limit ({hard}) cannot hold {FLOOD} client sockets")
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (max(soft, want) if hard == resource.RLIM_INFINITY else hard, hard)
    )
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "cli.main",
        "serve",
        str(tiny_checkpoint),
        "--port",
        str(port),
        "--device",
        "cpu",
    ]

    def ulimit_n_1024():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=ulimit_n_1024, env=env
        )
    held = []
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(OSError):
                if _health(port, 1.0) == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        for _ in range(FLOOD):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /health HT")  # half a request line, never finished
            held.append(sock)
        for _ in range(3):
            start = time.monotonic()
            assert _health(port, 1.0) == 200
            assert time.monotonic() - start < 1.0
            time.sleep(0.3)
        assert proc.poll() is None
    finally:
        for sock in held:
            sock.close()
        proc.terminate()
        proc.wait(10)
    text = log.read_text()
    assert "Too many open files" not in text and len(text) < 20_000, text[-2000:]
