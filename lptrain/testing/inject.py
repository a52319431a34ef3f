"""Faults injected into ``python -m lptrain ...`` subprocesses, for tests.

Some faults only exist between processes: a SIGKILL in the middle of a write, one rank of a
launch that hangs while its peers wait. A test cannot monkeypatch a process it starts, so
:func:`injected_env` returns an environment whose ``PYTHONPATH`` starts with a folder holding a
``sitecustomize.py``; Python imports it at start-up in that process and in every process it
starts (the ranks of a launch inherit the environment), and it runs ``code`` -- once
``lptrain`` itself can be imported, so ``code`` may patch lptrain's functions. ``code`` sees
``RANK`` and the other launcher variables in ``os.environ`` to pick its process.
"""

from __future__ import annotations

import os
from pathlib import Path

_SITECUSTOMIZE = '''\
import os as _os
_code = _os.environ.get("LPTRAIN_TEST_INJECT")
if _code:
    exec(compile(_code, "<lptrain-test-inject>", "exec"), {"__name__": "lptrain_test_inject"})
'''


def injected_env(folder: Path, code: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment (``base``, default ``os.environ``) that runs ``code`` at the start of
    every Python process started with it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = dict(os.environ if base is None else base)
    repo = str(Path(__file__).resolve().parents[2])
    paths = [str(folder), repo, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["LPTRAIN_TEST_INJECT"] = code
    return env
