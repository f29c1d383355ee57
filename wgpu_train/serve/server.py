"""Listening: the socket bound before the model loads (a port in use is one line, not a uvicorn traceback),
then uvicorn serving the application on it, in the foreground (the CLI) or on a thread (tests, the bench)."""
from __future__ import annotations

import errno
import socket
import threading

from wgpu_train.errors import ConfigError

EXTRA = "pip install 'wgpu-train[serve]'"


def require_extra():
    """ConfigError (one line) unless the serve extra's packages are installed."""
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ConfigError(f"wgpu-train serve needs starlette, uvicorn and prometheus_client: {EXTRA}") from None


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (port 0: a free one the system picks); ConfigError when
    the address cannot be had (a port in use, a host not of this machine)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: a TCP port lies in 0..65535")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # a port in TIME_WAIT is free to rebind
    try:
        sock.bind((host, port))
        sock.listen(2048)       # uvicorn's backlog: a client that connects before uvicorn runs waits, not refused
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is in use: stop what listens there, or pick another --port") \
                from None
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


def url_of(sock: socket.socket) -> str:
    """http://host:port of a bound socket, an IPv6 address in brackets (http://[::1]:8000)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _server(app, log_level: str):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))


def serve(app, sock: socket.socket, log_level: str = "info"):
    """Serve until Ctrl-C (uvicorn's own signal handling shuts it down gracefully)."""
    _server(app, log_level).run(sockets=[sock])


class ServerThread:
    """uvicorn serving an application on a bound socket from a background thread; stop() ends it."""

    def __init__(self, app, sock: socket.socket, log_level: str = "warning"):
        self.url = url_of(sock)
        self._server = _server(app, log_level)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        for _ in range(int(timeout / 0.02)):
            if self._server.started:
                return self
            if not self._thread.is_alive():
                break
            self._thread.join(0.02)
        raise RuntimeError(f"the server at {self.url} did not start")

    def stop(self):
        self._server.should_exit = True
        self._thread.join()
