"""Triton's model-repository and config API, for ``ensemble deploy`` / ``rollback`` and the
supervisor (urllib only at import: ``ensemble serve`` imports this).

Loads and unloads go over gRPC when the server's gRPC address is known (``grpc_url``). Triton
2.51's HTTP front end runs a model-control load inside the libevhtp worker thread that read it,
for the whole load (the new python-backend stub's start and ``initialize``: seconds), and every
HTTP connection owned by that worker, keep-alive inference connections included, gets no reply
until it returns; gRPC runs repository calls on a thread of their own. Reads (index, config,
stats, the checks' infer) stay on HTTP.

Whoever can call the load API changes what serves. ``ensemble serve`` keeps it on loopback, and
before it binds any other address requires :data:`ADMIN_KEY_ENV`: Triton then answers the APIs of
:data:`RESTRICTED_APIS` only for requests carrying the key, over HTTP in the :data:`ADMIN_HEADER`
header and over gRPC in :data:`GRPC_ADMIN_HEADER` (its restricted-API options, :func:`restricted_options`).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from ensemble import schema
from ensemble.schema import Model

ADMIN_HEADER = "ensemble-admin-key"
# Triton's gRPC front end looks for a restricted protocol's key under its name with this prefix.
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
ADMIN_KEY_ENV = "ENSEMBLE_ADMIN_KEY"
# Triton's API groups a client of the ranker never needs, and that change what serves or reach into
# the server's memory, files or logs: model control, system and CUDA shared-memory registration,
# trace settings, log settings. With a key they answer only requests that carry it; inference,
# health, metadata, config and statistics stay open.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
# The release a fleet's gateway sends a request to (ensemble.fleet.gateway sets it); tritonserver passes
# it to the models as a request parameter of this name.
RELEASE_HEADER = "ensemble-release"
# During an experiment with a shadow share the gateway names the candidates that score a sampled request
# too (after its answer, which the serving release gives) in this header (ensemble/native/backend_shadow.c).
SHADOW_HEADER = "ensemble-shadow"


def restricted_options(key: str) -> list[str]:
    """tritonserver's options that put :data:`RESTRICTED_APIS` behind ``key`` on HTTP and gRPC."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={key}",
            f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={key}"]


def admin_headers(grpc: bool, key: str | None = None) -> dict[str, str] | None:
    """The header that carries the admin key (``key``, else :data:`ADMIN_KEY_ENV`'s) over gRPC or
    HTTP; None without a key."""
    key = key if key is not None else os.environ.get(ADMIN_KEY_ENV)
    return {GRPC_ADMIN_HEADER if grpc else ADMIN_HEADER: key} if key else None


class ControlError(RuntimeError):
    """The server refused or did not answer; the message has its reply, ``status`` its HTTP
    status (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# The ranker's refusal of a request that would miss its deadline (503): a check retries it after a short pause.
BUSY_STATUS = 503
BUSY_RETRIES = 20


@dataclass(frozen=True)
class Control:
    """``url``: ``http://host:port``; ``key``: the admin key, when the server has one;
    ``grpc_url``: ``host:port`` of the server's gRPC endpoint, for loads and unloads (None: over
    HTTP, which stalls other HTTP clients for the length of a load, see the module docstring);
    ``timeout``: seconds to wait for a reply, for every request but loads, unloads and checks,
    which name their own."""

    url: str
    key: str | None = None
    model: str = Model.RANKER.value
    grpc_url: str | None = None
    timeout: float = 10.0

    @classmethod
    def of(cls, address: str, key: str | None = None, grpc: str | None = None) -> "Control":
        """From ``host:port`` or ``http://host:port`` (and ``grpc``: ``host:port`` or
        ``grpc://host:port``); the key defaults to :data:`ADMIN_KEY_ENV`."""
        base = address if "://" in address else f"http://{address}"
        grpc_url = grpc.split("://", 1)[-1].rstrip("/") if grpc else None
        return cls(base.rstrip("/"), key if key is not None else (os.environ.get(ADMIN_KEY_ENV) or None),
                   grpc_url=grpc_url)

    def _request(self, path: str, body: dict | bytes | None = None, timeout: float | None = None):
        headers = {"Content-Type": "application/json", **(admin_headers(grpc=False, key=self.key or "") or {})}
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data, headers, method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout if timeout is None else timeout) as reply:
                text = reply.read()
        except urllib.error.HTTPError as exc:
            raise ControlError(f"{path}: HTTP {exc.code}: {exc.read()[:500].decode(errors='replace')}",
                               exc.code) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ControlError(f"no answer from {self.url}: {exc}") from exc
        return json.loads(text) if text else None

    def serving_release(self) -> int | None:
        """The ranker version Triton reports READY (the newest, if several are)."""
        return max(self.ready_versions(), default=None)

    def ready_versions(self) -> list[int]:
        """Every ranker version Triton reports READY, oldest first (two during a fleet's release)."""
        return sorted(int(m["version"]) for m in self._request("/v2/repository/index", {})
                      if m.get("name") == self.model and m.get("state") == "READY" and m.get("version"))

    def scored(self) -> int:
        """Requests the ranker has answered successfully so far (Triton's statistics, all versions)."""
        stats = self._request(f"/v2/models/{self.model}/stats")
        return sum(int(m.get("inference_stats", {}).get("success", {}).get("count", 0))
                   for m in stats.get("model_stats", []))

    def version_statistics(self, version: int) -> dict:
        """Triton's ``inference_stats`` of one ranker version ({} when it reports none)."""
        found = self._request(f"/v2/models/{self.model}/versions/{version}/stats").get("model_stats", [])
        return found[0].get("inference_stats", {}) if found else {}

    def config(self) -> dict:
        return self._request(f"/v2/models/{self.model}/config")

    def load(self, config: dict | None, timeout: float = 300.0) -> None:
        """Load the model with ``config`` as an override (Triton skips a load whose config and
        versions are unchanged, so an override is how to force or pin one); None: the
        repository's config file."""
        if self.grpc_url:
            self._grpc("load_model", timeout, config=None if config is None else json.dumps(config))
            return
        body = {} if config is None else {"parameters": {"config": json.dumps(config)}}
        self._request(f"/v2/repository/models/{self.model}/load", body, timeout=timeout)

    def unload(self, timeout: float = 60.0) -> None:
        """Unload the ranker and what only it uses (an ensemble's steps): from then on Triton's
        ready endpoints say not-ready and inference answers 404 "has no available versions"."""
        if self.grpc_url:
            self._grpc("unload_model", timeout, unload_dependents=True)
            return
        self._request(f"/v2/repository/models/{self.model}/unload", {"parameters": {"unload_dependents": True}},
                      timeout=timeout)

    def _grpc(self, call: str, timeout: float, **kwargs) -> None:
        """One model-repository call over gRPC (imported here: only loads and unloads need it)."""
        from ensemble.base.grpc_polling import import_grpc

        import_grpc()
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            getattr(client, call)(self.model, headers=admin_headers(grpc=True, key=self.key or ""),
                                  client_timeout=timeout, **kwargs)
        except InferenceServerException as exc:
            raise ControlError(f"gRPC {call} at {self.grpc_url}: {exc.status() or ''} {exc.message()}") from exc
        finally:
            client.close()

    def load_release(self, release: int | list[int], timeout: float = 300.0) -> None:
        """Serve version ``release`` (and only it) of the ranker, or every version of a list."""
        config = self.config()
        config["version_policy"] = {"specific": {"versions": sorted({int(v) for v in (
            release if isinstance(release, list) else [release])})}}
        self.load(config, timeout)

    def infer(self, dense, categorical, outputs: tuple[str, ...] = tuple(t.name for t in schema.RANKER_OUTPUTS),
              timeout: float = 60.0, version: int | None = None) -> dict:
        """Score rows through the ranker's v2 JSON endpoint: output name -> [B] float array.

        For checks (deploy's served == in-process); the clients (``clients.triton``) are the fast path.
        ``version``: that ranker version (None: the server's choice). A request the ranker predicts
        would miss its deadline is refused with 503: retried up to ``BUSY_RETRIES``
        times with growing pauses (about 8 s in all), as the clients do.
        """
        import numpy as np

        body = schema.v2_json_request(dense, categorical, outputs)
        for attempt in range(BUSY_RETRIES + 1):
            try:
                path = schema.RANKER_INFER_PATH if version is None else \
                    f"/v2/models/{self.model}/versions/{version}/infer"
                reply = self._request(path, body, timeout)
                break
            except ControlError as exc:
                if exc.status != BUSY_STATUS or attempt == BUSY_RETRIES:
                    raise
                time.sleep(min(0.01 * 2**attempt, 0.5))
        return {out["name"]: np.asarray(out["data"], dtype=np.float32) for out in reply["outputs"]}
