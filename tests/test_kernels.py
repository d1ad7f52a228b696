"""The Triton page store against its torch reference, and the reference quantizer against plain math.

Without CUDA (or with TRITON_INTERPRET=1 already set) the Triton store runs on the CPU under the
interpreter; with CUDA and no TRITON_INTERPRET it runs compiled on the GPU. The choice must be
made before triton is imported, so it happens at the top of this module.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

import pytest  # noqa: E402

from kvchat.kernels import reference  # noqa: E402
from kvchat.kernels.formats import PageFormat, page_format  # noqa: E402

try:
    from kvchat.kernels import triton_store
    _TRITON_ERROR = None
except Exception as exc:  # triton missing, or unusable in this process
    triton_store = None
    _TRITON_ERROR = f"triton kernels cannot run here: {exc!r}"

needs_triton = pytest.mark.skipif(_TRITON_ERROR is not None, reason=_TRITON_ERROR or "")


def _fmt(name: str, role: str) -> PageFormat:
    return page_format(name, role)


def _empty_pages(fmt: PageFormat, num_blocks: int, bs: int, H: int, D: int):
    shapes = fmt.shapes(bs, H, D)
    make = {k: torch.zeros((num_blocks, *shape), dtype=dtype, device=DEVICE) for k, (shape, dtype) in shapes.items()}
    return make["data"], make.get("scale"), make.get("zero")


# ---------------------------------------------------------------- quantize-and-store

STORE_FORMATS = [("fp32", "k"), ("fp16", "k"), ("bf16", "k"), ("int8", "k"), ("int8", "v"),
                 ("fp8", "k"), ("fp8", "v"), ("int4", "k"), ("int4", "v")]


@needs_triton
@pytest.mark.parametrize("bs,D", [(1, 64), (16, 128), (64, 64)])
@pytest.mark.parametrize("name,role", STORE_FORMATS)
def test_store_matches_reference_bit_exact(name, role, bs, D):
    """Triton store writes the same data, scale and zero pages as the reference, bit for bit."""
    fmt = _fmt(name, role)
    gen = torch.Generator().manual_seed(bs + D)
    src = (3 * torch.randn(3, bs, 2, D, generator=gen)).to(DEVICE)
    block_ids = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    want = _empty_pages(fmt, 6, bs, 2, D)
    got = _empty_pages(fmt, 6, bs, 2, D)
    reference.store_blocks(src, block_ids, *want, fmt)
    triton_store.store_blocks(src, block_ids, *got, fmt)
    for w, g in zip(want, got):
        if w is not None:   # compare raw bytes: rounding is explicit (half to even), so no step of slack
            assert torch.equal(w.view(torch.uint8), g.view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_store_rounds_half_to_even(name):
    """Codes exactly halfway between two levels round to even, like torch.round."""
    fmt = PageFormat(name, "token", symmetric=name != "int4")
    if name == "int8":   # max |x| = 127 makes the scale exactly 1
        row = [-3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 127.0] + [0.0] * 55
    else:                # min 0 and max 15 make the zero point 0 and the scale 1
        row = [i + 0.5 for i in range(14)] + [0.0, 15.0]
        row = row * 4
    src = torch.tensor(row, device=DEVICE).view(1, 1, 1, 64)
    data, scale, zero = _empty_pages(fmt, 1, 1, 1, 64)
    triton_store.store_blocks(src, torch.zeros(1, dtype=torch.int32, device=DEVICE), data, scale, zero, fmt)
    if name == "int4":
        data = torch.stack((data & 0xF, data >> 4), -1)
    assert float(scale.flatten()[0]) == 1.0
    assert torch.equal(data.flatten().float().cpu(), torch.tensor(row).round())


# ---------------------------------------------------------------- dispatch

def test_import_kernels_needs_no_triton():
    """`import kernels` neither imports triton nor needs it; without triton the CPU path still runs."""
    code = ("import sys; from kvchat import kernels; assert 'triton' not in sys.modules, 'triton imported eagerly'; "
            "sys.modules['triton'] = None; kernels.triton_available.cache_clear(); "
            "assert not kernels.triton_available(); "
            "import torch; f = kernels.page_format('int8', 'v'); s = f.shapes(4, 1, 8); "
            "d, sc = (torch.zeros(2, *s[k][0], dtype=s[k][1]) for k in ('data', 'scale')); "
            "kernels.store_blocks(torch.ones(1, 4, 1, 8), torch.tensor([1]), d, sc, None, f); "
            "assert d[1].eq(127).all()")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------- references against plain math

@pytest.mark.parametrize("name,role", [("int8", "k"), ("int8", "v"), ("fp8", "k"), ("fp8", "v"), ("int4", "k"), ("int4", "v")])
def test_quantize_error_within_one_step(name, role):
    """Reference quantize/dequantize errs at most half a step (int) or 2^-4 relative (fp8), plus fp16 scale rounding."""
    fmt = _fmt(name, role)
    x = 4 * torch.randn(3, 16, 2, 64, generator=torch.Generator().manual_seed(1))
    data, scale, zero = reference.quantize(x, fmt)
    err = (reference.dequantize(data, scale, zero, fmt) - x).abs()
    step = reference.dequantize(torch.full_like(data, 0x11 if name == "int4" else 1), scale,
                                None if zero is None else torch.zeros_like(zero), fmt)
    amax = x.abs().amax()
    if name == "fp8":   # 3 mantissa bits: half an ulp is 2^-4 of |x|; below 2^-6 the subnormal step 2^-9
        centred = x if zero is None else x - zero.float().unsqueeze(1)   # fp8 keys are centred per channel
        bound = centred.abs() * 2 ** -4 + step * 2 ** -10 + amax * 2 ** -10
    else:               # half a step, plus what clamping loses when the fp16 scale rounded down
        bound = step / 2 + amax * 2 ** -10
    assert (err <= bound + 1e-6).all()
