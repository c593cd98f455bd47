"""Drives graft's Anthropic Messages dialect through litellm's `anthropic/` route (non-stream,
with a tool). Prints one JSON line.

usage: python litellm_anthropic.py
env:   GRAFT_BASE_URL (including /v1; litellm gets it without and appends /v1/messages),
       GRAFT_API_KEY, GRAFT_SESSION (x-graft-session header when set), GRAFT_MODEL.
"""

import importlib.metadata
import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")

import litellm  # noqa: E402

litellm.telemetry = False

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def main() -> None:
    base = os.environ["GRAFT_BASE_URL"].rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base
    headers = {}
    if os.environ.get("GRAFT_SESSION"):
        headers["x-graft-session"] = os.environ["GRAFT_SESSION"]
    messages = [
        {"role": "system", "content": "You are a test."},
        {"role": "user", "content": "graft-weather-ask (litellm): what is the weather in Paris?"},
    ]
    r = litellm.completion(
        model=f"anthropic/{os.environ.get('GRAFT_MODEL', 'scripted')}",
        api_base=base,
        api_key=os.environ.get("GRAFT_API_KEY", "sk-ant-graft-test"),
        messages=messages,
        tools=[TOOL],
        max_tokens=256,
        extra_headers=headers or None,
        num_retries=0,
        timeout=60,
    )
    m = r.choices[0].message
    out = {
        "client": "litellm-anthropic",
        "version": importlib.metadata.version("litellm"),
        "sent_messages": messages,
        "id": r.id,
        "content": m.content,
        "tool_calls": [
            {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
            for tc in (m.tool_calls or [])
        ],
        "finish_reason": r.choices[0].finish_reason,
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
