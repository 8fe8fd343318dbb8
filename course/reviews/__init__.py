"""The design reviews: numbers a reviewer can defend, produced by the module's own code.

    scenarios.py     the four scenarios `python solution.py` prints (sizing, batching, speculation,
                     the stack), and `batching`, `speculate`
    sizing.py        `size`: the capacity plan's printout and KV waste
    stacks.py        `stack`: vLLM vs TensorRT-LLM vs SGLang, as data
    fleet.py         `fleet`: every candidate searched (loadtest/fleet_search.py), the table, the pick and
                     what binds, in words
    attack.py        `attack prefix-cache`: the prefix cache's timing channel, and what a salt costs
"""
