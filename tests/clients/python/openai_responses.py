"""Drives graft's Responses dialect (POST /v1/responses) with the real openai Python SDK:
a function call, then the final answer after the tool output. Prints one JSON line.

usage: python openai_responses.py MODE     MODE: json | stream
env:   GRAFT_BASE_URL (including /v1), GRAFT_API_KEY, GRAFT_SESSION (x-graft-session header
       when set), GRAFT_MODEL (default scripted).
`sent` holds the exact JSON bodies the SDK put on the wire (captured by an httpx hook).
The scripted upstream (tests/clients/script.json) answers "graft-weather-ask" with a
get_weather call and a tool output containing "graft-weather-result" with the final text.
"""

import json
import os
import sys

import httpx
import openai

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TOOL_OUTPUT = {"city": "Paris", "forecast": "sunny", "marker": "graft-weather-result"}


def client(sent: list) -> openai.OpenAI:
    def hook(request: httpx.Request) -> None:
        if request.method == "POST":
            sent.append(json.loads(request.content))

    headers = {}
    if os.environ.get("GRAFT_SESSION"):
        headers["x-graft-session"] = os.environ["GRAFT_SESSION"]
    return openai.OpenAI(
        base_url=os.environ["GRAFT_BASE_URL"],
        api_key=os.environ.get("GRAFT_API_KEY", "sk-graft-test"),
        default_headers=headers,
        max_retries=0,
        timeout=60,
        http_client=httpx.Client(event_hooks={"request": [hook]}),
    )


def summary(r) -> dict:
    return {
        "id": r.id,
        "object": r.object,
        "status": r.status,
        "model": r.model,
        "output_text": r.output_text,
        "output": [item.model_dump(exclude_none=True) for item in r.output],
        "function_calls": [
            {"call_id": i.call_id, "name": i.name, "arguments": i.arguments}
            for i in r.output
            if i.type == "function_call"
        ],
        "usage": r.usage.model_dump() if r.usage else None,
    }


def call_json(c: openai.OpenAI, kw: dict) -> dict:
    return summary(c.responses.create(**kw))


def call_stream(c: openai.OpenAI, kw: dict) -> dict:
    events, text, args = [], "", {}
    with c.responses.stream(**kw) as s:
        for ev in s:
            events.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
            elif ev.type == "response.function_call_arguments.delta":
                args[ev.item_id] = args.get(ev.item_id, "") + ev.delta
        final = s.get_final_response()
    out = summary(final)
    out.update({"events": events, "delta_text": text, "delta_arguments": list(args.values())})
    return out


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in ("json", "stream"):
        raise SystemExit("usage: openai_responses.py {json|stream}")
    mode = sys.argv[1]
    call = call_json if mode == "json" else call_stream
    sent: list = []
    c = client(sent)
    model = os.environ.get("GRAFT_MODEL", "scripted")
    history = [{"role": "user", "content": f"graft-weather-ask ({mode}): what is the weather in Paris?"}]
    base = {"model": model, "tools": [WEATHER_TOOL], "instructions": "You are a test."}
    first = call(c, {**base, "input": history})
    if len(first["function_calls"]) != 1:
        raise SystemExit(f"expected one function call, got {first}")
    fc = first["function_calls"][0]
    history = history + first["output"] + [
        {"type": "function_call_output", "call_id": fc["call_id"], "output": json.dumps(TOOL_OUTPUT)}
    ]
    second = call(c, {**base, "input": history})
    out = {
        "client": "openai-python",
        "version": openai.__version__,
        "mode": mode,
        "sent": sent,
        "calls": [first, second],
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
