"""One client for the ``ranker`` ensemble over HTTP or gRPC (tritonclient), sync and asyncio.

Request building is written once and shared by both variants: over HTTP through tritonclient's
``InferInput`` objects, over gRPC as the serialized request message itself (:func:`grpc_request`),
sent through tritonclient's channel. Large inputs
are split into requests no larger than the model's ``max_batch_size`` (read from the server)
and re-joined in order. Transient failures (server unavailable, overloaded, connection reset)
are retried with exponential backoff a bounded number of times; a request that still fails
raises :class:`ScoringError` naming its rows.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from clients.inputs import ranking_tensors, to_tensors
from clients import adapter
from clients.wire import WireStrings, set_bytes_input
from ensemble import schema
from ensemble.dataset import DatasetSpec
from ensemble.base.grpc_polling import import_grpc
from clients.grpc_messages import _grpc_compression, _service, grpc_error, grpc_outputs, grpc_request  # noqa: F401


class Protocol(str, enum.Enum):
    HTTP = "http"
    GRPC = "grpc"


class ScoringError(RuntimeError):
    """Rows ``start..stop-1`` of a call could not be scored."""

    def __init__(self, start: int, stop: int, cause: BaseException, attempts: int):
        self.start, self.stop, self.cause, self.attempts = start, stop, cause, attempts
        super().__init__(f"rows {start}..{stop - 1} failed after {attempts} attempt(s): "
                         f"{type(cause).__name__}: {cause}{_wrong_port_hint(cause)}")


def _wrong_port_hint(cause: BaseException) -> str:
    """What a protocol/port mix-up looks like from each client, said in words."""
    text = str(cause)
    if type(cause).__name__ == "HTTPParseError" or "Expected HTTP/" in text:  # geventhttpclient on a gRPC port
        return " (the server did not answer in HTTP: is this Triton's gRPC port? give grpc://host:port)"
    if "StatusCode.UNAVAILABLE" in text and "Socket closed" in text:  # gRPC on the HTTP (or metrics) port
        return " (is this Triton's HTTP port? gRPC is on its own port, 8001 by default; or give http://host:port)"
    return ""


# Status strings tritonclient puts on InferenceServerException for failures worth retrying.
TRANSIENT_STATUS = {"502", "503", "504", "429", "StatusCode.UNAVAILABLE", "StatusCode.RESOURCE_EXHAUSTED",
                    "StatusCode.DEADLINE_EXCEEDED", "StatusCode.ABORTED"}


# Messages of failures that heal by themselves, whatever their status code:
# - "Stub process ... is not healthy": a backend process died or stalled;
# - "has no available versions" (404 / NOT_FOUND): the model is known but unloaded or loading, as
#   while the supervisor (ensemble serve) reloads a broken ranker; an unknown model name answers
#   "is not found" instead, which is not retried.
TRANSIENT_MESSAGES = ("connect", "not healthy", "has no available versions")


def is_transient(exc: BaseException) -> bool:
    """Connection problems and overload rejections are transient; bad requests are not."""
    import http.client

    from tritonclient.utils import InferenceServerException

    if isinstance(exc, InferenceServerException):
        status, message = str(exc.status() or ""), str(exc).lower()
        return status in TRANSIENT_STATUS or any(m in message for m in TRANSIENT_MESSAGES)
    try:  # the HTTP client's "server closed the connection" (not an OSError)
        from geventhttpclient.response import HTTPConnectionClosed
    except ImportError:  # pragma: no cover - geventhttpclient comes with tritonclient[http]
        HTTPConnectionClosed = ()  # noqa: N806
    try:  # the asyncio HTTP client's disconnects
        from aiohttp import ClientConnectionError
    except ImportError:  # pragma: no cover
        ClientConnectionError = ()  # noqa: N806
    return isinstance(exc, (OSError, TimeoutError, asyncio.TimeoutError, http.client.IncompleteRead,
                            HTTPConnectionClosed, ClientConnectionError))


def _pause_or_raise(exc: BaseException, sleeps, start: int, stop: int, attempts: int) -> float:
    """The pause before the next attempt, or :class:`ScoringError` when ``exc`` is not transient
    or the retries are used up."""
    pause = next(sleeps, None) if is_transient(exc) else None
    if pause is None:
        raise ScoringError(start, stop, exc, attempts) from exc
    return pause


def parse_url(url: str, protocol: Protocol | str | None = None) -> tuple[str, Protocol]:
    """``grpc://host:8001`` / ``http://host:8000`` / ``host:port`` (+ protocol) -> (host:port, protocol)."""
    scheme, sep, rest = url.partition("://")
    if sep:
        chosen = Protocol(scheme.lower())
        if protocol is not None and Protocol(protocol) is not chosen:
            raise ValueError(f"URL {url!r} says {chosen.value} but protocol={Protocol(protocol).value}")
        return rest.rstrip("/"), chosen
    return url.rstrip("/"), Protocol(protocol or Protocol.HTTP)


@dataclass(frozen=True)
class Retry:
    """At most ``attempts`` tries; sleep ``backoff * 2**k`` (capped at ``max_sleep``) between."""

    attempts: int = 4
    backoff: float = 0.25
    max_sleep: float = 4.0

    def sleeps(self):
        for k in range(self.attempts - 1):
            yield min(self.backoff * 2 ** k, self.max_sleep)


def _module(protocol: Protocol, aio: bool = False):
    # Import only what is used: grpc.aio must not be imported under gevent (locust users).
    if protocol is Protocol.GRPC:
        import_grpc()  # before tritonclient.grpc: grpcio's polling is chosen at its import
        if aio:
            import tritonclient.grpc.aio as module
        else:
            import tritonclient.grpc as module
    elif aio:
        import tritonclient.http.aio as module
    else:
        import tritonclient.http as module
    return module


def build_inputs(tc, protocol: Protocol, binary: bool, dense: np.ndarray, categorical: np.ndarray) -> list:
    """The request tensors for one batch ([B x dense] float32, [B x categorical] bytes objects or
    :class:`clients.wire.WireStrings`)."""
    if isinstance(categorical, WireStrings):
        if protocol is Protocol.HTTP and not binary:  # JSON carries the values, not the wire format
            categorical = categorical.to_objects()
    else:
        categorical = np.asarray(categorical, object)
    return [_input(tc, protocol, binary, schema.DENSE, np.ascontiguousarray(dense, np.float32)),
            _input(tc, protocol, binary, schema.CATEGORICAL, categorical)]


def _input(tc, protocol: Protocol, binary: bool, tensor: schema.Tensor, array: np.ndarray):
    """One request tensor: strings in the binary wire format (gRPC, or HTTP with binary data)."""
    item = tc.InferInput(tensor.name, list(array.shape), tensor.dtype.wire)
    if tensor.dtype is schema.DType.STRING and (binary or protocol is Protocol.GRPC):
        set_bytes_input(item, array, grpc=protocol is Protocol.GRPC)
    elif protocol is Protocol.HTTP:
        item.set_data_from_numpy(array, binary_data=binary)
    else:
        item.set_data_from_numpy(array)
    return item


@dataclass(frozen=True)
class Ranking:
    """A ranking request's answer.

    Attributes:
        order: candidate indices, best first (the first ``k`` when asked); ties keep the order sent.
        scores: every candidate's blended score, in the order the candidates were sent (NaN for a
            dropped one).
        dropped: ranking by ids: the indices of the item ids the online store does not hold, when the
            server drops unknown items (they are not in ``order``); empty otherwise.
    """

    order: np.ndarray
    scores: np.ndarray
    dropped: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))


def _outputs(all_scores: bool) -> tuple[schema.Tensor, ...]:
    return schema.RANKER_OUTPUTS if all_scores else (schema.SCORE,)


def build_outputs(tc, protocol: Protocol, binary: bool, all_scores: bool) -> list:
    tensors = _outputs(all_scores)
    if protocol is Protocol.HTTP:
        return [tc.InferRequestedOutput(t.name, binary_data=binary) for t in tensors]
    return [tc.InferRequestedOutput(t.name) for t in tensors]


def read_result(result, all_scores: bool) -> dict[str, np.ndarray]:
    tensors = _outputs(all_scores)
    return {t.name: result.as_numpy(t.name).reshape(-1) for t in tensors}


def _max_batch(config, protocol: Protocol) -> int:
    """``max_batch_size`` from a model-config reply (protobuf over gRPC, a dict over HTTP)."""
    return int(config.config.max_batch_size if protocol is Protocol.GRPC else config["max_batch_size"])


def _join(parts: list[dict[str, np.ndarray]], all_scores: bool):
    if not parts:
        names = [t.name for t in (schema.RANKER_OUTPUTS if all_scores else (schema.SCORE,))]
        parts = [{n: np.empty(0, np.float32) for n in names}]
    joined = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return joined if all_scores else joined[schema.SCORE.name]


@dataclass
class _Settings:
    url: str
    protocol: Protocol | str | None = None
    model: str = schema.Model.RANKER.value
    binary: bool = True
    timeout: float = 60.0
    retry: Retry = field(default_factory=Retry)
    compression: str | None = None  # gRPC: None (off), "gzip" or "deflate"
    priority: int = 0  # schema.Priority; 0: the model's default (interactive)
    dataset: DatasetSpec = schema.CRITEO  # names the columns of DataFrames and Arrow tables to score

    def __post_init__(self) -> None:
        self.url, self.protocol = parse_url(self.url, self.protocol)
        if self.compression is not None and self.compression.lower() not in ("gzip", "deflate"):
            raise ValueError(f"compression must be None, 'gzip' or 'deflate', got {self.compression!r}")

    def _client_kwargs(self) -> dict:
        if self.protocol is Protocol.HTTP:
            return {"network_timeout": self.timeout, "connection_timeout": self.timeout}
        return {}

    @functools.cached_property
    def _infer_call(self):
        """``ModelInfer`` on this client's gRPC channel (tritonclient's, sync or asyncio), taking a request
        already serialized (:func:`grpc_request`); registered with the channel, as grpcio's generated
        stubs do."""
        return adapter.infer_call(self._client, _service().ModelInferResponse.FromString)

    def _grpc_call(self, model: str, tensors, outputs, priority: bool = True) -> dict:
        """The arguments of ``ModelInfer`` for one request on tritonclient's channel (with its
        message-size limits): what its ``infer`` passes, the request serialized."""
        deadline = self._infer_kwargs()
        request = grpc_request(model, tensors, outputs, deadline["timeout"], deadline["priority"] if priority else 0,
                               deadline.get("parameters"))
        return {"request": request, "metadata": (), "timeout": self.timeout,
                "compression": _grpc_compression(self.compression)}

    def _grpc_ranker_call(self, dense, categorical, all_scores: bool) -> dict:
        return self._grpc_call(self.model, ((schema.DENSE, dense), (schema.CATEGORICAL, categorical)),
                               _outputs(all_scores))

    def _infer_kwargs(self) -> dict:
        # `timeout` (microseconds) travels with the request: the fused ranker refuses a request at
        # once when it cannot be scored before the client would give up. Batch requests are also
        # marked bulk: held to that timeout only, never to the server's latency objective.
        deadline = {"timeout": int(self.timeout * 1e6), "priority": int(self.priority)}
        if self.priority == schema.Priority.BATCH:
            deadline["parameters"] = {schema.BULK_PARAMETER: True}
        if self.protocol is Protocol.GRPC:
            return {**deadline, "client_timeout": self.timeout, "compression_algorithm": self.compression}
        return deadline


@dataclass
class RankerClient(_Settings):
    """Synchronous client: ``score(rows)`` against a running server.

    Args:
        url: ``host:port``, or ``http://host:port`` / ``grpc://host:port`` (then the protocol
            comes from the URL).
        protocol: ``http`` (default) or ``grpc`` when the URL has no scheme.
        binary: HTTP binary tensor extension (default) or JSON; gRPC is always binary.
        timeout: seconds per request.
        retry: bounded retries with backoff for transient failures.
        compression: gRPC compression (off by default).
        priority: :class:`ensemble.schema.Priority` of every request. ``BATCH`` (what batch
            scoring sends) also marks each request bulk (``schema.BULK_PARAMETER``): the fused
            ranker holds it to this client's timeout only and never refuses it for the server's
            latency objective. 0 is interactive.
    """

    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        super().__post_init__()
        self._tc = _module(self.protocol)
        self._client = self._tc.InferenceServerClient(self.url, **self._client_kwargs())
        self._max_batch: int | None = None

    @property
    def max_batch_size(self) -> int:
        """The model's ``max_batch_size`` as the server reports it (read once)."""
        if self._max_batch is None:
            self._max_batch = _max_batch(self._client.get_model_config(self.model), self.protocol)
        return self._max_batch

    def infer(self, dense: np.ndarray, categorical: np.ndarray, all_scores: bool = False) -> dict[str, np.ndarray]:
        """One request, no retries; raises tritonclient's exception on error."""
        if self.protocol is Protocol.GRPC:  # the request built directly, sent through tritonclient's channel
            response = self._grpc_infer(self._grpc_ranker_call(dense, categorical, all_scores))
            return grpc_outputs(response, _outputs(all_scores))
        result = self._client.infer(
            self.model, build_inputs(self._tc, self.protocol, self.binary, dense, categorical),
            outputs=build_outputs(self._tc, self.protocol, self.binary, all_scores), **self._infer_kwargs())
        return read_result(result, all_scores)

    def _with_retry(self, call: Callable[[], object], start: int, stop: int):
        sleeps, attempts = self.retry.sleeps(), 0
        while True:
            attempts += 1
            try:
                return call()
            except Exception as exc:  # noqa: BLE001 - classified by _pause_or_raise
                self.sleep(_pause_or_raise(exc, sleeps, start, stop, attempts))

    def rank(self, context, candidates, k: int | None = None) -> Ranking:
        """Rank ``candidates`` for one ``context`` with one request to the ``rank`` model: the server
        broadcasts the context onto every candidate (the client sends it once).

        Args:
            context: the context's values (see :func:`clients.inputs.ranking_tensors`: a mapping of
                the dataset spec's context columns, or a ``(continuous, categorical)`` pair; None
                when the spec has none).
            candidates: a DataFrame with the spec's candidate columns, or a ``(continuous,
                categorical)`` pair of [N x columns] arrays.
            k: answer the best ``k`` candidates' indices only (None: all); scores are always all.
        """
        tensors = ranking_tensors(context, candidates, self.dataset)
        sent = [(t, a) for t, a in zip((schema.CONTEXT_DENSE, schema.CONTEXT_CATEGORICAL, schema.CANDIDATE_DENSE,
                                        schema.CANDIDATE_CATEGORICAL), tensors)
                if a.shape[-1] or t in (schema.CANDIDATE_DENSE, schema.CANDIDATE_CATEGORICAL)]
        return self._rank_call(sent, k, len(tensors[2]))

    def rank_ids(self, user, items, k: int | None = None, context=None) -> Ranking:
        """Rank items by their ids for one user, the server reading both's features from its online
        store (``ensemble serve --store URL``; docs/your-data.md, "Ranking by ids"): the same
        :class:`Ranking` :meth:`rank` answers for the same stored features. Item ids the store does not
        hold are answered in ``Ranking.dropped`` (or scored with missing features, as the server is set).

        Args:
            user: the user's id (the spec's context key), or None when the spec has no context.
            items: the items' ids (the spec's candidate key), str or bytes; repeats are scored each time.
            k: answer the best ``k`` items' indices only (None: all).
            context: request-time context features replacing the stored user's (a mapping of the spec's
                context columns, or a ``(continuous, categorical)`` pair), or None.
        """
        try:  # ids as str, the common case: encoded in one C-level pass
            values = list(map(str.encode, items))
        except TypeError:  # bytes, numbers, or a mix
            values = [v if isinstance(v, bytes) else str(v).encode() for v in items]
        ids = np.empty(len(values), object)
        ids[:] = values
        sent = [(schema.ITEM_IDS, ids)]
        if user is not None:
            sent.append((schema.USER_ID, np.array([user if isinstance(user, bytes) else str(user).encode()], object)))
        if context is not None:
            dense, cats = ranking_tensors(context, (np.zeros((0, 0)), np.zeros((0, 0))), self.dataset)[:2]
            sent += [(schema.CONTEXT_DENSE, dense), (schema.CONTEXT_CATEGORICAL, cats)]
        return self._rank_call(sent, k, len(ids))

    def _rank_call(self, sent: list, k: int | None, n: int) -> Ranking:
        if k is not None:
            sent.append((schema.TOP_K, np.array([k], np.int32)))
        answers = (schema.CANDIDATE_SCORES, schema.ORDER, schema.DROPPED)

        def call() -> Ranking:
            if self.protocol is Protocol.GRPC:  # the rank model has no priority levels
                out = grpc_outputs(self._grpc_infer(self._grpc_call(schema.RANK_MODEL, sent, answers, priority=False)),
                                   answers)
                return Ranking(out[schema.ORDER.name], out[schema.CANDIDATE_SCORES.name],
                               out.get(schema.DROPPED.name, np.empty(0, np.int32)))
            inputs = [_input(self._tc, self.protocol, self.binary, t, a) for t, a in sent]
            outputs = [self._tc.InferRequestedOutput(t.name, binary_data=self.binary) for t in answers]
            kwargs = self._infer_kwargs()
            kwargs.pop("priority", None)  # the rank model has no priority levels
            result = self._client.infer(schema.RANK_MODEL, inputs, outputs=outputs, **kwargs)
            dropped = result.as_numpy(schema.DROPPED.name)
            return Ranking(result.as_numpy(schema.ORDER.name).reshape(-1),
                           result.as_numpy(schema.CANDIDATE_SCORES.name).reshape(-1),
                           np.empty(0, np.int32) if dropped is None else dropped.reshape(-1))

        return self._with_retry(call, 0, n)

    def _grpc_infer(self, call: dict):
        import grpc

        try:
            return self._infer_call(**call)
        except grpc.RpcError as exc:
            raise grpc_error(exc) from None

    def infer_with_retry(self, dense, categorical, all_scores: bool = False, offset: int = 0):
        return self._with_retry(lambda: self.infer(dense, categorical, all_scores), offset, offset + len(dense))

    def score(self, rows, categorical: np.ndarray | None = None, all_scores: bool = False):
        """Score any number of rows (arrays, DataFrame, pyarrow Table or Criteo TSV lines).

        Every server call (the model-config read included) goes through the retries; any
        failure is raised as :class:`ScoringError`.

        Returns:
            [B] float32 blended scores, or with ``all_scores`` a dict of [B] arrays keyed by
            output name (``score``, ``score_xgb``, ``score_dlrm_torch``, ``score_dlrm_tf``).
        """
        dense, cats = to_tensors(rows, categorical, self.dataset)
        step = self._with_retry(lambda: self.max_batch_size, 0, len(dense))
        parts = [self.infer_with_retry(dense[s:s + step], cats[s:s + step], all_scores, offset=s)
                 for s in range(0, len(dense), step)]
        return _join(parts, all_scores)

    def close(self) -> None:
        self._client.close()


@dataclass
class AsyncRankerClient(_Settings):
    """asyncio client (``tritonclient.http.aio`` / ``tritonclient.grpc.aio``) for high concurrency.

    ``await score(rows)`` sends the pieces of a large input concurrently (at most
    ``max_in_flight`` at once) and re-joins them in order.
    """

    max_in_flight: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        self._tc = _module(self.protocol, aio=True)
        kwargs = {"conn_timeout": self.timeout} if self.protocol is Protocol.HTTP else {}
        self._client = self._tc.InferenceServerClient(self.url, **kwargs)
        self._max_batch: int | None = None

    async def max_batch_size(self) -> int:
        if self._max_batch is None:
            self._max_batch = _max_batch(await self._client.get_model_config(self.model), self.protocol)
        return self._max_batch

    async def infer(self, dense, categorical, all_scores: bool = False) -> dict[str, np.ndarray]:
        if self.protocol is Protocol.GRPC:  # as RankerClient.infer
            import grpc

            try:
                response = await self._infer_call(**self._grpc_ranker_call(dense, categorical, all_scores))
            except grpc.RpcError as exc:
                raise grpc_error(exc) from None
            return grpc_outputs(response, _outputs(all_scores))
        # HTTP: the aiohttp session's total timeout (conn_timeout) bounds each request.
        result = await self._client.infer(
            self.model, build_inputs(self._tc, self.protocol, self.binary, dense, categorical),
            outputs=build_outputs(self._tc, self.protocol, self.binary, all_scores), **self._infer_kwargs())
        return read_result(result, all_scores)

    async def _with_retry(self, call, start: int, stop: int, gate: asyncio.Semaphore):
        sleeps, attempts = self.retry.sleeps(), 0
        async with gate:
            while True:
                attempts += 1
                try:
                    return await call()
                except Exception as exc:  # noqa: BLE001 - classified by _pause_or_raise
                    await asyncio.sleep(_pause_or_raise(exc, sleeps, start, stop, attempts))

    async def score(self, rows, categorical: np.ndarray | None = None, all_scores: bool = False):
        dense, cats = to_tensors(rows, categorical, self.dataset)
        gate = asyncio.Semaphore(self.max_in_flight)
        step = await self._with_retry(self.max_batch_size, 0, len(dense), gate)
        parts = await asyncio.gather(*(
            self._with_retry(lambda s=s: self.infer(dense[s:s + step], cats[s:s + step], all_scores),
                             s, min(s + step, len(dense)), gate)
            for s in range(0, len(dense), step)))
        return _join(list(parts), all_scores)

    async def close(self) -> None:
        await self._client.close()
