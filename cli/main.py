"""The `kvchat` command: the desktop app, or a terminal subcommand (chat, serve, bench, estimate, doctor, replay)."""
from __future__ import annotations

import sys

TERMINAL_COMMANDS = {"chat", "bench", "serve", "estimate", "doctor", "replay", "-h", "--help"}


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:           # Ctrl+C while Qt or torch is still being imported
        print("\nkvchat: stopped (Ctrl+C)", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    if argv[:1] in (["--version"], ["-V"]):     # answered without importing Qt or torch
        from kvchat.app.shell.main import version
        print(f"kvchat {version()}")
        return 0
    if argv and argv[0] in TERMINAL_COMMANDS:
        from kvchat.cli.terminal import main as engine_main
        return engine_main(argv)
    from kvchat.app.shell.main import main as gui_main   # Qt is imported only for the app
    return gui_main(argv)


if __name__ == "__main__":
    sys.exit(main())
