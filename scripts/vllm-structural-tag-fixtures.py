"""The `structured_outputs` vLLM 0.34.0's chat server hands its engine for a tool request,
made by running vLLM's and xgrammar's own code; writes
gateway/tests/fixtures/vllm_structured_outputs.json, which graft's exact mode is held to
(`gateway/src/vllm.rs`, test `structured_outputs_equal_vllms_own`).

Usage (a throwaway venv, nothing of vLLM installed; the wheels are only unzipped):

    python3 -m venv /tmp/vt
    /tmp/vt/bin/pip install pydantic==2.14.4 openai==3.63.0 apache-tvm-ffi==0.1.15.post2
    python3 -m pip download --no-deps vllm==0.34.0 xgrammar==0.2.8 -d /tmp/wheels
    /tmp/vt/bin/python scripts/vllm-structural-tag-fixtures.py /tmp/wheels \
        gateway/tests/fixtures/vllm_structured_outputs.json

(xgrammar 0.2.8 is the version vLLM 0.34.0 pins; SGLang 0.5.23 pins 0.2.7.)

What runs as it is:
- xgrammar 0.2.8: `structural_tag.py`, `builtin_structural_tag.py`,
  `openai_tool_call_schema.py`, `grammar.py` and its native library (the structural tag is
  compiled by `xgr.Grammar.from_structural_tag`, as vLLM's request validation does). Its
  package `__init__` is replaced by one that skips the modules needing torch (matcher,
  compiler, kernels, contrib, testing, tokenizer_info).
- vLLM 0.34.0: `vllm/envs.py` (`VLLM_ENFORCE_STRICT_TOOL_CALLING`, set per case through the
  environment), `vllm/exceptions.py`, `tool_parsers/tool_strict_level.py` and
  `tool_parsers/structural_tag_registry.py` whole.

What is taken out of vLLM's files by name (`ast`) and run, because the files around them
import torch, numpy, msgspec or the tokenizers: `ToolParser` (tool_parsers/abstract_tool_parser.py,
whole class: `__init_subclass__`, `adjust_request`, `get_structural_tag`);
`DelegatingParser.adjust_request` / `_apply_structural_tag`, `structured_outputs_to_format`,
`_xgrammar_supports` (parser/abstract_parser.py); `StructuredOutputsParams`,
`check_json_nesting` (sampling_params.py); `validate_xgrammar_grammar` and its JSON-schema
feature check (v1/structured_output/backend_xgrammar.py); `structured_outputs_from_response_format`,
`validate_structural_tag_payload`, `FunctionDefinition`, `ResponseFormat`,
`JsonSchemaResponseFormat` (entrypoints/generate/base/protocol.py); `ChatCompletionToolsParam`,
`ChatCompletionNamedToolChoiceParam` and `ChatCompletionRequest.check_tool_usage`
(entrypoints/openai/chat_completion/protocol.py); `OpenAIBaseModel`
(entrypoints/serve/engine/protocol.py); the tool helpers of tool_parsers/utils.py.

Stubbed (named here and in the fixture's `stubs`): the logger (`init_logger`, silent);
`SamplingParams` (only its `structured_outputs` attribute is read by
`validate_xgrammar_grammar`); `ChatCompletionRequest` (a pydantic model with the fields
`_apply_structural_tag` reads, typed as vLLM types them, and vLLM's own
`extract_structured_outputs` body; its `check_tool_usage` validator is vLLM's, run on the
request dict first); `ResponsesRequest` (a class no request is); the reasoning parser (none:
the three formats' parsers have no say over `structured_outputs`); the parser classes
(`ToolParser` subclasses carrying the `structural_tag_model` and `default_tool_strict_level`
read from each parser's file: hermes_tool_parser.py, llama_json_engine_tool_parser.py,
qwen3_engine_tool_parser.py; their own `adjust_request` only sets `skip_special_tokens`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import pathlib
import sys
import tempfile
import types
import typing
import zipfile
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeAlias

VLLM = "vllm==0.34.0"
XGRAMMAR = "xgrammar==0.2.8"

STUBS = [
    "vllm.logger.init_logger: a silent logger",
    "vllm.sampling_params.SamplingParams: holds structured_outputs only",
    "ChatCompletionRequest: a pydantic model of the fields _apply_structural_tag reads "
    "(tools, tool_choice, parallel_tool_calls, response_format, structured_outputs, "
    "skip_special_tokens) with vLLM's extract_structured_outputs; vLLM's check_tool_usage "
    "validator runs on the request dict first",
    "ResponsesRequest: a class no request is",
    "no reasoning parser",
    "the tool parser classes: ToolParser subclasses with each parser file's "
    "structural_tag_model / default_tool_strict_level",
    "xgrammar/__init__.py: only exception, load_binding, structural_tag, "
    "builtin_structural_tag, grammar (the rest needs torch)",
]

# graft's exact.tool_call_format -> vLLM's --tool-call-parser and the file of its class.
FORMATS = {
    "hermes": ("hermes", "vllm/tool_parsers/hermes_tool_parser.py", "Hermes2ProToolParser"),
    "llama3": (
        "llama3_json",
        "vllm/tool_parsers/llama_json_engine_tool_parser.py",
        "LlamaJsonEngineToolParser",
    ),
    "qwen3_coder": (
        "qwen3_coder",
        "vllm/tool_parsers/qwen3_engine_tool_parser.py",
        "Qwen3EngineToolParser",
    ),
}

XGRAMMAR_FILES = [
    "xgrammar/exception.py",
    "xgrammar/load_binding.py",
    "xgrammar/base.py",
    "xgrammar/config.py",
    "xgrammar/structural_tag.py",
    "xgrammar/builtin_structural_tag.py",
    "xgrammar/openai_tool_call_schema.py",
    "xgrammar/grammar.py",
]


def unzip(wheels: pathlib.Path, root: pathlib.Path) -> None:
    (vllm_whl,) = wheels.glob("vllm-0.34.0-*.whl")
    (xgr_whl,) = wheels.glob("xgrammar-0.2.8-*.whl")
    with zipfile.ZipFile(vllm_whl) as z:
        for name in z.namelist():
            if name.endswith(".py") and name.startswith("vllm/"):
                z.extract(name, root / "src")
    with zipfile.ZipFile(xgr_whl) as z:
        for name in z.namelist():
            keep = (
                name in XGRAMMAR_FILES
                or name.startswith("xgrammar/tvm_ffi_binding/")
                or name.endswith(".so")
            )
            if keep:
                z.extract(name, root / "xgr")
    (root / "xgr/xgrammar/__init__.py").write_text(
        "# graft: xgrammar's __init__ without the modules that need torch\n"
        "from . import exception, load_binding, structural_tag\n"
        "from .builtin_structural_tag import (get_builtin_structural_tag,\n"
        "    get_model_structural_tag, normalize_tool_choice, register_model_structural_tag)\n"
        "from .grammar import Grammar, StructuralTagItem\n"
        "from .structural_tag import StructuralTag\n"
    )


def take(path: pathlib.Path, names: Sequence[str], ns: dict, cls: str | None = None) -> None:
    """Runs the top-level definitions `names` of `path` (or of its class `cls`) in `ns`,
    decorators of methods dropped (they run as plain functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    body = tree.body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    picked = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        else:
            continue
        if name in names:
            if cls is not None and isinstance(node, ast.FunctionDef):
                node.decorator_list = []
            picked.append((name, node))
    missing = set(names) - {n for n, _ in picked}
    if missing:
        sys.exit(f"{path}: no {sorted(missing)}")
    exec(compile(ast.Module(body=[n for _, n in picked], type_ignores=[]), str(path), "exec"), ns)


def module(name: str, ns: dict | None = None) -> types.ModuleType:
    m = types.ModuleType(name)
    if ns:
        m.__dict__.update(ns)
    sys.modules[name] = m
    parent, _, leaf = name.rpartition(".")
    if parent:
        setattr(sys.modules.get(parent) or module(parent), leaf, m)
    if not hasattr(m, "__path__"):
        m.__path__ = []
    return m


def run_file(name: str, path: pathlib.Path) -> types.ModuleType:
    m = module(name)
    m.__file__ = str(path)
    exec(compile(path.read_text(), str(path), "exec"), m.__dict__)
    return m


class SilentLogger:
    def __getattr__(self, _name):
        return lambda *a, **k: None


def build(root: pathlib.Path) -> dict:
    """vLLM's pieces, wired; returns what the cases call."""
    src = root / "src"
    sys.path.insert(0, str(root / "xgr"))
    import pydantic
    import xgrammar
    from openai.types.responses import (
        CustomTool,
        FunctionTool,
        NamespaceTool,
        ToolChoiceCustom,
        ToolChoiceFunction,
    )
    from openai.types.responses.tool import Tool as ResponsesTool

    module("vllm")
    envs = run_file("vllm.envs", src / "vllm/envs.py")
    exceptions = run_file("vllm.exceptions", src / "vllm/exceptions.py")
    module("vllm.logger", {"init_logger": lambda _name: SilentLogger()})
    VLLMValidationError = exceptions.VLLMValidationError
    base = {
        "Any": Any,
        "Annotated": Annotated,
        "ClassVar": ClassVar,
        "Literal": Literal,
        "TypeAlias": TypeAlias,
        "Sequence": Sequence,
        "json": json,
        "json_mod": json,
        "dataclass": pydantic.dataclasses.dataclass,
        "field": dataclasses.field,
        "replace": dataclasses.replace,
        "BaseModel": pydantic.BaseModel,
        "ConfigDict": pydantic.ConfigDict,
        "Field": pydantic.Field,
        "TypeAdapter": pydantic.TypeAdapter,
        "ValidationError": pydantic.ValidationError,
        "model_validator": pydantic.model_validator,
        "model_serializer": pydantic.model_serializer,
        "VLLMValidationError": VLLMValidationError,
        "logger": SilentLogger(),
        "init_logger": lambda _n: SilentLogger(),
        "envs": envs,
        "xgr": xgrammar,
        "FunctionTool": FunctionTool,
        "CustomTool": CustomTool,
        "NamespaceTool": NamespaceTool,
        "ToolChoiceFunction": ToolChoiceFunction,
        "ToolChoiceCustom": ToolChoiceCustom,
        "ResponsesTool": ResponsesTool,
        "cached_property": functools.cached_property,
    }

    def space(name: str, **extra: Any) -> dict:
        """A module's namespace, registered (dataclasses and pydantic look it up)."""
        m = module(name)
        m.__dict__.update(base)
        m.__dict__.update(extra)
        return m.__dict__

    # sampling_params.py
    ns = space("vllm.sampling_params")
    take(
        src / "vllm/sampling_params.py",
        [
            "MAX_STRUCTURED_OUTPUT_JSON_NESTING",
            "STRUCTURAL_TAG_WRAPPER_NESTING",
            "_exceeds_json_nesting",
            "check_json_nesting",
            "StructuredOutputsParams",
        ],
        ns,
    )

    class SamplingParams:  # stub: validate_xgrammar_grammar reads this one attribute
        def __init__(self, structured_outputs=None):
            self.structured_outputs = structured_outputs

    ns["SamplingParams"] = SamplingParams
    sp = sys.modules["vllm.sampling_params"]

    # v1/structured_output/backend_xgrammar.py: the request-time validation.
    ns = space(
        "vllm.v1.structured_output.backend_xgrammar",
        check_json_nesting=sp.check_json_nesting,
        SamplingParams=SamplingParams,
    )
    take(
        src / "vllm/v1/structured_output/backend_xgrammar.py",
        [
            "STRING_SUPPORTED_FORMATS",
            "_has_pattern_and_length_bounds",
            "_schema_types",
            "has_xgrammar_unsupported_json_features",
            "validate_xgrammar_grammar",
        ],
        ns,
    )

    # serve/engine/protocol.py, generate/base/protocol.py
    ns = space("vllm.entrypoints.serve.engine.protocol")
    take(src / "vllm/entrypoints/serve/engine/protocol.py", ["_REMOVED_GUIDED_FIELDS", "OpenAIBaseModel"], ns)
    ns = space("vllm.entrypoints.generate.base.protocol", OpenAIBaseModel=ns["OpenAIBaseModel"])
    take(
        src / "vllm/entrypoints/generate/base/protocol.py",
        [
            "FunctionDefinition",
            "JsonSchemaResponseFormat",
            "LegacyStructuralTag",
            "LegacyStructuralTagResponseFormat",
            "StructuralTagResponseFormat",
            "ResponseFormat",
            "AnyResponseFormat",
            "structured_outputs_from_response_format",
            "validate_structural_tag_payload",
        ],
        ns,
    )
    ns["StructuredOutputsParams"] = sp.StructuredOutputsParams
    gen = sys.modules["vllm.entrypoints.generate.base.protocol"]
    ns = space(
        "vllm.entrypoints.openai.chat_completion.protocol",
        OpenAIBaseModel=gen.OpenAIBaseModel,
        FunctionDefinition=gen.FunctionDefinition,
    )
    take(
        src / "vllm/entrypoints/openai/chat_completion/protocol.py",
        ["ChatCompletionToolsParam", "ChatCompletionNamedFunction", "ChatCompletionNamedToolChoiceParam"],
        ns,
    )
    chat = sys.modules["vllm.entrypoints.openai.chat_completion.protocol"]
    check_tool_usage_ns = space("graft_vllm.check_tool_usage")
    take(
        src / "vllm/entrypoints/openai/chat_completion/protocol.py",
        ["check_tool_usage"],
        check_tool_usage_ns,
        cls="ChatCompletionRequest",
    )

    class ResponsesRequest:  # stub: no request is one
        pass

    class ChatCompletionRequest(gen.OpenAIBaseModel):
        """Stub: the fields `_apply_structural_tag` reads, typed as vLLM's."""

        tools: list[chat.ChatCompletionToolsParam] | None = None
        tool_choice: (
            Literal["none"]
            | Literal["auto"]
            | Literal["required"]
            | chat.ChatCompletionNamedToolChoiceParam
            | None
        ) = "none"
        parallel_tool_calls: bool | None = True
        response_format: gen.AnyResponseFormat | None = None
        structured_outputs: sp.StructuredOutputsParams | None = None
        skip_special_tokens: bool | None = None

    extract_ns = space(
        "graft_vllm.extract_structured_outputs",
        structured_outputs_from_response_format=gen.structured_outputs_from_response_format,
    )
    take(
        src / "vllm/entrypoints/openai/chat_completion/protocol.py",
        ["extract_structured_outputs"],
        extract_ns,
        cls="ChatCompletionRequest",
    )
    ChatCompletionRequest.extract_structured_outputs = extract_ns["extract_structured_outputs"]

    # tool_parsers: utils helpers, the strict level, the registry (whole file).
    run_file("vllm.tool_parsers.tool_strict_level", src / "vllm/tool_parsers/tool_strict_level.py")
    ns = space(
        "vllm.tool_parsers.utils",
        ChatCompletionToolsParam=chat.ChatCompletionToolsParam,
        ChatCompletionNamedToolChoiceParam=chat.ChatCompletionNamedToolChoiceParam,
    )
    ns["Tool"] = chat.ChatCompletionToolsParam | ResponsesTool
    take(
        src / "vllm/tool_parsers/utils.py",
        [
            "CUSTOM_TOOL_INPUT_KEY",
            "custom_tool_parameters",
            "custom_tool_as_function_dict",
            "_NAMESPACE_TOOL_SEPARATOR",
            "flat_namespace_tool_name",
            "get_function_tools",
            "require_function_tools",
            "iter_response_function_tool_info",
            "_is_function_tool",
            "_extract_tool_info",
            "_params_or_empty_object",
            "_get_tool_schema_from_name_and_params",
            "_get_tool_schema_from_tool",
            "_get_tool_schema_defs",
            "_get_json_schema_from_tools",
            "get_json_schema_from_tools",
        ],
        ns,
    )
    registry = run_file(
        "vllm.tool_parsers.structural_tag_registry", src / "vllm/tool_parsers/structural_tag_registry.py"
    )
    level = sys.modules["vllm.tool_parsers.tool_strict_level"].ToolStrictLevel

    # The tool parser base and the unified parser's request adjustment.
    ns = space(
        "vllm.tool_parsers.abstract_tool_parser",
        ChatCompletionRequest=ChatCompletionRequest,
        ChatCompletionToolsParam=chat.ChatCompletionToolsParam,
        ResponsesRequest=ResponsesRequest,
        StructuredOutputsParams=sp.StructuredOutputsParams,
        ToolStrictLevel=level,
        get_json_schema_from_tools=sys.modules["vllm.tool_parsers.utils"].get_json_schema_from_tools,
        ResponseTextConfig=object,
        ResponseFormatTextJSONSchemaConfig=object,
    )
    take(src / "vllm/tool_parsers/abstract_tool_parser.py", ["ToolParser"], ns)
    tool_parser_ns = ns
    ns = space(
        "vllm.parser.abstract_parser",
        ChatCompletionNamedToolChoiceParam=chat.ChatCompletionNamedToolChoiceParam,
        ResponsesRequest=ResponsesRequest,
        StructuredOutputsParams=sp.StructuredOutputsParams,
        check_json_nesting=sp.check_json_nesting,
        SamplingParams=SamplingParams,
        ToolStrictLevel=level,
        get_structural_tag_tools=registry.get_structural_tag_tools,
        limit_to_single_tool_call=registry.limit_to_single_tool_call,
        resolve_tool_strictness=registry.resolve_tool_strictness,
        StructuralTag=xgrammar.StructuralTag,
    )
    from xgrammar.structural_tag import (
        ConstStringFormat,
        GrammarFormat,
        JSONSchemaFormat,
        OrFormat,
        RegexFormat,
        TagFormat,
        TriggeredTagsFormat,
    )

    ns.update(
        ConstStringFormat=ConstStringFormat,
        GrammarFormat=GrammarFormat,
        JSONSchemaFormat=JSONSchemaFormat,
        OrFormat=OrFormat,
        RegexFormat=RegexFormat,
        TagFormat=TagFormat,
        TriggeredTagsFormat=TriggeredTagsFormat,
        Grammar=xgrammar.Grammar,
    )
    take(src / "vllm/parser/abstract_parser.py", ["structured_outputs_to_format", "_xgrammar_supports"], ns)
    take(src / "vllm/parser/abstract_parser.py", ["adjust_request", "_apply_structural_tag"], ns, cls="DelegatingParser")

    return {
        "envs": envs,
        "ToolParser": tool_parser_ns["ToolParser"],
        "adjust_request": ns["adjust_request"],
        "_apply_structural_tag": ns["_apply_structural_tag"],
        "check_tool_usage": check_tool_usage_ns["check_tool_usage"],
        "ChatCompletionRequest": ChatCompletionRequest,
        "validate_structural_tag_payload": gen.validate_structural_tag_payload,
        "level": level,
        "src": src,
    }


def parser_class(v: dict, fmt: str) -> type:
    """The tool parser of `fmt` as vLLM defines it, reduced to what shapes the request:
    its `structural_tag_model` and `default_tool_strict_level` (read from its file) over
    vLLM's own `ToolParser`. Made after the environment is set, as vLLM's
    `__init_subclass__` reads `VLLM_ENFORCE_STRICT_TOOL_CALLING` then."""
    _, path, name = FORMATS[fmt]
    tree = ast.parse((v["src"] / path).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    attrs: dict[str, Any] = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            key = node.targets[0].id
            if key == "structural_tag_model":
                attrs[key] = ast.literal_eval(node.value)
            if key == "default_tool_strict_level":
                attrs[key] = v["level"][ast.unparse(node.value).split(".")[-1]]
    if "structural_tag_model" not in attrs:
        sys.exit(f"{path}: {name} has no structural_tag_model")
    return type(name, (v["ToolParser"],), attrs)


class Parser:
    """`DelegatingParser` with no reasoning parser: `adjust_request` and
    `_apply_structural_tag` are vLLM's."""

    tool_strict_level = None

    def __init__(self, v: dict, tool_parser) -> None:
        self._reasoning_parser = None
        self._tool_parser = tool_parser
        self.adjust_request = types.MethodType(v["adjust_request"], self)
        self._apply_structural_tag = types.MethodType(v["_apply_structural_tag"], self)


def structured_outputs(v: dict, fmt: str, strict: bool, request: dict) -> dict | None:
    os.environ["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "1" if strict else "0"
    cls = parser_class(v, fmt)
    tool_parser = cls.__new__(cls)
    data = v["check_tool_usage"](None, json.loads(json.dumps(request)))
    req = v["ChatCompletionRequest"].model_validate(data)
    req = Parser(v, tool_parser).adjust_request(req)
    so = req.extract_structured_outputs()
    if so is None:
        return None
    out = {}
    for f in dataclasses.fields(so):
        if f.name.startswith("_") or not f.init:
            continue
        value = getattr(so, f.name)
        if value != f.default:
            out[f.name] = value
    if "structural_tag" in out:
        # What the completions endpoint runs on it (`validate_structured_outputs_structural_tag`):
        # nesting, then xgrammar compiles it.
        v["validate_structural_tag_payload"](out["structural_tag"], parameter="structured_outputs")
    return out


def tool(name: str, params: Any = None, strict: bool | None = None, description: str | None = None) -> dict:
    f: dict[str, Any] = {"name": name}
    if description is not None:
        f["description"] = description
    if params is not None:
        f["parameters"] = params
    if strict is not None:
        f["strict"] = strict
    return {"type": "function", "function": f}


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLSETS = {
    # One strict tool among loose ones, one with `$defs`, one without parameters.
    "mixed": [
        tool("get_weather", CITY, description="Weather now"),
        tool(
            "get_time",
            {
                "type": "object",
                "properties": {"zone": {"$ref": "#/$defs/zone"}},
                "$defs": {"zone": {"type": "string", "enum": ["utc", "local"]}},
            },
            strict=True,
        ),
        tool("loose", {"type": "object"}, strict=False),
        tool("ping"),
    ],
    # No tool says `strict: true`.
    "loose": [tool("get_weather", CITY), tool("ping", strict=False)],
}
CHOICES = {
    "absent": None,
    "auto": "auto",
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_weather"}},
}
RESPONSE_FORMATS = {
    "none": None,
    "json_schema": {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "schema": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
        },
    },
    "json_object": {"type": "json_object"},
}


def cases(v: dict) -> list[dict]:
    out = []
    for strict in (True, False):
        for fmt in FORMATS:
            for tools_name, tools in TOOLSETS.items():
                for choice_name, choice in CHOICES.items():
                    for parallel in (None, False):
                        for rf_name, rf in RESPONSE_FORMATS.items():
                            # `json_object` is the OR's other branch under `auto` only; elsewhere
                            # it reads as `json_schema` does.
                            if rf_name == "json_object" and (not strict or choice_name != "auto"):
                                continue
                            request: dict[str, Any] = {"tools": tools}
                            if choice is not None:
                                request["tool_choice"] = choice
                            if parallel is not None:
                                request["parallel_tool_calls"] = parallel
                            if rf is not None:
                                request["response_format"] = rf
                            out.append(
                                {
                                    "name": f"{fmt}/{'strict' if strict else 'not-strict'}/{tools_name}/{choice_name}/"
                                    f"parallel-{'false' if parallel is False else 'default'}/rf-{rf_name}",
                                    "tool_call_format": fmt,
                                    "strict_tool_calling": strict,
                                    "tools": tools_name,
                                    "request": {k: v_ for k, v_ in request.items() if k != "tools"},
                                    "structured_outputs": structured_outputs(v, fmt, strict, request),
                                }
                            )
    return out


def main() -> None:
    wheels, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        unzip(wheels, root)
        v = build(root)
        doc = {
            "source": f"{VLLM} and {XGRAMMAR}, run by scripts/vllm-structural-tag-fixtures.py: "
            "DelegatingParser.adjust_request (_apply_structural_tag, then ToolParser.adjust_request) "
            "with --tool-call-parser PARSER --enable-auto-tool-choice, no --tool-strict-level, "
            "VLLM_ENFORCE_STRICT_TOOL_CALLING as strict_tool_calling says, then "
            "ChatCompletionRequest.extract_structured_outputs; structured_outputs is the "
            "StructuredOutputsParams the engine gets (fields left at their defaults omitted), "
            "each structural_tag validated as the completions endpoint validates it "
            "(validate_structural_tag_payload: check_json_nesting, xgrammar's Grammar.from_structural_tag)",
            "parsers": {fmt: parser for fmt, (parser, _, _) in FORMATS.items()},
            "stubs": STUBS,
            "toolsets": TOOLSETS,
            "cases": cases(v),
        }
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"{out}: {len(doc['cases'])} cases")


if __name__ == "__main__":
    main()
