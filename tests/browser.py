"""Headless Debian `chromium` driven over the DevTools protocol (websockets, no driver binary):
open a page with cookies or headers, collect console errors, take screenshots."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import websockets

from devstack.services import free_port

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"  # git-ignored


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, binary: str):
        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="tb-chromium-")
        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--remote-debugging-port={self.port}", "--remote-debugging-address=127.0.0.1",
             f"--user-data-dir={self.profile}", "--window-size=1280,900", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # its renderers and zygotes end with it (_stop)
        )  # fmt: skip
        try:
            self._connect()
        except BaseException:
            self._stop()
            raise

    def _connect(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                targets = httpx.get(f"http://127.0.0.1:{self.port}/json", timeout=2).json()
                self.ws_url = next(t for t in targets if t["type"] == "page")[
                    "webSocketDebuggerUrl"
                ]
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        self.loop = asyncio.new_event_loop()
        self.ws = self.loop.run_until_complete(websockets.connect(self.ws_url, max_size=2**26))
        self.ids = itertools.count(1)
        self.console_errors: list[str] = []
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")

    async def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        msg_id = next(self.ids)
        await self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        async with asyncio.timeout(60):  # a browser that never answers fails the test, not hangs
            return await self._answer(method, msg_id)

    async def _answer(self, method: str, msg_id: int) -> dict[str, Any]:
        while True:
            msg = json.loads(await self.ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)

    def _event(self, msg: dict[str, Any]) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.console_errors.append(json.dumps(params.get("args"))[:500])
        elif method == "Runtime.exceptionThrown":
            self.console_errors.append(json.dumps(params.get("exceptionDetails"))[:500])
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.console_errors.append(params["entry"].get("text", "")[:500])

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return self.loop.run_until_complete(self._call(method, params))

    def pump(self, seconds: float) -> None:
        async def drain() -> None:
            end = time.monotonic() + seconds
            while (left := end - time.monotonic()) > 0:
                try:
                    self._event(json.loads(await asyncio.wait_for(self.ws.recv(), left)))
                except TimeoutError:
                    return

        self.loop.run_until_complete(drain())

    def open(self, url: str, settle: float = 1.5) -> None:
        self.call("Page.navigate", url=url)
        self.pump(settle)

    def text(self, expression: str = "document.body.innerText") -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)[
            "result"
        ].get("value")

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path = ARTIFACTS / name
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.ws.close())
        finally:
            self.loop.close()
            self._stop()

    def _stop(self) -> None:
        # The process is always reaped: a Popen dropped while its child runs is a
        # ResourceWarning, which fails the test that made it. Chromium on a busy host may take
        # longer than the grace to exit; it is then killed with its process group. The leader
        # is reaped only after the last signal to its group: until then its pid, which is the
        # group's id, cannot be given to another process that a signal would reach.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        if not _exited(self.proc.pid, 10):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):  # a renderer that outlived the browser
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


def _exited(pid: int, timeout: float) -> bool:
    """Whether the child `pid` exits within `timeout`, left unreaped (a zombie keeps its pid)."""
    deadline = time.monotonic() + timeout
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
