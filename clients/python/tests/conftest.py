"""Runs the real combee server for the client tests: the binary at
``$COMBEE_BIN`` (default ``target/debug/combee``; this builds nothing), on a
free loopback port with a temporary SQLite store, ready once ``/readyz`` says so."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Polls ``check`` until it returns something truthy, or fails the test."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


class CombeeServer:
    """One ``combee serve`` process; ``stop()`` and ``start()`` again reuse the
    same port and the same store."""

    def __init__(self, binary: Path, data_dir: Path) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        self.log_path = data_dir / "server.log"
        self.admin_key = ""

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COMBEE", "DATABASE_URL", "OPENAI_"))}
        env.update(
            COMBEE__DATABASE__DATA_DIR=str(self.data_dir),
            COMBEE_CONFIG_DIR=str(self.data_dir / "no-config"),
            COMBEE__LOG__LEVEL="warn",
        )
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(self.binary), "serve", "--bind", f"127.0.0.1:{self.port}", "--role", "api"],
            env=env, cwd=self.data_dir, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        wait_until(self._ready, timeout=30, what=f"combee on port {self.port} to be ready")
        self.admin_key = (self.data_dir / "admin-key").read_text().strip()

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"combee exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        self.proc = None

    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """A request with the admin key (for setting up and checking)."""
        headers = {"Authorization": f"Bearer {self.admin_key}", **kw.pop("headers", {})}
        return httpx.request(method, self.url + path, headers=headers, timeout=10, **kw)

    def create_prompt(self, name: str, base: str) -> Dict[str, Any]:
        res = self.api("POST", "/v1/prompts", json={"name": name, "base": base})
        assert res.status_code == 201, res.text
        return dict(res.json())

    def new_production_version(self, name: str, base: str) -> int:
        res = self.api("POST", f"/v1/prompts/{name}/versions", json={"base": base, "labels": ["production"]})
        assert res.status_code == 201, res.text
        return int(res.json()["number"])

    def traces(self, prompt: str) -> List[Dict[str, Any]]:
        """Every stored trace of a prompt (all pages)."""
        out: List[Dict[str, Any]] = []
        token: Optional[str] = None
        while True:
            params: Dict[str, Any] = {"prompt": prompt, "page_size": 200}
            if token:
                params["page_token"] = token
            res = self.api("GET", "/v1/traces", params=params)
            assert res.status_code == 200, res.text
            page = res.json()
            out.extend(page["traces"])
            token = page.get("next_page_token")
            if not token:
                return out


@pytest.fixture
def server(tmp_path: Path) -> Iterator[CombeeServer]:
    binary = Path(os.environ.get("COMBEE_BIN", REPO / "target" / "debug" / "combee"))
    if not binary.exists():
        pytest.fail(f"no combee binary at {binary}: run `cargo build --bin combee` or set COMBEE_BIN")
    s = CombeeServer(binary, tmp_path)
    s.start()
    yield s
    s.stop()


class RequestLog:
    """Every request an httpx client sent and the status it got (an event hook)."""

    def __init__(self) -> None:
        self.entries: List[Dict[str, Any]] = []

    def on_request(self, request: httpx.Request) -> None:
        self.entries.append({"method": request.method, "path": request.url.path, "headers": dict(request.headers), "status": None})

    def on_response(self, response: httpx.Response) -> None:
        for e in reversed(self.entries):
            if e["path"] == response.request.url.path and e["status"] is None:
                e["status"] = response.status_code
                e["replayed"] = response.headers.get("idempotent-replayed") == "true"
                break

    async def aon_request(self, request: httpx.Request) -> None:
        self.on_request(request)

    async def aon_response(self, response: httpx.Response) -> None:
        self.on_response(response)

    def matching(self, method: str, path_prefix: str) -> List[Dict[str, Any]]:
        return [e for e in self.entries if e["method"] == method and e["path"].startswith(path_prefix)]

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(event_hooks={"request": [self.on_request], "response": [self.on_response]}, **kw)

    def async_client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"request": [self.aon_request], "response": [self.aon_response]}, **kw)


@pytest.fixture
def requests_log() -> RequestLog:
    return RequestLog()
