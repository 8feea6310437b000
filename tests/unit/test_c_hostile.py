"""The C code that reads client bytes, on hostile input, in the modules this environment built: every
module is there, the committed fuzz seeds give what the Python twins give, a float32 tensor is read at
any address, and a BYTES tensor that another process rewrites while it is split is refused, not read
out of bounds. (tests/fuzz/sanitize.py runs these under AddressSanitizer and UndefinedBehaviorSanitizer
too, and fuzzes the same code.)"""

import importlib
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ensemble import schema
from ensemble import native
from tests.helpers import fresh_rows

from tests.fuzz.sanitize import CORPUS, MODULES, ROOT


@pytest.mark.parametrize("name", MODULES)
def test_every_c_module_is_built_here(name):
    # setup.py builds them optional=True: one that stops compiling (-Werror) would vanish silently.
    module = importlib.import_module(name)
    source = Path(module.__file__).with_name(name.rsplit(".", 1)[1] + ".c")
    assert Path(module.__file__).stat().st_mtime >= source.stat().st_mtime, f"{module.__file__} is older than its source"


def test_the_native_backend_is_built_here():
    backend = ROOT / "ensemble" / "native" / ("libtriton_native" + sysconfig.get_config_var("EXT_SUFFIX"))
    assert backend.exists()
    sources = [*(ROOT / "ensemble" / "native").glob("backend*.c"), *(ROOT / "ensemble" / "native").glob("*.h")]
    assert backend.stat().st_mtime >= max(source.stat().st_mtime for source in sources)


def _seeds(target):
    return sorted((CORPUS / target).iterdir())


@pytest.mark.parametrize("seed", _seeds("split_wire"), ids=lambda p: p.name)
def test_split_wire_seeds_match_the_python_loop(seed):
    data = seed.read_bytes()
    try:
        expected = native._split_wire_py(data)
    except ValueError:
        with pytest.raises(ValueError, match="truncated"):
            native.split_wire(data)
        return
    assert native.split_wire(data) == expected
    assert native.join_wire(expected) == data


def _fixed_tables():
    return ({b"": 1, b"a": 2, b"68fd1e64": 3, b"this key is longer than eight bytes": 5},
            {b"\x00": 101, b"8cf07265": 102, b"0123456789": 104},
            {b"7e0ccccf": 201, b"": 202, b"a1b2c3d4e5f6a7b8c9d0": 203})


@pytest.mark.parametrize("seed", _seeds("lookup_wire"), ids=lambda p: p.name)
def test_lookup_wire_seeds_match_the_python_vocabulary(seed):
    wire = seed.read_bytes()[1:]  # the target's first byte chooses its mode
    try:
        count = len(native._split_wire_py(wire))
    except ValueError:
        count = None
    tables = _fixed_tables()
    for vocabulary in (native.Vocabulary(tables), native._VocabularyPy(tables)):
        for n in {count or 0, (count or 0) + 1}:
            out = np.full(n, -5, np.int64)
            if count is None or n != count:
                with pytest.raises(ValueError):
                    vocabulary.lookup_wire(wire, 7, out)
            else:
                vocabulary.lookup_wire(wire, 7, out)
                values = native._split_wire_py(wire)
                assert out.tolist() == [tables[i % 3].get(v, 7) for i, v in enumerate(values)]


# A child process splits a shared-memory BYTES tensor while a grandchild rewrites its last value's
# length between 4 (in bounds) and 0x7FFFFFF0 (2 GiB past the end). split_wire walks the buffer twice;
# each pass must check the lengths it reads. A second pass that trusted the first one's walk copies
# 2 GiB from a 1 MB region: the child then dies (SIGSEGV) instead of printing its counts.
_RACE = textwrap.dedent("""
    import json, multiprocessing, os, sys, time
    from multiprocessing import shared_memory
    from ensemble import native

    VALUES = 200_000
    def rewrite(name, stop, parent):
        shm = shared_memory.SharedMemory(name=name)
        at = (VALUES - 1) * 8
        while not stop.is_set() and os.getppid() == parent:  # also ends when the splitting process died
            shm.buf[at:at + 4] = b"\\xf0\\xff\\xff\\x7f"
            shm.buf[at:at + 4] = b"\\x04\\x00\\x00\\x00"
        shm.close()

    if __name__ == "__main__":
        wire = native.join_wire([b"abcd"] * VALUES)
        shm = shared_memory.SharedMemory(create=True, size=len(wire))
        shm.buf[:len(wire)] = wire
        stop = multiprocessing.Event()
        writer = multiprocessing.Process(target=rewrite, args=(shm.name, stop, os.getpid()))
        writer.start()
        counts = {"split": 0, "truncated": 0, "changed": 0}
        deadline = time.monotonic() + float(sys.argv[1])
        try:
            while time.monotonic() < deadline and counts["changed"] < 1:
                try:
                    values = native.split_wire(shm.buf[:len(wire)])
                    assert len(values) == VALUES and values[-1] == b"abcd"
                    counts["split"] += 1
                except ValueError as e:
                    counts["changed" if "changed while it was read" in str(e) else "truncated"] += 1
        finally:
            stop.set()
            writer.join()
            shm.close()
            shm.unlink()
        print(json.dumps(dict(counts, module=sys.modules["ensemble.native._request"].__file__)))
""")


def test_split_wire_refuses_a_buffer_rewritten_between_its_passes(tmp_path):
    # The child imports the package this process imported (the sanitized build under tests/fuzz/sanitize.py).
    package_root = str(Path(native.__file__).parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, *(p for p in sys.path if p)]))
    done = subprocess.run([sys.executable, "-c", _RACE, "60"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, f"the splitting process ended with {done.returncode}: {done.stderr[-2000:]}"
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts.pop("module") == sys.modules["ensemble.native._request"].__file__
    # The rewrite must have landed between the two passes at least once, else this run proved nothing.
    assert counts["changed"] >= 1, counts


def _at_odd_address(data: bytes) -> memoryview:
    """data 1 byte past a float's alignment, as a client's tensor can sit in Triton's request buffer."""
    return memoryview(b"\0" + data)[1:]


@pytest.mark.parametrize("seed", _seeds("dense_prepare"), ids=lambda p: p.name)
def test_dense_prepare_reads_a_tensor_at_any_address(seed):
    # UBSan on the sanitized build: "load of misaligned address ... for type 'const float'" (seed odd_address).
    data = seed.read_bytes()
    fills, clips = (0.0, -1.0, 3.5, float("nan")), (0.0, -1.0, 3.5, float("-inf"))  # as the fuzz target reads them
    fill, clip_min = fills[data[0] & 3], clips[(data[0] >> 2) & 3]
    n = (len(data) - 1) // 4
    src = np.frombuffer(memoryview(data)[1:1 + 4 * n], np.float32)  # one byte past the seed's start
    assert not src.flags.aligned
    want = np.empty_like(src)
    native._dense_prepare_py(src.copy(), want, fill, clip_min)
    assert np.array_equal(native.dense_prepare(src, fill, clip_min), want, equal_nan=True)


def test_the_chain_in_c_scores_tensors_at_any_address(pipeline):
    dense, cats = fresh_rows(24, seed=77)
    dense = np.ascontiguousarray(dense, np.float32)
    wire = native.join_wire(cats.reshape(-1).tolist())
    aligned = np.full((len(schema.RANKER_OUTPUTS), len(dense)), -1, np.float32)
    odd = np.full_like(aligned, -1)
    pipeline.c_chain.score(((dense.tobytes(), wire, len(dense)),), aligned)
    pipeline.c_chain.score(((_at_odd_address(dense.tobytes()), _at_odd_address(wire), len(dense)),), odd, 2)
    assert np.array_equal(odd, aligned) and (aligned != -1).all()
