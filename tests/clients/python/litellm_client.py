"""Drives graft with litellm's OpenAI route and prints one JSON line with what it got.

usage: python litellm_client.py MODE     MODE: chat | chat-stream
env:   GRAFT_BASE_URL, GRAFT_API_KEY, GRAFT_SESSION, GRAFT_MODEL as in openai_sdk.py.
litellm must not fetch its cost map from the internet: this script sets
LITELLM_LOCAL_MODEL_COST_MAP=True before importing it.
"""

import importlib.metadata
import json
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")

import litellm  # noqa: E402

litellm.telemetry = False


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in ("chat", "chat-stream"):
        raise SystemExit("usage: litellm_client.py {chat|chat-stream}")
    mode = sys.argv[1]
    stream = mode == "chat-stream"
    model = os.environ.get("GRAFT_MODEL", "scripted")
    messages = [{"role": "user", "content": "graft-litellm: hello from litellm"}]
    headers = {}
    if os.environ.get("GRAFT_SESSION"):
        headers["x-graft-session"] = os.environ["GRAFT_SESSION"]
    r = litellm.completion(
        model=f"openai/{model}",
        api_base=os.environ["GRAFT_BASE_URL"],
        api_key=os.environ.get("GRAFT_API_KEY", "sk-graft-test"),
        messages=messages,
        stream=stream,
        extra_headers=headers or None,
        num_retries=0,
        timeout=60,
    )
    if stream:
        content, finish, ids = "", None, set()
        for chunk in r:
            ids.add(chunk.id)
            for choice in chunk.choices:
                if choice.delta.content:
                    content += choice.delta.content
                if choice.finish_reason:
                    finish = choice.finish_reason
        rid = sorted(ids)[0] if ids else None
    else:
        content, finish, rid = r.choices[0].message.content, r.choices[0].finish_reason, r.id
    out = {
        "client": "litellm",
        "version": importlib.metadata.version("litellm"),
        "mode": mode,
        "sent_messages": messages,
        "id": rid,
        "content": content,
        "finish_reason": finish,
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
