"""Where a job is aggregated: on the switch where its program can take the job, otherwise on a
``thc-aggregator`` (in the manner of ATP's fallback to a parameter server), with the reason logged.

Why: a switch program has a fixed geometry and few resources (K, b and the result width it was
compiled for, THC jobs only, a few job rows, a bounded number of slots). A job it refuses need not fail:
the software aggregator speaks the same protocol and serves any job, so the control plane installs it
there instead and tells the workers that address. The switch's refusal (``JobRefused``) is the reason.

    placer = JobPlacer(switch=ThcSwitch(addr), switch_service="10.0.0.100:9451",
                       fallback=Fallback(ControlAddress.parse("/run/thc.sock"), "10.0.0.9:9451"))
    home = placer.place(cfg, ports=(1, 2, 3, 4))   # JobHome(job, on="switch"|"aggregator", address, reason)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Protocol

from aggregator.control import ControlAddress, send_command
from aggregator.switch.errors import JobRefused, SwitchError
from worker_lib.job import JobConfig

log = logging.getLogger(__name__)


class SwitchJobs(Protocol):
    """What the placer needs of a switch controller (``aggregator.p4rt.ThcSwitch``)."""

    def configure_job(self, cfg: JobConfig, ports: tuple[int, ...]) -> object: ...


@dataclass(frozen=True)
class Fallback:
    """A running ``thc-aggregator``: its control address (and token, if it has one) and the data address
    workers send to."""

    control: ControlAddress
    service: str
    token: bytes | None = None
    timeout: float = 5.0


@dataclass(frozen=True)
class JobHome:
    """Where a job was installed: ``on`` the switch or the aggregator, the ``address`` its workers send
    to, and why it is not on the switch (None where it is)."""

    job: int
    on: Literal["switch", "aggregator"]
    address: str
    reason: str | None = None

    def to_dict(self) -> dict[str, object]:
        return {"job": self.job, "on": self.on, "address": self.address, "reason": self.reason}


class PlacementError(SwitchError):
    """Neither the switch nor the fallback aggregator took the job."""


class JobPlacer:
    """Installs each job on the switch, or, where the switch refuses it, on the fallback aggregator.

    switch: the switch's controller, or None (no switch: every job goes to the fallback); switch_service:
    the switch's aggregator address; fallback: the thc-aggregator to use, or None (a refused job fails)."""

    def __init__(self, switch: SwitchJobs | None, switch_service: str, fallback: Fallback | None) -> None:
        self.switch = switch
        self.switch_service = switch_service
        self.fallback = fallback

    def place(self, cfg: JobConfig, ports: tuple[int, ...]) -> JobHome:
        """Install ``cfg`` (its workers on switch ``ports``) and say where; raises PlacementError if
        nothing takes it (the switch's reason and the aggregator's answer in the message)."""
        if self.switch is not None:
            try:
                self.switch.configure_job(cfg, tuple(ports))
                log.info("job %d aggregated on the switch at %s", cfg.job, self.switch_service)
                return JobHome(cfg.job, "switch", self.switch_service)
            except JobRefused as exc:
                reason = str(exc)
        else:
            reason = "no switch"
        fb = self.fallback
        if fb is None:
            raise PlacementError(f"job {cfg.job}: the switch refused it ({reason}) and no fallback aggregator "
                                 "is given (--fallback-control, --fallback)")
        try:
            reply = send_command(fb.control, f"add {cfg.spec()}", token=fb.token, timeout=fb.timeout)
        except (OSError, TimeoutError) as exc:
            raise PlacementError(f"job {cfg.job}: the switch refused it ({reason}), and the fallback aggregator's "
                                 f"control at {fb.control} did not answer: {exc}") from None
        if not reply.startswith("ok"):
            raise PlacementError(f"job {cfg.job}: the switch refused it ({reason}), and the fallback aggregator "
                                 f"too: {reply}")
        log.warning("job %d aggregated on thc-aggregator at %s instead of the switch: %s", cfg.job, fb.service,
                    reason)
        return JobHome(cfg.job, "aggregator", fb.service, reason)
