"""The bulk lane's limits, one set for both lanes: the fused ranker's in Python (:mod:`ensemble.serving.model`) and
the native backend's in C, which reads them from the model at load (``lane_limits``, ensemble/native/backend.c)."""

LANE_REQUESTS = 64  # the most requests a lane holds; more are refused (retryable)
LANE_NICE = 19  # the lane's thread: below everything else in the process
LANE_YIELD_S = 1.0  # bulk requests go to the lane while an interactive request was served this recently

LIMITS = (LANE_REQUESTS, LANE_NICE, LANE_YIELD_S)


def lane_full_text(requests: int = LANE_REQUESTS) -> str:
    """What a bulk request the full lane refuses is answered (UNAVAILABLE, retryable)."""
    return (f"refused: {requests} bulk requests already wait beside interactive traffic (the bulk lane's limit); "
            "retry with backoff")
