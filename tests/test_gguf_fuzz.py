"""A tiny GGUF with its header fields and tensor shapes mutated, answered through `kvchat chat --prompt` by the
torch-free path and by the engine, in a child process: never a crash, never a traceback, never a made-up
answer. Each file is refused (a nonzero exit, one line on stderr, nothing on stdout) or answered exactly as
the unmutated file is: no mutation here leaves a self-consistent model of other numbers (the header's
values and the shapes are chosen so that none does), so any other answer is garbage read from wrong shapes."""
from __future__ import annotations

import itertools
import json
import math
import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gguf_mutants as gm
from kvchat.engine.text.tokenizer_cache import gguf_tokenizer, gguf_tokenizer_dir
from kvchat.kernels import cpu_lib

pytestmark = pytest.mark.skipif(cpu_lib.library() is None, reason="C kernels unavailable")

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["chat", "--prompt", "Hello", "--temperature", "0", "--max-new-tokens", "4", "--device", "cpu"]
PATHS = {"quick": {"KVCHAT_NO_QUICK": None}, "engine": {"KVCHAT_NO_QUICK": "1"}}

# values that are wrong, absurd, mistyped, absent, or (context 4096, no key_length: the rope's 32) harmless;
# none of the whole numbers gives q, k and o shapes that agree with another head split
FIELDS = {
    "llama.block_count": [0, 1, 3, 1025, 10**9, -1, "2", 2.0, gm.MISSING],
    "llama.embedding_length": [0, 32, 65, 128, 2**17, gm.MISSING],
    "llama.attention.head_count": [0, 1, 3, 4, 1025, gm.MISSING],
    "llama.attention.head_count_kv": [0, 2, 3, gm.MISSING],
    "llama.attention.key_length": [0, 31, 33, 48, 64, 2**20, gm.MISSING],
    "llama.feed_forward_length": [0, 64, 256, 2**21, gm.MISSING],
    "llama.context_length": [0, 4096, 2**25, -5],
    "llama.rope.freq_base": [0.0, -1.0, math.nan, math.inf, "x"],
    "llama.attention.layer_norm_rms_epsilon": [0.0, -1.0, math.nan, math.inf],
}


def _reshape(shape: tuple[int, ...], op: str) -> tuple[int, ...] | None:
    first, rest = shape[0], shape[1:]
    return {"drop": None, "transpose": tuple(reversed(shape)) if rest else (1, first),
            "half": (first // 2, *rest), "double": (first * 2, *rest), "empty": (0, *rest),
            "wider": (*shape[:-1], shape[-1] + 32), "ragged": (*shape[:-1], shape[-1] + 5),
            "flat": (math.prod(shape),) if rest else (first, 1), "extra_dim": (1, *shape)}[op]


OPS = ("drop", "transpose", "half", "double", "empty", "wider", "ragged", "flat", "extra_dim")
NAMES = sorted(gm.base_tensors(1))         # the vocabulary's size does not change the names


@st.composite
def mutations(draw) -> tuple[dict, dict]:
    """(fields, tensors) overrides for gm.write: one to three changes."""
    fields, tensors = {}, {}
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("field", "tensor", "tensor", "untie", "layer")))
        if kind == "field":
            key = draw(st.sampled_from(sorted(FIELDS)))
            fields[key] = draw(st.sampled_from(FIELDS[key]))
        elif kind == "tensor":
            name = draw(st.sampled_from(NAMES))
            # a longer vocabulary is a real model's padding, not a mistake: token_embd is not doubled
            ops = [op for op in OPS if not (name == "token_embd.weight" and op == "double")]
            base = gm.base_tensors(gm.vocab_size())[name]
            tensors[name] = _reshape(tensors.get(name) or base, draw(st.sampled_from(ops)))
        elif kind == "untie":            # an output head of the wrong shape (a right one is another model)
            v, h = gm.vocab_size(), gm.HIDDEN
            tensors["output.weight"] = draw(st.sampled_from([(v, h + 32), (h, v), (v // 2, h), (v, h, 1)]))
        else:
            tensors["blk.2.attn_norm.weight"] = (gm.HIDDEN,)
    return fields, tensors


class Child:
    """cli_child.py, restarted after a crash."""

    def __init__(self):
        self.proc = None

    def ask(self, path: Path, which: str) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "cli_child.py")], cwd=ROOT, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.proc.stdin.write(json.dumps({"args": [*ARGS, "--model", str(path)], "env": PATHS[which]}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], 180)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            code = self.proc.wait()
            return {"rc": code if ready else "timeout", "out": "", "err": f"the child died (code {code})"}
        return json.loads(line)

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    base = gm.write(folder / "base.gguf")
    gguf_tokenizer(base)           # built once; every mutant's tokenizer fields are the base's (seed_tokenizer)
    child = Child()
    answers = {which: child.ask(base, which) for which in PATHS}
    for which, got in answers.items():
        assert got["rc"] == 0 and got["out"].strip() and not got["err"], (which, got)
    yield folder, base, child, {which: got["out"] for which, got in answers.items()}
    child.close()


def seed_tokenizer(base: Path, mutant: Path) -> None:
    """The base's cached tokenizer under the mutant's cache key (the same tokenizer fields): a first start
    builds it in seconds, which the fuzzing does not need to measure."""
    target = gguf_tokenizer_dir(mutant)
    if not target.exists():
        shutil.copytree(gguf_tokenizer_dir(base), target)


def check(got: dict, answers: dict, which: str, change) -> None:
    where = (which, change, got)
    assert isinstance(got["rc"], int) and got["rc"] >= 0, where            # no signal, no hang
    assert "Traceback" not in got["err"], where
    event(f"{which}: {'answered as the base' if got['rc'] == 0 else 'refused'}")
    if got["rc"] == 0:                  # harmless: the unmutated file's own answer, by either path
        assert got["out"] in answers.values() and not got["err"], where
    else:
        err = got["err"].strip()
        assert err.startswith("kvchat: ") and "\n" not in err and got["out"] == "", where


_count = itertools.count()


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(change=mutations())
def test_mutated_gguf_is_refused_in_one_line_or_answered_as_before(fuzz, change):
    """Each mutant through both paths: refused in one line, or the base's answer; never a signal or a traceback."""
    folder, base, child, answers = fuzz
    mutant = folder / f"mutant-{next(_count)}.gguf"
    gm.write(mutant, *change)
    seed_tokenizer(base, mutant)
    try:
        for which in PATHS:
            check(child.ask(mutant, which), answers, which, change)
    finally:
        mutant.unlink()
