"""The OpenAI-compatible server: a request's JSON in, the chapter's engine stepping, tokens out.
Nothing here imports `solution` or `lab` by name: it is handed an engine of either module, so
`python lab.py serve` serves the student's own code.

    file                    what it holds                                   vLLM's file for the same job
    http_server.py          HTTP/1.1: connections, framing, keep-alive      (uvicorn, under vLLM)
    api_server.py           the server's processes, routes, model card      vllm/entrypoints/openai/api_server.py
    protocol.py             a request's JSON read into the module's Requests vllm/entrypoints/openai/protocol.py
    serving_engine.py       one request run and answered, whole or streamed .../openai/serving_engine.py
    serving_completion.py   the completions endpoint's choices              .../openai/serving_completion.py
    serving_chat.py         chat messages, the plain template, the choices  .../openai/serving_chat.py, chat_utils.py
    serving_tokenization.py /tokenize and /detokenize                       .../openai/serving_tokenization.py
    engine/                 engine thread <-pipes-> HTTP front end process  vllm/v1/engine/async_llm.py, core.py
    sampling.py             vLLM's sampling extras as logits processors     vllm/v1/sample/
    output.py               tokens to text: detokenizing, stop strings      vllm/v1/engine/output_processor.py
    metrics.py              Prometheus text under vLLM's names              vllm/v1/metrics/

The packages beside this one: `checkpoints/` (a GPT-2 from disk, its tokenizer), `loadtest/` (the
load generator, its workloads, the step simulator) and `course/` (the command line, hints, quiz,
trace, report, design reviews). Imports run one way: course -> loadtest, checkpoints, serving ->
the chapter module each is handed.
"""

from .api_server import start_server

__all__ = ["start_server"]
