"""Criteo ranking ensemble served by NVIDIA Triton.

Folders by role, in pipeline order: ``schema`` (the contract shared with clients and the load
test) -> ``data/`` (Criteo reading, synthetic data) -> ``features/`` (NVTabular workflow and its
lean serving transform) -> ``models/`` (one module per model, the registry, metrics) ->
``training`` -> ``repository/`` (configs, export, manifest, container releases) -> ``serving/``
(steps, the one model.py, server launcher, supervisor, model control, releases) -> ``check/``
(GPU compatibility checks). ``device``, ``machine``, ``grpc_polling`` (how grpc is imported),
``demo`` and ``cli`` sit at the top; only ``cli`` and ``demo`` import the clients and the load test.
"""
