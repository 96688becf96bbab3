"""The long fuzz run: schemathesis against OpenAI's published spec, one batch per operation, on a server it starts.

    python benchmarks/fuzz.py --model demo --examples 600 --json fuzz.json

For each operation (chat, completions, embeddings, models) schemathesis generates requests from the spec
(its examples, coverage and fuzzing phases, ``--examples`` per phase), with the hooks of
tests/server/fuzz_hooks.py (every other body names the served model and leaves out refused fields). After each
batch: /health must be 200, an ordinary request must be answered, and /metrics must show every KV block free.
Reported per operation: cases generated and passed (no 5xx), and the statuses the server counted. Exit status 1
if any case failed or the server was left unhealthy. ``--spec`` defaults to ../shared/data/openai-openapi.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = ["createChatCompletion", "createCompletion", "createEmbedding", "listModels", "retrieveModel"]
MODEL_NAME = "fuzz-model"


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def statuses(url: str) -> dict[int, float]:
    totals: dict[int, float] = {}
    text = get(f"{url}/metrics")[1]
    for status, count in re.findall(r'^pluginfer_requests_total\{route="[^"]*",status="(\d+)"\} (\S+)$', text, re.M):
        totals[int(status)] = totals.get(int(status), 0) + float(count)
    return totals


def healthy(url: str) -> tuple[bool, str]:
    """Alive, answering an ordinary request, every KV block free (waiting up to 30 s for aborts to land)."""
    if get(f"{url}/health")[0] != 200:
        return False, "health is not 200"
    body = json.dumps({"model": MODEL_NAME, "prompt": [11, 12], "max_tokens": 2}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        if response.status != 200:
            return False, f"an ordinary request got {response.status}"
    deadline = time.monotonic() + 30
    while True:
        text = get(f"{url}/metrics")[1]
        free = float(re.search(r"^pluginfer_kv_cache_free_blocks (\S+)$", text, re.M).group(1))
        total = float(re.search(r"^pluginfer_kv_cache_blocks (\S+)$", text, re.M).group(1))
        if free == total:
            return True, ""
        if time.monotonic() > deadline:
            return False, f"{free:g} of {total:g} KV blocks free"
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="what `pluginfer serve --model` serves")
    parser.add_argument("--examples", type=int, default=200, help="schemathesis --max-examples (per phase)")
    parser.add_argument("--spec", default=str(ROOT.parent / "shared" / "data" / "openai-openapi.json"))
    parser.add_argument("--operations", nargs="*", default=OPERATIONS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("serve_args", nargs="*", help="more `pluginfer serve` flags, after --")
    args = parser.parse_args(argv)
    server = subprocess.Popen([sys.executable, "-m", "pluginfer", "serve", "--model", args.model, "--port", "0",
                               "--served-model-name", MODEL_NAME, *args.serve_args], stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    if "serving" not in line:
        server.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    url = line.split(" on ")[-1].strip()
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.server.fuzz_hooks", "PLUGINFER_FUZZ_MODEL": MODEL_NAME,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    report: dict = {"model": args.model, "examples_per_phase": args.examples, "operations": {}}
    ok = True
    try:
        for operation in args.operations:
            before = statuses(url)
            started = time.monotonic()
            result = subprocess.run(
                [sys.executable, "-m", "schemathesis.cli", "run", args.spec, "--url", f"{url}/v1",
                 "--include-operation-id", operation, "--max-examples", str(args.examples),
                 "--checks", "not_a_server_error", "--request-timeout", "120", "--seed", str(args.seed),
                 "--no-color"], capture_output=True, text=True, env=env)
            found = re.search(r"(\d+) generated, (\d+) passed", result.stdout)
            generated, passed = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
            after = statuses(url)
            answered = {status: int(count - before.get(status, 0)) for status, count in sorted(after.items())
                        if count - before.get(status, 0)}
            alive, why = healthy(url)
            report["operations"][operation] = {"generated": generated, "passed": passed, "statuses": answered,
                                               "seconds": round(time.monotonic() - started, 1), "healthy": alive,
                                               **({"problem": why} if why else {})}
            ok &= result.returncode == 0 and generated == passed and alive
            print(operation, json.dumps(report["operations"][operation]), flush=True)
            if result.returncode != 0:
                print(result.stdout[-4000:], file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=60)
    report["generated"] = sum(op["generated"] for op in report["operations"].values())
    report["passed"] = sum(op["passed"] for op in report["operations"].values())
    print(json.dumps({k: v for k, v in report.items() if k != "operations"}))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
