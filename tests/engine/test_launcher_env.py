"""How a process that torchrun or mpiexec started is recognised, and how it ends once its work is done."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pluginfer.engine.launcher_env import external_launcher, leave_launched_rank


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, None),
    ({"TORCHELASTIC_RUN_ID": "x"}, "torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, None),  # a half torchrun environment is not one
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
    ({"PMI_SIZE": "2"}, "mpi"),
])
def test_the_launcher_is_read_from_the_environment(environ: dict[str, str], expected: str | None) -> None:
    assert external_launcher(environ) == expected


def test_a_process_no_launcher_started_carries_on(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("TORCHELASTIC_RUN_ID", "RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert leave_launched_rank(0) is None


SCRIPT = textwrap.dedent("""
    import atexit, sys, threading
    from pluginfer.engine.launcher_env import leave_launched_rank
    atexit.register(lambda: print("exit handler ran", flush=True))
    # A non-daemon thread that never ends: the interpreter's finalization would wait for it forever.
    threading.Thread(target=threading.Event().wait).start()
    print("done", flush=True)
    leave_launched_rank(3)
    print("not reached", flush=True)
""")


def test_a_launched_rank_runs_its_exit_handlers_then_leaves_without_finalization() -> None:
    env = {"TORCHELASTIC_RUN_ID": "test", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                          env={**env, "PYTHONPATH": ":".join(sys.path)})
    assert done.returncode == 3, done.stderr
    assert done.stdout.split() == ["done", "exit", "handler", "ran"]
