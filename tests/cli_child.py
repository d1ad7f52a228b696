"""`kvchat chat --prompt` for one model file after another in one process: a JSON line of arguments and
environment in on stdin, a JSON line of exit code, stdout and stderr out (an escaped exception's traceback
in stderr, code 1, as the interpreter would print it). A crash ends the process, and the caller sees its
signal; each file costs no interpreter or torch start of its own."""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


def run(request: dict) -> dict:
    from kvchat.cli.main import main
    for key, value in request.get("env", {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(request["args"])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except Exception:       # what an uncaught exception would print: the test fails on it
            traceback.print_exc()
            rc = 1
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue()}


if __name__ == "__main__":
    reply = sys.stdout
    for line in sys.stdin:
        reply.write(json.dumps(run(json.loads(line))) + "\n")
        reply.flush()
