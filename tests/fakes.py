"""A small fake engine with the real engine's API, for GUI tests that only drive signals.

Bytes follow a simple per-format rule so mode switches and resets show up as exact numbers.
"""
from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

from kvchat.engine.api import LOCAL, EngineFacts
from kvchat.engine.config import CacheConfig, ConfigError, EngineConfig, SamplingParams
from kvchat.engine.errors import ModelLoadError
from kvchat.engine.kv.layout import check_cache_for_model
from kvchat.engine.events import LayerBytes, MemoryProbe, StatsSnapshot, TokenDelta, TurnFinished
from kvchat.engine.text.reasoning import assistant_message

NUM_LAYERS = 4
ELEMENTS_PER_TOKEN = 2 * 32             # kv_heads x head_dim of the fake model
BYTES_PER_ELEMENT = {"auto": 4, "fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "fp8": 1, "int4": 0.5}
CONTEXT_TOKENS = 2048                   # the fake model's max_position_embeddings
VOCAB = 97
LOGIT_NOISE = {"auto": 0.0, "fp32": 0.0, "fp16": 0.001, "bf16": 0.004, "int8": 0.01, "fp8": 0.05, "int4": 0.4}


USER_ID, ASSISTANT_ID, END_ID = VOCAB, VOCAB + 1, VOCAB + 2     # the fake chat format's marks, past the words
SPECIALS = {USER_ID: "<user>", ASSISTANT_ID: "<assistant>", END_ID: "<end>"}


class FakeTokenizer:
    """Words to ids, enough for engine.text.samples.load_tokens; decode gives back the last word seen for an id."""

    def __init__(self):
        self.words: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [sum(map(ord, word)) % VOCAB for word in text.split()]
        self.words.update(zip(ids, text.split()))
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        words = [SPECIALS[i] if i in SPECIALS else self.words.get(i, f"w{i}") for i in ids
                 if not (skip_special_tokens and i in SPECIALS)]
        return " ".join(words)


class FakeAlternative(SimpleNamespace):
    """Like engine.session.Alternative: a reply regenerated away from (text; no cache in the fake)."""


class FakeSession:
    def __init__(self, engine: "FakeEngine", cache: CacheConfig, history=None, system_prompt=None):
        self.engine = engine
        self.cache_config = cache
        self.system_prompt = system_prompt
        self.alternatives: list[FakeAlternative] = []
        self.prefilled = 0              # prompt tokens read into the cache, all turns together
        self.messages: list[dict] = [dict(m) for m in history or ()]
        self.tokens_in_context = sum(len(m["content"].split()) for m in self.messages)
        self.tokens_held = 0            # a resumed chat is prefilled lazily, on the next send
        self.tokens_evicted = 0
        self.decode_tok_s = 0.0
        self.sent: list[str] = []
        self.watching: str | None = None    # watch_attention's weights
        self.turns = 0                  # replies finished; a map needs one since watching began
        self._watched_at = 0

    # --- the chat as tokens: <user> words <end> <assistant> | words <end>, a reply starting after its mark ---

    @property
    def tokenizer(self) -> FakeTokenizer:
        return self.engine.tokenizer

    def _tokens(self) -> tuple[list[int], list[int]]:
        ids, starts = [], []
        for message in self.messages:
            if message["role"] == "assistant":
                ids.append(ASSISTANT_ID)
            starts.append(len(ids))
            ids += ([USER_ID] if message["role"] == "user" else []) + self.tokenizer.encode(message["content"])
            ids.append(END_ID)
        return ids, starts

    @property
    def token_ids(self) -> list[int]:
        return self._tokens()[0]

    @property
    def state(self) -> SimpleNamespace:
        ids, starts = self._tokens()
        return SimpleNamespace(starts=starts, num_cached=len(ids))

    def watch_attention(self, weights: str | None = "blocks") -> None:
        self.watching, self._watched_at = weights, self.turns

    def attention(self, over: str = "newest", weights: str = "blocks", max_columns: int = 4096):
        """A plausible map of the chat (fake_attention_map) once a reply finished since watching began."""
        if self.watching is None or self.turns == self._watched_at:
            return None
        from fake_attention import fake_attention_map
        ids, starts = self._tokens()
        cache = self.cache_config
        return fake_attention_map(ids, cache.block_size, window=cache.window, sinks=cache.sinks, over=over,
                                  message_starts=tuple(starts)).bucketed(max_columns)

    def _token_bytes(self, layer: int) -> tuple[float, float]:
        cache = self.cache_config
        full = layer in cache.full_precision_layers
        k = BYTES_PER_ELEMENT["auto" if full else cache.k_format] * ELEMENTS_PER_TOKEN
        v = BYTES_PER_ELEMENT["auto" if full else cache.v_format] * ELEMENTS_PER_TOKEN
        return k, v

    def _bytes_per_token(self) -> float:
        return sum(sum(self._token_bytes(i)) for i in range(NUM_LAYERS))

    def _budget_tokens(self) -> int:
        return int(self.cache_config.budget_mb * 1024 * 1024 // self._bytes_per_token())

    def send(self, text: str, sampling: SamplingParams, should_stop=lambda: False):
        self.sent.append(text)
        self.messages.append({"role": "user", "content": text})
        prompt = len(text.split()) + 4
        needed = self.tokens_in_context - self.tokens_held + prompt
        if self.tokens_held + needed > self._budget_tokens():
            self.messages.pop()
            yield TurnFinished("", "budget", f"This prompt needs {needed} tokens but the budget holds "
                               f"{self._budget_tokens()}: raise the KV budget in Settings or start a new chat.",
                               self.stats())
            return
        self.tokens_held += needed
        self.prefilled += needed
        self.tokens_in_context += prompt
        self.alternatives = []
        yield from self._decode(sampling, should_stop, offset=0, continues=False)

    def _decode(self, sampling, should_stop, offset: int, continues: bool):
        """The reply: the engine's words from `offset` on, so a regenerate says something else."""
        words = self.engine.reply_words
        pieces, reason, start = [], "length", time.monotonic()
        thoughts = [] if continues else list(self.engine.reasoning_pieces)
        for piece in thoughts:          # a model that reasons apart (gpt-oss): its reasoning streams first
            yield TokenDelta("", (), piece)
        thought = "".join(thoughts)
        for i in range(sampling.max_new_tokens):
            if should_stop():
                reason = "stopped"
                break
            time.sleep(self.engine.step_s)
            word = words[(offset + i) % len(words)]
            piece = " " + word if continues else word + " "
            pieces.append(piece)
            self.tokens_held += 1
            self.tokens_in_context += 1
            self.decode_tok_s = (i + 1) / max(1e-6, time.monotonic() - start)
            yield TokenDelta(piece, (i,))
        if continues:
            reply = self.messages[-1]["content"] + "".join(pieces)
            thought = self.messages[-1].get("reasoning", "")
            self.messages[-1] = assistant_message(reply, thought)
        else:
            reply = "".join(pieces).strip()
            self.messages.append(assistant_message(reply, thought))
        self.turns += 1
        yield TurnFinished(reply, reason, "", self.stats(), thought)

    def regenerate(self, sampling: SamplingParams, should_stop=lambda: False):
        """A new reply to the last user message; the old one joins `alternatives`. Nothing is read again."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ConfigError("there is no reply to regenerate yet: send a message first")
        old = self.messages.pop()
        dropped = len(old["content"].split())
        self.tokens_held = max(0, self.tokens_held - dropped)
        self.tokens_in_context -= dropped
        self.alternatives.append(FakeAlternative(text=old["content"], seq=None, token_ids=[]))
        self.regenerated = getattr(self, "regenerated", 0) + 1
        yield from self._decode(sampling, should_stop, offset=self.regenerated, continues=False)

    def select_alternative(self, index: int) -> None:
        alt = self.alternatives[index]
        current = FakeAlternative(text=self.messages[-1]["content"], seq=None, token_ids=[])
        self.messages[-1] = {"role": "assistant", "content": alt.text}
        self.alternatives[index] = current

    def continue_reply(self, sampling: SamplingParams, should_stop=lambda: False):
        """More of the last reply: its text grows by the engine's words, continuing where it stopped."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ConfigError("there is no reply to continue: send a message first")
        offset = len(self.messages[-1]["content"].split())
        yield from self._decode(sampling, should_stop, offset=offset, continues=True)

    def rewind(self, index: int) -> None:
        """Drop messages[index:]; the cache goes back to where message `index` began."""
        if not 0 <= index <= len(self.messages):
            raise ConfigError(f"there is no message {index} to go back to")
        del self.messages[index:]
        self.alternatives = []
        self.tokens_in_context = sum(len(m["content"].split()) + 4 for m in self.messages)
        self.tokens_held = min(self.tokens_held, self.tokens_in_context)
        self.rewound = getattr(self, "rewound", []) + [index]

    def append(self, ids):
        """Teacher-forced logits [len(ids), VOCAB]: the same for every mode, plus noise that grows as the
        format narrows, so a quality measurement has something real to find."""
        import torch

        rows = []
        for token in ids:
            position = self.tokens_held
            base = torch.randn(VOCAB, generator=torch.Generator().manual_seed(position * 131 + token))
            noise = torch.randn(VOCAB, generator=torch.Generator().manual_seed(7_000_003 + position))
            rows.append(base * 3 + noise * LOGIT_NOISE[self.cache_config.k_format] * 3)
            self.tokens_held += 1
            self.tokens_in_context += 1
        time.sleep(self.engine.step_s)
        return torch.stack(rows)

    def set_cache(self, cache: CacheConfig) -> None:
        check_cache_for_model(cache, self.engine.model.config)
        if cache.k_format == "fp8" and self.engine.refuse_fp8:
            raise ConfigError("fp8 keys are not supported by this fake device: choose int8 or int4")
        self.cache_config = cache

    def reset(self) -> int:
        freed = self.stats().kv_bytes
        self.tokens_held = 0
        return freed

    def close(self) -> None:
        self.reset()
        if self in self.engine.sessions:
            self.engine.sessions.remove(self)

    def stats(self) -> StatsSnapshot:
        cache = self.cache_config
        blocks_used = -(-self.tokens_held // cache.block_size)
        stored = blocks_used * cache.block_size         # as in the engine, a part-filled block takes all its bytes
        layers = []
        for i in range(NUM_LAYERS):
            k, v = self._token_bytes(i)
            full = i in cache.full_precision_layers
            layers.append(LayerBytes(i, int(k * stored), int(v * stored),
                                     "fp32" if full else cache.k_format, "fp32" if full else cache.v_format))
        kv = sum(layer.k_bytes + layer.v_bytes for layer in layers)
        budget = int(cache.budget_mb * 1024 * 1024)
        per_token = self._bytes_per_token()
        blocks_budget = int(budget // (per_token * cache.block_size))
        return StatsSnapshot(
            time_s=time.monotonic(), cache_label=cache.label(), layers=tuple(layers), kv_bytes=kv,
            budget_bytes=budget, block_size=cache.block_size, blocks_used=blocks_used,
            blocks_free=max(0, blocks_budget - blocks_used), blocks_budget=blocks_budget,
            tokens_in_context=self.tokens_in_context, tokens_held=self.tokens_held,
            tokens_evicted=self.tokens_evicted,
            tokens_left=None if cache.window is not None else max(0, self._budget_tokens() - self.tokens_held),
            bytes_per_token=per_token, prefill_tokens=0, prefill_tok_s=500.0, decode_tok_s=self.decode_tok_s,
            ttft_s=0.01, memory=MemoryProbe(300 * 1024 * 1024 + kv, 0, 0, 0),
            full_precision_bytes_per_token=float(BYTES_PER_ELEMENT["auto"] * ELEMENTS_PER_TOKEN * 2 * NUM_LAYERS),
            context_tokens=self.engine.context_tokens)


class FakeEngine:
    # it stands in for the local engine (per-layer bytes, live switches, edits, a prefix cache), without its disk
    # store, speculative decoding or prompt precision
    capabilities = replace(LOCAL, saves_caches=False, speculative=False, prefill_precision=False,
                           decode_precision=False)

    def __init__(self, config: EngineConfig, step_s: float = 0.005):
        self.config = config
        self.model_name = "fake-model"
        self.device = "cpu"
        self.num_layers = NUM_LAYERS
        self.tokenizer = FakeTokenizer()
        self.context_tokens = CONTEXT_TOKENS
        self.step_s = step_s
        self.refuse_fp8 = True
        self.reply_words = ["Hello", "from", "the", "fake", "engine."]
        self.reasoning_pieces: list[str] = []       # set: each reply streams this reasoning before its words
        self.replay_refusal: str | None = None      # set: check_replay_room refuses with it (fake_replay_module)
        self.sessions: list[FakeSession] = []
        self.prefix_cache_bytes = 3 * 1024 * 1024    # what clear_prefix_cache frees the first time
        # the shape the byte rule above describes, so the engine's own cache check applies to the fake too
        self.model = SimpleNamespace(config=fake_model_config())
        self.dtype_name = "fp32"

    @property
    def budget_mb(self) -> float:
        return self.config.cache.budget_mb

    def clear_prefix_cache(self) -> int:
        freed, self.prefix_cache_bytes = self.prefix_cache_bytes, 0
        return freed

    kernel_status = None            # a test may say the C kernels are missing (tests/test_no_kernels.py)
    notice = None

    def describe(self) -> EngineFacts:
        return EngineFacts(self.model_name, self.device, self.num_layers, "", 0, self.dtype_name, self.notice or "",
                           self.kernel_status or "")

    def new_session(self, system_prompt=None, cache=None, history=None) -> FakeSession:
        check_cache_for_model(cache or self.config.cache, self.model.config)
        session = FakeSession(self, cache or self.config.cache, history, system_prompt)
        self.sessions.append(session)
        return session


def fake_model_config():
    from kvchat.engine.model.config import ModelConfig
    return ModelConfig.from_hf(dict(model_type="llama", vocab_size=320, hidden_size=64, num_hidden_layers=NUM_LAYERS,
                                    num_attention_heads=2, num_key_value_heads=2, intermediate_size=128,
                                    max_position_embeddings=2048))


class FakeLoader:
    """Stands in for Engine.load; remembers what it built. A model path containing 'missing' fails."""

    def __init__(self, step_s: float = 0.005, load_s: float = 0.0):
        self.step_s = step_s
        self.load_s = load_s
        self.engines: list[FakeEngine] = []

    def __call__(self, config: EngineConfig, progress) -> FakeEngine:
        progress("Reading weights", 0.5)
        time.sleep(self.load_s)
        if "missing" in config.model:
            raise ModelLoadError(f"model file {config.model} not found: choose a model folder or .gguf in Settings")
        engine = FakeEngine(config, self.step_s)
        self.engines.append(engine)
        progress("Ready", 1.0)
        return engine


def live_dashboard(qtbot, snapshot: StatsSnapshot):
    """A shown Dashboard (520 x 700) that has drawn one snapshot."""
    from kvchat.app.dashboard.dock import Dashboard
    dash = Dashboard()
    qtbot.addWidget(dash)
    dash.resize(520, 700)
    dash.show()
    dash.data.add(snapshot)
    dash.redraw()
    return dash


def isolate_app(monkeypatch, tmp_path) -> None:
    """Point the history database and QSettings at tmp_path; Qt renders offscreen."""
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVCHAT_SETTINGS_FILE", str(tmp_path / "settings.ini"))
    monkeypatch.setenv("KVCHAT_QUALITY_FILE", str(tmp_path / "quality.json"))


def open_window(qtbot, loader, autoload: bool = True):
    """A MainWindow on the isolated stores, shown, registered with qtbot for closing."""
    from kvchat.app.store.history import HistoryStore
    from kvchat.app.shell.main_window import MainWindow
    from kvchat.app.store.settings_store import SettingsStore

    window = MainWindow(SettingsStore(), HistoryStore(), loader=loader, autoload=autoload)
    # pytest-qt holds widgets weakly; without a strong reference the window (and its running engine
    # thread) could be collected before teardown closes it
    qtbot.kvchat_windows = getattr(qtbot, "kvchat_windows", []) + [window]
    qtbot.addWidget(window, before_close_func=lambda w: w.history.close())
    window.show()
    return window


def real_window(qtbot, model: str, cache=None, sampling=None, timeout: int = 60_000):
    """A window over the real engine (the app's own loader), loaded with `model`; fails on a load error."""
    from kvchat.app.bridge.loader import default_loader as _default_loader
    window = open_window(qtbot, _default_loader, autoload=False)
    base = window.settings
    window.apply_settings(type(base)(model, cache or base.cache, sampling or base.sampling, base.system_prompt))
    qtbot.waitUntil(lambda: window.session_ready or window.last_error is not None, timeout=timeout)
    assert window.last_error is None, window.last_error
    return window


def remote_window(qtbot, url: str, key: str = "", model: str = "tiny", sampling=None, wait: bool = True):
    """A window in Server mode on `url` (a real kvchat server on loopback in the tests)."""
    from dataclasses import replace

    from kvchat.app.store.settings_store import RemoteSettings
    from kvchat.app.bridge.loader import default_loader as _default_loader
    window = open_window(qtbot, _default_loader, autoload=False)
    window.apply_settings(replace(window.settings, sampling=sampling or window.settings.sampling,
                                  remote=RemoteSettings(url, key, model)))
    if wait:
        qtbot.waitUntil(lambda: window.session_ready or window.last_error is not None, timeout=20_000)
        assert window.last_error is None, window.last_error
    return window


def send(qtbot, window, text: str, timeout: int = 60_000):
    """Type a message into a real window and send it; returns the TurnFinished once the reply is done and the window
    is idle again."""
    with qtbot.waitSignal(window.host.turn_finished, timeout=timeout) as blocker:
        window.input.setPlainText(text)
        window.input.submit()
    qtbot.waitUntil(lambda: not window.generating, timeout=5000)
    return blocker.args[0]


def slow_steps(monkeypatch, engine, seconds: float = 0.02) -> None:
    """Each model step of `engine` (a real engine, served here) waits `seconds` first, so that a reply the test
    must see streaming lasts long enough to be seen: a fast machine streamed the tiny model's in 0.4 s."""
    step = engine.runner.step

    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return step(*args, **kwargs)
    monkeypatch.setattr(engine.runner, "step", slowed)


def engine_of(window):
    """The engine a real window's worker holds (None before a load)."""
    return window.host.worker._engine


def saved_files(tmp_path):
    """The chat caches an isolated app (KVCHAT_CACHE_DIR under tmp_path) saved on disk."""
    folder = tmp_path / "cache" / "kv"
    return sorted(folder.glob("*.kvcache")) if folder.is_dir() else []

