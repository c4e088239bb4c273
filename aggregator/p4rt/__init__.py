"""P4Runtime control plane of the THC switch programs (BMv2 simple_switch_grpc).

Needs the optional extra ``p4`` (``pip install -e .[p4]``): grpcio, the ``p4runtime`` stubs, protobuf.
One ``ThcSwitch`` per switch; see docs/bmv2.md.
"""

from aggregator.p4rt.client import P4RuntimeClient, SwitchAddress, wait_for_port, wait_for_socket, wait_for_switch
from aggregator.p4rt.errors import (
    JobRefused,
    NotPrimary,
    P4InfoError,
    SwitchError,
    SwitchRejected,
    SwitchUnreachable,
)
from aggregator.p4rt.p4info import P4InfoIndex, ProgramGeometry, load_p4info
from aggregator.p4rt.thc import InstalledJob, Placement, ThcSwitch, check_job, job_updates

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
    "check_job",
    "job_updates",
    "load_p4info",
    "wait_for_port",
    "wait_for_socket",
    "wait_for_switch",
]
