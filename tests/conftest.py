"""The fixtures every file here may use without importing them (they live in support.py)."""

from tests.support import byte_server, engine_model, server, shared_byte_server, shared_server  # noqa: F401
