"""What runs the chapter for a user: the server, the load generator, the simulator, the design
reviews and the command line. Nothing here imports `solution` or `lab` by name: every entry point
is handed the module (or an engine of it), so `python lab.py serve` serves the student's own code.

    file                    what it holds                                   vLLM's file for the same job
    cli.py                  `main(lab, argv)`: every command                vllm/entrypoints/cli/main.py
    api_server.py           the server's processes, routes, model card     vllm/entrypoints/openai/api_server.py
    http_server.py          HTTP/1.1: connections, framing, keep-alive      (uvicorn, under vLLM)
    protocol.py             a request's fields: shapes, tables, Requests    vllm/entrypoints/openai/protocol.py
    serving_engine.py       one request run and answered, whole or streamed .../openai/serving_engine.py
    serving_completion.py   the completions endpoint's choices              .../openai/serving_completion.py
    serving_chat.py         the chat endpoint's choices                     .../openai/serving_chat.py
    chat.py                 chat messages and the plain chat template       vllm/entrypoints/chat_utils.py
    sampling.py             vLLM's sampling extras as logits processors     vllm/v1/sample/
    output.py               tokens to text: detokenizing, stop strings      vllm/v1/engine/output_processor.py
    async_llm.py            engine thread <-pipes-> HTTP front end process  vllm/v1/engine/async_llm.py, core.py
    metrics.py              Prometheus text under vLLM's names              vllm/v1/metrics/
    benchmark_serving.py    open-loop load generator, vLLM's latencies      vllm/benchmarks/serve.py
    datasets.py             synthetic traffic and load-test workloads       vllm/benchmarks/datasets.py
    simulator.py            model-free step simulator for design reviews    (none: vLLM benchmarks the engine)
    scenarios.py            the design reviews `python solution.py` prints  (none)
    sizing.py               the capacity plan printout, KV waste            (none)
    costmodel.py            the simulator's step cost: roofline, or a fit   (none: Vidur profiles operators)
    fleet.py                `fleet`: cheapest deployment meeting p99 SLOs   (none: Vidur-Search)
    stacks.py               vLLM vs TensorRT-LLM vs SGLang, as data         (none)
    model_loader.py         a GPT-2 checkpoint from disk (safetensors)      vllm/model_executor/model_loader/
    tokenizer.py            GPT-2's BPE, ByteTokenizer, detokenizing        vllm/transformers_utils/tokenizer.py
    checkpoint_commands.py  generate / speculate / serve on checkpoints     (none)
    report.py               one HTML page of figures drawn from real runs   (none)
    hints.py                `hint N`: the hints of docs/hints.md, by level  (none)
    quiz.py                 `quiz N`: numeric questions the module answers  (none)
    trace.py                a step-by-step page of one recorded engine run  (none)
"""

from .api_server import start_server
from .cli import main
from .model_loader import load_gpt2
from .simulator import simulate_serving

__all__ = ["main", "start_server", "simulate_serving", "load_gpt2"]
