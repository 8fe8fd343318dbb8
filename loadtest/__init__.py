"""Load and simulation: the open-loop load generator any OpenAI server can be measured with, its
workloads, and the model-free step simulator that predicts such runs from the module's scheduler.

    file                  what it holds                                   vLLM's file for the same job
    benchmark_serving.py  Poisson arrivals, vLLM's latency definitions    vllm/benchmarks/serve.py
    datasets.py           synthetic traffic and load-test workloads       vllm/benchmarks/datasets.py
    simulator.py          each scheduled step costed by a model           (none: vLLM benchmarks the engine)
    fleet_search.py       a replica's largest rate within a p99 SLO       (none: vLLM benchmarks the engine)
    costmodel.py          a step's cost: roofline, measured operators, or a fit  Vidur's execution_time_predictor/
    vidur_profile.json    the measured cost's coefficients (tools/fleet/fit_vidur.py)   Vidur's data/profiling/
"""

from .simulator import simulate_serving

__all__ = ["simulate_serving"]
