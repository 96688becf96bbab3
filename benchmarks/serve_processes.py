"""The server processes `serve_vs_llamacpp.py` starts and watches: a server started and timed to its first
ready answer, a free loopback port, and the CPU a process tree uses (Linux /proc) while idle."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, log: Path,
                 ready_path: str = "/health") -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        self.log = log.open("w")
        started = time.perf_counter()
        # Not in the checkout: `python -m` puts the working directory first on sys.path, before PYTHONPATH.
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=log.parent)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.process.returncode}; see {log}")
            try:
                with urllib.request.urlopen(self.url + ready_path, timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        self.startup_s = time.perf_counter() - started

    def exit_description(self) -> str | None:
        """How the server's process ended ("exited on SIGSEGV", "exited with 1"); None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        if code < 0:
            try:
                return f"exited on {signal.Signals(-code).name}"
            except ValueError:
                return f"exited on signal {-code}"
        return f"exited with {code}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and all its descendants (Linux /proc), in seconds."""
    total, pending = 0.0, [pid]
    ticks = os.sysconf("SC_CLK_TCK")
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def idle_cpu(server: Server, seconds: float) -> float:
    """Cores the server (and its engine core) use while no request is in flight, over ``seconds``."""
    before = tree_cpu_seconds(server.process.pid)
    time.sleep(seconds)
    return (tree_cpu_seconds(server.process.pid) - before) / seconds


def load_average() -> float:
    return os.getloadavg()[0]


if __name__ == "__main__":
    print(__doc__)  # a helper module of serve_vs_llamacpp.py; nothing to run
