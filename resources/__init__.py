"""kvchat's resources: style sheet, icon, desktop entry, texts for the benchmarks.

A package only so that `pip install .` ships them beside app/ and engine/, which find them at
<site-packages>/resources (a checkout, an editable install and the PyInstaller bundle have the same
layout).
"""
from pathlib import Path

RESOURCES = Path(__file__).resolve().parent
