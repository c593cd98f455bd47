"""Drives graft's Anthropic Messages dialect (POST /v1/messages) with the real anthropic
Python SDK: a tool_use, then the final answer after the tool_result. Prints one JSON line.

usage: python anthropic_sdk.py MODE     MODE: json | stream
env:   GRAFT_BASE_URL (including /v1; the SDK wants it without, and appends /v1/messages),
       GRAFT_API_KEY (sent as x-api-key), GRAFT_SESSION (x-graft-session header when set),
       GRAFT_MODEL (default scripted).
`sent` holds the exact JSON bodies the SDK put on the wire (captured by an httpx hook).
"""

import json
import os
import sys

import anthropic
import httpx2  # anthropic 2.x is built on httpx2 and rejects httpx objects

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TOOL_OUTPUT = {"city": "Paris", "forecast": "sunny", "marker": "graft-weather-result"}


def client(sent: list) -> anthropic.Anthropic:
    def hook(request: httpx2.Request) -> None:
        if request.method == "POST":
            sent.append(json.loads(request.content))

    base = os.environ["GRAFT_BASE_URL"].rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base
    headers = {}
    if os.environ.get("GRAFT_SESSION"):
        headers["x-graft-session"] = os.environ["GRAFT_SESSION"]
    return anthropic.Anthropic(
        base_url=base,
        api_key=os.environ.get("GRAFT_API_KEY", "sk-ant-graft-test"),
        default_headers=headers,
        max_retries=0,
        timeout=60,
        http_client=httpx2.Client(event_hooks={"request": [hook]}),
    )


def summary(m) -> dict:
    return {
        "id": m.id,
        "type": m.type,
        "role": m.role,
        "model": m.model,
        "stop_reason": m.stop_reason,
        "content": [b.model_dump(exclude_none=True) for b in m.content],
        "text": "".join(b.text for b in m.content if b.type == "text"),
        "tool_uses": [
            {"id": b.id, "name": b.name, "input": b.input} for b in m.content if b.type == "tool_use"
        ],
        "usage": m.usage.model_dump(exclude_none=True) if m.usage else None,
    }


def call_json(c: anthropic.Anthropic, kw: dict) -> dict:
    return summary(c.messages.create(**kw))


def call_stream(c: anthropic.Anthropic, kw: dict) -> dict:
    events, text, partial_json = [], "", ""
    with c.messages.stream(**kw) as s:
        for ev in s:
            events.append(ev.type)
            if ev.type == "content_block_delta":
                if ev.delta.type == "text_delta":
                    text += ev.delta.text
                elif ev.delta.type == "input_json_delta":
                    partial_json += ev.delta.partial_json
        final = s.get_final_message()
    out = summary(final)
    out.update({"events": events, "delta_text": text, "delta_input_json": partial_json})
    return out


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in ("json", "stream"):
        raise SystemExit("usage: anthropic_sdk.py {json|stream}")
    mode = sys.argv[1]
    call = call_json if mode == "json" else call_stream
    sent: list = []
    c = client(sent)
    model = os.environ.get("GRAFT_MODEL", "scripted")
    messages = [{"role": "user", "content": f"graft-weather-ask ({mode}): what is the weather in Paris?"}]
    base = {"model": model, "max_tokens": 256, "system": "You are a test.", "tools": [WEATHER_TOOL]}
    first = call(c, {**base, "messages": messages})
    if len(first["tool_uses"]) != 1:
        raise SystemExit(f"expected one tool_use, got {first}")
    tu = first["tool_uses"][0]
    messages = messages + [
        {"role": "assistant", "content": first["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tu["id"], "content": json.dumps(TOOL_OUTPUT)}],
        },
    ]
    second = call(c, {**base, "messages": messages})
    out = {
        "client": "anthropic-python",
        "version": anthropic.__version__,
        "mode": mode,
        "sent": sent,
        "calls": [first, second],
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
