"""One client for the ``ranker`` ensemble over HTTP or gRPC (tritonclient).

Request building is written once and shared by both protocols. Large inputs are split into
requests no larger than the model's ``max_batch_size`` (read from the server) and re-joined in
order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ensemble import schema


class Protocol(str, enum.Enum):
    HTTP = "http"
    GRPC = "grpc"


def _module(protocol: Protocol):
    if protocol is Protocol.GRPC:
        import tritonclient.grpc as module
    else:
        import tritonclient.http as module
    return module


@dataclass
class RankerClient:
    """``score(dense, categorical)`` against a running server.

    Args:
        url: ``host:port`` of the HTTP or gRPC endpoint.
        protocol: ``http`` or ``grpc``.
        model: ensemble name.
        binary: HTTP binary tensor extension (True) or JSON (False); gRPC is always binary.
        timeout: per-request timeout in seconds.
    """

    url: str
    protocol: Protocol = Protocol.HTTP
    model: str = schema.Model.RANKER.value
    binary: bool = True
    timeout: float = 30.0

    def __post_init__(self) -> None:
        self.protocol = Protocol(self.protocol)
        self._tc = _module(self.protocol)
        kwargs = {"network_timeout": self.timeout, "connection_timeout": self.timeout} \
            if self.protocol is Protocol.HTTP else {}
        self._client = self._tc.InferenceServerClient(self.url, **kwargs)
        self._max_batch: int | None = None

    @property
    def max_batch_size(self) -> int:
        if self._max_batch is None:
            config = self._client.get_model_config(self.model)
            if self.protocol is Protocol.GRPC:
                self._max_batch = int(config.config.max_batch_size)
            else:
                self._max_batch = int(config["max_batch_size"])
        return self._max_batch

    def build_inputs(self, dense: np.ndarray, categorical: np.ndarray) -> list:
        """The request tensors for one batch ([B x 13] float32, [B x 26] bytes objects)."""
        inputs = []
        for tensor, array in ((schema.DENSE, np.asarray(dense, np.float32)),
                              (schema.CATEGORICAL, np.asarray(categorical, object))):
            item = self._tc.InferInput(tensor.name, list(array.shape), tensor.dtype.wire)
            if self.protocol is Protocol.HTTP:
                item.set_data_from_numpy(array, binary_data=self.binary)
            else:
                item.set_data_from_numpy(array)
            inputs.append(item)
        return inputs

    def build_outputs(self, all_scores: bool) -> list:
        tensors = schema.RANKER_OUTPUTS if all_scores else (schema.SCORE,)
        if self.protocol is Protocol.HTTP:
            return [self._tc.InferRequestedOutput(t.name, binary_data=self.binary) for t in tensors]
        return [self._tc.InferRequestedOutput(t.name) for t in tensors]

    def infer(self, dense: np.ndarray, categorical: np.ndarray, all_scores: bool = False) -> dict[str, np.ndarray]:
        """One request (at most ``max_batch_size`` rows); raises tritonclient's exception on error."""
        kwargs = {"client_timeout": self.timeout} if self.protocol is Protocol.GRPC else {}
        result = self._client.infer(self.model, self.build_inputs(dense, categorical),
                                    outputs=self.build_outputs(all_scores), **kwargs)
        tensors = schema.RANKER_OUTPUTS if all_scores else (schema.SCORE,)
        return {t.name: result.as_numpy(t.name) for t in tensors}

    def score(self, dense: np.ndarray, categorical: np.ndarray, all_scores: bool = False):
        """Score any number of rows.

        Returns:
            [B] float32 blended scores, or with ``all_scores`` a dict of [B] arrays keyed by
            output name (``score``, ``score_xgb``, ...).
        """
        step = self.max_batch_size
        parts = [self.infer(dense[s:s + step], categorical[s:s + step], all_scores)
                 for s in range(0, len(dense), step)]
        joined = {k: np.concatenate([p[k] for p in parts]).reshape(-1) for k in parts[0]}
        return joined if all_scores else joined[schema.SCORE.name]

    def close(self) -> None:
        self._client.close()
