"""The environment for a child Python process that must run this checkout's code.

A script started by its path (``torchrun examples/train_ddp.py``, a benchmark that re-runs itself) has its
own folder first on ``sys.path``, not the checkout, so ``import worker_lib`` finds whichever checkout the
virtual environment installed in editable mode. From a second checkout (a ``git worktree`` of an older
commit, to compare two versions) the children then ran the installed checkout's worker code while the
parent ran its own: the comparison measured one version twice.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The checkout this module belongs to.
CHECKOUT = Path(__file__).resolve().parents[1]


def checkout_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with this checkout first on ``PYTHONPATH``, ahead of
    what ``PYTHONPATH`` already holds."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), *filter(None, [env.get("PYTHONPATH")])])
    return env
