"""The allocator tritonserver is started with (ensemble/operate/allocator.py), without starting one."""

from ensemble.operate import allocator
from ensemble.operate.allocator import Allocator

TCMALLOC = "libtcmalloc_minimal.so.4"


def test_auto_preloads_tcmalloc_first_when_the_machine_has_it(monkeypatch):
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: TCMALLOC)
    assert allocator.library(Allocator.AUTO, {}) == TCMALLOC
    assert allocator.preloaded({"LD_PRELOAD": "x.so"}, Allocator.AUTO) == {"LD_PRELOAD": f"{TCMALLOC}:x.so"}
    assert allocator.preloaded({}, Allocator.SYSTEM) == {}


def test_auto_leaves_malloc_to_a_preloaded_address_sanitizer(monkeypatch):
    """tests/fuzz/sanitize.py runs tritonserver with ASan's runtime preloaded: tcmalloc beside it would take
    the allocations ASan must see. Asked for by name, tcmalloc is still preloaded."""
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: TCMALLOC)
    for runtime in ("/usr/lib/gcc/x86_64-linux-gnu/12/libasan.so", "/usr/lib/clang/14/libclang_rt.asan-x86_64.so"):
        sanitized = {"LD_PRELOAD": f"{runtime} /build/asan_init_first.so"}
        assert allocator.library(Allocator.AUTO, sanitized) is None
        assert allocator.preloaded(sanitized, Allocator.AUTO) == sanitized
        assert allocator.preloaded(sanitized, Allocator.TCMALLOC)["LD_PRELOAD"].startswith(TCMALLOC)
