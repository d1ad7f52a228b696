"""Binary byte units, defined once: the engine, the app, the benchmarks and the command line import these."""
from __future__ import annotations

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

# bytes an element of a full-precision dtype takes, by the names the configs use and torch's own
DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2}


def format_size(num_bytes: float) -> str:
    """The estimate's words: 1.25 GiB, 600.00 MiB, 3.50 KiB, 512 B (thousands separated)."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:,.2f} {unit}"
    return f"{num_bytes:,.0f} B"
