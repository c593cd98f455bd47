"""The OpenHands SDK LLM pointed at a graft session (import `llm` into your agent script).

With the env vars of `graft harness env openhands-sdk` set, `LLM.load_from_env()` builds
the same LLM.
"""

from openhands.sdk import LLM
from pydantic import SecretStr

llm = LLM(
    model="openai/{{model}}",
    base_url="{{base_url}}",
    api_key=SecretStr("{{api_key}}"),
    usage_id="graft",
)
