"""Every Triton kernel the GPU path launches, compiled for real GPUs on a machine without one.

The interpreter runs a kernel's Python, not its compilation: a global that is not a constexpr, a shape the compiler
refuses or a type it cannot lower pass there and fail on the first CUDA machine. So the GPU path's own launches
are recorded while it runs under the interpreter (a tiny model through every cache format and a window, and
the packed matmul over every packed kind), and each distinct one (kernel, argument types, constexprs) is compiled
to a cubin by triton's own toolchain (ptxas ships in the triton wheel) in a process without the interpreter, for
an RTX 30-series card (sm_86) and an H100 / H200 (sm_90)."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from kvchat import kernels  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGETS = (86, 90)
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                reason="records launches under the interpreter; a GPU compiles them as it runs")

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8", torch.uint8: "u8",
          torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}

COMPILE = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
failed = []
for spec in json.load(open(sys.argv[1])):
    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    for cc in spec["targets"]:
        try:
            k = triton.compile(ASTSource(fn, spec["signature"], spec["constexprs"]), target=GPUTarget("cuda", cc, 32),
                               options={"num_warps": spec["num_warps"]})
            assert k.asm["cubin"]
        except Exception as exc:
            failed.append(f"{spec['name']} sm_{cc} {spec['constexprs']}: {type(exc).__name__}: {str(exc)[-600:]}")
print(json.dumps(failed))
"""


def _spec(fn, args, kwargs) -> dict:
    params = inspect.signature(fn.fn).parameters
    values = dict(zip(fn.arg_names, args)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constexprs = {}, {}
    for name in fn.arg_names:
        value = values[name]
        if "constexpr" in str(params[name].annotation):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    module = sys.modules[fn.fn.__module__]
    constexprs |= getattr(module, "GPU_TILES", {}).get(fn.fn.__name__, {})     # the GPU's tiles, not the interpreter's
    return {"module": fn.fn.__module__, "name": fn.fn.__name__, "signature": signature, "constexprs": constexprs,
            "num_warps": kwargs.get("num_warps", 4), "targets": list(TARGETS)}


@pytest.fixture
def launches(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction
    seen: dict[str, dict] = {}
    real = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        spec = _spec(self, args, kwargs)
        seen[json.dumps({k: spec[k] for k in ("name", "signature", "constexprs")}, sort_keys=True)] = spec
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    return seen


def test_every_kernel_the_gpu_path_launches_compiles_for_real_gpus(launches, tmp_path, monkeypatch):
    from dataclasses import replace

    from kvchat.bench.gguf_writer import preset, write_random_gguf
    from kvchat.engine import CacheConfig, Engine, EngineConfig
    from kvchat.kernels.triton_attention import decode_attention
    from kvchat.kernels.triton_matmul import packed_matmul
    from test_triton_matmul import _q4, _q8

    g = torch.Generator().manual_seed(0)
    for kind in ("fp32", "fp16", "offset8", "two-level"):
        codes, scales = _q4(16, 256, kind, g)
        for rows in (1, 20):
            packed_matmul(torch.randn(rows, 256), codes, scales, 4, 32)
    for kind in ("q8_0", "q5_1", "q6k", "q5k"):
        codes, scales, group = _q8(16, 256, kind, g)
        for rows in (1, 20):
            packed_matmul(torch.randn(rows, 256), codes, scales, 8, group)
    k = torch.randn(64, 2, 32).bfloat16()
    decode_attention(torch.randn(1, 4, 32), k, k, torch.arange(40), torch.tensor([0, 40]), [40], 0.2, softcap=30.0)

    # the tokenizer cut to 2,048 tokens: the tied output GEMV launches the same kernel, types and tiles over 2 programs
    # instead of 48 (the 49k default vocabulary took two thirds of this run under the interpreter)
    shape = replace(preset("tiny"), vocab=2048)
    model = str(write_random_gguf(tmp_path / "tiny-Q4_0.gguf", shape, "Q4_0", seed=1))
    monkeypatch.setenv("KVCHAT_GPU_PATH", "interpret")
    assert kernels.gpu_path("cpu")
    engine = Engine.load(EngineConfig(model=model, device="cpu"))
    runner = engine.runner
    for cache in (CacheConfig(k_format="fp32", v_format="fp32", window=16, sinks=4),
                  CacheConfig(k_format="bf16", v_format="bf16"),
                  CacheConfig(k_format="int8", v_format="int8", window=16, sinks=4),
                  CacheConfig(k_format="int4", v_format="int4"), CacheConfig(k_format="fp8", v_format="fp8")):
        seq = runner.new_sequence(cache)
        logits = runner.step([(seq, list(range(5, 45)))])[0][-1]      # past the first block, kept whole
        for _ in range(2):
            logits = runner.step([(seq, [int(logits.argmax())])])[0][-1]
        runner.close(seq)

    specs = {json.dumps({k: s[k] for k in ("name", "signature", "constexprs")}, sort_keys=True): s
             for s in launches.values()}
    names = {s["name"] for s in specs.values()}
    assert {"_gemv_kernel", "_gemm_kernel", "_decode_kernel", "_store_kernel"} <= names, names
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVCHAT_GPU_PATH")}
    env |= {"TRITON_CACHE_DIR": str(tmp_path / "triton-cache"), "TRITON_DEFAULT_FP_FUSION": "1"}
    # one compiling process a target, side by side (each is single-threaded: the suite's time halves)
    procs = []
    for cc in TARGETS:
        todo = tmp_path / f"sm_{cc}.json"
        todo.write_text(json.dumps([s | {"targets": [cc]} for s in specs.values()]))
        procs.append(subprocess.Popen([sys.executable, "-c", COMPILE, str(todo)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=env, text=True, cwd=ROOT))
    failed = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, stderr[-3000:]
            failed += json.loads(stdout.strip().splitlines()[-1])
    finally:
        for proc in procs:
            proc.kill()
    assert not failed, "\n".join(failed)
