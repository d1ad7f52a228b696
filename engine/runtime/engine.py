"""Engine: a loaded model, its tokenizer and the sessions that chat with it."""
from __future__ import annotations

import os

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvchat.kernels import cpu_lib, cpu_quant

from kvchat.engine.api import LOCAL, EngineFacts
from kvchat.engine.text.chat_format import chat_format_notice, check_template, stop_ids
from kvchat.engine.text.reply import reply_format
from kvchat.engine.config import ACTIVATION_MODES, PREFILL_MODES, CacheConfig, ConfigError, EngineConfig, SpeculativeConfig
from kvchat.engine.kv.layout import MIB, cache_context
from kvchat.engine.model.gguf_view import GGUFModel
from kvchat.engine.model.source import (Progress, load_state_dict, locate, read_config, remove_conversion_cache,
                                 transformers_reference)
from kvchat.engine.text.tokenizer_cache import cached_gguf_tokenizer, gguf_tokenizer, load_tokenizer
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.plan.fit import check_fits, folder_weights, trim_heap
from kvchat.engine.model.config import ModelConfig
from kvchat.engine.model.transformer import Transformer
from kvchat.engine.model.weights import from_gguf, from_state_dict
from kvchat.engine.runtime import memory
from kvchat.engine.runtime.runner import ModelRunner
from kvchat.engine.runtime.session import ModelInfo, Session

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def read_model_config(model: str) -> ModelConfig:
    """The architecture numbers of a model spec, from config.json or the GGUF header (no weights read)."""
    files = locate(model)
    return ModelConfig.from_gguf(GGUFModel(files.path)) if files.is_gguf else ModelConfig.from_hf(read_config(files.folder))


def load_transformers_reference(model: str, dtype=torch.float32):
    """transformers' own model on the same weights (a GGUF dequantized by transformers + gguf): for checks.
    Read through a private folder with trust_remote_code=False: no code from the model folder runs."""
    return transformers_reference(locate(model), dtype)


def describe_weights(model: Transformer) -> str:
    """What the weights are, for status lines: "Q4_1 (+Q8_0), packed" or "bf16"."""
    if model.weights == "gguf":
        return f"{model.quant}, packed"
    if model.quant:
        return f"{model.quant} as {model.weights}"
    return model.weights


def kernel_status(device: str) -> str | None:
    """One line for the user when a CPU engine runs without the C kernels (they are CPU kernels: on CUDA they do
    not apply); None when they are loaded. The fallback is correct but slow, so it is said, not silent."""
    if not str(device).startswith("cpu"):
        return None
    if not cpu_quant.available():
        return f"C kernels not loaded ({cpu_quant.unavailable_reason()}): running torch's kernels, several times slower"
    st = cpu_lib.status()
    if st["variant"] == "baseline" and "avx2" in st["variants"]:
        # measured on the default model (AMD EPYC, AVX2): the baseline build decodes 28.6 tok/s, the AVX2 one 73
        return "C kernels: the baseline x86-64 build (without AVX2, FMA and F16C), several times slower"
    if not st["openmp"] and (os.cpu_count() or 1) > 1:
        return "C kernels built without OpenMP: one thread of {cores}".format(cores=os.cpu_count())
    return None


def auto_prefill() -> tuple[str, str]:
    """(fp32 | bf16, why): what prefill="auto" takes for packed weights on this CPU (the app's settings say it)."""
    return cpu_lib.auto_prefill()


def choose_prefill(asked: str, model: Transformer) -> tuple[str, str]:
    """(fp32 | bf16 | int8, why): what the packed linears give prompt rows. auto takes what this machine measured
    (measure_prefill, once, then kept) on AVX2, AVX-512 or AMX (Xeon, Zen 4, Ice Lake, AVX2 EPYC); elsewhere fp32,
    which is exact over the dequantized weights. int8 asked for where the build has no gemm8 reads as fp32, said."""
    if not str(model.device).startswith("cpu") or model.weights not in ("gguf", "int8", "int4"):
        return "fp32", "dense weights: the model's own dtype"
    if asked == "int8" and not cpu_quant.gemm8_available():
        return "fp32", "int8 asked for, but it needs the C kernels' AVX2 or AVX-512 build: the exact fp32 GEMM"
    if asked != "auto":
        return asked, "asked for"
    measure_prefill_once()
    return auto_prefill()


def prefill_dtypes(choice: str) -> tuple[torch.dtype, torch.dtype]:
    """(dtype, fallback) for Transformer.set_prefill: int8 leaves the kinds gemm8 does not read (MXFP4, dense) on the
    bf16 GEMM where the CPU multiplies bf16 (AVX-512 BF16 or AMX), else on fp32."""
    fallback = torch.bfloat16 if _multiplies_bf16() else torch.float32
    return {"bf16": torch.bfloat16, "int8": torch.int8}.get(choice, torch.float32), fallback


def _multiplies_bf16() -> bool:
    """Whether the CPU multiplies bf16 itself (AVX-512 BF16 or AMX)."""
    return bool(cpu_lib.cpu_features() & {"avx512bf16", "amx_bf16"})


def measure_prefill_once() -> None:
    """On AVX2, AVX-512 or AMX, with nothing kept for this machine yet: measure_prefill, kept."""
    if cpu_lib.prefill_measured_here() and cpu_lib.prefill_record() is None:
        cpu_lib.save_prefill_record(*measure_prefill())


def measure_prefill(rows: int = 64, n: int = 2048, k: int = 2048, tries: int = 5) -> tuple[str, str]:
    """(fp32 | bf16 | int8, why): which path a tile of `rows` prompt rows runs fastest here through a packed n x k
    4-bit linear, as the engine calls it (the fp32 and bf16 GEMMs with their slabs dequantized; int8 where the build
    has gemm8), timed alternately `tries` times, medians compared. Each step away from the exact fp32 must win by
    10% over the one before (bf16 rounds the weights, int8 the activations), so a tie keeps the more exact."""
    import statistics
    import time
    from kvchat.engine.model.linears import Q4Linear
    gen = torch.Generator().manual_seed(0)
    lin = Q4Linear.from_float(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if not _multiplies_bf16():
        del dtypes["bf16"]                      # no bf16 multiply: oneDNN would emulate it
    if cpu_quant.gemm8_available():
        dtypes["int8"] = torch.int8
    times: dict[str, list[float]] = {name: [] for name in dtypes}

    def run(dtype):
        lin.prefill_dtype = dtype
        lin._gemm(x)
    for dtype in dtypes.values():
        run(dtype)                              # oneDNN and MKL pick and warm their kernels
    for _ in range(tries):
        for name, dtype in dtypes.items():
            t0 = time.perf_counter()
            run(dtype)
            times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    choice = "fp32"
    for name in ("bf16", "int8"):
        if name in median and median[choice] / median[name] >= 1.1:
            choice = name
    ran = ", ".join(f"{name} {median['fp32'] / median[name]:.2f}x" for name in median if name != "fp32")
    return choice, f"measured here: {ran} the exact fp32 GEMM ({rows} prompt rows, a 4-bit {n} x {k} linear)"


def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device={device!r} asked for CUDA, but no NVIDIA GPU is available here: use device='cpu'")
    return device


class Engine:
    capabilities = LOCAL
    def __init__(self, config: EngineConfig, model: Transformer, tokenizer, name: str, load_s: float,
                 notice: str | None = None):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = name
        self.device = model.device
        self.dtype_name = {v: k for k, v in _DTYPES.items()}[model.dtype]
        self.load_s = load_s
        self.notice = notice          # something the user should hear about the load (old caches removed)
        self.stop_ids = stop_ids(tokenizer)
        self.weight_bytes = model.weight_bytes()
        self.weights_label = describe_weights(model)
        self.kernel_status = kernel_status(model.device)   # None, or why the C kernels are missing
        self.rope_note: str | None = None    # LongRoPE: which factors the cache's context chose (Engine.load)
        self.set_prefill(config.prefill)
        self.set_activations(config.activations)
        self.runner = ModelRunner(model, self.dtype_name, config.cache.budget_mb)
        self._identity: dict | None = None
        self._warm_store = None
        self.reply_format = reply_format(tokenizer)     # how its replies come (a reasoning part apart, or not)
        self.info = ModelInfo(name, tokenizer, self.stop_ids, model.config.max_position_embeddings,
                              self.weight_bytes, self.weights_label, self.reply_format)
        self.draft_engine: "Engine | None" = None     # a draft model loaded for speculative decoding
        if config.speculative.method != "draft":      # a draft model loads in set_speculative (Engine.load calls it)
            self.runner.speculation = config.speculative

    def set_prefill(self, mode: str) -> None:
        """The prompt rows' GEMM over packed weights, now: "auto", "fp32" or "bf16" (EngineConfig.prefill). Decode
        steps and KV already written are untouched; the next prompt reads in the new precision."""
        if mode not in PREFILL_MODES:
            raise ConfigError(f"prefill={mode!r}: choose {', '.join(PREFILL_MODES)}")
        self.prefill, self.prefill_why = choose_prefill(mode, self.model)
        self.model.set_prefill(*prefill_dtypes(self.prefill))

    def set_activations(self, mode: str) -> None:
        """Decode rows' activations in the C kernels, now: "int16" or "int8" (EngineConfig.activations). Only
        packed weights on the CPU have them; elsewhere the setting is kept and changes nothing."""
        if mode not in ACTIVATION_MODES:
            raise ConfigError(f"activations={mode!r}: choose {', '.join(ACTIVATION_MODES)}")
        self.activations = mode
        self.model.set_activations(8 if mode == "int8" else 16)

    @property
    def num_layers(self) -> int:
        return self.model.config.num_layers

    def describe(self) -> EngineFacts:
        """What this engine says about itself (engine/api.py)."""
        return EngineFacts(self.model_name, str(self.device), self.num_layers, self.weights_label,
                           int(self.weight_bytes), self.dtype_name, self.notice or "", self.kernel_status or "",
                           self.chat_format_notice or "", len(self.model.config.linear_layers))

    @property
    def chat_format_notice(self) -> str | None:
        """What the user should hear before chatting with a model whose file has no chat template (a base model:
        chats go as a plain-text continuation, engine.text.chat_format.PLAIN_TEMPLATE); None for the others."""
        return chat_format_notice(self.tokenizer, self.model_name)

    @classmethod
    def load(cls, config: EngineConfig | None = None, progress: Progress | None = None) -> "Engine":
        config = config or EngineConfig()
        started = time.perf_counter()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = resolve_device(config.device)
        dtype_name = config.dtype if config.dtype != "auto" else ("bf16" if device.startswith("cuda") else "fp32")
        dtype = _DTYPES[dtype_name]
        if progress:
            progress("locating model", 0.0)
        notice = remove_conversion_cache()
        if notice and progress:
            progress(notice, 0.0)
        files = locate(config.model)
        # the C kernels build (first start only) and the tokenizer loads while the weights are read
        pool = ThreadPoolExecutor(2, thread_name_prefix="kvchat-load")
        try:
            if device == "cpu":
                pool.submit(cpu_quant.available)
            if files.is_gguf:
                gf = GGUFModel(files.path)
                mc = ModelConfig.from_gguf(gf)
                context = cache_context(mc, config.cache, dtype_name, device)
                mc = mc.for_context(context)
                check_fits(mc, gf.tensor_bytes, config.weights, device, files.path.name, dtype_name)
                # cached: read at once, before the weights, so the two loads' transient memory never adds up;
                # the first start converts it (seconds) beside the weights
                cached = cached_gguf_tokenizer(files.path)
                if cached is not None:
                    trim_heap()       # the JSON parse's garbage (~14 MiB) goes back before the weights come in
                tokenizer = _done(cached) if cached is not None else pool.submit(gguf_tokenizer, files.path, progress)
                if progress:
                    progress("mapping weights", 0.5)
                model = from_gguf(mc, gf, dtype, device, config.weights)
                gf.release_pages()
            else:
                mc = ModelConfig.from_hf(read_config(files.folder))
                context = cache_context(mc, config.cache, dtype_name, device)
                mc = mc.for_context(context)
                stored_bytes, stored_dtype = folder_weights(files.folder)
                check_fits(mc, stored_bytes, config.weights, device, files.name, dtype_name, "safetensors",
                           stored_dtype)
                tokenizer = pool.submit(load_tokenizer, files.folder)
                if progress:
                    progress("reading weights", 0.5)
                model = from_state_dict(mc, load_state_dict(files.folder), dtype, device, config.weights)
            tokenizer = tokenizer.result()
        finally:
            pool.shutdown(wait=True)
        trim_heap()
        check_template(tokenizer, files.name)     # a template that hangs or fails is refused now, not mid-chat
        engine = cls(config, model, tokenizer, files.name, time.perf_counter() - started, notice)
        engine.rope_note = mc.rope_note(context)
        engine.runner.check(config.cache)   # validates the cache config against this model
        if config.speculative.method == "draft":
            engine.set_speculative(config.speculative)
        if progress:
            progress("ready", 1.0)
        return engine

    def new_session(self, system_prompt: str | None = None, cache: CacheConfig | None = None,
                    history: list[dict] | None = None, prefix_cache: bool = True) -> Session:
        """A conversation in the engine's shared KV pool. The budget is the engine's: a cache config
        carrying another budget_mb sets it for every conversation."""
        cache = cache or self.config.cache
        self.runner.check(cache)
        if int(cache.budget_mb * MIB) != self.runner.budget_bytes:
            self.runner.set_budget(cache.budget_mb)
        return Session(self.runner, self.info, cache, system_prompt, history, prefix_cache)

    # ---- warm conversations (engine/runtime/warm.py) ----------------------------------------------------------

    @property
    def model_identity(self) -> dict:
        """What a saved cache must name to be restored here: the model file's name, size, mtime, header hash."""
        if self._identity is None:
            from kvchat.engine.runtime.warm import model_identity
            files = locate(self.config.model)
            self._identity = model_identity(files.path, files.is_gguf)
            mc = self.model.config
            if mc.longrope:         # keys rotated with the other LongRoPE factors cannot be read back here
                self._identity["longrope"] = "long" if mc.rope_scaling[1] == mc.longrope[2] else "short"
        return self._identity

    @property
    def warm_store(self):
        """The folder of saved conversation caches (the user cache dir's kv/) and its disk budget."""
        if self._warm_store is None:
            from kvchat.engine.paths import kv_cache_dir
            from kvchat.engine.runtime.warm import WarmStore
            self._warm_store = WarmStore(kv_cache_dir(), self.config.kv_disk_budget_mb)
        return self._warm_store

    def keep_warm(self, session: Session, key: str) -> None:
        """The session's cache is kept under `key` (a conversation id): saved by save_warm, restored by
        restore_warm, and saved instead of dropped when the budget releases it for another conversation."""
        session.warm = (self.warm_store, str(key), self.model_identity)
        self.runner.warm_sessions.add(session)

    def save_warm(self, session: Session) -> int:
        """Save a warm session's cache now (idle, switched away from, app closing); returns the file's bytes."""
        if session.warm is None or session.is_closed:
            return 0
        store, key, identity = session.warm
        with self.runner.lock:
            return store.save(session, key, identity)

    def restore_warm(self, session: Session):
        """Read a warm session's saved cache back (a conversation reopened): warm.Restored, or warm.CacheFileError
        saying why its history must be read again."""
        from kvchat.engine.runtime.warm import CacheFileError
        if session.warm is None:
            raise CacheFileError("the conversation is not kept warm")
        store, key, identity = session.warm
        return store.restore(session, key, identity)

    # ---- speculative decoding (engine/runtime/speculative.py) -------------------------------------------------------

    @property
    def speculative(self) -> SpeculativeConfig:
        return self.runner.speculation

    def set_speculative(self, config: SpeculativeConfig) -> None:
        """Switch speculative decoding live (every conversation's next turn uses it). A draft model loads here and must
        share this model's tokenizer; ModelLoadError or ConfigError say why not, and the setting stays as it was."""
        if not isinstance(config, SpeculativeConfig):
            raise ConfigError(f"speculative={config!r}: give a SpeculativeConfig")
        draft = self.runner.draft_runner if config.method == "draft" else None
        if config.method == "draft":
            draft = self._draft_runner(config.draft_model)
        with self.runner.lock:
            if draft is not self.runner.draft_runner and self.draft_engine is not None \
                    and self.draft_engine.runner is not draft:
                self.draft_engine = None       # the old draft's weights go once no conversation holds them
            self.runner.speculation, self.runner.draft_runner = config, draft

    def _draft_runner(self, spec: str) -> ModelRunner:
        if spec == "self":
            return self.runner
        if self.draft_engine is not None and self.draft_engine.config.model == spec:
            return self.draft_engine.runner
        c = self.config
        draft = Engine.load(EngineConfig(model=spec, device=str(self.device), dtype=c.dtype, weights=c.weights,
                                         cache=CacheConfig(budget_mb=256.0), num_threads=c.num_threads,
                                         speculative=SpeculativeConfig("off"), prefill=c.prefill,
                                         activations=self.activations))
        mine, theirs = self.tokenizer, draft.tokenizer
        probe = "def f(x):\n    return x + 1  # Hello, world. 你好"
        if len(theirs) > len(mine) + 1024 or theirs.encode(probe) != mine.encode(probe):
            raise ConfigError(f"the draft model {draft.model_name} does not share {self.model_name}'s tokenizer: "
                              f"choose a draft of the same family (the same vocabulary), or prompt lookup")
        self.draft_engine = draft
        return draft.runner

    @property
    def budget_mb(self) -> float:
        return self.runner.budget_bytes / MIB

    def clear_prefix_cache(self) -> int:
        """Free the blocks kept only for prefix reuse and give the memory back to the system; returns the bytes freed."""
        freed = self.runner.clear_prefix_cache()
        memory.release_cached(self.device)
        trim_heap()
        return freed
