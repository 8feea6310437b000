"""What a load test runs against: the Triton targets (one per layout and protocol) and the CPU baselines."""

from __future__ import annotations

import enum

from ensemble.models.registry import Layout


class Target(str, enum.Enum):
    """What a scenario loads. The two plain Triton targets serve the fused layout (the python-backend
    fallback); ``triton-native-*`` the default, the ranker in the project's own backend. The baselines:
    ``inproc`` and ``naive`` (FastAPI processes) and ``mlserver`` (the in-process pipeline as an MLServer
    runtime)."""

    TRITON_HTTP = "triton-http"
    TRITON_GRPC = "triton-grpc"
    TRITON_NATIVE_HTTP = "triton-native-http"
    TRITON_NATIVE_GRPC = "triton-native-grpc"
    INPROC = "inproc"
    NAIVE = "naive"
    MLSERVER = "mlserver"

    @property
    def layout(self) -> Layout | None:
        """The Triton layout it loads (None for a baseline)."""
        if self.value.startswith("triton-native"):
            return Layout.NATIVE
        return Layout.FUSED if self.value.startswith("triton") else None

    @property
    def grpc(self) -> bool:
        return self.value.endswith("-grpc")

    @property
    def strict_json(self) -> bool:
        """Its JSON parser refuses a bare NaN (MLServer's orjson): missing dense values go as 0."""
        return self is Target.MLSERVER


TARGETS = tuple(t.value for t in Target)
DEFAULT_TARGETS = TARGETS
BASELINES = (Target.INPROC.value, Target.NAIVE.value, Target.MLSERVER.value)
