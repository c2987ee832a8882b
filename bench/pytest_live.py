"""A pytest plugin that writes one JSON line per test outcome as it happens, so a run cut by its time
limit still names every test that failed before the cut (junit XML is written only at the end).

    python -m pytest -p bench.pytest_live --live-log tests.jsonl ...

Under pytest-xdist the controller receives every worker's reports through the same hook, so one
file holds the whole run. Lines: {"nodeid", "when", "outcome", "seconds", "gpu", "error"} (`gpu`: the test is gpu-marked), where `error` is
the first line of the failure that says what went wrong (the first `E   ` line, else the last line of
the report); passes are written too (without `error`), so what ran at all is known.
"""

from __future__ import annotations

import json
import time

import pytest


def pytest_addoption(parser):
    parser.addoption("--live-log", default=None, help="append one JSON line per test outcome to this file")


def first_error(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    for x in lines:
        if x.startswith("E "):
            return x[1:].strip()[:400]
    return (lines[-1] if lines else "")[:400]


class LiveLog:
    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)   # line-buffered: each outcome reaches the disk at once

    def write(self, **row) -> None:
        self.f.write(json.dumps({**row, "t": round(time.time(), 1)}) + "\n")

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        # A test's outcome is its call phase, or a setup/teardown phase that did not pass (fixture errors).
        if report.when != "call" and report.passed:
            return
        outcome = "skipped" if report.skipped else report.outcome
        if report.when != "call" and report.failed:
            outcome = "error"
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        row = {"nodeid": report.nodeid, "when": report.when, "outcome": outcome,
               "seconds": round(report.duration, 2), "gpu": "gpu" in report.keywords}
        if report.failed:
            row["error"] = first_error(report.longreprtext)
        self.write(**row)

    @pytest.hookimpl
    def pytest_collectreport(self, report):
        if report.failed:
            self.write(nodeid=report.nodeid, when="collect", outcome="error", seconds=0.0,
                       error=first_error(report.longreprtext))


def pytest_configure(config):
    path = config.getoption("--live-log")
    if path and not hasattr(config, "workerinput"):   # the xdist controller (or a plain run) writes
        config.pluginmanager.register(LiveLog(path), "trainfit-live-log")
