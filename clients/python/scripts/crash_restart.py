"""An experiment, not a test: an agent logs traces as fast as it can while
the server is SIGKILLed (a crash, not a graceful restart) and started again on
the same store; then count what was lost and what was stored twice.

    target/py-venv/bin/python clients/python/scripts/crash_restart.py 8

Each round can take two minutes: a batch whose request was cut by the crash
leaves its Idempotency-Key "in flight" on the server for 120 s
(IDEMPOTENCY_STALE_SECS), and the client retries (409) until it is released.
"""
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from conftest import REPO, CombeeServer  # noqa: E402

from combee import Combee  # noqa: E402

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
binary = Path(os.environ.get("COMBEE_BIN", REPO / "target" / "debug" / "combee"))
for r in range(rounds):
    d = Path(tempfile.mkdtemp())
    s = CombeeServer(binary, d)
    s.start()
    s.create_prompt("p", "base")
    c = Combee(s.url, s.admin_key, batch_size=50, flush_interval=0.01, max_backoff=1, timeout=2)
    logged: "list[str]" = []
    stop = threading.Event()
    def agent() -> None:
        while not stop.is_set():
            logged.append(c.log_trace("p", {"n": len(logged)}).external_id)
            time.sleep(0.0005)
    t = threading.Thread(target=agent); t.start()
    time.sleep(random.uniform(0.3, 1.0))
    s.stop(signal.SIGKILL)
    time.sleep(0.3)
    s.start()
    time.sleep(0.3)
    stop.set(); t.join()
    t0 = time.monotonic()
    ok = c.flush(timeout=200)
    took = time.monotonic() - t0
    c.close(timeout=1)
    stored = Counter(x["external_id"] for x in s.traces("p"))
    dup = sum(v - 1 for v in stored.values() if v > 1)
    lost = len(set(logged) - set(stored))
    print(f"round {r}: logged {len(logged)} stored {sum(stored.values())} lost {lost} duplicated {dup} flush_ok {ok} flush_s {took:.1f} retries {c.stats.retries}", flush=True)
    s.stop()
