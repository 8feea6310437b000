"""Checks an image build runs after its ``pip install``; exits 1 with the reasons on failure.

Always: no two installed distributions own the same file. pip does not notice two wheels
writing one path (e.g. CUDA 12 and CUDA 13 builds of one NVIDIA library); the loser fails only
at run time, on the GPU.
``--torch cuda|cpu``: the installed torch is (or is not) a CUDA build.
``--no-cuda-wheels``: no CUDA runtime wheels at all (the CPU image: a CUDA torch pulls gigabytes).
Stdlib only, except ``--torch`` imports torch.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from importlib import metadata

# CUDA runtime wheels: NVIDIA's libraries (not nvidia-pytriton, the CPU server itself), the CUDA
# toolkit metapackages, and OpenAI Triton, which only the CUDA torch build requires.
CUDA_WHEEL = re.compile(r"^(nvidia-(?!pytriton$).+|cuda-toolkit|cuda-bindings|triton)$", re.I)


def clashes(distributions=None) -> dict[str, list[str]]:
    """Installed file path -> the distributions whose RECORD lists it, where there are several."""
    owners: dict[str, set[str]] = defaultdict(set)
    for dist in metadata.distributions() if distributions is None else distributions:
        name = dist.metadata["Name"]  # parsed from METADATA on every access: once per distribution
        for file in dist.files or ():
            path = str(file)
            # Metadata and byte code are per distribution; paths outside site-packages are scripts.
            if ".dist-info/" in path or path.endswith(".pyc") or path.startswith(".."):
                continue
            owners[path].add(name)
    return {path: sorted(names) for path, names in owners.items() if len(names) > 1}


def cuda_wheels(distributions=None) -> list[str]:
    """Names of installed CUDA runtime wheels."""
    names = {d.metadata["Name"] for d in (metadata.distributions() if distributions is None else distributions)}
    return sorted(n for n in names if CUDA_WHEEL.match(n))


def problems(torch: str | None, no_cuda_wheels: bool) -> list[str]:
    found = [f"{path} is written by {', '.join(names)}" for path, names in sorted(clashes().items())]
    if no_cuda_wheels and cuda_wheels():
        found.append(f"CUDA wheels installed: {', '.join(cuda_wheels())}")
    if torch is not None:
        import torch as module

        built = module.version.cuda
        if (torch == "cuda") != (built is not None):
            found.append(f"torch {module.__version__} is {'CUDA ' + built if built else 'a CPU'} build, expected {torch}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--no-cuda-wheels", action="store_true")
    args = parser.parse_args(argv)
    found = problems(args.torch, args.no_cuda_wheels)
    for line in found:
        print(f"check_install: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
