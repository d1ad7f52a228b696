"""A running server: scheduler thread + uvicorn, in the foreground (CLI) or a background thread (tests, bench)."""
from __future__ import annotations

import functools
import os
import socket
import threading
import time
from dataclasses import dataclass

from kvchat.engine.config import CacheConfig, ConfigError
from kvchat.engine.serve.app import ServeState, create_app
from kvchat.engine.serve.guard import READ_TIMEOUT_S, HeaderDeadline, is_loopback
from kvchat.engine.serve.metrics import ServeMetrics
from kvchat.engine.serve.scheduler import Scheduler, SchedulerConfig
from kvchat.engine.kv.tier import DEFAULT_TIER_MB

API_KEY_ENV = "KVCHAT_API_KEY"


@dataclass(frozen=True, slots=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_id: str | None = None         # the name clients send; the model file's name by default
    max_num_seqs: int = 16
    prefill_chunk: int = 256
    preempt_tier_mb: float = DEFAULT_TIER_MB
    read_timeout_s: float = READ_TIMEOUT_S   # seconds a client has to send a request's line and headers, and its body

    def __post_init__(self):
        if not is_loopback(self.host) and not self.api_key:
            raise ConfigError(f"--host {self.host} would let other machines reach the model: set an API key with "
                              f"--api-key or {API_KEY_ENV}, or keep the default 127.0.0.1")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: use 1-65535 (0 picks a free port)")
        if not 1 <= self.max_num_seqs <= 4096:
            raise ConfigError(f"--max-num-seqs {self.max_num_seqs}: use 1-4096 (requests decoded together)")
        if not 1 <= self.prefill_chunk <= 65536:
            raise ConfigError(f"--prefill-chunk {self.prefill_chunk}: use 1-65536 (prompt tokens a request reads "
                              f"per step)")
        if not (isinstance(self.preempt_tier_mb, (int, float)) and 0 <= self.preempt_tier_mb <= 2**20):
            raise ConfigError(f"--preempt-tier-mb {self.preempt_tier_mb}: use 0 (preempted requests read their prompt "
                              f"again) up to 1048576")
        timeout = self.read_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise ConfigError(f"read_timeout_s={timeout!r}: use more than 0 and at most 3600 seconds")


class Server:
    def __init__(self, engine, config: ServeConfig, cache: CacheConfig | None = None):
        import uvicorn
        self.engine = engine
        self.config = config
        cache = cache or engine.config.cache
        self.model_id = config.model_id or engine.model_name
        self.metrics = ServeMetrics(engine, self.model_id)
        self.scheduler = Scheduler(engine, SchedulerConfig(cache, config.max_num_seqs, config.prefill_chunk,
                                                                   tier_mb=config.preempt_tier_mb),
                                   self.metrics)
        self.state = ServeState(engine, self.scheduler, self.metrics, self.model_id, config.api_key,
                                config.read_timeout_s)
        self.app = create_app(self.state)
        http = functools.partial(HeaderDeadline, read_timeout_s=config.read_timeout_s)
        self._uvicorn = uvicorn.Server(uvicorn.Config(self.app, http=http, log_level="warning", lifespan="off",
                                                      timeout_graceful_shutdown=5))
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        sock.set_inheritable(True)
        self._socket = sock
        return sock

    @property
    def base_url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/v1"

    def start(self, timeout: float = 30.0) -> str:
        """Serve from a background thread; returns the base URL (…/v1) once it accepts connections."""
        sock = self._bind()
        self.scheduler.start()
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]},
                                        name="kvchat-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self.base_url

    def stop(self) -> None:
        self.scheduler.shutdown()
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        if self._socket is not None:
            self._socket.close()
        self.state.prompt_pool.shutdown(wait=False, cancel_futures=True)

    def run(self) -> None:
        """Serve in the foreground until Ctrl+C."""
        sock = self._bind()
        self.scheduler.start()
        try:
            self._uvicorn.run(sockets=[sock])
        finally:
            self.scheduler.shutdown()
            sock.close()
            self.state.prompt_pool.shutdown(wait=False, cancel_futures=True)


def api_key_from(arg: str | None) -> str | None:
    return arg or os.environ.get(API_KEY_ENV) or None
