"""Criteo ranking ensemble served by NVIDIA Triton.

Modules in pipeline order: schema -> data -> features -> models -> training -> export ->
runtime (serving steps) -> serve -> demo -> cli.
"""
