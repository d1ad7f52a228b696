"""The torch-free one-shot path (engine.runtime.quick) on the families of issue 23: a family the C step does not
compute (Gemma's) declines before printing anything and `kvchat chat --prompt` answers through the engine; Phi-3
without a window is the Llama arithmetic with fused weights, and Qwen3 the Llama arithmetic with its q/k norms
(qk_norm_rows in the kernel), both answered here."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from kvchat.bench.gguf_hf import write_gguf_from_hf
from kvchat.cli.main import main
from kvchat.engine import Engine, EngineConfig, SamplingParams
from kvchat.engine.runtime import quick
from kvchat.kernels import cpu_quant
from tiny_models import tiny_family_dir

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="C kernels unavailable")

# llama.cpp derives Gemma's query scale from head_dim: a GGUF of the tiny gemma3 must have that one
GGUF_OVERRIDES = {"qwen3": {}, "gemma3": dict(query_pre_attn_scalar=32)}


@pytest.mark.parametrize("fam", ["gemma3"])
def test_a_family_the_kernel_does_not_compute_declines_to_the_engine(tmp_path, fam, capsys, monkeypatch):
    """A folder, and the same model as a Q8_0 GGUF: one_shot answers None with nothing printed, and `kvchat chat
    --prompt` answers as with the one-shot path switched off (the engine's answer), without a traceback."""
    folder = tiny_family_dir(tmp_path / fam, fam, **GGUF_OVERRIDES[fam])
    gguf = str(write_gguf_from_hf(folder, tmp_path / f"{fam}.gguf", "Q8_0"))
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    argv = ["chat", "--prompt", "hi", "--max-new-tokens", "4", "--temperature", "0", "--device", "cpu"]
    for model in (folder, gguf):
        out = io.StringIO()
        assert quick.one_shot(model, "hi", None, params, out) is None and out.getvalue() == ""
        answers = []
        for off in ("", "1"):
            monkeypatch.setenv("KVCHAT_NO_QUICK", off)
            capsys.readouterr()
            rc = main(argv + ["--model", model])
            got = capsys.readouterr()
            assert rc == 0 and "Traceback" not in got.err, got.err[-800:]
            answers.append(got.out)
        assert answers[0] == answers[1] and answers[0]


@pytest.mark.parametrize("fam, longrope", [("phi3", False), ("phi3", True), ("qwen3", False)])
def test_phi3_and_qwen3_through_the_kernel_are_the_engines_decode_steps(tmp_path, fam, longrope):
    """Phi-3's stored qkv and gate | up, one part each in the kernel's table; with LongRoPE the short factors are
    the rope table and the attention factor the query scale. A prompt of two kernel calls gives, bit for bit, the
    logits of the engine's decode steps fed the same tokens one at a time (the same kernel; the engine's own
    prompt goes through the GEMM, which differs in the last bits)."""
    folder = tiny_family_dir(tmp_path / fam, fam, **({"longrope": True} if longrope else {}))
    gguf = write_gguf_from_hf(folder, tmp_path / f"{fam}.gguf", "Q8_0")
    m = quick.QuickModel(Path(gguf))
    assert m.config.fused_kernel_ok and (m.query_scale != m.config.head_dim ** -0.5) == longrope
    session = Engine.load(EngineConfig(model=str(gguf))).new_session()
    ids = torch.randint(3, 320, (quick.CHUNK + 9,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = quick.QuickSequence(m, len(ids) + 3)
    got = [seq.forward(ids[lo:lo + quick.CHUNK]) for lo in range(0, len(ids), quick.CHUNK)][-1]
    want = [session.append([t], all_logits=False)[-1].numpy() for t in ids][-1]
    for step in range(3):
        assert np.array_equal(got, want), (step, np.abs(got - want).max())
        nxt = int(np.argmax(want))
        want, got = session.append([nxt], all_logits=False)[-1].numpy(), seq.forward([nxt])
