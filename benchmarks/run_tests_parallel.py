"""Run pytest over test files in several processes at once (Triton's kernel compiles dominate a first GPU run of the
kernel tests and use one core per process). Collects the test ids, deals them round-robin to ``--procs`` pytest
processes, writes each process's log and prints every failure line and the combined counts; exits non-zero when a
test failed or a process timed out.

Usage: ``python benchmarks/run_tests_parallel.py --procs 8 --log-dir DIR [--timeout S] tests/test_x.py ...
[-- PYTEST_ARGS]`` (environment passes through, e.g. ``FML_TEST_DEVICE=cuda``; ``PYTEST_ARGS`` such as
``-m gpu -k "not fuzz"`` go to the collection and to every process).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--log-dir", default=".")
    ap.add_argument("--timeout", type=float, default=600.0)
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    logs = Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *extra,
                          *a.files],
                         capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    if not ids:
        print(out.stdout[-3000:], out.stderr[-3000:])
        return 1
    shards = [ids[i :: a.procs] for i in range(min(a.procs, len(ids)))]
    procs = []
    for i, shard in enumerate(shards):
        log = open(logs / f"shard{i}.log", "w")
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider", *extra, *shard]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.time() + a.timeout
    timed_out = False
    for p, log in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            timed_out = True
        log.close()
    counts: dict = {}
    failed = False
    for i in range(len(shards)):
        text = (logs / f"shard{i}.log").read_text()
        for line in text.splitlines():
            if line.startswith(("FAILED", "ERROR")):
                print(line)
                failed = True
        tail = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
        for k, v in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail[-1] if tail else ""):
            counts[v] = counts.get(v, 0) + int(k)
    print(f"{len(ids)} tests in {len(shards)} processes: {counts}" + (" -- TIMED OUT" if timed_out else ""))
    return 1 if failed or timed_out or counts.get("passed", 0) == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
