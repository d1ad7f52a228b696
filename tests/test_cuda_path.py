"""The engine's GPU path, run end to end: on a CUDA machine on the GPU, elsewhere on CPU tensors with every Triton
kernel under triton's interpreter (KVCHAT_GPU_PATH=interpret, kernels.gpu_path). Weights stay packed and go
through kernels/triton_matmul.py, decode attention through kernels/triton_attention.py (the backends in
engine/runtime/backends/triton_pages.py), quantized page stores through kernels/triton_store.py. Its logits are
compared with the CPU path's (within 1e-3 of the largest logit) and its greedy tokens must be equal.

Under the interpreter a kernel call costs milliseconds, so the model is tiny and the prompts short; the longer
version (more formats, longer replies) runs with `pytest -m gpu_long`."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvchat import kernels
from kvchat.bench.gguf_writer import preset, write_random_gguf
from kvchat.engine import CacheConfig, Engine, EngineConfig

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not importable here")

PROMPT = [5 + (7 * i) % 200 for i in range(37)]      # past two 16-row blocks: the second one is quantized
FORMATS = {
    "fp32": CacheConfig(k_format="fp32", v_format="fp32"),
    "int8": CacheConfig(k_format="int8", v_format="int8"),
    "int4": CacheConfig(k_format="int4", v_format="int4"),
    "fp8": CacheConfig(k_format="fp8", v_format="fp8"),
    "window": CacheConfig(k_format="fp32", v_format="fp32", window=16, sinks=4),
    "int8-window": CacheConfig(k_format="int8", v_format="int8", window=16, sinks=4),
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    # the tokenizer cut to 2,048 tokens (the prompts' ids are below 210): the tied output GEMV is the same launch
    # (kernel, types, tiles) over 2 programs instead of 48, which took most of each step under the interpreter
    shape = replace(preset("tiny"), vocab=2048)
    return str(write_random_gguf(tmp_path_factory.mktemp("gpu-path") / "tiny-Q4_0.gguf", shape, "Q4_0", seed=5))


def run(engine, cache: CacheConfig, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt's last logits, then `steps` greedy decode steps: logits [steps + 1, vocab], the tokens."""
    runner = engine.runner
    seq = runner.new_sequence(cache)
    try:
        rows = [runner.step([(seq, prompt)])[0][-1].float().cpu()]
        tokens = []
        for _ in range(steps):
            tokens.append(int(rows[-1].argmax()))
            rows.append(runner.step([(seq, [tokens[-1]])])[0][-1].float().cpu())
    finally:
        runner.close(seq)
    return torch.stack(rows), tokens


def gpu_engine(model: str, monkeypatch) -> Engine:
    if CUDA:        # prompt rows in float32, not TF32: the comparison is with the CPU's float32 bits
        monkeypatch.setenv("KVCHAT_MATMUL_IEEE", "1")
    else:
        monkeypatch.setenv("KVCHAT_GPU_PATH", "interpret")
        assert kernels.gpu_path("cpu"), "TRITON_INTERPRET=1 must be set before triton is imported (conftest)"
    return Engine.load(EngineConfig(model=model, device=DEVICE))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    err = (a - b).abs().max().item()
    assert err <= 1e-3 * b.abs().max().item(), f"largest difference {err:.2e} of {b.abs().max().item():.2f}"


def compare(model, monkeypatch, names: list[str], steps: int, prompt: list[int] = PROMPT) -> None:
    # the CPU path in float32 prompts: `auto` takes bf16 on a CPU with AMX, and the comparison is with fp32 bits
    cpu = Engine.load(EngineConfig(model=model, device="cpu", prefill="fp32"))
    want = {name: run(cpu, FORMATS[name], prompt, steps) for name in names}
    gpu = gpu_engine(model, monkeypatch)
    if model.endswith(".gguf"):
        assert gpu.model.weights == "gguf", "the GPU path keeps the GGUF's blocks packed"
    for name in names:
        got = run(gpu, FORMATS[name], prompt, steps)
        close(got[0], want[name][0])
        assert got[1] == want[name][1], name
    used = {type(b).__name__ for b in gpu.runner._backends.values()}
    assert used and all(n.endswith("Triton") for n in used), used


def test_the_gpu_path_gives_the_cpu_paths_logits_and_tokens(tiny_gguf, monkeypatch):
    # two decodes after the 37-token prompt take every path four did (no block fills before 48); -m gpu_long: 24
    compare(tiny_gguf, monkeypatch, list(FORMATS), steps=2)


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen3", "gemma4"])
def test_the_families_on_the_gpu_path(family, tmp_path, monkeypatch):
    """Gemma 2 (soft-capped scores, sliding and global layers alternating), Gemma 3 (five sliding layers to one
    global, a KV group each, their own RoPE), Qwen3 (q/k norms) and Gemma 4 (heads of two sizes, layers reading
    another layer's pages): a prompt past the sliding window, then decodes, through the Triton backends, against
    the CPU path."""
    from tiny_models import tiny_family_dir
    folder = tiny_family_dir(tmp_path / family, family)
    prompt = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    compare(folder, monkeypatch, ["fp32", "int8", "int8-window"], steps=4, prompt=prompt)


@pytest.mark.gpu_long
def test_the_gpu_path_longer(tiny_gguf, monkeypatch):
    compare(tiny_gguf, monkeypatch, list(FORMATS), steps=24)


def test_a_batched_step_on_the_gpu_path_equals_each_sequence_alone(tiny_gguf, monkeypatch):
    """A serve step of three sequences (two decoding, one reading its prompt) gives each the logits it has alone."""
    gpu = gpu_engine(tiny_gguf, monkeypatch)
    runner, cache = gpu.runner, FORMATS["int8"]
    prompts = [PROMPT, PROMPT[3:15], PROMPT[:9]]
    alone = [run(gpu, cache, p, 1)[0] for p in prompts]
    seqs = [runner.new_sequence(cache) for _ in prompts]
    try:
        first = [runner.step([(s, p)])[0][-1].float().cpu() for s, p in zip(seqs[:2], prompts[:2])]
        nxt = [int(f.argmax()) for f in first]
        out = runner.step([(seqs[0], [nxt[0]]), (seqs[1], [nxt[1]]), (seqs[2], prompts[2])],
                          decode=[True, True, False])
        close(out[0][-1].float().cpu(), alone[0][1])
        close(out[1][-1].float().cpu(), alone[1][1])
        close(out[2][-1].float().cpu(), alone[2][0])
    finally:
        for s in seqs:
            runner.close(s)


def test_weights_stay_packed_on_the_gpu_path(tiny_gguf, monkeypatch):
    """Resident weight bytes on the GPU path are the CPU path's (packed), within 1.1x of the file's tensor bytes."""
    from kvchat.engine.gguf.file import GGUFFile
    gpu = gpu_engine(tiny_gguf, monkeypatch)
    gf = GGUFFile(tiny_gguf)
    file_bytes = sum(t.n_bytes for t in gf.tensors.values())
    assert gpu.model.weight_bytes() <= 1.1 * file_bytes, (gpu.model.weight_bytes(), file_bytes)
    kinds = gpu.model.linear_kinds()
    assert kinds and all(k.startswith(("q4", "q8", "int")) for k in kinds), kinds


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_the_gpu_path_measures_attention_as_the_cpu_path(tiny_gguf, fmt, monkeypatch):
    """The Triton backends' attention mass (read again through torch from the pages the kernel left) against the C
    kernels' on the same prompt and decodes: per block, within 1e-4."""
    maps = []
    for engine in (Engine.load(EngineConfig(model=tiny_gguf)), gpu_engine(tiny_gguf, monkeypatch)):
        s = engine.new_session(cache=FORMATS[fmt])
        s.watch_attention()
        s.append(PROMPT)
        for t in (3, 4):
            s.append([t])
        maps.append(s.attention())
        s.close()
    assert maps[0].mass.shape == maps[1].mass.shape and maps[0].mass.shape[-1] == 3
    assert abs(maps[0].mass - maps[1].mass).max() < 1e-4
    assert (maps[0].held == maps[1].held).all()
