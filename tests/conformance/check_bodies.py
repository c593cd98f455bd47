"""Checks request bodies graft sent against the inference servers' own request models.

Usage: python check_bodies.py SERVERS_SRC < bodies.json > verdicts.json
       python check_bodies.py SERVERS_SRC --strings FILE   (the string literals of FILE)

SERVERS_SRC is `.graft-test-env/servers/src` (scripts/setup-test-env.sh extracts it from the
pinned sglang and vllm wheels). The input is `{"bodies": [{"server": "sglang" | "vllm",
"path": "/generate", "body": {...}}, ...]}`; the output `{"verdicts": [{"server", "path",
"model", "ok", "errors": [...]}, ...]}`, one per body, in order.

How each body is judged, always by the servers' own files, nothing copied from them:

- SGLang `POST /generate`: `GenerateRequest.from_json_value` of SGLang's generated
  `sglang/api/v1/api_types.py`, the contract gate `http_server.py` runs before it serves a
  `/generate` (`api_contract.generate_contract_error`; its `JsonContractError` text is the
  body of the server's 400). Unknown `sampling_params` keys fail there with SGLang's own
  message. A top-level key that is not a `GenerateRequest` field is reported too: the server
  ignores it, so graft would believe it set something it did not.
- SGLang's other routes: the route's body model is read from `http_server.py` (the
  `obj: Annotated[X, Body()]` parameter of the function the route decorates), its fields
  (with `BaseReq`'s) from `io_struct.py` with `ast`; a route without a body model takes
  none. Required fields must be there, simple annotations must hold, and every key must be a
  field (the server ignores others: FastAPI's schema for these structs drops extra keys).
- vLLM: the route's model from the router module (`request: CompletionRequest`), its fields
  from the protocol modules with `ast` (importing them needs torch); vLLM's
  `OpenAIBaseModel` allows extra keys and only logs them, so a key that is not a field is
  silently ignored and reported here. Simple annotations must hold.
- vLLM's `structured_outputs`: validated into vLLM's own `StructuredOutputsParams` (the
  pydantic dataclass of `vllm/sampling_params.py`, with its `__post_init__`: exactly one
  constraint; taken out of the file by name with `ast`, as the module imports torch), then
  what vLLM runs on it before serving: `check_json_nesting`, and xgrammar 0.2.8 (vLLM's pin)
  compiles it (`Grammar.from_structural_tag` for a structural tag, as the completions
  endpoint's `validate_structured_outputs_structural_tag` does; `Grammar.from_json_schema`
  for `json`), with xgrammar's native library through apache-tvm-ffi. xgrammar's package
  `__init__` is not run (it imports torch): `xgrammar.grammar` is imported under an empty
  package. A key that is not a `StructuredOutputsParams` field is reported (pydantic drops it).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import json
import pathlib
import sys
import types
from typing import Any, Dict, List, Optional

SGLANG_MODELS = ["sglang/srt/managers/io_struct.py"]
SGLANG_ROUTERS = ["sglang/srt/entrypoints/http_server.py"]
VLLM_MODELS = [
    "vllm/entrypoints/openai/completion/protocol.py",
    "vllm/entrypoints/openai/chat_completion/protocol.py",
    "vllm/entrypoints/serve/engine/protocol.py",
    "vllm/entrypoints/generate/base/protocol.py",
]
VLLM_ROUTERS = [
    "vllm/entrypoints/openai/completion/api_router.py",
    "vllm/entrypoints/openai/chat_completion/api_router.py",
]
VLLM_SAMPLING = "vllm/sampling_params.py"
VLLM_EXCEPTIONS = "vllm/exceptions.py"


class Models:
    """The classes and type aliases of some modules, read with `ast`."""

    def __init__(self, root: pathlib.Path, files: List[str]):
        self.classes: Dict[str, ast.ClassDef] = {}
        self.aliases: Dict[str, ast.expr] = {}
        for f in files:
            tree = ast.parse((root / f).read_text(), filename=f)
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, node)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    if node.value is not None:
                        self.aliases.setdefault(node.target.id, node.value)
                elif (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                ):
                    self.aliases.setdefault(node.targets[0].id, node.value)

    def fields(self, name: str) -> Dict[str, tuple]:
        """name -> (annotation, required) of a class and its bases in these modules."""
        cls = self.classes[name]
        out: Dict[str, tuple] = {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in self.classes:
                out.update(self.fields(base.id))
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            ann = node.annotation
            text = ast.unparse(ann)
            if text.startswith("ClassVar") or node.target.id == "model_config":
                continue
            required = node.value is None or (
                isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func).endswith("Field")
                and not node.value.args
                and not any(k.arg in ("default", "default_factory") for k in node.value.keywords)
            )
            out[node.target.id] = (ann, required)
        return out


def _name(node: ast.expr) -> str:
    return ast.unparse(node).split(".")[-1] if node is not None else ""


def check_type(v: Any, ann: ast.expr, models: Models, where: str, depth: int = 0) -> Optional[str]:
    """Why `v` does not fit the annotation, or None. Annotations this does not understand
    (another model's class, a custom validator) are taken as anything."""
    if depth > 8:
        return None
    if isinstance(ann, ast.Constant):
        if ann.value is None:
            return None if v is None else f"{where}: expected null, got {json.dumps(v)}"
        if isinstance(ann.value, str):
            return check_type(v, ast.parse(ann.value, mode="eval").body, models, where, depth + 1)
        return None
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        options = [ann.left, ann.right]
        return _union(v, options, models, where, depth)
    if isinstance(ann, ast.Subscript):
        head = _name(ann.value)
        args = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        if head == "Optional":
            return None if v is None else check_type(v, args[0], models, where, depth + 1)
        if head == "Union":
            return _union(v, args, models, where, depth)
        if head == "Annotated":
            return check_type(v, args[0], models, where, depth + 1) or _bounds(v, args[1:], where)
        if head == "Literal":
            allowed = [a.value for a in args if isinstance(a, ast.Constant)]
            return None if v in allowed else f"{where}: {json.dumps(v)} is not one of {allowed}"
        if head in ("List", "list", "Sequence", "Tuple", "tuple"):
            if not isinstance(v, list):
                return f"{where}: expected a list, got {json.dumps(v)}"
            if head in ("List", "list", "Sequence"):
                for i, x in enumerate(v):
                    err = check_type(x, args[0], models, f"{where}[{i}]", depth + 1)
                    if err:
                        return err
            return None
        if head in ("Dict", "dict", "Mapping"):
            if not isinstance(v, dict):
                return f"{where}: expected an object, got {json.dumps(v)}"
            if len(args) == 2:
                for k, x in v.items():
                    err = check_type(x, args[1], models, f"{where}[{k!r}]", depth + 1)
                    if err:
                        return err
            return None
        return None
    if isinstance(ann, (ast.Name, ast.Attribute)):
        name = _name(ann)
        if name == "bool":
            ok = isinstance(v, bool)
        elif name == "int":
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif name == "float":
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        elif name == "str":
            ok = isinstance(v, str)
        elif name in ("dict", "Dict"):
            ok = isinstance(v, dict)
        elif name in ("list", "List"):
            ok = isinstance(v, list)
        elif name in models.aliases:
            return check_type(v, models.aliases[name], models, where, depth + 1)
        elif name in models.classes:
            ok = isinstance(v, dict)
        else:
            return None
        return None if ok else f"{where}: expected {name}, got {json.dumps(v)}"
    return None


def _bounds(v: Any, metadata: List[ast.expr], where: str) -> Optional[str]:
    """The numeric bounds of a pydantic `Field(ge=.., le=.., gt=.., lt=..)`, where they are
    literal numbers."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    tests = {"ge": lambda a, b: a >= b, "le": lambda a, b: a <= b,
             "gt": lambda a, b: a > b, "lt": lambda a, b: a < b}
    for m in metadata:
        if not (isinstance(m, ast.Call) and _name(m.func) == "Field"):
            continue
        for k in m.keywords:
            try:
                bound = ast.literal_eval(k.value)
            except ValueError:
                continue
            if k.arg in tests and isinstance(bound, (int, float)) and not tests[k.arg](v, bound):
                return f"{where}: {v} is not {k.arg} {bound}"
    return None


def _union(v: Any, options: List[ast.expr], models: Models, where: str, depth: int) -> Optional[str]:
    flat: List[ast.expr] = []
    stack = list(options)
    while stack:
        o = stack.pop(0)
        if isinstance(o, ast.BinOp) and isinstance(o.op, ast.BitOr):
            stack[:0] = [o.left, o.right]
        else:
            flat.append(o)
    errors = [check_type(v, o, models, where, depth + 1) for o in flat]
    if any(e is None for e in errors):
        return None
    return f"{where}: {json.dumps(v)} fits none of {ast.unparse(ast.Tuple(elts=flat))}"


def route_model(routers: List[pathlib.Path], path: str, models: Models) -> Optional[str]:
    """The body model of `POST path` in the router modules; "" when the route takes no
    body; None when no module serves the route."""
    for f in routers:
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for dec in node.decorator_list:
                if not (isinstance(dec, ast.Call) and dec.args):
                    continue
                if _name(dec.func) not in ("post", "api_route", "put"):
                    continue
                first = dec.args[0]
                if not (isinstance(first, ast.Constant) and first.value == path):
                    continue
                for arg in node.args.args + node.args.kwonlyargs:
                    ann = arg.annotation
                    if ann is None:
                        continue
                    if isinstance(ann, ast.Subscript) and _name(ann.value) == "Annotated":
                        elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
                        ann = elts[0]
                    if _name(ann) in models.classes:
                        return _name(ann)
                return ""
    return None


def check_fields(body: Any, model: str, models: Models, server: str) -> List[str]:
    if not isinstance(body, dict):
        return [f"the body is not a JSON object: {json.dumps(body)}"]
    fields = models.fields(model)
    errors = []
    for key, value in body.items():
        if key not in fields:
            errors.append(
                f"`{key}` is not a field of {server}'s {model}: the server ignores it"
            )
            continue
        err = check_type(value, fields[key][0], models, key)
        if err:
            errors.append(err)
    for key, (_, required) in fields.items():
        if required and key not in body:
            errors.append(f"`{key}` is required by {server}'s {model}")
    return errors


class StructuredOutputs:
    """vLLM's `StructuredOutputsParams` and the xgrammar compile vLLM runs on it."""

    NAMES = [
        "MAX_STRUCTURED_OUTPUT_JSON_NESTING",
        "STRUCTURAL_TAG_WRAPPER_NESTING",
        "_exceeds_json_nesting",
        "check_json_nesting",
        "StructuredOutputsParams",
    ]

    def __init__(self, root: pathlib.Path):
        import pydantic

        exceptions: Dict[str, Any] = {"__name__": "graft_vllm_exceptions"}
        exec(compile((root / VLLM_EXCEPTIONS).read_text(), VLLM_EXCEPTIONS, "exec"), exceptions)
        # A registered module: pydantic's dataclass resolves its annotations there.
        mod = types.ModuleType("graft_vllm_sampling_params")
        sys.modules[mod.__name__] = mod
        mod.__dict__.update(
            json_mod=json,
            Any=Any,
            dataclass=pydantic.dataclasses.dataclass,
            field=dataclasses.field,
            VLLMValidationError=exceptions["VLLMValidationError"],
        )
        tree = ast.parse((root / VLLM_SAMPLING).read_text(), filename=VLLM_SAMPLING)
        picked = [n for n in tree.body if _defines(n) in self.NAMES]
        missing = set(self.NAMES) - {_defines(n) for n in picked}
        if missing:
            raise SystemExit(f"{VLLM_SAMPLING}: no {sorted(missing)}")
        exec(compile(ast.Module(body=picked, type_ignores=[]), VLLM_SAMPLING, "exec"), mod.__dict__)
        self.params = mod.StructuredOutputsParams
        self.adapter = pydantic.TypeAdapter(mod.StructuredOutputsParams)
        self.check_json_nesting = mod.check_json_nesting
        if "xgrammar" not in sys.modules:
            package = types.ModuleType("xgrammar")
            package.__path__ = [str(root / "xgrammar")]
            sys.modules["xgrammar"] = package
        # As xgrammar's `__init__` starts: the native library first.
        for name in ("exception", "load_binding"):
            importlib.import_module(f"xgrammar.{name}")
        self.grammar = importlib.import_module("xgrammar.grammar")

    def check(self, so: Any) -> List[str]:
        if so is None:
            return []
        where = "structured_outputs"
        try:
            params = self.adapter.validate_python(so)
        except Exception as e:  # pydantic's error, or the __post_init__'s VLLMValidationError
            return [f"{where}: vLLM's StructuredOutputsParams refuses {json.dumps(so)}: {e}"]
        fields = {f.name for f in dataclasses.fields(self.params) if f.init}
        errors = [
            f"{where}.{k} is not a field of vLLM's StructuredOutputsParams: vLLM drops it"
            for k in so
            if k not in fields
        ]
        Grammar = self.grammar.Grammar
        try:
            if params.structural_tag is not None:
                self.check_json_nesting(params.structural_tag, structural_tag=True)
                tag = json.loads(params.structural_tag)
                if "structures" in tag:
                    items = [
                        self.grammar.StructuralTagItem(
                            begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
                        )
                        for s in tag["structures"]
                    ]
                    Grammar.from_structural_tag(items, tag["triggers"])
                else:
                    Grammar.from_structural_tag(params.structural_tag)
            elif params.json is not None:
                self.check_json_nesting(params.json)
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                Grammar.from_json_schema(schema)
        except Exception as e:
            errors.append(f"{where}: vLLM's validation refuses it (xgrammar 0.2.8): {e}")
        return errors


def _defines(node: ast.stmt) -> Optional[str]:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


class Checker:
    def __init__(self, root: pathlib.Path):
        self.root = root
        spec = importlib.util.spec_from_file_location(
            "sglang_api_types", root / "sglang/api/v1/api_types.py"
        )
        assert spec and spec.loader
        self.api_types = importlib.util.module_from_spec(spec)
        sys.modules["sglang_api_types"] = self.api_types
        spec.loader.exec_module(self.api_types)
        self.sglang = Models(root, SGLANG_MODELS)
        self.vllm = Models(root, VLLM_MODELS)
        self.structured_outputs = StructuredOutputs(root)

    def check(self, server: str, path: str, body: Any) -> Dict[str, Any]:
        if server == "sglang" and path == "/generate":
            model, errors = "api_types.GenerateRequest", self.generate(body)
        elif server in ("sglang", "vllm"):
            models = self.sglang if server == "sglang" else self.vllm
            routers = SGLANG_ROUTERS if server == "sglang" else VLLM_ROUTERS
            model = route_model([self.root / r for r in routers], path, models)
            if model is None:
                errors = [f"{server} serves no POST {path}"]
            elif model == "":
                errors = (
                    []
                    if body in (None, {})
                    else [f"{server}'s {path} takes no body; it ignores {json.dumps(body)}"]
                )
            else:
                errors = check_fields(body, model, models, server)
                if server == "vllm" and isinstance(body, dict):
                    errors += self.structured_outputs.check(body.get("structured_outputs"))
        else:
            model, errors = None, [f"unknown server {server!r}"]
        return {"server": server, "path": path, "model": model, "ok": not errors, "errors": errors}

    def generate(self, body: Any) -> List[str]:
        t = self.api_types
        try:
            t.GenerateRequest.from_json_value(body)
        except t.JsonContractError as e:
            return [str(e)]
        import msgspec

        known = {f.name for f in msgspec.structs.fields(t.GenerateRequest)}
        return [
            f"`{k}` is not a field of SGLang's GenerateRequest: the server ignores it"
            for k in body
            if k not in known
        ]


def main() -> None:
    root = pathlib.Path(sys.argv[1])
    if sys.argv[2:3] == ["--strings"]:
        # Every string literal of one of the servers' files, to compare messages with.
        tree = ast.parse((root / sys.argv[3]).read_text())
        strings = sorted({n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)})
        json.dump({"strings": strings}, sys.stdout)
        return
    checker = Checker(root)
    bodies = json.load(sys.stdin)["bodies"]
    verdicts = [checker.check(b["server"], b["path"], b.get("body")) for b in bodies]
    json.dump({"verdicts": verdicts}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
