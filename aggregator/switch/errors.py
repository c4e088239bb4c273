"""Exceptions of the P4Runtime control plane, one per kind of failure a user can act on.

gRPC errors are translated once, at the boundary (``client.py``), into these; the CLI prints their
message and exits non-zero, never a traceback.
"""

from __future__ import annotations


class SwitchError(RuntimeError):
    """Base class: something went wrong talking to, or configuring, a P4Runtime switch."""


class SwitchUnreachable(SwitchError):
    """The switch's gRPC port did not answer (not started, wrong address, or it died)."""


class SwitchRejected(SwitchError):
    """The switch refused a request (a write, a read, or the pipeline). ``details`` lists the
    per-update errors of a rejected Write, in the order of its updates."""

    def __init__(self, message: str, details: list[str] | None = None) -> None:
        super().__init__(message)
        self.details = details or []


class NotPrimary(SwitchError):
    """Another controller holds the primary role for this device (higher election id)."""


class P4InfoError(SwitchError):
    """The P4Info does not describe a THC program (a table, action or field this code needs is missing)."""


class JobRefused(SwitchError):
    """A job that the loaded program cannot aggregate (geometry, result width, capacity, ports)."""
