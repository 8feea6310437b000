"""The gateway's Lua files in LuaJIT (the runtime Envoy embeds), through lupa, for the tests and the
fuzzer: each file loaded as the chunk it is, given a ``CONFIG`` table written the way the generator
writes it (:func:`ensemble.fleet.lua_filters.config_table`), so its functions can be called from
Python with bytes and get bytes back.
"""

from __future__ import annotations

from pathlib import Path

from ensemble.fleet import envoy_config as ec
from ensemble.fleet import lua_filters

HANDLE = Path(__file__).with_name("envoy_handle.lua")
STRICT = Path(__file__).with_name("strict.lua")


class GatewayLua:
    """One LuaJIT state holding ``arm.lua``, ``pin_version.lua`` and ``client_error.lua``.

    Attributes:
        arm, pin, http: the tables those files return (Lua functions, called with bytes).
        config: the ``CONFIG`` table they were given: :func:`ensemble.fleet.ec.lua_config` with
            ``overrides`` (a fuzzer runs the depth walker with a small ``max_json_depth``).
    """

    def __init__(self, **overrides: str | int):
        import lupa.luajit21 as lupa  # LuaJIT 2.1, as Envoy's Lua filter

        self.runtime = lupa.LuaRuntime(encoding=None, unpack_returned_tuples=True)
        self.settings = {**ec.lua_config(), **overrides}
        self.strict = self.runtime.execute(STRICT.read_bytes())
        self.config = self.runtime.execute(lua_filters.config_table(self.settings) + "return CONFIG")
        self.arm = self.load("arm", self.config)
        self.pin = self.load("pin_version", self.config, self.arm)
        self.http = self.load("client_error", self.config, self.arm)
        self._new_handle = self.runtime.execute(HANDLE.read_bytes())

    def load(self, name: str, *args):
        """Run ``ensemble/fleet/lua/<name>.lua`` with ``args`` as its ``...``; what it returns. Its
        chunk is named after the file (a Lua error names the file and line) and runs with no global
        of its own (``tests/fuzz/strict.lua``)."""
        loaded = self.runtime.eval("loadstring")(lua_filters.source(name).encode(), f"@{name}.lua".encode())
        if isinstance(loaded, tuple):  # nil and the error
            raise SyntaxError(loaded[1].decode())
        return self.strict(loaded)(*args)

    def handle(self, headers: list[tuple[str, str | bytes]], metadata: dict[str, str] | None = None,
               body: bytes | None = None):
        """A stand-in for Envoy's handle (``tests/fuzz/envoy_handle.lua``): request or response
        ``headers`` in order, the route's Lua ``metadata``, the whole ``body`` (None: none)."""
        pairs = self.runtime.table_from([[_bytes(k), _bytes(v)] for k, v in headers], recursive=True)
        meta = self.runtime.table_from({_bytes(k): _bytes(v) for k, v in (metadata or {}).items()})
        return self._new_handle(pairs, meta, body)


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value
