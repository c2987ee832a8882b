"""A pytest plugin that writes one JSON line per test outcome as it happens, so a run cut by its time
limit still names every test that failed before the cut (junit XML is written only at the end).

    python -m pytest -p bench.pytest_live --live-log tests.jsonl ...

Under pytest-xdist the controller receives every worker's reports through the same hook, so one
file holds the whole run. Lines: {"nodeid", "when", "outcome", "seconds", "gpu", "error"} (`gpu`: the test is gpu-marked), where `error` is
the first line of the failure that says what went wrong (the first `E   ` line, else the last line of
the report); passes are written too (without `error`), so what ran at all is known. One line
{"collected": N} says how many tests the run collected.

`--run-first tests/test_a.py,tests/test_b.py` moves the gpu-marked tests, then the tests of those
files (or node-id prefixes), to the front, the rest keeping their order: a run cut by its time limit
has run them. Under xdist every worker reorders its collection the same way, and the schedulers hand
tests out in that order.
"""

from __future__ import annotations

import json
import time

import pytest


def pytest_addoption(parser):
    parser.addoption("--live-log", default=None, help="append one JSON line per test outcome to this file")
    parser.addoption("--run-first", default="", help="comma-separated files or node-id prefixes whose tests run "
                                                     "first, after the gpu-marked ones")


def first_rank(item, prefixes: list[str]) -> int:
    """0: gpu-marked; 1: under one of `prefixes`; 2: the rest."""
    if item.get_closest_marker("gpu") is not None:
        return 0
    return 1 if any(item.nodeid.startswith(p) for p in prefixes) else 2


@pytest.hookimpl(trylast=True)   # after the suite's own hooks (tests/conftest.py marks skips): only the order changes
def pytest_collection_modifyitems(config, items):
    prefixes = [p.strip() for p in config.getoption("--run-first").split(",") if p.strip()]
    if prefixes:
        items[:] = sorted(items, key=lambda it: first_rank(it, prefixes))   # stable: the rest keep their order


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


class Collected:
    """The number of tests the run collected, as one line (under xdist, from the first worker)."""

    def __init__(self, log: LiveLog):
        self.log, self.done = log, False

    def say(self, n: int) -> None:
        if not self.done:
            self.done = True
            self.log.write(collected=n)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self.say(len(ids))

    @pytest.hookimpl
    def pytest_collection_finish(self, session):
        if not session.config.pluginmanager.has_plugin("dsession"):   # no xdist controller: items are here
            self.say(len(session.items))


def pytest_configure(config):
    path = config.getoption("--live-log")
    if path and not hasattr(config, "workerinput"):   # the xdist controller (or a plain run) writes
        log = LiveLog(path)
        config.pluginmanager.register(log, "trainfit-live-log")
        config.pluginmanager.register(Collected(log), "trainfit-live-collected")
