"""launchers.checkout: child processes started by a script's path import this checkout's packages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from launchers.checkout import CHECKOUT, checkout_env


def test_the_checkout_goes_first_and_the_rest_is_kept() -> None:
    assert checkout_env({"PYTHONPATH": "/elsewhere", "X": "1"}) == {
        "PYTHONPATH": os.pathsep.join([str(CHECKOUT), "/elsewhere"]), "X": "1"}
    assert checkout_env({})["PYTHONPATH"] == str(CHECKOUT)
    assert (CHECKOUT / "worker_lib" / "transport.py").is_file()


def test_a_script_run_by_its_path_imports_this_checkouts_worker_lib(tmp_path: Path) -> None:
    """A decoy worker_lib on PYTHONPATH stands for another checkout installed in editable mode: a script
    started by its path from elsewhere imports the decoy with the plain environment, this checkout's
    package with ``checkout_env``."""
    decoy = tmp_path / "decoy"
    (decoy / "worker_lib").mkdir(parents=True)
    (decoy / "worker_lib" / "__init__.py").write_text("")
    script = tmp_path / "where.py"
    script.write_text("import worker_lib\nprint(worker_lib.__file__)\n")

    def imported(env: dict[str, str]) -> Path:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, env=env,
                             cwd=tmp_path, timeout=60).stdout
        return Path(out.strip()).resolve().parent

    plain = {**os.environ, "PYTHONPATH": str(decoy)}
    assert imported(plain) == decoy / "worker_lib"
    assert imported(checkout_env(plain)) == CHECKOUT / "worker_lib"
