"""`kvchat serve`: an OpenAI-compatible server with continuous batching over the engine.

batch.py is the only module that touches engine internals; scheduler.py batches requests on one
engine thread; app.py speaks HTTP (FastAPI on uvicorn), after guard.py has checked who calls and
how much they send; metrics.py exports Prometheus metrics under vLLM's names. Nothing here imports Qt.
"""
