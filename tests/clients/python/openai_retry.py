"""The real openai Python SDK with a short timeout and its own retries (max_retries=2, as by
default): the first attempt of the call is slow (the scripted upstream's `first_delay_ms`),
so the SDK times out, closes the connection and retries it with `x-stainless-retry-count`.
Prints one JSON line with the answer it finally got.

usage: python openai_retry.py MODE      MODE: json | stream
env:   GRAFT_BASE_URL (including /v1), GRAFT_API_KEY, GRAFT_MODEL (default scripted),
       GRAFT_TIMEOUT (seconds, default 1.5), GRAFT_TEXT (the user message).
"""

import json
import os
import sys

import openai


def main() -> None:
    mode = sys.argv[1]
    c = openai.OpenAI(
        base_url=os.environ["GRAFT_BASE_URL"],
        api_key=os.environ.get("GRAFT_API_KEY", "sk-graft-test"),
        max_retries=2,
        timeout=float(os.environ.get("GRAFT_TIMEOUT", "1.5")),
    )
    sent = {
        "model": os.environ.get("GRAFT_MODEL", "scripted"),
        "messages": [{"role": "user", "content": os.environ["GRAFT_TEXT"]}],
    }
    if mode == "json":
        r = c.chat.completions.create(**sent)
        content = r.choices[0].message.content
        rid = r.id
    else:
        content, rid = "", None
        for chunk in c.chat.completions.create(**sent, stream=True):
            rid = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                content += chunk.choices[0].delta.content
    print(json.dumps({"content": content, "id": rid}))


if __name__ == "__main__":
    main()
