"""Criteo ranking ensemble served by NVIDIA Triton.

One folder per role, in pipeline order (each imports only its own layer and those below:
``tests/unit/test_layout.py``): ``native/`` (every C source and the native backend) and ``base/`` (the machine,
the device, tool pins) -> ``schema`` and ``dataset`` (the contract, ``datasets/``) -> ``data/`` -> ``features/`` ->
``models/`` and ``tables/`` (tables larger than memory) -> ``repository/`` (configs, export, the declared
release) -> ``scoring/`` (the in-process scorer) and ``online/`` (the online store) -> ``serving/`` (what runs
inside Triton's process) -> ``operate/`` (one server) and ``runs/`` (training) -> ``fleet/`` and ``check/`` ->
``cli/`` (the composition roots: the command line, the demos). The README's Layout section lists the same
folders, and ``tests/unit/test_docs.py`` holds both to the tree.
"""
