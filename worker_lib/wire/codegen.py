"""Shared steps of the scripts that render code from templates (p4/gen_bmv2.py, p4/gen_tofino.py).

Both P4 generators fill ``@MARKER@`` lines of a hand-written template with generated blocks and then
either write the result or check that the checked-in file is current; the steps live here once.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def fill_markers(text: str, parts: dict[str, str]) -> str:
    """Replace each ``@MARKER@`` line (alone on its line) with its block, indented like the marker."""
    for marker, body in parts.items():
        found = re.findall(rf"^([ ]*){marker}[ ]*$", text, flags=re.M)
        if len(found) != 1:
            raise ValueError(f"template must contain {marker} exactly once, alone on its line")
        indent = found[0]
        block = "\n".join(indent + line if line else line for line in body.split("\n"))
        text = re.sub(rf"^[ ]*{marker}[ ]*$", lambda _m, b=block: b, text, count=1, flags=re.M)
    return text


def write_or_check(text: str, output: Path, *, check: bool, script: str) -> int:
    """Write ``text`` to ``output``, or with ``check`` return 1 (and say so) if the file differs."""
    if check:
        current = output.read_text() if output.exists() else ""
        if current != text:
            sys.stderr.write(f"{output} is out of date: run python {script}\n")
            return 1
        return 0
    output.write_text(text)
    return 0
