"""The engine and the HTTP front end in two processes, joined by one kind of pipe each way.

vLLM V1 splits a server the same way: the engine core busy-loops in a process of its own, and
the API server (HTTP, tokenizing, detokenizing, one JSON event per token) runs in another, so
that the two never take turns on one interpreter lock. A thread would not do: in CPython only
one thread runs Python at a time, and a small model's step is mostly Python, so an HTTP loop
in the engine's process adds its time to every step instead of overlapping it
(`python -m tools.bench serving` measures both).

Here the engine stays where the caller made it (the caller keeps the object it passed in,
and can look at it afterwards), and the front end is the forked child:

    file            what it holds                                          vLLM's file for the same job
    messages.py     the typed messages that cross, each way; sample ids   vllm/v1/engine/__init__.py
    transport.py    a pipe of length-prefixed pickles, one each way       vllm/v1/engine/core_client.py (ZMQ)
    core.py         EngineCore: the caller's thread that steps the engine  vllm/v1/engine/core.py
    async_llm.py    AsyncLLM: the front end's side, outputs to requests    vllm/v1/engine/async_llm.py

`n` has one home, the engine: `AddRequests` carries each prompt once, with its `n`, and
`LLMEngine.add_request(request, n=n)` runs the prompt once and forks its block table for the
other samples, which the engine names `sample_ids` (docs/sampling.md says why here and not in
the front end, as vLLM V1 does it).
"""
