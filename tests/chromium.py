"""A real browser for tests: headless Chromium (Debian's `chromium` package) driven
over its DevTools protocol with aiohttp's websocket client (installed with Ray).

`Browser()` starts one with a fresh profile (empty localStorage, as a first
visit); `open`, `wait_for` (a JavaScript expression becoming truthy),
`evaluate`, `click` (a link by its text) and `screenshot`; `close` ends it."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SKIP_REASON = (
    "no chromium on this machine (Debian: apt-get install -y chromium); the MLflow UI "
    "is checked in a real browser"
)


class Browser:
    def __init__(self, width: int = 1400, height: int = 1000, start_timeout_s: float = 60) -> None:
        assert CHROMIUM, SKIP_REASON
        self._profile = tempfile.mkdtemp(prefix="chromium-profile-")
        self._proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",  # as root (CI); the pages are the test's own loopback server
                "--disable-gpu",
                "--no-first-run",
                f"--window-size={width},{height}",
                f"--user-data-dir={self._profile}",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        ws_url = self._devtools_url(start_timeout_s)
        self._loop = asyncio.new_event_loop()
        self._next_id = 0
        self._session, self._ws = self._loop.run_until_complete(self._connect(ws_url))

    def _devtools_url(self, timeout_s: float) -> str:
        assert self._proc.stderr is not None
        deadline = time.monotonic() + timeout_s
        lines = []
        for line in self._proc.stderr:
            lines.append(line)
            found = re.search(r"DevTools listening on (ws://\S+)", line)
            if found:  # the rest of its stderr is drained, or a full pipe would stall it
                threading.Thread(target=self._proc.stderr.read, daemon=True).start()
                return found.group(1)
            if time.monotonic() > deadline:
                break
        self.close()
        raise RuntimeError("chromium did not start:\n" + "".join(lines[-20:]))

    async def _connect(self, browser_ws: str) -> tuple[Any, Any]:
        import aiohttp

        port = browser_ws.split(":")[2].split("/")[0]
        session = aiohttp.ClientSession()
        async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t["type"] == "page")
        ws = await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        return session, ws

    def _call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        my_id = self._next_id

        async def call() -> dict[str, Any]:
            await self._ws.send_json({"id": my_id, "method": method, "params": params})
            while True:
                message = await self._ws.receive_json(timeout=120)
                if message.get("id") == my_id:
                    if "error" in message:
                        raise RuntimeError(f"{method}: {message['error']}")
                    return message.get("result", {})

        return self._loop.run_until_complete(call())

    def open(self, url: str) -> None:
        self._call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self._call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float = 90, what: str = "") -> Any:
        """The value of `expression` once truthy (polled); AssertionError naming
        `what` and where the page is when it never becomes so."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"waited {timeout_s:.0f} s for {what or expression} at "
                    f"{self.evaluate('location.href')}; page text: "
                    f"{(self.evaluate('document.body.innerText') or '')[:600]!r}"
                )
            time.sleep(0.5)

    def click(
        self, link_text: str, href_part: str = "", selector: str = "a", timeout_s: float = 90
    ) -> str:
        """Click the first element of `selector` (links) whose text is `link_text`
        and whose href holds `href_part` (once there); its href."""
        text, part, css = json.dumps(link_text), json.dumps(href_part), json.dumps(selector)
        find = (
            f"[...document.querySelectorAll({css})].find(a => a.textContent.trim() === "
            f"{text} && (a.getAttribute('href') || '').includes({part}))"
        )
        self.wait_for(f"!!({find})", timeout_s, what=f"{selector} {link_text!r}")
        return self.evaluate(f"(() => {{ const a = {find}; a.click(); return a.href; }})()")

    def screenshot(self, path: str | Path) -> None:
        data = self._call("Page.captureScreenshot", format="png")["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if getattr(self, "_loop", None) is not None:
            self._loop.run_until_complete(self._ws.close())
            self._loop.run_until_complete(self._session.close())
            self._loop.close()
            self._loop = None
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
