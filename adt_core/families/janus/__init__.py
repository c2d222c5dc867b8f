"""Janus-Pro: target, drafter, prompts, weights."""
