"""Bundles: target + drafter + decoder + prompter, loaded from a directory, a manifest or embedded (emoji16)."""
