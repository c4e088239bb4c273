"""P4Runtime writer of the THC switch control plane (BMv2 simple_switch_grpc); the entries it writes
are the target-neutral ones of ``aggregator.switch.entries``.

Needs the optional extra ``p4`` (``pip install -e .[p4]``): grpcio, the ``p4runtime`` stubs, protobuf.
One ``ThcSwitch`` per switch; see docs/bmv2.md.
"""

from aggregator.p4rt.client import P4RuntimeClient, SwitchAddress, wait_for_port, wait_for_socket, wait_for_switch
from aggregator.p4rt.p4info import P4InfoIndex, load_p4info, program_geometry
from aggregator.p4rt.thc import ThcSwitch, job_updates
from aggregator.switch.entries import InstalledJob, Placement, ProgramGeometry, Uplink, check_job
from aggregator.switch.errors import (
    JobRefused,
    NotPrimary,
    P4InfoError,
    SwitchError,
    SwitchRejected,
    SwitchUnreachable,
)

__all__ = [
    "InstalledJob",
    "JobRefused",
    "NotPrimary",
    "P4InfoError",
    "P4InfoIndex",
    "P4RuntimeClient",
    "Placement",
    "ProgramGeometry",
    "SwitchAddress",
    "SwitchError",
    "SwitchRejected",
    "SwitchUnreachable",
    "ThcSwitch",
    "Uplink",
    "check_job",
    "job_updates",
    "load_p4info",
    "program_geometry",
    "wait_for_port",
    "wait_for_socket",
    "wait_for_switch",
]
