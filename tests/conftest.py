"""The fixtures every file here may use without importing them (they live in support.py)."""

from tests.support import byte_server, engine_model, server  # noqa: F401
