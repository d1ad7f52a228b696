import atexit
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

# kvchat is imported by its one name, kvchat (the editable install maps it onto the repository root); the root
# itself must not be on sys.path, where its folders would pass for top-level packages and shadow others of the same
# name (Hugging Face's `kernels`, which transformers imports). `python -m pytest` puts it there: take it off, and
# keep it off in every child process the tests start from this folder (PYTHONSAFEPATH, Python 3.11's -P).
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# a suite started as a background job (`make test &`) inherits SIGINT ignored, and so would every kvchat it starts
# (a child keeps an ignored signal across exec): the Ctrl+C tests would then test nothing. Take it as a terminal would.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# the tests' tokenizer caches and any kernel build go to a folder of their own, not the user's cache dir
# (random tiny GGUFs each leave a tokenizer folder there); the kernels built at install are still found
if "KVCHAT_CACHE_DIR" not in os.environ:
    os.environ["KVCHAT_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvchat-test-cache-")
    atexit.register(shutil.rmtree, os.environ["KVCHAT_CACHE_DIR"], True)
import kernel_cache  # noqa: E402,F401  (records the session's cache folder, where the kernels are built or found)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# without a GPU, Triton kernels run under triton's interpreter on CPU tensors; it must be chosen before triton is
# first imported (tests/test_cuda_path.py, test_kernels.py, test_triton_*.py)
try:
    import torch as _torch
    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

import pytest  # noqa: E402


OPT_IN = ("arm", "gpu_long")


def pytest_collection_finish(session):
    """What lives once the tests are collected (torch, transformers, Qt, the test modules) is frozen: the cyclic
    collector no longer scans it, neither in the GUI tests' two collections each (0.2 s apiece over it) nor in
    Python's own full collections. 2.5 of the suite's 18 minutes went there. The GUI tests' collectors
    (app/shell/gc_guard.py) leave it frozen."""
    import gc
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """Given back before the interpreter ends, so it is freed as usual (frozen, triton's bindings report their
    objects as leaked at exit)."""
    import gc
    gc.unfreeze()
    gc.collect()


def pytest_collection_modifyitems(config, items):
    """Opt-in tests (marked arm or gpu_long) run only when asked for by name: pytest -m arm."""
    asked = config.getoption("-m") or ""
    for mark in OPT_IN:
        if mark in asked:
            continue
        skip = pytest.mark.skip(reason=f"opt-in: run with pytest -m {mark}")
        for item in items:
            if mark in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _quantized_kv_kernels_built():
    """The quantized-KV kernels build in the background on first use (cpu_quant.kv_kernels_ready), and a layout's
    backend is chosen again once they have: a test comparing two sessions' bits must not see one before and one
    after. Built (or found cached) once, before any test."""
    from kvchat.kernels import cpu_quant
    if cpu_quant.available():
        cpu_quant.kv_kernels_ready(wait=True)


@pytest.fixture(scope="session")
def default_engine():
    from kvchat.engine import Engine, EngineConfig
    # dense fp32 weights: the path whose logits must match transformers exactly
    return Engine.load(EngineConfig(model="default", weights="dense"))


@pytest.fixture(scope="session")
def _hf_default_model():
    """transformers' own model on the default model's GGUF (dequantized by transformers + gguf: about 15 s), read once
    for the suite (tests/test_model.py and tests/test_attention_map.py both compare with it)."""
    from kvchat.engine.runtime.engine import load_transformers_reference
    return load_transformers_reference("default").eval()


@pytest.fixture
def hf_default(_hf_default_model):
    """The shared reference as each test first sees it: a test may switch its attention implementation (eager, for
    the attention probabilities); the one it was loaded with comes back after the test."""
    impl = _hf_default_model.config._attn_implementation
    yield _hf_default_model
    if _hf_default_model.config._attn_implementation != impl:
        _hf_default_model.set_attn_implementation(impl)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tiny_models import tiny_model_dir
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), arch="llama", hidden=96, heads=6, kv_heads=2,
                          layers=3, max_positions=4096)


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama):
    from kvchat.engine import Engine, EngineConfig
    return Engine.load(EngineConfig(model=tiny_llama))


@pytest.fixture(autouse=True)
def _collect_on_the_gui_thread(request):
    """GUI tests collect garbage as the app does, on the GUI thread only (app/shell/gc_guard.py): an earlier test's Qt
    objects collected on an engine thread can deadlock against the GUI thread. Earlier garbage goes now."""
    if "qtbot" not in request.fixturenames:
        yield
        return
    import gc
    from kvchat.app.shell.gc_guard import GuiThreadCollector
    request.getfixturevalue("qapp")
    gc.collect()
    collector = GuiThreadCollector()
    try:
        yield
    finally:
        collector.stop()
        gc.collect()
