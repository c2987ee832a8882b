"""A page opened in headless Chromium over the Chrome DevTools Protocol (the `websockets` package):
its console errors and uncaught exceptions, JavaScript evaluated in it (values, not pixels), and a
screenshot. tests/test_report_browser.py and bench/report_screenshots.py use it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Page:
    """`Page(path)` loads a local file; `.errors` lists console errors and exceptions; `.eval(js)` returns
    the expression's value (JSON-serialisable)."""

    def __init__(self, path: Path, timeout: float = 30.0):
        from websockets.sync.client import connect

        self.profile = tempfile.mkdtemp(prefix="trainfit-chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.time() + timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.time() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("Chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(t for t in targets if t["type"] == "page")
        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=timeout))
        self.errors: list[str] = []
        self._id = 0
        for method in ("Runtime.enable", "Log.enable", "Page.enable"):
            self.call(method)
        self.call("Page.navigate", url=Path(path).resolve().as_uri())
        self._wait_event("Page.loadEventFired", timeout)

    def _handle(self, msg: dict) -> None:
        m, p = msg.get("method"), msg.get("params", {})
        if m == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.errors.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
        elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
        elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
            self.errors.append(f"{p['entry'].get('source')}: {p['entry'].get('text')} {p['entry'].get('url', '')}")

    def _wait_event(self, name: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.time())))
            self._handle(msg)
            if msg.get("method") == name:
                return
        raise TimeoutError(name)

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            self._handle(msg)
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def eval(self, expression: str):
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(res["exceptionDetails"].get("exception", {}).get("description", expression))
        return res["result"].get("value")

    def settle(self, seconds: float = 0.5) -> None:
        """Let the page's pending events (late console errors, image loads) arrive."""
        end = time.time() + seconds
        while time.time() < end:
            try:
                self._handle(json.loads(self.ws.recv(timeout=max(0.05, end - time.time()))))
            except TimeoutError:
                break

    def screenshot(self, out: Path, width: int = 1280, height: int = 2400, selector: str = "") -> Path:
        """The page (`height` CSS pixels of it, from the top or from `selector`'s element) as a PNG."""
        import base64

        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.settle(1.5)   # plotly redraws at the new width
        if selector:       # from the top of this element down
            rect = f"document.querySelector({json.dumps(selector)}).getBoundingClientRect()"
            top = self.eval(f"{rect}.top + window.scrollY")
            self.eval(f"window.scrollTo(0, {top} - 10)")
            self.settle(0.5)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_bytes(base64.b64decode(data))
        return Path(out)

    def close(self) -> None:
        try:
            if getattr(self, "_stack", None) is not None:
                self._stack.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def have_chromium() -> bool:
    return CHROMIUM is not None and os.access(CHROMIUM, os.X_OK)
