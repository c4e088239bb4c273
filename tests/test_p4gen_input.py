"""p4gen's generators: a --p4testgen that is no executable is refused in one line before anything runs
or is written, and the Tofino generator's help states the K the checked-in program has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from p4gen import testgen, testgen_tofino, tofino
from tests.cli_support import assert_one_line_refusal, call_main


@pytest.mark.parametrize("what", ["data file", "folder"])
@pytest.mark.parametrize(("main", "extra", "says"), [
    (testgen.main, [], "p4gen.testgen: p4testgen "),
    (testgen_tofino.main, ["--corpus", "tofino"], "p4gen.testgen_tofino: p4testgen "),
], ids=["bmv2", "tofino"])
def test_p4testgen_that_is_not_executable_is_one_line(main, extra: list[str], says: str, what: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A readable data file or a folder as --p4testgen: one line naming it (it exists, so 'not found' would be
    wrong), not a PermissionError traceback from running it; the output folder is not created."""
    given = tmp_path / "p4testgen"
    if what == "folder":
        given.mkdir()
    else:
        given.write_text("not a program\n")
    out = tmp_path / "corpus"
    code, err = call_main(main, ["--p4testgen", str(given), *extra, "--out", str(out)], capsys)
    assert_one_line_refusal(code, err, f"{says}{given} is not an executable file")
    assert not out.exists()


def test_p4testgen_that_cannot_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Executable but no program this system runs (a script without #!): one line, not an OSError traceback."""
    given = tmp_path / "p4testgen"
    given.write_text("echo no interpreter line\n")
    given.chmod(0o755)
    code, err = call_main(testgen.main, ["--p4testgen", str(given), "--out", str(tmp_path / "corpus")], capsys)
    assert_one_line_refusal(code, err, f"p4gen.testgen: cannot run {given}: Exec format error")


def test_tofino_help_names_the_checked_in_k() -> None:
    """The module docstring (the CLI's epilog) gives the K the default geometry and p4src/tofino/thc.p4 have."""
    k = tofino.TofinoGeometry().elems
    said = re.search(r"rendered with the defaults of ``TofinoGeometry`` \(Tofino 1, K = (\d+)", tofino.__doc__ or "")
    assert said and int(said[1]) == k, said
    assert f"const bit<32> THC_K = {k};" in tofino.OUTPUT.read_text()
