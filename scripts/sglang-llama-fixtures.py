#!/usr/bin/env python3
"""Makes reconstruct/tests/fixtures/parse/sglang_llama32.jsonl: what SGLang 0.5.23's own
`Llama32Detector.detect_and_parse` (`srt/function_call/llama32_detector.py`, the `llama3` tool
parser) makes of each Llama 3 model text, which reconstruct/tests/parse_rules.rs compares
graft's SGLang rule against (normal text, and each call's name and arguments string byte for
byte).

The detector and what it is built on are SGLang's own files, loaded from the pinned wheel and
run as they are: `llama32_detector.py`, `base_format_detector.py`, `core_types.py` and
`function_call/utils.py` (its `safe_literal_eval`: Python's `ast.literal_eval`, the fallback
that reads calls written as Python dicts). Stood in for, because importing them needs the
server: `sglang.srt.entrypoints.openai.protocol` (`Tool` / `Function`, as pydantic models with
the fields the detector reads) and `sglang.srt.environ` (`SGLANG_FORWARD_UNKNOWN_TOOLS` unset,
its default).

Run once by a developer (again after changing the texts or the pinned SGLang); the output is
committed. It needs `orjson`, `partial_json_parser` and `pydantic` (a throwaway venv) and the
SGLang wheel:

    python3 -m venv /tmp/vt && /tmp/vt/bin/pip install orjson partial_json_parser pydantic
    python3 -m pip download --no-deps sglang==0.5.23 -d /tmp/pkgs
    /tmp/vt/bin/python scripts/sglang-llama-fixtures.py /tmp/pkgs/sglang-0.5.23-*.whl

The texts: every Llama 3 fixture of tests/fixtures/parse/sglang.jsonl, and the calls written
as Python dicts below. The tools are parse_rules.rs's.
"""

import json
import sys
import types
import zipfile
from pathlib import Path
from typing import Any, Optional

import pydantic

REPO = Path(__file__).resolve().parent.parent
SGLANG = REPO / "reconstruct/tests/fixtures/parse/sglang.jsonl"
OUT = REPO / "reconstruct/tests/fixtures/parse/sglang_llama32.jsonl"
TOOLS = ["get_weather", "get_time", "search"]

# Calls written as Python dicts (Llama models do this; SGLang reads them with literal_eval).
PYTHON_DICT_TEXTS = [
    ("llama32_python_dict_call", "{'name': 'get_weather', 'parameters': {'city': 'Paris', 'days': 2}}"),
    ("llama32_python_dict_after_text", "Let me check.<|python_tag|>{'name': 'search', 'parameters': {'query': \"it's raining\"}}"),
    ("llama32_python_dict_literals", "{'name': 'get_time', 'parameters': {'tz': 'UTC', 'exact': True, 'offset': None, 'at': -1.5}}"),
    ("llama32_python_dict_then_json", "{'name': 'get_time', 'parameters': {'tz': 'CET'}}; {\"name\": \"search\", \"parameters\": {\"query\": \"x\"}}"),
    ("llama32_python_dict_not_a_literal", "{'name': 'search', 'parameters': {'query': open('x')}}"),
]


class Function(pydantic.BaseModel):
    name: str
    parameters: Optional[dict] = None
    strict: bool = False


class Tool(pydantic.BaseModel):
    type: str = "function"
    function: Function


class Env:
    def get(self):
        return False


def module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def load(wheel: Path):
    files = {}
    with zipfile.ZipFile(wheel) as z:
        for f in ["core_types", "utils", "base_format_detector", "llama32_detector"]:
            files[f] = z.read(f"sglang/srt/function_call/{f}.py").decode()
    for pkg in ["sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.openai",
                "sglang.srt.function_call"]:
        module(pkg).__path__ = []
    module("sglang.srt.entrypoints.openai.protocol", Tool=Tool, ToolChoice=object, Function=Function)
    module("sglang.srt.environ", envs=types.SimpleNamespace(SGLANG_FORWARD_UNKNOWN_TOOLS=Env()))
    for f in ["core_types", "utils", "base_format_detector", "llama32_detector"]:
        name = f"sglang.srt.function_call.{f}"
        m = module(name)
        exec(compile(files[f], f"sglang/srt/function_call/{f}.py", "exec"), m.__dict__)
    return sys.modules["sglang.srt.function_call.llama32_detector"].Llama32Detector


def main() -> None:
    wheel = Path(sys.argv[1])
    detector_cls = load(wheel)
    tools = [Tool(function=Function(name=n, parameters={"type": "object"})) for n in TOOLS]
    texts = []
    for line in SGLANG.read_text().splitlines():
        f = json.loads(line)
        if "llama3" in f["families"]:
            texts.append((f["name"], f["text"], "tests/fixtures/parse/sglang.jsonl"))
    for name, text in PYTHON_DICT_TEXTS:
        texts.append((name, text, "scripts/sglang-llama-fixtures.py (calls as Python dicts)"))
    with OUT.open("w") as out:
        for name, text, source in texts:
            r = detector_cls().detect_and_parse(text, tools)
            calls = [{"name": c.name, "arguments": c.parameters} for c in r.calls]
            row = {"name": name, "source": source, "sglang": wheel.name, "text": text,
                   "normal_text": r.normal_text, "calls": calls}
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(texts)} cases to {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
