"""Real GPT-2 checkpoints: a Hugging Face directory from disk into the module's ToyTransformer, its
byte-level BPE tokenizer, and the commands that run them (`generate`, `speculate --target --draft`).

    file              what it holds                                   vLLM's file for the same job
    model_loader.py   config.json + model.safetensors, no unpickling  vllm/model_executor/model_loader/
    tokenizer.py      GPT-2's BPE, the byte tokenizer, detokenizing   vllm/transformers_utils/tokenizer.py
    commands.py       generate / speculate / an engine on a checkpoint (none)
"""

from .model_loader import load_gpt2

__all__ = ["load_gpt2"]
