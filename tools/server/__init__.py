"""The server measured over HTTP, and vLLM itself beside it."""
