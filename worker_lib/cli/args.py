"""Argument types shared by the command-line tools."""

from __future__ import annotations

import argparse

from worker_lib.thc.table import parse_fraction


def fraction(text: str) -> float:
    """Parse a probability written as a decimal (0.03125) or a fraction (1/32)."""
    try:
        return parse_fraction(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
