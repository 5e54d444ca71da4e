"""Glue between emdlm losses and training frameworks (opt-in; nothing is patched on import)."""
