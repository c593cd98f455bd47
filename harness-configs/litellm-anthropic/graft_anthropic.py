"""Anthropic Messages through graft (POST {{base_url_root}}/v1/messages), two ways."""

import anthropic
import litellm

# The anthropic SDK: base_url WITHOUT /v1 (the SDK appends /v1/messages).
client = anthropic.Anthropic(base_url="{{base_url_root}}", api_key="{{api_key}}")
msg = client.messages.create(
    model="{{model}}",
    max_tokens=1024,
    messages=[{"role": "user", "content": "hello"}],
)

# litellm's anthropic/ route: same base URL, litellm appends /v1/messages.
resp = litellm.completion(
    model="anthropic/{{model}}",
    api_base="{{base_url_root}}",
    api_key="{{api_key}}",
    messages=[{"role": "user", "content": "hello"}],
)
