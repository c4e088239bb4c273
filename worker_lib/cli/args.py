"""Argument types shared by the command-line tools."""

from __future__ import annotations

import argparse


def fraction(text: str) -> float:
    """Parse a probability written as a decimal (0.03125) or a fraction (1/32)."""
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a number or fraction: {text!r}") from None
