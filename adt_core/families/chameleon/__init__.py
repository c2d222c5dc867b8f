"""Chameleon / Anole / Lumina-mGPT: target, drafter, prompts, VQ decoder."""
