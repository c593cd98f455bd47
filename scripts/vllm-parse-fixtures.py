#!/usr/bin/env python3
"""Makes reconstruct/tests/fixtures/parse/vllm_hermes.jsonl: what vLLM 0.34's own Hermes tool
parser (`vllm/tool_parsers/hermes_tool_parser.py`, `--tool-call-parser hermes`, the parser vLLM
runs Qwen2.5 and Qwen3 with) makes of each model text, whole and streamed, which
reconstruct/tests/parse_rules.rs compares graft's vLLM rule against.

The parser is vLLM's own file, loaded from the pinned wheel and run as it is. Only what it
imports from the rest of vLLM, which cannot be imported without torch, is stood in for here:
the protocol types (`FunctionCall`, `ToolCall`, `DeltaMessage`, ... as pydantic models with the
fields the parser uses; `FunctionCall.name` and `.arguments` are `str`, as in vLLM, so a call
whose name is not a string fails as it fails there), `ToolParser.__init__` (the streaming state
it sets), the logger and `make_tool_call_id`. `is_complete_json` and `partial_tag_overlap` are
vLLM's own functions, taken from `vllm/tool_parsers/utils.py` with `ast`.

The serving layer's part (`vllm/parser/abstract_parser.py` `_extract_tool_calls`, auto tool
choice) is applied as written there: with calls, content that is only whitespace becomes
`None`; without, the content is the model output.

Run once by a developer (again after changing the texts or the pinned vLLM); the output is
committed. It needs `regex` and `pydantic` (a throwaway venv) and the vLLM wheel:

    python3 -m venv /tmp/vt && /tmp/vt/bin/pip install regex pydantic
    python3 -m pip download --no-deps vllm==0.34.0 -d /tmp/pkgs
    /tmp/vt/bin/python scripts/vllm-parse-fixtures.py /tmp/pkgs/vllm-0.34.0-*.whl

The texts: every fixture of tests/fixtures/parse/sglang.jsonl for the Hermes families, and the
model texts of vLLM's own `tests/tool_parsers/test_hermes_tool_parser.py` (read from vLLM's
repository; the wheel ships no tests), each named by its source. Streamed: the text fed in
pieces of 1, 2, 3, 5 and 8 characters (vLLM feeds what a step decoded), the deltas
accumulated as a client accumulates them; the script checks every piece size gives the same
message and writes it once.
"""

import ast
import json
import sys
import types
import zipfile
from pathlib import Path
from typing import Any, Optional

import pydantic

REPO = Path(__file__).resolve().parent.parent
SGLANG = REPO / "reconstruct/tests/fixtures/parse/sglang.jsonl"
OUT = REPO / "reconstruct/tests/fixtures/parse/vllm_hermes.jsonl"

# Model texts of vLLM's own tests/tool_parsers/test_hermes_tool_parser.py.
VLLM_TEST_TEXTS = [
    ("vllm_test_just_forward_text", "This is some prior text that has nothing to do with tool calling."),
    ("vllm_test_bug_19056", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>'),
    ("vllm_test_streaming", '<tool_call>\n{"name": "get_current_temperature",\n"arguments": {"location":\n"San Francisco, California, United States", "unit": "celsius"}}\n</tool_call>'),
    ("vllm_test_content_then_call", 'Sure, let me check the weather.<tool_call>{"name": "get_weather", "arguments": {"city": "NYC"}}</tool_call>'),
    ("vllm_test_multiple_calls", '<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call><tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>'),
    ("vllm_test_until_eos", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}'),
    ("vllm_test_invalid_json", '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}'),
]


class Model(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")


class FunctionCall(Model):
    id: Optional[str] = None
    name: str
    arguments: str


class ToolCall(Model):
    id: str = "call_x"
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(Model):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(Model):
    id: Optional[str] = None
    type: Optional[str] = None
    index: int
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(Model):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: list = []


class ExtractedToolCallInformation(Model):
    tools_called: bool
    tool_calls: list
    content: Optional[str] = None


class ToolParser:
    def __init__(self, tokenizer, tools=None):
        self.prev_tool_call_arr = []
        self.current_tool_id = -1
        self.current_tool_name_sent = False
        self.streamed_args_for_tool = []
        self.model_tokenizer = tokenizer
        self.tools = tools or []


class Logger:
    def __getattr__(self, _name):
        return lambda *a, **k: None


def module(name: str, **attrs: Any) -> None:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m


def utils_functions(source: str, names: set) -> dict:
    """vLLM's own functions `names` from tool_parsers/utils.py, compiled alone."""
    tree = ast.parse(source)
    picked = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in picked} == names, names
    code = compile(ast.Module(body=picked, type_ignores=[]), "vllm/tool_parsers/utils.py", "exec")
    scope: dict = {"json": json, "JSONDecodeError": json.JSONDecodeError}
    exec(code, scope)
    return {n: scope[n] for n in names}


def load_parser(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        hermes = z.read("vllm/tool_parsers/hermes_tool_parser.py").decode()
        utils = z.read("vllm/tool_parsers/utils.py").decode()
    fns = utils_functions(utils, {"is_complete_json", "partial_tag_overlap"})
    protocol = dict(
        DeltaFunctionCall=DeltaFunctionCall,
        DeltaMessage=DeltaMessage,
        DeltaToolCall=DeltaToolCall,
        ExtractedToolCallInformation=ExtractedToolCallInformation,
        FunctionCall=FunctionCall,
        ToolCall=ToolCall,
    )
    for pkg in ["vllm", "vllm.entrypoints", "vllm.entrypoints.generate", "vllm.entrypoints.generate.base",
                "vllm.entrypoints.openai", "vllm.entrypoints.openai.chat_completion",
                "vllm.entrypoints.openai.responses", "vllm.renderers", "vllm.tool_parsers", "vllm.utils"]:
        module(pkg)
    module("vllm.entrypoints.generate.base.protocol", **protocol)
    module("vllm.entrypoints.openai.chat_completion.protocol", ChatCompletionRequest=object)
    module("vllm.entrypoints.openai.responses.protocol", ResponsesRequest=object)
    module("vllm.logger", init_logger=lambda _n: Logger())
    module("vllm.renderers.chat_utils", make_tool_call_id=lambda: "call_x")
    module("vllm.tokenizers", TokenizerLike=object)
    module("vllm.tool_parsers.abstract_tool_parser", Tool=object, ToolParser=ToolParser)
    module("vllm.tool_parsers.utils", **fns)
    module("vllm.utils.mistral", is_mistral_tokenizer=lambda _t: False)
    scope: dict = {"__name__": "vllm.tool_parsers.hermes_tool_parser"}
    exec(compile(hermes, "vllm/tool_parsers/hermes_tool_parser.py", "exec"), scope)
    return scope["Hermes2ProToolParser"]


def whole(parser_cls, text: str) -> dict:
    """`_extract_tool_calls` (auto) over `extract_tool_calls`."""
    info = parser_cls(tokenizer=object()).extract_tool_calls(text, request=None)
    if info.tools_called:
        content = info.content
        if content and content.strip() == "":
            content = None
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in info.tool_calls]
        return {"content": content, "tool_calls": calls}
    return {"content": text, "tool_calls": []}


def streamed(parser_cls, text: str, size: int) -> dict:
    parser = parser_cls(tokenizer=object())
    content = None
    calls: dict = {}
    previous = ""
    for i in range(0, len(text), size):
        delta = text[i : i + size]
        current = previous + delta
        msg = parser.extract_tool_calls_streaming(previous, current, delta, [], [], [], None)
        previous = current
        if msg is None:
            continue
        if msg.content:
            content = (content or "") + msg.content
        for tc in msg.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": None, "arguments": ""})
            f = tc.function or {}
            f = f if isinstance(f, dict) else f.model_dump()
            if f.get("name"):
                call["name"] = f["name"]
            if f.get("arguments"):
                call["arguments"] += f["arguments"]
    return {"content": content, "tool_calls": [calls[k] for k in sorted(calls)]}


def main() -> None:
    wheel = Path(sys.argv[1])
    parser_cls = load_parser(wheel)
    texts = []
    for line in SGLANG.read_text().splitlines():
        f = json.loads(line)
        if set(f["families"]) & {"qwen3", "qwen2.5"}:
            texts.append((f["name"], f["text"], "tests/fixtures/parse/sglang.jsonl"))
    for name, text in VLLM_TEST_TEXTS:
        texts.append((name, text, "vllm tests/tool_parsers/test_hermes_tool_parser.py"))
    with OUT.open("w") as out:
        for name, text, source in texts:
            s = [streamed(parser_cls, text, n) for n in (1, 2, 3, 5, 8)]
            assert all(x == s[0] for x in s), (name, s)
            row = {"name": name, "source": source, "vllm": wheel.name, "text": text,
                   "whole": whole(parser_cls, text), "streamed": s[0]}
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(texts)} cases to {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
