"""`kvchat serve` as a child process on a free loopback port, for the tests that drive the real command."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvchat(*args) -> list[str]:
    """The `kvchat` command line as this interpreter runs it."""
    return [sys.executable, "-m", "kvchat.cli.main", *args]


def start_serve(args: list[str], env: dict[str, str], cwd=None, wait_s: float = 120) -> tuple[subprocess.Popen, str]:
    """`kvchat serve ARGS --port P` started and answering /health; returns (process, base URL). A child that dies
    while starting fails the calling test with its stderr."""
    port = free_port()
    proc = subprocess.Popen(kvchat("serve", *args, "--port", str(port)), cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"kvchat serve did not answer /health within {wait_s:g} s")
