"""The OpenAI-compatible server over an engine (docs/SERVING.md)."""

from .server import ServeConfig, build_app, engine_chat_template, run_server

__all__ = ["ServeConfig", "build_app", "engine_chat_template", "run_server"]
