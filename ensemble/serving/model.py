"""The python-backend ``model.py`` of every python model (export copies this file): a composing
step of the ``gpu`` layout (features, blend), or the whole ranker in the ``fused`` layout.

One dynamic batch = one call of the step (:class:`ensemble.serving.calls.Ranker`: a request that
fails validation gets its own error response and the rest of the batch is still scored). With a
``latency_objective_ms`` parameter (the fused ranker) the call first applies the admission policy
(:mod:`ensemble.serving.admission`): requests that would miss their deadline are answered
UNAVAILABLE, and bulk requests are scored after the interactive ones, whose answers go out first.
Beside interactive traffic the fused ranker hands the bulk requests of a call to its bulk lane
(:class:`BulkLane`) instead, so no interactive request waits in Triton's queue behind them.
"""

import json
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np

import triton_python_backend_utils as pb_utils

from ensemble import schema
from ensemble.serving import admission, calls
from ensemble.scoring import pipeline
from ensemble.serving.lane import LANE_NICE, LANE_REQUESTS, LANE_YIELD_S, lane_full_text

class TritonPythonModel:
    def initialize(self, args):
        pb_utils.deserialize_bytes_tensor = pipeline.deserialize_bytes  # the stub looks it up per call
        config = json.loads(args["model_config"])
        params = pipeline.model_parameters(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        threads, layout = int(params.get("threads", "1")), params.get("layout")
        if layout not in ("fused", "gpu"):  # the retired CPU ensemble's configs named none
            raise pb_utils.TritonModelException(
                f"{config['name']}: the config's 'layout' parameter is {layout!r}, not 'fused' or 'gpu': the per-step "
                "CPU ensemble layout is retired; serve the repository with `ensemble serve` (the native layout)")
        pipeline.refuse_row_stores(version_dir, config["name"], layout)
        if layout == "fused":
            runner = pipeline.load_fused(version_dir, threads)
        else:
            runner = pipeline.load_step(config["name"], version_dir, threads, layout=layout,
                                       widths=schema.widths_of_config(config))
        objective = params.get("latency_objective_ms")
        self.ranker = calls.Ranker(runner, float(objective) if objective else None)
        self.lane = BulkLane(runner) if layout == "fused" and objective else None
        self.interactive_at = -float("inf")

    def finalize(self):
        if self.lane is not None:
            self.lane.stop()

    def execute(self, requests):
        call = [_call_request(r, self.ranker.runner.step) for r in requests]
        kept = self._hand_bulk_to_lane(requests, call)
        if kept is not None:  # some went to the lane: the call plans the others
            if not kept:
                return None
            requests, call = [requests[i] for i in kept], [call[i] for i in kept]
        responses, sent = [None] * len(requests), set()
        for item in self.ranker.call(call):
            if item is calls.FLUSH:  # the interactive answers go out before the bulk rows are scored
                for i, response in enumerate(responses):
                    if response is not None and i not in sent:
                        _send(requests[i], response)
                        sent.add(i)
                continue
            i, answer = item
            responses[i] = _response(answer)
        if not sent and kept is None:
            return responses
        for i, response in enumerate(responses):
            if i not in sent:
                _send(requests[i], response)
        return None

    def _hand_bulk_to_lane(self, requests, call):
        """Beside interactive traffic (a call held an interactive request within the last
        :data:`LANE_YIELD_S`, or the lane still holds requests), the bulk requests go to the lane (or
        are refused when it is full: answered here through their senders). Returns the indices the
        call itself scores, or None when every request stays in the call (then nothing was answered
        here)."""
        if self.lane is None:
            return None
        now = time.monotonic()
        if any(not c.admitted.bulk for c in call):
            self.interactive_at = now
        if not any(c.admitted.bulk for c in call):
            return None
        if now - self.interactive_at > LANE_YIELD_S and not self.lane.holding():
            return None  # no interactive traffic and an empty lane: the call scores its bulk requests
        kept = []
        for i, (request, c) in enumerate(zip(requests, call)):
            if not c.admitted.bulk:
                kept.append(i)
                continue
            taken = self.lane.take(request, c, self.ranker.runner.step)
            if taken is None:
                kept.append(i)  # its inputs cannot be read: the call answers why
            elif not taken:
                _send(request, _response(calls.failed(calls.UNAVAILABLE, LANE_FULL)))
        return kept


LANE_FULL = lane_full_text()


class BulkLane:
    """The fused ranker's bulk requests beside interactive traffic, scored one at a time, in arrival
    order, on a thread of their own at nice :data:`LANE_NICE` and answered through their response
    senders after the call that handed them over has returned (the native backend has the same lane in
    C: ``backend.c``). Holds at most :data:`LANE_REQUESTS`; a request that waited past its own
    timeout is refused when its turn comes; :meth:`stop` answers every request it holds first."""

    def __init__(self, runner):
        self.runner = runner
        self.items = queue.Queue()
        self.lock = threading.Lock()
        self.held = 0
        self.thread = threading.Thread(target=self._main, name="bulk-lane", daemon=True)
        self.thread.start()

    def take(self, request, call_request, step):
        """True: handed over; False: the lane is full; None: the request's inputs cannot be read."""
        with self.lock:
            if self.held >= LANE_REQUESTS:
                return False
            self.held += 1
        try:  # copies: the backend releases the request, and its tensors, once the call returns
            inputs = {t.name: np.array(_as_numpy(request, t.name)) for t in step.inputs}
        except (pipeline.BadInput, ValueError, RuntimeError):
            with self.lock:
                self.held -= 1
            return None
        timeout = call_request.admitted.timeout_s
        deadline = time.monotonic() + timeout if timeout > 0 else float("inf")
        self.items.put((inputs, call_request.wanted, request.get_response_sender(), deadline, timeout))
        return True

    def holding(self) -> bool:
        """Whether the lane holds requests (the one it scores included): later bulk requests then
        queue behind them here, in arrival order, however long ago interactive traffic was served."""
        with self.lock:
            return self.held > 0

    def stop(self):
        self.items.put(None)
        self.thread.join()

    def _main(self):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LANE_NICE)
        except OSError:
            pass
        while True:
            item = self.items.get()
            if item is None:
                return
            inputs, wanted, sender, deadline, timeout = item
            if time.monotonic() > deadline:
                answer = calls.failed(calls.UNAVAILABLE, f"refused: the bulk request waited past its timeout "
                                                         f"({timeout * 1e3:.0f} ms) behind interactive traffic; "
                                                         "retry with backoff")
            else:
                answer = calls.score_alone(self.runner, inputs, wanted, validate=True)
            try:
                sender.send(_response(answer), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            finally:
                with self.lock:
                    self.held -= 1


def _call_request(request, step):
    """What a call needs of a request: its inputs (read when scored), and for admission its rows
    (from the dense tensor's shape, no copy; 1 when it has none: validation answers it), its
    client's timeout and whether it is marked bulk."""
    tensor = pb_utils.get_input_tensor_by_name(request, schema.DENSE.name)
    shape = tensor.shape() if tensor is not None else ()
    parameters = request.parameters()
    bulk = parameters not in ("", "{}") and json.loads(parameters).get(schema.BULK_PARAMETER) is True
    admitted = admission.Request(int(shape[0]) if len(shape) else 1, request.timeout() * 1e-6, bulk)
    return calls.CallRequest(lambda: {t.name: _as_numpy(request, t.name) for t in step.inputs}, admitted,
                             tuple(request.requested_output_names()))


def _send(request, response):
    """Answer ``request`` now through its response sender (the call then returns None)."""
    request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _as_numpy(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise pipeline.BadInput(f"missing input '{name}'")
    return tensor.as_numpy()


def _response(answer):
    if not answer.ok:  # pb_utils.TritonError exists once the stub runs, not when this module is imported
        code = {calls.INTERNAL: pb_utils.TritonError.INTERNAL, calls.INVALID_ARG: pb_utils.TritonError.INVALID_ARG,
                calls.UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE}[answer.code]
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(answer.message, code))
    return pb_utils.InferenceResponse([pb_utils.Tensor(n, a) for n, a in answer.outputs.items()])
