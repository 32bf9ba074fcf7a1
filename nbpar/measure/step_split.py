"""How one metered step's communication divides a normal step: the shares a run reports
and the dashboard draws (`step_shares`). Imports nothing, so the kernel's view can use it
without torch.
"""

from __future__ import annotations


def step_shares(
    in_flight_s: float | None, exposed_s: float | None, wait_s: float | None, step_s: float
) -> tuple[float, float, float]:
    """(in flight, exposed, wait) of one metered step as shares of a normal step.

    ``exposed_s`` (no compute ran, every rank had joined) and ``wait_s`` (no compute ran,
    a rank had not joined yet) are disjoint parts of ``in_flight_s``. The metered step runs
    slower than a normal one (every op passes through Python), and a rank's wait for a
    slower peer stretches with it; when its in-flight time outlasts a normal step the three
    are scaled together, so in flight is the whole step and the parts keep their
    proportions. Always 0 <= exposed + wait <= in flight <= 1.
    """
    if not step_s or step_s <= 0 or not in_flight_s:
        return 0.0, 0.0, 0.0
    scale = 1.0 / max(step_s, in_flight_s)
    in_flight = in_flight_s * scale
    exposed = min(max(exposed_s or 0.0, 0.0) * scale, in_flight)
    wait = min(max(wait_s or 0.0, 0.0) * scale, in_flight - exposed)
    return in_flight, exposed, wait
