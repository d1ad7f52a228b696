"""The bundle's entry script (PyInstaller needs a file): the same `kvchat` command the wheel installs."""
from kvchat.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
