"""The tests of GPT-2 checkpoints from disk and their tokenizer (checkpoints/)."""
