"""LlamaGen: the GPT target, its EAGLE drafter, caption prompts, VQ-16 decoder."""
