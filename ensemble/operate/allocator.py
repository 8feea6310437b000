"""The memory allocator tritonserver runs with.

Triton's release notes suggest running it with tcmalloc or jemalloc through ``LD_PRELOAD`` (its own
containers ship both). Under load the server allocates and frees on every request (its JSON parsing
above all: malloc and free were 12% of its CPU under 100-row JSON requests on the build VM). There,
tcmalloc answered 1.10x the rows a second of glibc's allocator with 100-row requests at 16
connections (jemalloc 1.08x), the same within the VM's noise with 1-row requests, for ~4% more
resident memory (docs/serving.md, "The allocator"). So ``ensemble serve`` preloads tcmalloc when the
machine has it (Debian and Ubuntu: ``libtcmalloc-minimal4``) and says so when it starts; without it,
with ``--allocator system``, or under AddressSanitizer, Triton runs on the system's allocator.
"""

from __future__ import annotations

import ctypes.util
import os
import re
from collections.abc import Mapping
from enum import Enum

PACKAGE = "libtcmalloc-minimal4"  # Debian's and Ubuntu's
# AddressSanitizer's runtime (gcc's or clang's) in LD_PRELOAD, as tests/fuzz/sanitize.py runs tritonserver:
# it brings its own malloc, and tcmalloc preloaded beside it would take allocations ASan must see.
SANITIZER_RUNTIME = re.compile(r"lib(clang_rt\.)?asan")


class Allocator(str, Enum):
    AUTO = "auto"  # tcmalloc when installed, else the system's
    TCMALLOC = "tcmalloc"
    SYSTEM = "system"


def library(choice: Allocator | str, environment: Mapping[str, str] | None = None) -> str | None:
    """The library to preload for ``choice`` (None: the system's allocator). ``auto`` is the system's
    too when ``environment`` (this process's if None) preloads AddressSanitizer's runtime.

    Raises:
        FileNotFoundError: ``tcmalloc`` asked for and not installed.
    """
    choice = Allocator(choice)
    if choice is Allocator.SYSTEM:
        return None
    preload = (os.environ if environment is None else environment).get("LD_PRELOAD", "")
    if choice is Allocator.AUTO and SANITIZER_RUNTIME.search(preload):
        return None
    found = ctypes.util.find_library("tcmalloc_minimal")
    if found is None and choice is Allocator.TCMALLOC:
        raise FileNotFoundError(f"tcmalloc is not installed (Debian and Ubuntu: apt-get install {PACKAGE})")
    return found


def preloaded(environment: dict[str, str], choice: Allocator | str) -> dict[str, str]:
    """``environment`` with the allocator's library first in ``LD_PRELOAD``."""
    found = library(choice, environment)
    if found is None:
        return environment
    rest = environment.get("LD_PRELOAD", "")
    return {**environment, "LD_PRELOAD": f"{found}:{rest}" if rest else found}
