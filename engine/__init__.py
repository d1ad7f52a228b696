"""kvchat's inference engine: no Qt here. See README for the API."""
import importlib

# each name is imported on first use, so that `import engine.<wing>.<module>` of a torch-free module (engine.runtime.quick, the
# one-shot terminal answer) does not bring torch in
_WHERE = {"CacheConfig": "config", "ConfigError": "config", "EngineConfig": "config", "SamplingParams": "config",
          "SpeculativeConfig": "config", "SpecStats": "events",
          "Engine": "runtime.engine", "LayerBytes": "events", "MemoryProbe": "events", "StatsSnapshot": "events",
          "TokenDelta": "events", "TurnFinished": "events", "ModelLoadError": "errors", "UserError": "errors",
          "BudgetFull": "runtime.session", "Session": "runtime.session", "SessionBusy": "runtime.turns",
          "SessionClosed": "runtime.turns"}

__all__ = ["Engine", "EngineConfig", "CacheConfig", "SamplingParams", "SpeculativeConfig", "Session", "ConfigError", "ModelLoadError",
           "UserError", "BudgetFull", "SessionBusy", "SessionClosed", "StatsSnapshot", "LayerBytes", "MemoryProbe",
           "TokenDelta", "TurnFinished", "SpecStats"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
