"""Fixtures of the ecosystem tests: the real combee server (the binary at
$COMBEE_BIN, `serve --role api`, a temporary SQLite store, a free loopback
port) and the project's LLM simulator (`combee sim-llm`, an OpenAI-compatible
SIMULATION standing in for the model the agents call); a runner for the agent
scripts in agents/ (Python, in this venv) and node/ (Node.js, from
$COMBEE_ECO_NODE_DIR where scripts/test-ecosystem installed the npm packages),
each in a fresh process, configured by environment variables only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import httpx
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
QUESTIONS = [
    "Where is order 1001?",
    "Can I return shoes after 40 days?",
    "How do I reset my password?",
    "Do you ship to Norway?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def binary() -> Path:
    path = Path(os.environ.get("COMBEE_BIN", REPO / "target" / "debug" / "combee"))
    if not path.exists():
        pytest.fail(f"no combee binary at {path}: run scripts/test-ecosystem (it builds one) or set COMBEE_BIN")
    return path


def clean_env() -> Dict[str, str]:
    """This process's environment without anything that would steer combee,
    an OpenTelemetry SDK, an OpenAI client or a Langfuse SDK elsewhere."""
    prefixes = ("COMBEE", "DATABASE_URL", "OPENAI_", "OTEL_", "LANGFUSE_", "TRACELOOP_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def wait_until(check, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Process:
    """A child process with its output in a log file, stopped on `stop()`."""

    def __init__(self, args: List[str], env: Dict[str, str], cwd: Path, log: Path) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.proc.args[1]} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


class Combee:
    """A running combee server with its admin key."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = clean_env()
        env.update(
            COMBEE__DATABASE__DATA_DIR=str(data_dir),
            COMBEE_CONFIG_DIR=str(data_dir / "no-config"),
            COMBEE__LOG__LEVEL="warn",
        )
        args = [str(binary()), "serve", "--bind", f"127.0.0.1:{self.port}", "--role", "api"]
        self.process = Process(args, env, data_dir, data_dir / "server.log")
        wait_until(self._ready, 30, f"combee on port {self.port}")
        self.admin_key = (data_dir / "admin-key").read_text().strip()

    def _ready(self) -> bool:
        self.process.alive()
        try:
            return httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.admin_key}", **kw.pop("headers", {})}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kw)

    def create_prompt(self, name: str, base: str = "You are a support agent for {topic}.") -> None:
        res = self.api("POST", "/v1/prompts", json={"name": name, "base": base, "promotion": "auto"})
        assert res.status_code == 201, res.text

    def add_version(self, name: str, base: str) -> int:
        res = self.api("POST", f"/v1/prompts/{name}/versions", json={"base": base, "message": "briefer"})
        assert res.status_code == 201, res.text
        return int(res.json()["number"])

    def key(self, *scopes: str) -> str:
        res = self.api("POST", "/v1/keys", json={"name": "ecosystem", "scopes": list(scopes)})
        assert res.status_code == 201, res.text
        return str(res.json()["secret"])

    def traces(self, prompt: str) -> List[Dict[str, Any]]:
        res = self.api("GET", "/v1/traces", params={"prompt": prompt, "page_size": 200})
        assert res.status_code == 200, res.text
        return list(res.json()["traces"])


@pytest.fixture(scope="session")
def combee(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Combee]:
    server = Combee(tmp_path_factory.mktemp("combee"))
    yield server
    server.process.stop()


@pytest.fixture(scope="session")
def simulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The OpenAI-compatible base URL of the LLM SIMULATION."""
    port = free_port()
    work = tmp_path_factory.mktemp("sim")
    sim = Process([str(binary()), "sim-llm", "--bind", f"127.0.0.1:{port}"], clean_env(), work, work / "sim.log")

    def ready() -> bool:
        sim.alive()
        try:
            return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, 30, "the LLM simulator")
    yield f"http://127.0.0.1:{port}/v1"
    sim.stop()


def run_agent(script: str, args: List[str], env: Dict[str, str]) -> Dict[str, Any]:
    """Runs one agent script in a fresh process (Python from agents/, Node.js
    from the installed node directory) and returns the JSON of its last line."""
    full = clean_env()
    full.update(env)
    if script.endswith(".mjs"):
        node_dir = os.environ.get("COMBEE_ECO_NODE_DIR")
        if not node_dir:
            pytest.fail("COMBEE_ECO_NODE_DIR is unset: run the ecosystem tests with scripts/test-ecosystem")
        cmd, cwd = ["node", script, *args], Path(node_dir)
    else:
        cmd, cwd = [sys.executable, script, *args], HERE / "agents"
    done = subprocess.run(cmd, env=full, cwd=cwd, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        raise AssertionError(f"{script} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{script} printed no result:\n{done.stdout}\n{done.stderr[-2000:]}"
    return dict(json.loads(lines[-1]))


def otlp_env(server: Combee, key: str, simulator: str, prompt: Optional[str]) -> Dict[str, str]:
    """What the README tells an OpenTelemetry user to set, and the model's address."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"{server.url}/v1/otlp",
        "OTEL_EXPORTER_OTLP_HEADERS": f"Authorization=Bearer%20{key}",
        "OPENAI_BASE_URL": simulator,
        "OPENAI_API_KEY": "simulation",
    }
    if prompt:
        env["OTEL_RESOURCE_ATTRIBUTES"] = f"combee.prompt={prompt}"
    return env


def text_of(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def assert_one_trace_per_call(traces: List[Dict[str, Any]], questions: List[str] = QUESTIONS) -> None:
    """Each model call became one trace holding its question and an answer."""
    assert len(traces) == len(questions), [t["input"] for t in traces]
    for question in questions:
        matching = [t for t in traces if question in text_of(t["input"])]
        assert len(matching) == 1, f"{question!r} is in {len(matching)} trace inputs: {[t['input'] for t in traces]}"
        t = matching[0]
        assert "simulated" in text_of(t["output"]), f"no answer in the output of {t}"
        assert t["status"] == "pending"
        assert "You are a support agent" not in text_of(t["input"]), "the system prompt is no part of the task input"
