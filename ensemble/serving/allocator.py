"""The memory allocator tritonserver runs with.

Triton's release notes suggest running it with tcmalloc or jemalloc through ``LD_PRELOAD`` (its own
containers ship both). Under load the server allocates and frees on every request (its JSON
parsing above all: malloc and free were 12% of its CPU under 100-row JSON requests on the build
VM), and jemalloc answered 1.06-1.08x the rows a second of glibc's allocator at 4 and 16
connections, with ~3% more resident memory (docs/serving.md, "The allocator"). So ``ensemble serve``
preloads jemalloc when the machine has it (Debian and Ubuntu: ``libjemalloc2``) and says so in its
log; without it, or with ``--allocator system``, Triton runs on the system's allocator.
"""

from __future__ import annotations

import ctypes.util
from enum import Enum


class Allocator(str, Enum):
    AUTO = "auto"  # jemalloc when installed, else the system's
    JEMALLOC = "jemalloc"
    SYSTEM = "system"


def library(choice: Allocator | str) -> str | None:
    """The library to preload for ``choice`` (None: the system's allocator).

    Raises:
        FileNotFoundError: ``jemalloc`` asked for and not installed.
    """
    choice = Allocator(choice)
    if choice is Allocator.SYSTEM:
        return None
    found = ctypes.util.find_library("jemalloc")
    if found is None and choice is Allocator.JEMALLOC:
        raise FileNotFoundError("jemalloc is not installed (Debian and Ubuntu: apt-get install libjemalloc2)")
    return found


def preloaded(environment: dict[str, str], choice: Allocator | str) -> dict[str, str]:
    """``environment`` with the allocator's library first in ``LD_PRELOAD``."""
    found = library(choice)
    if found is None:
        return environment
    rest = environment.get("LD_PRELOAD", "")
    return {**environment, "LD_PRELOAD": f"{found}:{rest}" if rest else found}
