"""engine/paths.py is the one place that names kvchat's folders: it imports nothing of kvchat, honours the environment
overrides tests rely on, and the engine's writers (tokenizer cache, warm store, Ollama links, bench models) use it."""
import subprocess
import sys
from pathlib import Path

from kvchat.engine import paths


def test_paths_is_a_ground_floor_module():
    """Importing engine.paths loads no other kvchat module (the package inits are lazy)."""
    code = ("import sys, kvchat.engine.paths; print(sorted(m for m in sys.modules if m.startswith('kvchat') and "
            "m not in ('kvchat', 'kvchat.engine', 'kvchat.engine.paths')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_environment_overrides_each_root(monkeypatch, tmp_path):
    """KVCHAT_CACHE_DIR, KVCHAT_DATA_DIR, KVCHAT_LOG_DIR and KVCHAT_QUALITY_FILE win; the folders below the cache
    root follow it."""
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("KVCHAT_LOG_DIR", str(tmp_path / "l"))
    monkeypatch.delenv("KVCHAT_QUALITY_FILE", raising=False)
    c = tmp_path / "c"
    assert (paths.cache_root(), paths.data_dir(), paths.log_dir()) == (c, tmp_path / "d", tmp_path / "l")
    assert (paths.tokenizer_cache_dir(), paths.kv_cache_dir(), paths.bench_models_dir(), paths.ollama_links_dir(),
            paths.weight_fidelity_dir(), paths.conversion_cache_dir(), paths.quality_file()) == \
        (c / "tokenizers", c / "kv", c / "bench-models", c / "ollama-links", c / "weight-fidelity", c / "models",
         c / "quality.json")
    monkeypatch.setenv("KVCHAT_QUALITY_FILE", str(tmp_path / "q.json"))
    assert paths.quality_file() == tmp_path / "q.json"


def test_platform_folders_without_overrides(monkeypatch):
    """Unset, the roots are the platform's user folders for kvchat."""
    import platformdirs
    for key in ("KVCHAT_CACHE_DIR", "KVCHAT_DATA_DIR", "KVCHAT_LOG_DIR"):
        monkeypatch.delenv(key, raising=False)
    assert paths.cache_root() == Path(platformdirs.user_cache_dir("kvchat"))
    assert paths.data_dir() == Path(platformdirs.user_data_dir("kvchat", appauthor=False))


def test_engine_writers_use_it(monkeypatch, tmp_path):
    """The tokenizer cache, the Ollama links and the old conversion cache's removal all land under the cache root
    paths.py names; source.cache_root is the same function."""
    from kvchat.engine.model import source
    from kvchat.engine.plan.library import ModelEntry, loadable_path
    from kvchat.engine.text.tokenizer_cache import gguf_tokenizer_dir
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    assert source.cache_root is paths.cache_root
    blob = tmp_path / "sha256-abc"
    blob.write_bytes(b"GGUF")
    assert gguf_tokenizer_dir(blob).parent == paths.tokenizer_cache_dir()
    link = Path(loadable_path(ModelEntry("m:1b", str(blob), "Ollama", "gguf")))
    assert link.parent == paths.ollama_links_dir() and link.resolve() == blob.resolve()
    old = paths.conversion_cache_dir()
    old.mkdir(parents=True)
    (old / "x.safetensors").write_bytes(b"0" * 10)
    assert source.remove_conversion_cache() is not None and not old.exists()
