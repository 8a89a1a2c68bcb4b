"""combee: the Python client of the combee prompt-learning service.

Fetch prompts (cached, revalidated in the background, with fallbacks when the
server is down) and log traces (batched by a background sender that retries
with idempotency keys and never blocks the agent)::

    from combee import Combee

    client = Combee("http://127.0.0.1:8080", api_key="cmb_…")
    prompt = client.get_prompt("support-agent", fallback="You are a support agent.")
    client.log_trace(prompt, input={"question": q}, output=answer, feedback={"success": True})
"""

from ._core import TraceHandle, TraceStats
from ._tracing import TraceContext
from .aio import AsyncCombee
from .client import Combee
from .errors import CombeeAPIError, CombeeError, CombeeUnavailable, MissingVariable
from .prompt import Arm, Prompt, placeholders

__all__ = [
    "Arm",
    "AsyncCombee",
    "Combee",
    "CombeeAPIError",
    "CombeeError",
    "CombeeUnavailable",
    "MissingVariable",
    "Prompt",
    "TraceContext",
    "TraceHandle",
    "TraceStats",
    "placeholders",
]
__version__ = "0.1.0"
