"""kvchat.engine.runtime.quick: a one-shot terminal answer without torch, against the engine on the same files."""
import io
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvchat.engine import Engine, EngineConfig, SamplingParams, TokenDelta
from kvchat.engine.runtime import quick
from kvchat.cli.terminal import build_parser
from kvchat.bench.gguf_writer import write_random_gguf
from kvchat.engine.model.source import default_gguf_path
from kvchat.engine.runtime.sampling import sample as engine_sample, sample_numpy
from kvchat.kernels import cpu_quant

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="C kernels unavailable")

PACKED = ("Q4_0", "Q4_1", "Q4_K", "Q4_K_M", "Q5_0", "Q6_K", "Q8_0")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quick")
    return {t: str(write_random_gguf(folder / f"tiny-{t}.gguf", "tiny", t, seed=5)) for t in PACKED + ("F16",)}


@pytest.mark.parametrize("kind", PACKED)
def test_logits_track_the_engine(tiny, kind):
    """Prompt (two kernel calls: more than CHUNK tokens) and three decode steps give the engine's logits: the same
    kernels decode; the engine's prompt goes through the GEMM, so agreement is close, not bitwise."""
    engine = Engine.load(EngineConfig(model=tiny[kind], prefill="fp32"))       # as exact as this path's prompt
    m = quick.QuickModel(Path(tiny[kind]))
    ids = [int(i) for i in torch.randint(3, m.config.vocab_size, (quick.CHUNK + 9,), generator=torch.Generator().manual_seed(1))]
    session = engine.new_session()
    seq = quick.QuickSequence(m, len(ids) + 4)
    want = session.append(ids, all_logits=False)[-1].numpy()
    got = [seq.forward(ids[lo:lo + quick.CHUNK]) for lo in range(0, len(ids), quick.CHUNK)][-1]
    for step in range(4):
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= 2e-3 * scale, (kind, step)
        nxt = int(np.argmax(want))
        want = session.append([nxt], all_logits=False)[-1].numpy()
        got = seq.forward([nxt])
    assert seq.length == len(ids) + 4


def test_what_it_does_not_cover_is_left_to_the_engine(tiny, tmp_path, monkeypatch):
    """16-bit weights, a missing, damaged or too big file: None, nothing printed; the engine then says what
    is wrong. A file never seen before is answered, its tokenizer cached on the way."""
    out = io.StringIO()
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    assert quick.one_shot(tiny["F16"], "hi", None, params, out) is None
    assert quick.one_shot(str(tmp_path / "missing.gguf"), "hi", None, params, out) is None
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(Path(tiny["Q8_0"]).read_bytes()[:5000])
    assert quick.one_shot(str(damaged), "hi", None, params, out) is None
    with monkeypatch.context() as mp:       # a file too big for the memory left: the engine refuses it, with numbers
        mp.setattr("kvchat.engine.plan.fit.available_bytes", lambda device: 2**20)
        assert quick.one_shot(tiny["Q8_0"], "hi", None, params, out) is None
    assert out.getvalue() == ""
    fresh = write_random_gguf(tmp_path / "fresh.gguf", "tiny", "Q8_0", seed=9)
    assert quick.one_shot(str(fresh), "hi", None, params, out) == 0 and out.getvalue().endswith("\n")


def test_cli_options_that_need_the_engine():
    """Cache settings, a device, or a seeded sample (which must equal the engine's stream) take the engine."""
    parse = lambda *a: build_parser(benches=False).parse_args(["chat", "--prompt", "hi", *a])   # noqa: E731
    assert quick.covers(parse()) or Path("/dev/nvidiactl").exists()
    assert quick.covers(parse("--seed", "3", "--temperature", "0")) or Path("/dev/nvidiactl").exists()
    for extra in (["--k-format", "int8"], ["--window", "64"], ["--device", "cuda"], ["--seed", "3"],
                  ["--budget-mb", "64"], ["--fp-layers", "0"]):
        assert not quick.covers(parse(*extra)), extra
    assert not quick.covers(Namespace(**{**vars(parse()), "prompt": None}))


def test_sampling_matches_the_engines_rules():
    """Greedy with a repetition penalty picks what engine.runtime.sampling picks; top-k 1 and a tiny top-p keep the best."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(300, generator=g) * 3
        recent = [int(i) for i in torch.randint(0, 300, (12,), generator=g)]
        greedy = SamplingParams(temperature=0.0, repetition_penalty=1.3)
        rng = np.random.default_rng(0)
        assert sample_numpy(logits.numpy(), greedy, recent, rng) == engine_sample(logits, greedy, recent, None)
        best = int(logits.argmax())
        assert sample_numpy(logits.numpy(), SamplingParams(temperature=0.8, top_k=1, top_p=1.0,
                                                           repetition_penalty=1.0), [], rng) == best
        assert sample_numpy(logits.numpy(), SamplingParams(temperature=0.8, top_k=0, top_p=1e-6,
                                                           repetition_penalty=1.0), [], rng) == best
    probs = torch.tensor([0.5, 0.3, 0.2]).log().numpy()
    draws = [sample_numpy(probs, SamplingParams(temperature=1.0, top_k=0, top_p=0.7, repetition_penalty=1.0), [], rng)
             for _ in range(2000)]
    assert set(draws) == {0, 1} and 0.55 < draws.count(0) / len(draws) < 0.70     # 0.5 / 0.8 = 0.625


def test_default_model_one_shot_without_torch():
    """The real default model: `kvchat chat --prompt` answers greedily with the engine's words, in a process that
    never imports torch (the prompt read as exactly as the engine's fp32 GEMM reads it)."""
    prompt, n = "What is the capital of France?", 24
    engine = Engine.load(EngineConfig(prefill="fp32"))     # this path's prompt is as exact (a CPU with AMX: bf16)
    events = list(engine.new_session().send(prompt, SamplingParams(temperature=0.0, max_new_tokens=n)))
    want = "".join(e.text for e in events if isinstance(e, TokenDelta))
    code = ("import sys; from kvchat.cli.main import main; rc = main(sys.argv[1:]); "
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH'); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, "chat", "--prompt", prompt, "--temperature", "0",
                          "--max-new-tokens", str(n), "--device", "cpu"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    text, flag = out.stdout.rsplit("\n", 2)[0], out.stdout.strip().rsplit("\n", 1)[-1]
    assert flag == "NO-TORCH"
    assert text.strip() == want.strip() and "Paris" in text
    assert default_gguf_path().is_file()


def test_a_reader_that_goes_away_stops_the_answer_quietly():
    """`kvchat chat --prompt ... | head -c 1` on the real model: no traceback, exit 141 as a pipe's writer, through
    either path."""
    for env in ({}, {"KVCHAT_NO_QUICK": "1"}):
        proc = subprocess.Popen([sys.executable, "-m", "kvchat.cli.main", "chat", "--prompt", "Write a long story about a cat.",
                                 "--temperature", "0", "--max-new-tokens", "300"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env})
        proc.stdout.read(1)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=300) == 141 and "Traceback" not in err, (env, err[-500:])
