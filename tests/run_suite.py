"""Run the test suite one file per process, read each file's junit XML, print one closing line.

Why one process per file: the real-model files each load SmolLM2 (and some the transformers
reference), and XLA keeps every compiled program of a process alive, so one process for all
500+ tests grew past 20 GB on the 24 GB CI machine.

Usage::

    python3 tests/run_suite.py                            # every tests/test_*.py
    python3 tests/run_suite.py -m "not slow"              # pytest options go to every file
    python3 tests/run_suite.py tests/test_mask.py test_tree.py 'tests/test_npu_*.py'
    python3 tests/run_suite.py tests/test_mask.py::test_one -x

Arguments ending in ``.py`` (globs allowed, relative to the working directory or to
``tests/``), ``file.py::node`` ids and directories select the files; everything else is
forwarded to every pytest call. Each file runs as::

    python -m pytest -q -p no:cacheprovider --junitxml=<tmp>/<file>.xml -rs
        --timeout=<per-test s> <file> <extra args>

Counts come from the junit XML, never from pytest's last output line. A file fails when a
test fails or errors, when it does not finish within the per-file limit, when pytest crashes
or exits non-zero without a failure in its report, or when it fails to collect. With
``CI=true`` a file whose tests are all skipped at import/collection time (a module-level
``pytest.importorskip``) or that collects no test at all also fails; outside CI that is a
loud warning. A file whose every test is deselected by ``-m``/``-k`` is fine.

Environment:
  EAGLEPANGU_FILE_TIMEOUT  wall-clock seconds per file (default 1800); over it the file's
                           process group is killed and the file counts as failed.
  EAGLEPANGU_TEST_TIMEOUT  per-test seconds for pytest-timeout (default 600).
  EAGLEPANGU_TEST_JOBS     files run at the same time (default 2); results print as files
                           finish, longest files start first (tests/durations.json,
                           else file size).
  EAGLEPANGU_RECORD_DURATIONS  ``1``: write this run's seconds per file into
                           tests/durations.json.
  CI                       ``true``/``1``/``yes``: collection-time skips and empty files fail.
  JAX_COMPILATION_CACHE_DIR  if unset, one temporary persistent compilation cache is shared
                           by all files of the run (with JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME
                           _SECS=0.5 and JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0) and
                           deleted at the end; if set, the caller's cache is used as is.

Exit status: 0 when nothing failed and something passed, 1 otherwise, 2 on bad arguments.
This module is also loaded into every child as a pytest plugin (``-p run_suite``) only to
record how many tests were collected and deselected (the XML does not say).
"""

from __future__ import annotations

import ast
import collections
import concurrent.futures
import dataclasses
import glob
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

TESTS = pathlib.Path(__file__).resolve().parent
REPO = TESTS.parent
DEFAULT_FILE_TIMEOUT = 1800.0
DEFAULT_TEST_TIMEOUT = 600.0
# Files run two at a time: most of a file's time is XLA compiling on one thread, so two files
# share two cores well; peak memory stays far under 24 GB (the real-model files use ~3-5 GB).
DEFAULT_JOBS = 2
DURATIONS = TESTS / "durations.json"  # seconds per file of a recorded run: the start order
LOG_TAIL = 8000
_STATS_ENV = "EAGLEPANGU_SUITE_STATS"  # child side: where the plugin writes its counts

# pytest options whose value may come as the next argument (so that value is not a file).
_VALUE_OPTIONS = {
    "-m",
    "-k",
    "-p",
    "-W",
    "-o",
    "-c",
    "-n",
    "--timeout",
    "--timeout-method",
    "--maxfail",
    "--deselect",
    "--ignore",
    "--ignore-glob",
    "--rootdir",
    "--basetemp",
    "--durations",
    "--durations-min",
    "--junitxml",
    "--junit-xml",
    "--junit-prefix",
    "--confcutdir",
    "--tb",
    "--capture",
    "--import-mode",
    "--override-ini",
    "--log-level",
    "--log-cli-level",
    "--log-file",
    "--log-format",
    "--color",
    "--code-highlight",
    "--pastebin",
    "--hypothesis-profile",
    "--hypothesis-seed",
    "--hypothesis-verbosity",
    "--dist",
    "--config-file",
    "--inifile",
    "--show-capture",
}
_GLOB_CHARS = set("*?[")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


# --------------------------------------------------------------------------------------------
# Child side: a tiny pytest plugin (loaded with ``-p run_suite``).

_plugin_counts = {"collected": 0, "deselected": 0, "running": None}


def pytest_deselected(items):  # pragma: no cover - runs inside the child pytest
    _plugin_counts["deselected"] += len(items)


def pytest_collection_finish(session):  # pragma: no cover - runs inside the child pytest
    _plugin_counts["collected"] = len(session.items) + _plugin_counts["deselected"]


def pytest_runtest_logstart(nodeid, location):  # pragma: no cover - inside the child
    _plugin_counts["running"] = nodeid


def pytest_runtest_logfinish(nodeid, location):  # pragma: no cover - inside the child
    _plugin_counts["running"] = None


def pytest_sessionfinish(session, exitstatus):  # pragma: no cover - runs inside the child
    path = os.environ.get(_STATS_ENV)
    if path:
        pathlib.Path(path).write_text(json.dumps(_plugin_counts))


# --------------------------------------------------------------------------------------------
# Harness side.


@dataclasses.dataclass
class FileResult:
    name: str
    seconds: float = 0.0
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    deselected: int = 0
    skips: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    problems: list[str] = dataclasses.field(default_factory=list)  # make the file fail
    warnings: list[str] = dataclasses.field(default_factory=list)  # loud, but not fatal
    failing_tests: list[str] = dataclasses.field(default_factory=list)
    log: str = ""

    @property
    def bad(self) -> bool:
        return bool(self.problems or self.failed or self.errors)


def _usage_error(message: str) -> None:
    print(f"run_suite: {message}", file=sys.stderr)
    raise SystemExit(2)


def _split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split the command line into file selectors and arguments forwarded to pytest."""
    selectors, forwarded = [], []
    expect_value = False
    for arg in argv:
        if expect_value:
            forwarded.append(arg)
            expect_value = False
        elif arg.startswith("-"):
            forwarded.append(arg)
            expect_value = "=" not in arg and arg in _VALUE_OPTIONS
        else:
            head = arg.split("::", 1)[0]
            if head.endswith(".py") or _GLOB_CHARS & set(head) or os.path.isdir(head):
                selectors.append(arg)
            else:
                forwarded.append(arg)
    return selectors, forwarded


def _resolve(selectors: list[str]) -> dict[pathlib.Path, list[str]]:
    """Map each selected file to what pytest gets for it (the file, or its node ids)."""
    if not selectors:
        return {path: [str(path)] for path in sorted(TESTS.glob("test_*.py"))}
    chosen: dict[pathlib.Path, list[str]] = {}
    for sel in selectors:
        head, sep, node = sel.partition("::")
        matches: list[pathlib.Path] = []
        for base in (pathlib.Path.cwd(), TESTS):
            pattern = head if os.path.isabs(head) else str(base / head)
            found = sorted(pathlib.Path(p) for p in glob.glob(pattern))
            for path in found:
                matches += sorted(path.glob("test_*.py")) if path.is_dir() else [path]
            if matches:
                break
        matches = [m.resolve() for m in matches if m.is_file()]
        if not matches:
            _usage_error(f"no test file matches {sel!r}")
        for path in matches:
            if not sep:
                chosen[path] = [str(path)]
            elif chosen.get(path) != [str(path)]:  # a whole file beats its node ids
                chosen.setdefault(path, []).append(f"{path}::{node}")
    return dict(sorted(chosen.items()))


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the child and everything it started (it leads its own process group).

    SIGINT first: pytest then prints where it was stuck and still writes its junit report.
    """
    for sig, grace in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _is_collection_case(case: ET.Element, outcome: ET.Element | None, stem: str) -> bool:
    """A testcase pytest wrote for the module's collection report, not for a test.

    pytest marks those ``<skipped message="collection skipped">`` / ``<error
    message="collection failure">``; besides, node ``dir/test_x.py`` becomes classname
    ``dir``, name ``test_x``, while a test ``dir/test_x.py::test_a`` becomes classname
    ``dir.test_x``, name ``test_a``.
    """
    if outcome is not None and outcome.get("message") in (
        "collection skipped",
        "collection failure",
    ):
        return True
    classname = case.get("classname", "")
    return case.get("name") == stem and stem not in classname.split(".")


def _skip_reason(skipped: ET.Element) -> str:
    """The reason of a ``<skipped>``; a collection skip keeps it in the text, as a tuple."""
    reason = skipped.get("message", "")
    if reason == "collection skipped":
        try:
            reason = str(ast.literal_eval((skipped.text or "").strip())[2])
        except (ValueError, SyntaxError, IndexError, TypeError):
            reason = (skipped.text or reason).strip()
        reason = reason.removeprefix("Skipped: ")
    reason = reason or "(no reason given)"
    if skipped.get("type") == "pytest.xfail":
        reason = f"[xfail] {reason}"
    return reason


def _read_report(
    result: FileResult, xml_path: pathlib.Path, stem: str
) -> tuple[int, list[str], list[str], bool]:
    """Fill the counts from the junit XML.

    Returns (tests, collection skip reasons, collection errors, whether the last testcase
    counted as passed: an interrupted test is written without an outcome, like a pass).
    """
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tests, collect_skips, collect_errors, last_passed = 0, [], [], False
    for suite in suites:
        for case in suite.iter("testcase"):
            tests += 1
            label = "::".join(filter(None, (case.get("classname"), case.get("name"))))
            failure, error = case.find("failure"), case.find("error")
            skipped = case.find("skipped")
            outcome = next((e for e in (failure, error, skipped) if e is not None), None)
            last_passed = outcome is None
            collecting = _is_collection_case(case, outcome, stem)
            if failure is not None:
                result.failed += 1
                result.failing_tests.append(f"FAILED {label}: {failure.get('message', '')}")
            elif error is not None:
                message = error.get("message", "")
                if collecting:
                    collect_errors.append(f"{message}\n{(error.text or '').strip()[-1500:]}")
                    result.failing_tests.append(f"COLLECTION ERROR {label}: {message}")
                else:
                    result.failing_tests.append(f"ERROR {label}: {message}")
                result.errors += 1
            elif skipped is not None:
                reason = _skip_reason(skipped)
                result.skipped += 1
                result.skips[reason] += 1
                if collecting:
                    collect_skips.append(reason)
            else:
                result.passed += 1
            if failure is not None and error is not None:  # failed, then teardown errored too
                result.failing_tests.append(f"ERROR {label} (teardown): {error.get('message')}")
    return tests, collect_skips, collect_errors, last_passed


def _read_stats(path: pathlib.Path) -> dict:
    """What the child plugin recorded (empty when it wrote nothing)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _run_file(
    path: pathlib.Path,
    targets: list[str],
    forwarded: list[str],
    workdir: pathlib.Path,
    env: dict[str, str],
    file_timeout: float,
    test_timeout: float | None,
    ci: bool,
) -> FileResult:
    result = FileResult(path.name)
    stem = path.stem
    xml_path = workdir / f"{path.name}.xml"
    stats_path = workdir / f"{path.name}.stats.json"
    log_path = workdir / f"{path.name}.log"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "run_suite",
        f"--junitxml={xml_path}",
        "-rs",
    ]
    if test_timeout is not None:
        cmd.append(f"--timeout={test_timeout:g}")
    cmd += [*targets, *forwarded]
    child_env = dict(env, **{_STATS_ENV: str(stats_path)})
    start = time.perf_counter()
    timed_out = False
    with open(log_path, "wb") as log:
        # Output goes to a file, not a pipe: a grandchild that outlives pytest (a notebook
        # kernel) cannot then hang the harness.
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=file_timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
        except BaseException:
            _kill_group(proc)
            raise
    result.seconds = time.perf_counter() - start
    result.log = log_path.read_text(errors="replace")

    if timed_out:
        result.problems.append(
            f"TIMEOUT: still running after {file_timeout:g} s (the per-file limit, "
            f"EAGLEPANGU_FILE_TIMEOUT); it was interrupted/killed and the file counts as "
            f"failed"
        )
        result.failed += 1
        stats = _read_stats(stats_path)
        if xml_path.is_file():  # interrupted pytest still reports the tests it finished
            try:
                last_passed = _read_report(result, xml_path, stem)[3]
            except ET.ParseError:
                last_passed = False
            if stats.get("running") and last_passed:
                result.passed -= 1  # the stuck test: written without an outcome
        if stats.get("running"):
            result.problems.append(f"the test running at the limit: {stats['running']}")
        return result
    if not xml_path.is_file():
        result.problems.append(
            f"pytest exited with code {rc} and wrote no junit report (crashed or killed?)"
        )
        result.failed += 1
        return result
    try:
        tests, collect_skips, collect_errors, _ = _read_report(result, xml_path, stem)
    except ET.ParseError as err:
        result.problems.append(f"unreadable junit report ({err}); pytest exit code {rc}")
        result.failed += 1
        return result
    stats = _read_stats(stats_path)
    result.deselected = int(stats.get("deselected", 0))

    for error in collect_errors:
        result.problems.append(f"COLLECTION ERROR: {error}")
    ran = result.passed + result.failed + result.errors
    if collect_skips and ran == 0:
        reasons = "; ".join(sorted(set(collect_skips)))
        message = f"every test skipped at import/collection time: {reasons}"
        if ci:
            result.problems.append(f"CI=true: {message}")
            result.skipped -= len(collect_skips)
            result.failed += len(collect_skips)
        else:
            result.warnings.append(f"{message} (fails under CI=true)")
    elif tests == 0:
        collected = stats.get("collected")
        if result.deselected and collected == result.deselected:
            pass  # every test deselected by -m/-k: what "-m 'not slow'" is for
        elif collected is None and rc == 5 and forwarded:
            result.warnings.append("no test ran (exit code 5); probably all deselected")
        else:
            message = f"no test collected (pytest exit code {rc})"
            if ci:
                result.problems.append(f"CI=true: {message}")
                result.failed += 1
            else:
                result.warnings.append(f"{message} (fails under CI=true)")
    elif result.skipped == tests:
        result.warnings.append(f"all {tests} tests skipped")
    if rc not in (0, 5) and not (result.failed or result.errors or result.problems):
        result.problems.append(f"pytest exited with code {rc} but its report lists no failure")
        result.failed += 1
    return result


def _print_file(result: FileResult) -> None:
    line = (
        f"{result.name:<32} {result.passed:4d} passed {result.failed:3d} failed "
        f"{result.errors:3d} errors {result.skipped:3d} skipped"
    )
    if result.deselected:
        line += f" {result.deselected:3d} deselected"
    line += f"  {result.seconds:7.1f} s"
    if result.bad:
        line += "  <-- FAILED"
    print(line, flush=True)
    for reason, count in sorted(result.skips.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"    skipped {count}x: {reason}")
    for warning in result.warnings:
        print(f"    WARNING: {warning}")
    for problem in result.problems:
        print(f"    FAILURE: {problem}")
    for entry in result.failing_tests[:50]:
        print(f"    {(entry.splitlines() or [''])[0][:300]}")
    if result.bad:
        print(f"---- last {LOG_TAIL} characters of {result.name}'s output ----")
        print(result.log[-LOG_TAIL:])
        print(f"---- end of {result.name} ----", flush=True)
    sys.stdout.flush()


def _recorded_durations() -> dict[str, float]:
    """Seconds per file from :data:`DURATIONS` (written by a run with
    ``EAGLEPANGU_RECORD_DURATIONS=1``); only used to order the files."""
    try:
        data = json.loads(DURATIONS.read_text())
        return {str(k): float(v) for k, v in data.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def _record_durations(results: list[FileResult]) -> None:
    data = _recorded_durations()
    data.update({r.name: round(r.seconds, 1) for r in results})
    DURATIONS.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        _usage_error(f"{name}={raw!r} is not a number of seconds")
    if value <= 0:
        _usage_error(f"{name} must be positive, got {raw!r}")
    return value


def main(argv: list[str]) -> int:
    ci = _truthy(os.environ.get("CI"))
    file_timeout = _float_env("EAGLEPANGU_FILE_TIMEOUT", DEFAULT_FILE_TIMEOUT)
    jobs = max(1, int(_float_env("EAGLEPANGU_TEST_JOBS", DEFAULT_JOBS)))
    test_timeout: float | None = _float_env("EAGLEPANGU_TEST_TIMEOUT", DEFAULT_TEST_TIMEOUT)
    selectors, forwarded = _split_args(argv)
    files = _resolve(selectors)
    if not files:
        print("run_suite: no test files found", file=sys.stderr)
        return 1
    if importlib.util.find_spec("pytest_timeout") is None:
        message = (
            "pytest-timeout is not installed (pip install 'pytest-timeout>=2.3', or the "
            "'test' extra); tests have no per-test limit, only the per-file one"
        )
        if ci:
            print(f"run_suite: ERROR: {message}", file=sys.stderr)
            return 2
        print(f"run_suite: WARNING: {message}", flush=True)
        test_timeout = None

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="eaglepangu-suite-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        cache_note = f"caller's JAX cache {env['JAX_COMPILATION_CACHE_DIR']}"
    else:
        cache = workdir / "jax-cache"
        cache.mkdir()
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
        cache_note = f"shared JAX cache {cache} (deleted at the end)"
    print(
        f"run_suite: {len(files)} files, {jobs} at a time, per-file limit {file_timeout:g} s, "
        f"per-test limit "
        f"{'none' if test_timeout is None else f'{test_timeout:g} s'}, CI={ci}, {cache_note}"
        + (f", pytest args {forwarded}" if forwarded else ""),
        flush=True,
    )

    results: list[FileResult] = []
    start = time.perf_counter()
    # Longest files first (by the recorded durations, else by size) so that the last ones to
    # finish are short and the two workers end together.
    known = _recorded_durations()
    order = sorted(
        files.items(),
        key=lambda item: (-known.get(item[0].name, 0.0), -item[0].stat().st_size),
    )
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [
                pool.submit(
                    _run_file,
                    path,
                    targets,
                    forwarded,
                    workdir,
                    env,
                    file_timeout,
                    test_timeout,
                    ci,
                )
                for path, targets in order
            ]
            for future in concurrent.futures.as_completed(futures):
                result = future.result()
                results.append(result)
                _print_file(result)
    except KeyboardInterrupt:
        print("run_suite: interrupted", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    minutes = (time.perf_counter() - start) / 60
    if _truthy(os.environ.get("EAGLEPANGU_RECORD_DURATIONS")):
        _record_durations(results)

    passed = sum(r.passed for r in results)
    failed = sum(r.failed + r.errors for r in results)
    skipped = sum(r.skipped for r in results)
    bad = [r for r in results if r.bad]
    warned = [r for r in results if r.warnings]
    print()
    if warned:
        print("WARNINGS:")
        for r in warned:
            for warning in r.warnings:
                print(f"  {r.name}: {warning}")
    print(f"files with failures: {', '.join(r.name for r in bad) or 'none'}")
    if bad:
        for r in bad:
            for problem in r.problems:
                print(f"  {r.name}: {problem.splitlines()[0]}")
    print(f"total {minutes:.1f} min for {len(results)} files")
    print(f"{passed} passed, {failed} failed, {skipped} skipped", flush=True)
    return 1 if bad or failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
