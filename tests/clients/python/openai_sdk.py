"""Drives graft with the real openai Python SDK and prints one JSON line with what it got.

usage: python openai_sdk.py MODE      MODE: chat | chat-stream-tools | completions | chat-drift | tool-session
env:   GRAFT_BASE_URL  base URL including /v1 (e.g. http://127.0.0.1:8080/s/sess-1/v1)
       GRAFT_API_KEY   API key (default sk-graft-test)
       GRAFT_SESSION   if set, sent as the x-graft-session header
       GRAFT_MODEL     model id (default scripted)
Exits non-zero (with the error on stderr) when the call fails.
"""

import json
import os
import sys

import openai

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def client() -> openai.OpenAI:
    headers = {}
    if os.environ.get("GRAFT_SESSION"):
        headers["x-graft-session"] = os.environ["GRAFT_SESSION"]
    return openai.OpenAI(
        base_url=os.environ["GRAFT_BASE_URL"],
        api_key=os.environ.get("GRAFT_API_KEY", "sk-graft-test"),
        default_headers=headers,
        max_retries=0,
        timeout=60,
    )


def chat(c: openai.OpenAI, model: str) -> dict:
    sent = {
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a test."},
            {"role": "user", "content": "graft-chat: hello there"},
        ],
        "temperature": 0.5,
        "max_tokens": 64,
    }
    r = c.chat.completions.create(**sent)
    m = r.choices[0].message
    return {
        "sent": sent,
        "id": r.id,
        "object": r.object,
        "model": r.model,
        "content": m.content,
        "tool_calls": [],
        "finish_reason": r.choices[0].finish_reason,
        "usage": r.usage.model_dump() if r.usage else None,
    }


def chat_stream_tools(c: openai.OpenAI, model: str) -> dict:
    sent = {
        "model": model,
        "messages": [{"role": "user", "content": "graft-tool-call: list the files in /workspace"}],
        "tools": [BASH_TOOL],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    content = ""
    calls: dict[int, dict] = {}
    finish = None
    usage = None
    ids = set()
    chunks = 0
    for chunk in c.chat.completions.create(**sent):
        chunks += 1
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            d = choice.delta
            if d.content:
                content += d.content
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            if choice.finish_reason:
                finish = choice.finish_reason
    if len(ids) != 1:
        raise SystemExit(f"expected one completion id across the stream, got {sorted(ids)}")
    return {
        "sent": sent,
        "id": ids.pop(),
        "chunks": chunks,
        "content": content,
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
        "usage": usage,
    }


def completions(c: openai.OpenAI, model: str) -> dict:
    sent = {"model": model, "prompt": "graft-completion: Once upon a time", "max_tokens": 32}
    r = c.completions.create(**sent)
    return {
        "sent": sent,
        "id": r.id,
        "object": r.object,
        "model": r.model,
        "content": r.choices[0].text,
        "finish_reason": r.choices[0].finish_reason,
        "usage": r.usage.model_dump() if r.usage else None,
    }


def chat_drift(c: openai.OpenAI, model: str) -> dict:
    """Two turns where the second re-sends the first reply rewritten (its first word
    replaced), as a harness that re-serializes or trims its history does: the merge sees a
    drift in the assistant turn."""
    first = chat(c, model)
    words = (first["content"] or "").split(" ")
    edited = " ".join(["(rewritten)"] + words[1:])
    sent = {
        **first["sent"],
        "messages": first["sent"]["messages"]
        + [
            {"role": "assistant", "content": edited},
            {"role": "user", "content": "graft-chat: and once more"},
        ],
    }
    r = c.chat.completions.create(**sent)
    return {
        "sent": sent,
        "first_id": first["id"],
        "id": r.id,
        "first_content": first["content"],
        "edited": edited,
        "content": r.choices[0].message.content,
        "finish_reason": r.choices[0].finish_reason,
    }


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def tool_session(c: openai.OpenAI, model: str) -> dict:
    """One agent session of two calls: a streamed call that answers with a tool call, then
    (the call and its result echoed back as the SDK's users do) a whole one."""
    messages = [
        {"role": "system", "content": "You answer weather questions."},
        {"role": "user", "content": "graft-weather-ask: how is Paris today?"},
    ]
    stream = c.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER_TOOL],
        stream=True,
        stream_options={"include_usage": True},
    )
    content, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage.model_dump()
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            finish = ch.finish_reason or finish
    call = calls[0]
    messages.append(
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        }
    )
    messages.append(
        {"role": "tool", "tool_call_id": call["id"], "content": "graft-weather-result: sunny, 21 C"}
    )
    r = c.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL])
    return {
        "first": {"content": content, "tool_calls": [call], "finish_reason": finish, "usage": usage},
        "content": r.choices[0].message.content,
        "finish_reason": r.choices[0].finish_reason,
        "usage": r.usage.model_dump() if r.usage else None,
    }


def main() -> None:
    modes = {
        "chat": chat,
        "chat-stream-tools": chat_stream_tools,
        "completions": completions,
        "chat-drift": chat_drift,
        "tool-session": tool_session,
    }
    if len(sys.argv) != 2 or sys.argv[1] not in modes:
        raise SystemExit(f"usage: openai_sdk.py {{{'|'.join(modes)}}}")
    mode = sys.argv[1]
    out = modes[mode](client(), os.environ.get("GRAFT_MODEL", "scripted"))
    out = {"client": "openai-python", "version": openai.__version__, "mode": mode, **out}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
