"""kvchat's inference engine: no Qt here. See README for the API."""
from .config import CacheConfig, ConfigError, EngineConfig, SamplingParams
from .engine import Engine
from .events import LayerBytes, MemoryProbe, StatsSnapshot, TokenDelta, TurnFinished
from .loader import ModelLoadError
from .session import BudgetFull, Session

__all__ = ["Engine", "EngineConfig", "CacheConfig", "SamplingParams", "Session", "ConfigError", "ModelLoadError",
           "BudgetFull", "StatsSnapshot", "LayerBytes", "MemoryProbe", "TokenDelta", "TurnFinished"]
