"""Engine: a loaded model, its tokenizer and the sessions that chat with it."""
from __future__ import annotations

import time

import torch

from .config import CacheConfig, EngineConfig
from .loader import ModelLoadError, Progress, load_state_dict, load_tokenizer, locate, read_config
from .model import ModelConfig, Transformer
from .session import Session

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device={device!r} asked for CUDA, but no NVIDIA GPU is available here: use device='cpu'")
    return device


class Engine:
    def __init__(self, config: EngineConfig, model: Transformer, tokenizer, name: str, load_s: float, converted: bool):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = name
        self.device = model.device
        self.dtype_name = {v: k for k, v in _DTYPES.items()}[model.dtype]
        self.load_s = load_s
        self.converted = converted
        self.stop_ids = self._stop_ids()

    @property
    def num_layers(self) -> int:
        return self.model.config.num_layers

    @classmethod
    def load(cls, config: EngineConfig | None = None, progress: Progress | None = None) -> "Engine":
        config = config or EngineConfig()
        started = time.perf_counter()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = resolve_device(config.device)
        dtype_name = config.dtype if config.dtype != "auto" else ("bf16" if device.startswith("cuda") else "fp32")
        if progress:
            progress("locating model", 0.0)
        files = locate(config.model, progress)
        if progress:
            progress("reading weights", 0.6)
        mc = ModelConfig.from_hf(read_config(files.folder))
        state = load_state_dict(files.folder)
        weights = config.weights
        if weights == "auto":      # 4-bit sources decode from packed int4 on the CPU: the same grid, 1/8 the bytes
            weights = "int4" if files.source_quant.startswith(("Q4", "IQ4")) else "dense"
        if weights == "int4" and device != "cpu":
            weights = "dense"      # the packed int4 kernel used here is the CPU one
        model = Transformer(mc, state, _DTYPES[dtype_name], device, weights)
        if progress:
            progress("loading tokenizer", 0.9)
        tokenizer = load_tokenizer(files.folder)
        engine = cls(config, model, tokenizer, files.name, time.perf_counter() - started, files.converted)
        engine.new_session().cache   # validates the cache config against this model
        if progress:
            progress("ready", 1.0)
        return engine

    def _stop_ids(self) -> frozenset[int]:
        tok = self.tokenizer
        ids = set()
        if tok.eos_token_id is not None:
            ids.add(tok.eos_token_id)
        vocab = tok.get_vocab()
        ids.update(vocab[t] for t in _STOP_TOKENS if t in vocab)
        return frozenset(ids)

    def new_session(self, system_prompt: str | None = None, cache: CacheConfig | None = None,
                    history: list[dict] | None = None) -> Session:
        return Session(self, system_prompt, cache, history)
