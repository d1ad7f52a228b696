"""A decode matvec's rows shared out among the team (SHARED_STEPS, kernels/cpu_common.h): threads that finish their
share take the back half of another's, so which thread reads a row changes from call to call. Every row must still
be computed once and give the bits it gives on one thread. Seven threads on this machine's cores are preempted
mid-share, so the splitting runs in every call."""
import json
import os
import subprocess
import sys

import pytest

from kvchat.kernels import cpu_quant as cq

pytestmark = pytest.mark.skipif(not cq.available(), reason=f"C kernels unavailable: {cq.unavailable_reason()}")

_CHILD = r"""
import hashlib, json, sys
import numpy as np, torch
from kvchat.engine.gguf.blocks import mxfp4_blocks, q6k_parts
from kvchat.kernels import cpu_quant as cq
assert cq.available()

def blocks(n, nb, size, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, nb, size), dtype=np.uint8)

out, bad = {}, []
for n in (1, 3, 17, 1001):
    g = torch.Generator().manual_seed(n)
    k = 512
    x = torch.randn(1, k, generator=g)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    zero = -8 * scale + torch.randn(n, k // 32, generator=g) * 0.01
    c8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    b6 = blocks(n, k // 256, 210, n)
    b6[..., 208:210] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    ql, qh, sc, d = (torch.from_numpy(a) for a in q6k_parts(b6.reshape(n, -1)))
    s6 = cq.Scales(sc, scale_sup=d, per=16)
    b4 = blocks(n, k // 32, 17, n)
    b4[..., 0] = 127
    mc, me = (torch.from_numpy(a) for a in mxfp4_blocks(b4.reshape(n, -1)))
    for act in (16, 8):
        for name, fn, ref in (
                ("q4", lambda: cq.q4_gemv(x, codes, scale, zero, act=act), lambda: cq.q4_gemv_ref(x, codes, scale, zero)),
                ("q8", lambda: cq.q8_gemv(x, c8, scale * 0.1, None, 32, act=act),
                 lambda: cq.q8_gemv_ref(x, c8, scale * 0.1, None, 32)),
                ("q6k", lambda: cq.q6k_gemv(x, ql, qh, s6, act=act), lambda: cq.q6k_gemv_ref(x, ql, qh, s6)),
                ("mxfp4", lambda: cq.mxfp4_gemv(x, mc, me, act=act), lambda: cq.mxfp4_gemv_ref(x, mc, me))):
            r = ref()
            tol = 2e-2 * r.abs().max().item() + 1e-5
            digests = set()
            for _ in range(20):
                y = fn()
                if not torch.isfinite(y).all() or (y - r).abs().max().item() > tol:
                    bad.append(f"{name} n={n} act={act}")
                digests.add(hashlib.sha256(y.numpy().tobytes()).hexdigest())
            if len(digests) != 1:
                bad.append(f"{name} n={n} act={act}: {len(digests)} different results")
            out[f"{name} {n} {act}"] = digests.pop()
print(json.dumps({"out": out, "bad": bad}))
"""


def _run(threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="passive")
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_rows_shared_among_more_threads_than_cores_give_one_threads_bits():
    one, seven = _run(1), _run(7)
    assert not one["bad"] and not seven["bad"], (one["bad"], seven["bad"])
    assert seven["out"] == one["out"]
