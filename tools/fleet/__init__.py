"""The simulator against the served engine and vLLM, and the measured cost model's fit."""
