"""A command's ``main`` called in the test process as the shell would run it, and the check that a
refusal is one clear line. In process, because a new interpreter per bad option cost seconds of imports."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def call_main(main: Callable[[list[str]], object], argv: list[str],
              capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    """(exit status, stderr) of ``main(argv)``: its return value or SystemExit's code; ``sys.exit("text")``
    counts as the interpreter would handle it, the text on stderr and status 1."""
    try:
        code = main(argv)
    except SystemExit as exited:
        code = exited.code
    err = capsys.readouterr().err
    if isinstance(code, str):
        code, err = 1, err + code + "\n"
    return code, err


def assert_one_line_refusal(code: object, stderr: str, says: str) -> None:
    """Exit 1 or 2, no traceback, one line (argparse's usage aside) that contains ``says``."""
    lines = [ln for ln in stderr.splitlines() if not ln.startswith("usage:") and not ln.startswith("  ")]
    assert code in (1, 2) and "Traceback" not in stderr and len(lines) == 1, stderr
    assert says in lines[0], lines[0]
