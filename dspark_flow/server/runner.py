"""Running the app under uvicorn: in the foreground (the CLI) or on a background thread (tests,
benchmarks). The socket is bound here, before uvicorn starts, so that a taken port is a clean
one-line error instead of uvicorn's log-and-exit."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from dspark_flow.errors import DsparkFlowError


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise DsparkFlowError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, which on Ctrl-C / SIGTERM first ends the engine's requests with a 503:
    uvicorn waits for open connections to close, and a stream mid-generation would otherwise be
    cut off after the grace period (the client sees a broken chunked body, the log a
    CancelledError)."""

    def abort_requests(self) -> None:
        engine = getattr(getattr(self.config.app, "state", None), "engine", None)
        if engine is not None and not self.should_exit:
            engine.abort_all()

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.abort_requests()
        super().handle_exit(sig, frame)


def _server(app: Any, log_level: str) -> _Server:
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=log_level in ("debug", "info"),
        timeout_graceful_shutdown=5,
    )
    return _Server(config)


def serve_forever(app: Any, sock: socket.socket, log_level: str = "warning") -> None:
    """Blocks until Ctrl-C / SIGTERM."""
    _server(app, log_level).run(sockets=[sock])


class BackgroundServer:
    """uvicorn on a thread; `with BackgroundServer(app) as s: s.url ...`."""

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ):
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = _server(app, log_level)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.abort_requests()
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
