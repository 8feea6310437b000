"""An experiment's arms: which release scores a request, from its arm key's value, the same in Python and in the
gateway's Lua (``lua/arm.lua``), on every gateway and after restarts; the checks an experiment's arms pass."""

from __future__ import annotations

import re


class GatewayError(ValueError):
    """A fleet description the gateway cannot serve; the message says what is wrong."""


ARM_POINTS = 10_000  # an arm's share is counted in hundredths of a percent
HEADER_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")  # lower case: HTTP/2 and Envoy see header names so


def check_arms(release: int | None, arms: tuple[tuple[int, float], ...], key: str | None, shadow: float = 0.0) -> None:
    """Raises :class:`GatewayError` when ``arms`` (an experiment's candidates beside ``release``)
    cannot be served: unknown or repeated releases, shares outside (0, 100) or summing to 100 or
    more, a key that is no header name, or a shadow share outside [0, 100]."""
    if not 0 <= shadow <= 100:
        raise GatewayError(f"the shadow share must be 0-100 percent, got {shadow}")
    if not arms:
        if key is not None or shadow:
            raise GatewayError("an arm key or a shadow share needs an experiment's arms")
        return
    if release is None:
        raise GatewayError("an experiment needs the serving release (the arm that takes the rest)")
    releases = [r for r, _ in arms]
    if release in releases or len(set(releases)) != len(releases) or any(not 0 < r < 2**63 for r in releases):
        raise GatewayError(f"an experiment's candidates must be distinct releases other than {release}: {releases}")
    shares = [p for _, p in arms]
    if any(not 0 < p < 100 for p in shares) or sum(shares) >= 100:
        raise GatewayError(f"candidate shares must each be in (0, 100) percent and sum below 100: {shares}")
    if any(round(p * ARM_POINTS / 100) < 1 for p in shares):
        raise GatewayError(f"a share must be at least {100 / ARM_POINTS:g} percent: {shares}")
    if key is not None and not HEADER_NAME.match(key):
        raise GatewayError(f"the arm key must be a lower-case request header or parameter name, got {key!r}")


def arm_bounds(release: int, arms: tuple[tuple[int, float], ...]) -> list[tuple[int, int]]:
    """(release, upper bound in :data:`ARM_POINTS`) in order: the candidates, then the serving
    release up to the whole."""
    bounds, upto = [], 0
    for candidate, percent in arms:
        upto += round(percent * ARM_POINTS / 100)
        bounds.append((candidate, upto))
    return bounds + [(release, ARM_POINTS)]


def arm_point(value: str | bytes, rounds: int = 3) -> int:
    """Where ``value`` (an arm key's value) falls in [0, ARM_POINTS): a polynomial hash of its bytes,
    mixed by ``rounds`` Lehmer steps (3 for the arm; 5 for the shadow sample, drawn from the request
    id), all exact in doubles. The gateway's Lua computes the same (``lua/arm.lua``), so a key's arm
    is known here, the same on every gateway and after restarts."""
    h = 0
    for byte in value.encode() if isinstance(value, str) else value:
        h = (h * 31 + byte) % 2147483647
    for _ in range(rounds):
        h = (h * 48271 + 11) % 2147483647
    return h % ARM_POINTS


def arm_of(value: str | bytes, release: int, arms: tuple[tuple[int, float], ...]) -> int:
    """The release a request whose arm key is ``value`` is scored by."""
    point = arm_point(value)
    return next(r for r, upto in arm_bounds(release, arms) if point < upto)
