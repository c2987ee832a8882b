"""Headless Chromium browsers running MiniWoB++ tasks (PyPI `miniwob`, Selenium), and a bounded pool of them.

    chrome, driver = locate_browser()          # MissingDependency (exit 2 at the CLI) names what to install
    pool = BrowserPool(size=4)
    with pool.hold("ep-1", "click-button") as (browser, intact):
        if not intact:                         # another episode used this browser since: rebuild the state
            browser.reset(seed=3, mode="train")
        obs, reward, done, info = browser.step(action)

A browser is one Chromium + chromedriver showing one task page; switching task loads the other page in
the same browser. chromedriver starts in a session of its own, so it and its whole Chromium tree (the
browser, zygotes, renderers, ~10 processes) are one process group: closing a browser quits it and then
ends whatever is left of that group, also when chromedriver crashed and its Chromium was orphaned.
Episodes do not own browsers: a browser remembers the last episode it served, and an episode that finds
its browser taken is rebuilt on a free one by resetting the same seed and replaying its actions (MiniWoB
tasks are generated from the seed; every reset loads the page afresh and screenshots are settled, so the
rebuilt screen is the same to the byte). So any number of concurrent episodes share `size` browsers;
with size >= concurrent episodes nothing is ever replayed.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from .cua_actions import Action

OS_PACKAGES = "apt-get install chromium chromium-driver"
PIP_EXTRA = "pip install 'trainfit[miniwob]'"
# MiniWoB's 10 s task timer measures the policy's speed (batched generation on the trainer), not the
# agent's: episodes get this much instead, and the service's own abandoned-episode timeout bounds them.
EPISODE_MAX_MS = 3_600_000
# Screenshots are taken of a settled page, so the same task, seed and actions give the same bytes
# whatever the machine's load: no CSS transition or animation and no jQuery effect is ever caught
# half-way, the text caret is not drawn (it blinks: a focused input would look different every 0.5 s;
# the focus ring still shows), and the capture waits for the page's load and two animation frames (a
# frame painted after the last change), not for a fixed time. Before those frames the page's background
# is changed for two frames and restored, which repaints the whole page at once: without it about one
# page load in 100 kept a part painted in two goes, and click-dialog's close and resize icons then
# differed by one grey level on 2-6 pixels until the next load (a hidden page would repaint too, but
# hiding it takes the focus away). With the repaint it still happened about once in 700 loads, for one
# capture only (the icon's image decoded after the repaint): so a capture counts once the next one, after
# another repaint, shows the same pixels (at most MAX_CAPTURES tries).
SETTLE_CSS = ("*, *::before, *::after { transition: none !important; animation: none !important; "
              "caret-color: transparent !important; }")
_SETTLE_JS = """
const done = arguments[arguments.length - 1];
if (!document.getElementById('trainfit-settle')) {
  const style = document.createElement('style');
  style.id = 'trainfit-settle';
  style.textContent = arguments[0];
  (document.head || document.documentElement).appendChild(style);
}
if (window.jQuery) { jQuery.fx.off = true; jQuery(':animated').finish(); }
const frames = () => requestAnimationFrame(() => requestAnimationFrame(() => done(true)));
const root = document.documentElement;
const repaint = () => {
  root.style.backgroundColor = 'rgb(254, 254, 254)';
  requestAnimationFrame(() => requestAnimationFrame(() => { root.style.backgroundColor = ''; frames(); }));
};
if (document.readyState === 'complete') { repaint(); } else { window.addEventListener('load', repaint, {once: true}); }
"""
SETTLE_TIMEOUT_S = 10
MAX_CAPTURES = 4


class MissingDependency(RuntimeError):
    """Chromium, chromedriver or the miniwob package is missing; the message says what to install."""


def locate_browser() -> tuple[str, str]:
    """(chromium, chromedriver) paths: $MINIWOB_CHROME_BINARY / $MINIWOB_CHROMEDRIVER, else the OS's."""
    chrome = os.environ.get("MINIWOB_CHROME_BINARY") or next(
        filter(None, (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = os.environ.get("MINIWOB_CHROMEDRIVER") or shutil.which("chromedriver")
    missing = [n for n, p in (("chromium", chrome), ("chromedriver", driver)) if not p or not os.path.exists(p)]
    if missing:
        raise MissingDependency(
            f"the MiniWoB++ environment needs a headless browser: {' and '.join(missing)} not found (looked at "
            f"$MINIWOB_CHROME_BINARY / $MINIWOB_CHROMEDRIVER and PATH). Install the OS packages: `{OS_PACKAGES}` "
            "(Debian/Ubuntu; as root), or point both variables at a Chrome and its matching chromedriver.")
    return chrome, driver


def import_miniwob():
    """The miniwob and gymnasium modules, with MiniWoB's environments registered."""
    try:
        import miniwob   # first: it brings gymnasium, so a missing extra is named as `miniwob`
        import gymnasium
    except ModuleNotFoundError as e:
        raise MissingDependency(f"the MiniWoB++ environment needs the `{e.name}` package: `{PIP_EXTRA}`.") from None
    gymnasium.register_envs(miniwob)
    _own_session()
    return miniwob, gymnasium


def _own_session() -> None:
    """Make miniwob start chromedriver in a new session (it builds Selenium's Service itself, with no
    way to pass Popen options): Chromium inherits the process group, which one killpg then ends."""
    from miniwob import selenium_instance

    base = selenium_instance.ChromeService
    if getattr(base, "own_session", False):
        return

    class OwnSessionService(base):
        own_session = True

        def __init__(self, *args, **kwargs):
            kwargs["popen_kw"] = {**(kwargs.get("popen_kw") or {}), "start_new_session": True}
            super().__init__(*args, **kwargs)

    selenium_instance.ChromeService = OwnSessionService


def task_names() -> set[str]:
    """MiniWoB++ task names (`click-button`, ...) that run in a 160x210 screen (FlightWoB excluded)."""
    _, gymnasium = import_miniwob()
    return {k[len("miniwob/"):-len("-v1")] for k in gymnasium.registry
            if k.startswith("miniwob/") and k.endswith("-v1") and "flight." not in k}


class Browser:
    """One headless Chromium showing one MiniWoB task page (MiniWoB's own environment class)."""

    def __init__(self, task: str):
        chrome, driver = locate_browser()
        # miniwob reads these to start chromedriver itself; without them Selenium Manager would try to
        # download a browser.
        os.environ["MINIWOB_CHROME_BINARY"], os.environ["MINIWOB_CHROMEDRIVER"] = chrome, driver
        _, gymnasium = import_miniwob()
        self.task = task
        self.env = gymnasium.make(f"miniwob/{task}-v1").unwrapped
        self.width = self.env.instance.task_width     # 160: screenshot pixels
        self.height = self.env.instance.task_height   # 210
        self.driver_process = self.env.instance.driver.service.process   # chromedriver (subprocess.Popen)
        group = os.getpgid(self.driver_process.pid)
        # Only a group of its own is ended wholesale (never the service's own group).
        self.group = group if group == self.driver_process.pid and group != os.getpgid(0) else None
        self.profile = _profile_dir(self.driver_process.pid)
        inst = self.env.instance
        inst.driver.set_script_timeout(SETTLE_TIMEOUT_S)
        capture = inst.get_observation

        def settled_observation(*args, **kwargs):   # miniwob observes right after acting: settle first
            self.settle()
            got = capture(*args, **kwargs)
            # A capture agreed by the next one (another repaint apart): a page caught while an image
            # was still being decoded after the repaint looks different once, then never again.
            for _ in range(MAX_CAPTURES - 1):
                self.settle()
                again = capture(*args, **kwargs)
                if _same_screen(got[0], again[0]):
                    return again
                got = again
            return got

        inst.get_observation = settled_observation

    def settle(self) -> None:
        """Animations off, then wait until the page has loaded, repainted whole, and painted two more frames."""
        self.env.instance.driver.execute_async_script(_SETTLE_JS, SETTLE_CSS)

    def retarget(self, task: str) -> None:
        """Load another task's page in this browser (no new Chromium)."""
        from miniwob.fields import get_field_extractor
        from miniwob.selenium_instance import DEFAULT_BASE_URL

        inst = self.env.instance
        inst.url = urllib.parse.urljoin(DEFAULT_BASE_URL, f"{task}.html")
        inst.field_extractor = get_field_extractor(task)
        self._load()
        self.env.subdomain = inst.subdomain = self.task = task

    def _load(self) -> None:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support import expected_conditions as EC
        from selenium.webdriver.support.wait import WebDriverWait

        inst = self.env.instance
        inst.driver.get(inst.url)
        WebDriverWait(inst.driver, 5).until(EC.element_to_be_clickable((By.ID, inst.SYNC_SCREEN_ID)))

    def reset(self, seed: int, mode: str = "train") -> dict:
        from miniwob.selenium_actions import execute_move_coords

        inst = self.env.instance
        # Every episode starts on a freshly loaded page: a page reused across episodes keeps traces of
        # the last one (enter-text's input and focus, layout leftovers a pixel wide), so the same seed
        # would look different after different histories, and a replay on another browser would differ.
        self._load()
        inst.driver.execute_script(f"core.EPISODE_MAX_TIME = {EPISODE_MAX_MS};")
        # Likewise the pointer: it stays where the last episode clicked, and the element under it would
        # show its :hover style on this episode's first screenshot. Park it outside the task's area.
        execute_move_coords(inst.inner_width - 1, inst.inner_height - 1, inst.driver)
        self.settle()   # before the task draws its page: nothing of it animates
        obs, _ = self.env.reset(seed=seed, options={"data_mode": mode})
        return obs

    def step(self, action: Action) -> tuple[dict, float, bool, dict]:
        """Apply one parsed action through MiniWoB's action space: (observation, reward, done, info).
        The reward is MiniWoB's raw reward (+1 success, -1 failure, partial credit on some tasks), not
        scaled by wall time."""
        from miniwob.action import ActionTypes

        kinds = {"click": ActionTypes.CLICK_COORDS, "double_click": ActionTypes.DBLCLICK_COORDS}
        if action.kind in kinds:
            a = self.env.create_action(kinds[action.kind], coords=_coords(action))
        elif action.kind == "scroll":
            kind = ActionTypes.SCROLL_UP_COORDS if action.text == "up" else ActionTypes.SCROLL_DOWN_COORDS
            a = self.env.create_action(kind, coords=_coords(action))
        elif action.kind == "type":
            a = self.env.create_action(ActionTypes.TYPE_TEXT, text=action.text)
        elif action.kind == "key":
            a = self.env.create_action(ActionTypes.PRESS_KEY, key=self.allowed_keys().index(action.text))
        else:
            raise ValueError(f"no MiniWoB action for {action.kind!r}")
        obs, _, done, _, info = self.env.step(a)
        return obs, float(info.get("raw_reward", 0.0)) if done else 0.0, bool(done), info

    def allowed_keys(self) -> tuple:
        return tuple(self.env.action_space_config.allowed_keys)

    def close(self) -> None:
        """Quit Chromium (it removes its temporary profile), then end what is left of its process group:
        a crashed chromedriver cannot quit it, and even a clean quit leaves processes exiting a while."""
        inst = self.env.instance
        if self.driver_process.poll() is None:
            try:
                inst.driver.quit()   # not env.close(): miniwob prints a traceback when quitting fails
            except Exception:  # noqa: BLE001 - a crashed browser may fail to quit; the group is ended below
                pass
        inst.died = True
        if self.group is not None:
            _end_group(self.group, self.driver_process)
        if self.profile and os.path.isdir(self.profile):
            shutil.rmtree(self.profile, ignore_errors=True)   # left behind by a Chromium that did not quit


def _profile_dir(driver_pid: int) -> Optional[str]:
    """The temporary --user-data-dir chromedriver gave its Chromium (None if not found or not temporary)."""
    import psutil

    try:
        for p in psutil.Process(driver_pid).children():
            for arg in p.cmdline():
                if arg.startswith("--user-data-dir="):
                    path = arg.split("=", 1)[1]
                    return path if os.path.dirname(path) == tempfile.gettempdir() else None
    except psutil.Error:
        pass
    return None


def _end_group(group: int, driver) -> None:
    """SIGKILL every process of the group and wait (up to 10 s) until none is left running."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):   # none left (or the id now belongs to someone else)
            return
        driver.poll()             # reap chromedriver, our child; init reaps the orphaned Chromium
        if not _running_in(group):
            return
        time.sleep(0.05)


def _running_in(group: int) -> bool:
    """Whether a process of the group still runs (zombies, dead and waiting to be reaped, do not count)."""
    import psutil

    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == group:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def _same_screen(a: dict, b: dict) -> bool:
    import numpy as np

    return np.array_equal(a["screenshot"], b["screenshot"])


def _coords(action: Action):
    import numpy as np

    return np.array([action.x, action.y], dtype=np.float32)


@dataclass
class _Slot:
    index: int
    browser: Optional[Browser] = None
    owner: Optional[str] = None        # the episode whose state the page shows
    busy: bool = False
    last_used: float = 0.0


class BrowserPool:
    """At most `size` browsers, made on first need and reused; a crashed one is replaced."""

    def __init__(self, size: int, make=Browser):
        if size < 1:
            raise ValueError("a browser pool needs size >= 1")
        self.slots = [_Slot(i) for i in range(size)]
        self.make = make
        self.cond = threading.Condition()
        self.started = self.replaced = self.replays = 0

    def _pick(self, episode: str, task: str) -> Optional[_Slot]:
        free = [s for s in self.slots if not s.busy]
        for s in free:
            if s.owner == episode:
                return s
        # Prefer browsers nobody needs back, on the right page; then the least recently used.
        free.sort(key=lambda s: (s.owner is not None, s.browser is None or s.browser.task != task, s.last_used))
        return free[0] if free else None

    @contextmanager
    def hold(self, episode: str, task: str, wait_s: float = 120.0) -> Iterator[tuple[Browser, bool]]:
        """A browser for `episode` on `task`'s page, and whether it still shows the episode's state.
        An exception inside the block counts as a browser crash: the browser is closed and replaced."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while (slot := self._pick(episode, task)) is None:
                if not self.cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"no free browser within {wait_s:g}s ({len(self.slots)} in the pool)")
            intact = slot.owner == episode and slot.browser is not None
            slot.busy, slot.owner = True, episode
        ok = False
        try:
            if slot.browser is None:
                slot.browser = self.make(task)
                self.started += 1
            elif slot.browser.task != task:
                slot.browser.retarget(task)
            yield slot.browser, intact
            ok = True
        finally:
            if not ok and slot.browser is not None:
                slot.browser.close()
                slot.browser = None
                self.replaced += 1
            with self.cond:
                slot.busy, slot.last_used = False, time.monotonic()
                if not ok:
                    slot.owner = None
                self.cond.notify_all()

    def disown(self, episode: str) -> None:
        """The episode is over: its browsers may go to anyone."""
        with self.cond:
            for s in self.slots:
                if s.owner == episode:
                    s.owner = None

    def stats(self) -> dict:
        with self.cond:
            return {"size": len(self.slots), "running": sum(s.browser is not None for s in self.slots),
                    "busy": sum(s.busy for s in self.slots), "started": self.started,
                    "replaced": self.replaced, "replays": self.replays}

    def close(self) -> None:
        with self.cond:
            for s in self.slots:
                if s.browser is not None:
                    s.browser.close()
                    s.browser = None
