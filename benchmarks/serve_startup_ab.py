"""`pluginfer serve --model MODEL` until `/health` answers 200, for one or more source trees, interleaved.

    python benchmarks/serve_startup_ab.py --model demo --runs 4 --source before=/tmp/old-checkout --source after=.
    python benchmarks/serve_startup_ab.py --model /tmp/pluginfer-serve-bench/smol135m-q4_1.gguf

Each run starts the server in a fresh process from each tree in turn (`python -m pluginfer` with the tree as
its working directory, so that tree's package is the one imported, and its engine core the same), polls
`/health` every 10 ms, and stops it; it prints the engine core's start-up line (its phases) beside the time.
Medians and ranges of ``--runs``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_once(tree: Path, model: str) -> tuple[float, str]:
    """Seconds until /health answered 200, and the core's start-up line."""
    port = free_port()
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "pluginfer", "serve", "--model", model, "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tree,
                               env={**os.environ, "PYTHONPATH": str(tree)})
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server from {tree} exited with {process.returncode}: "
                                   f"{process.stdout.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.01)
        seconds = time.perf_counter() - started
    finally:
        process.terminate()
        output = process.communicate(timeout=60)[0]
    lines = [line for line in output.splitlines() if "ready in" in line]
    return seconds, lines[0] if lines else "(no start-up line)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--source", action="append", default=[], metavar="NAME=PATH",
                        help="a pluginfer tree to start the server from; repeat for A/B (default: this checkout)")
    args = parser.parse_args()
    sources = [item.split("=", 1) for item in args.source] or [["this", str(Path(__file__).resolve().parents[1])]]
    times: dict[str, list[float]] = {}
    for run in range(args.runs):
        for name, tree in sources:
            seconds, line = start_once(Path(tree).resolve(), args.model)
            times.setdefault(name, []).append(seconds)
            print(f"run {run + 1} {name}: {seconds:.3f} s; {line}", flush=True)
    print(f"\n`pluginfer serve --model {args.model}` to /health, median of {args.runs} (min-max):")
    for name, values in times.items():
        print(f"{name:>10}: {statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
