"""What a long benchmark is doing, on stderr: `--json` keeps stdout for the result alone.

One line a stage (`[bench speed 12.3 s] kvchat run 2/5`), rewritten in place on a terminal as tqdm does and one
line each elsewhere (a log, a pipe), so a run on a busy machine never looks hung. KVCHAT_BENCH_QUIET=1 silences it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time


class Progress:
    def __init__(self, name: str, stream=None):
        self.name = name
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self.quiet = os.environ.get("KVCHAT_BENCH_QUIET") == "1"
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._open = False          # a terminal line waiting to be rewritten
        self._last = (f"running kvchat bench {name}", None, None)
        self._said = time.perf_counter()
        self._lock = threading.Lock()

    def __call__(self, stage: str, i: int | None = None, n: int | None = None) -> None:
        self._last, self._said = (stage, i, n), time.perf_counter()
        if self.quiet:
            return
        count = f" {i}/{n}" if i is not None and n is not None else ""
        line = f"[bench {self.name} {time.perf_counter() - self.start:7.1f} s] {stage}{count}"
        with self._lock:
            self._write(line)

    def _write(self, line: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + line)
            self._open = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    @contextlib.contextmanager
    def heartbeat(self, every: float = 20.0):
        """While the block runs, repeat the last stage (with the time so far) when nothing was said for `every` s:
        a stage that takes minutes on a busy machine still shows it is alive."""
        stop = threading.Event()

        def beat():
            while not stop.wait(min(every, 1.0)):
                if time.perf_counter() - self._said >= every:
                    stage, i, n = self._last
                    self(stage + (" (still running)" if not stage.endswith("(still running)") else ""), i, n)
        thread = threading.Thread(target=beat, name="bench-heartbeat", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    def done(self) -> None:
        self(f"done in {time.perf_counter() - self.start:.1f} s")
        if self.tty and self._open and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()
