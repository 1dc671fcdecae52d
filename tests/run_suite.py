"""Run the test suite one file per process and print one combined closing line.

Each file gets a fresh interpreter: the real-model files each load SmolLM2 (and some the
transformers reference), and XLA keeps every compiled program of a process alive, so one
process for all 500+ tests grew past 20 GB on the 24 GB CI machine. Extra arguments go to
every pytest call (e.g. ``-m "not slow"``).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    root = pathlib.Path(__file__).resolve().parent
    files = sorted(root.glob("test_*.py"))
    totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0, "deselected": 0}
    failing = []
    start = time.perf_counter()
    for path in files:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), *argv]
        proc = subprocess.run(cmd, cwd=root.parent, capture_output=True, text=True)
        out = proc.stdout + proc.stderr
        last = [line for line in out.splitlines() if line.strip()][-1:] or ["(no output)"]
        print(f"{path.name}: {last[0]}", flush=True)
        for count, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)",
                                      last[0]):
            totals["error" if word.startswith("error") else word] += int(count)
        if proc.returncode not in (0, 5):  # 5: every test of the file was deselected
            failing.append(path.name)
            print(out[-6000:], flush=True)
    minutes = (time.perf_counter() - start) / 60
    print(f"files with failures: {', '.join(failing) or 'none'} ({minutes:.1f} min)")
    print(f"{totals['passed']} passed, {totals['failed'] + totals['error']} failed, "
          f"{totals['skipped']} skipped")
    return 1 if failing or totals["passed"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
