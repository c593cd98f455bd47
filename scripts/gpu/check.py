#!/usr/bin/env python3
"""The GPU check's parts, in order, each under its own `timeout`, the whole within a budget;
every figure to OUTDIR/figures.jsonl, each part's raw log beside it. Run by
scripts/gpu-check.sh (`run` on the GPU machine, `cpu` here); standard library only, so it
runs on any Python 3 -- the parts that need torch + transformers run under --hf-python and
are skipped, with a `skipped` line saying why, when there is none.

Parts (the `full` plan / the `tiny` one, for the CPU or a smoke run):
  matmul_peak          bf16 8192^3 matmul TFLOP/s (fp32 512^3 on the CPU): the MFU denominator
  trainer_bench SHAPE  graft's trainer bench binary on SHAPE (qwen3-0.6b, qwen3-1.7b, qwen3-4b
                       / tiny): GRPO step tokens/s, MFU, bare fwd+bwd, sampling, the per-step
                       checkpoint path and the in-process handoff (its Markdown table row and
                       any JSON line it prints); TMPDIR on /dev/shm when the checkpoint fits there
  hf_train SHAPE       transformers' own training step on the same shape, batch and length
  serve                graft serve against transformers generate (scripts/gpu/serve.py):
                       logprob agreement, decode tok/s per batch, the engine's own report, the
                       weight push through /update_weights_from_disk
  engine               the engine bench binary (GRAFT_GPU_CHECK_ENGINE_BENCH; bench `engine`)
                       in process, GRAFT_ENGINE_SYNC_TIMING=1: where a decode step's time goes
                       (forward, sampling, transfers, join, leave, bookkeeping) per batch
A part gets min(its cap, what the budget leaves after the later parts' floors); one that
would get less than its own floor is skipped. The 4B shape runs last: the first to go.

Figure kinds ("what"): run, host, gpu, build, part, skipped, python_env, matmul_peak,
trainer_bench, hf_train, train_compare, gpu_mem_peak, weights, serve_start,
logprob_agreement, decode, decode_summary, dmon, engine_info, weight_push, engine_step,
run_end.
"""
import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, figures, now, parameters, shape  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# Per plan: the training shapes with their batch x length, the serve settings, and the
# parts' caps and floors in seconds.
PLANS = {
    "full": dict(
        train=[("qwen3-0.6b", 8, 2048), ("qwen3-1.7b", 8, 2048), ("qwen3-4b", 4, 2048)],
        steps=3, gen_batch=32, gen_tokens=64,
        # The per-step path's checkpoint write and reload (22-72 s at 0.6B-1.7B on an H200,
        # ~16 bytes a parameter: 66 GiB at 4B) would take a third of the budget; the 4B
        # shape trains with activation checkpointing (without, 8 x 2048 does not fit).
        bench_flags=["--skip-per-step"], checkpoint_layers=["qwen3-4b"],
        serve=dict(shape="qwen3-0.6b", batches="1,32,128,256", tokens=128, prompt=64, rounds=2, lp_tokens=64),
        engine=dict(shape="qwen3-0.6b", batches=[1, 32, 128], tokens=64, prompt=64),
        caps={"matmul_peak": (45, 20), "trainer_bench": (100, 45), "hf_train": (70, 30), "serve": (210, 100),
              "engine": (60, 20)},
        budget=510,
    ),
    # A second, shorter run: serve and the engine, then 4B without activation checkpointing.
    "serve": dict(
        train=[("qwen3-4b", 4, 2048)],
        steps=3, gen_batch=32, gen_tokens=64, bench_flags=["--skip-per-step"], checkpoint_layers=[],
        serve=dict(shape="qwen3-0.6b", batches="1,32,128,256", tokens=128, prompt=64, rounds=2, lp_tokens=64),
        engine=dict(shape="qwen3-0.6b", batches=[1, 32, 128], tokens=64, prompt=64),
        caps={"matmul_peak": (45, 20), "trainer_bench": (100, 45), "hf_train": (70, 30), "serve": (210, 100),
              "engine": (60, 20)},
        budget=420,
    ),
    # The decode figures alone (serve and the engine): a third, shortest run.
    "decode": dict(
        train=[], matmul=False,
        steps=3, gen_batch=32, gen_tokens=64, bench_flags=[], checkpoint_layers=[],
        serve=dict(shape="qwen3-0.6b", batches="1,32,128,256", tokens=128, prompt=64, rounds=2, lp_tokens=64),
        engine=dict(shape="qwen3-0.6b", batches=[1, 32, 128], tokens=64, prompt=64),
        caps={"matmul_peak": (45, 20), "trainer_bench": (100, 45), "hf_train": (70, 30), "serve": (150, 60),
              "engine": (40, 15)},
        budget=200,
    ),
    "tiny": dict(
        train=[("tiny", 2, 64)],
        steps=2, gen_batch=2, gen_tokens=8,
        bench_flags=[], checkpoint_layers=[],
        serve=dict(shape="tiny-qwen3-vocab", batches="1,4,8", tokens=32, prompt=16, rounds=2, lp_tokens=32),
        engine=dict(shape="tiny-qwen3-vocab", batches=[1, 4], tokens=8, prompt=16),
        caps={"matmul_peak": (60, 10), "trainer_bench": (120, 20), "hf_train": (90, 20), "serve": (180, 40),
              "engine": (60, 10)},
        budget=420,
    ),
}


class Run:
    def __init__(self, a):
        self.a = a
        self.out = a.out
        self.fig = figures(a.out)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + a.budget
        self.failed = []
        self.peak = None
        self.nvsmi = shutil.which("nvidia-smi")

    def left(self):
        return self.deadline - time.monotonic()

    def part(self, name, kind, cmd, later_floor, env=None, log=None, skip_if=None):
        """Runs cmd under `timeout`; returns (status, rc, seconds). A `part` figure line
        records it (and, on a GPU, a `gpu_mem_peak` line from nvidia-smi sampled meanwhile).
        skip_if = (regex, reason): a failure whose log matches is a skip, for that reason."""
        cap, floor = self.a.plan["caps"][kind]
        limit = int(min(cap, self.left() - later_floor))
        if limit < floor:
            reason = f"{int(self.left())} s left in the {self.a.budget} s budget, {later_floor} s kept for later parts; this part needs {floor} s at least"
            self.fig.emit("skipped", part=name, reason=reason)
            self.fig.emit("part", part=name, status="skipped", reason=reason)
            return "skipped", None, 0.0
        log = log or os.path.join(self.out, re.sub(r"[^A-Za-z0-9.-]+", "-", name) + ".log")
        mem = self.sample_memory(name)
        print(f"gpu-check: {name} (up to {limit} s)", file=sys.stderr, flush=True)
        t = time.monotonic()
        with open(log, "w") as f:
            # GRAFT_GPU_CHECK_PART_LIMIT_S: so a part can leave room for its own last steps.
            rc = subprocess.call(["timeout", "-k", "10", str(limit), *cmd], stdout=f, stderr=subprocess.STDOUT,
                                 env={**os.environ, "NO_COLOR": "1", **(env or {}), "GRAFT_GPU_CHECK_PART_LIMIT_S": str(limit)},
                                 cwd=HERE)
        secs = time.monotonic() - t
        self.stop_memory(name, mem)
        status = "ok" if rc == 0 else "timeout" if rc in (124, 137) else "failed"
        rec = dict(part=name, status=status, rc=rc, seconds=round(secs, 1), limit_s=limit, log=os.path.basename(log))
        if status == "failed" and skip_if:
            with open(log, errors="replace") as f:
                if re.search(skip_if[0], f.read()):
                    status = rec["status"] = "skipped"
                    rec["reason"] = skip_if[1]
                    self.fig.emit("skipped", part=name, reason=skip_if[1])
        if status not in ("ok", "skipped"):
            self.failed.append(name)
            with open(log, errors="replace") as f:
                rec["log_tail"] = f.read()[-1500:]
        self.fig.emit("part", **rec)
        return status, rc, secs

    def sample_memory(self, name):
        if not self.nvsmi:
            return None
        path = os.path.join(self.out, "gpumem-" + re.sub(r"[^A-Za-z0-9.-]+", "-", name) + ".txt")
        p = subprocess.Popen([self.nvsmi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "200"],
                             stdout=open(path, "w"), stderr=subprocess.DEVNULL)
        return p, path

    def stop_memory(self, name, mem):
        if mem is None:
            return
        p, path = mem
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
        vals = []
        with open(path) as f:
            for line in f:
                line = line.strip().split(",")[0]
                if line.isdigit():
                    vals.append(int(line))
        if vals:
            self.fig.emit("gpu_mem_peak", part=name, mib=max(vals), first_mib=vals[0], samples=len(vals),
                          file=os.path.basename(path))

    def header(self):
        a = self.a
        plan = a.plan
        self.fig.emit("run", plan=a.plan_name, device_env=os.environ.get("GRAFT_DEVICE"), started=now(), budget_s=a.budget,
                      train=[dict(shape=s, batch=b, seq=t) for s, b, t in plan["train"]], steps=plan["steps"],
                      serve=plan["serve"], hf_python=bool(a.hf_python), bench=bool(a.bench))
        mem = None
        try:
            with open("/proc/meminfo") as f:
                mem = round(int(f.readline().split()[1]) / 2**20, 1)
        except (OSError, ValueError, IndexError):
            pass
        cpu = None
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        except OSError:
            pass
        self.fig.emit("host", cpus=os.cpu_count(), cpu=cpu, mem_gib=mem, machine=platform.machine(),
                      python=platform.python_version(), shm_free_gib=free_gib("/dev/shm"))
        if self.nvsmi:
            q = "name,memory.total,driver_version,clocks.max.sm,power.limit"
            r = subprocess.run([self.nvsmi, f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=60)
            for i, line in enumerate(r.stdout.strip().splitlines()):
                cols = [c.strip() for c in line.split(",")]
                self.fig.emit("gpu", index=i, **dict(zip(["name", "memory_mib", "driver", "sm_clock_max_mhz", "power_limit_w"], cols)))
        if a.manifest and os.path.exists(a.manifest):
            with open(a.manifest) as f:
                self.fig.emit("build", **json.load(f))
        else:
            self.fig.emit("build", graft=os.path.basename(a.graft), bench=os.path.basename(a.bench) if a.bench else None,
                          note="local binaries (no .gpu manifest)")

    def matmul(self, later):
        if not self.a.hf_python:
            self.fig.emit("skipped", part="matmul_peak", reason=self.a.hf_missing)
            return
        status, _, _ = self.part("matmul_peak", "matmul_peak", [self.a.hf_python, "matmul_peak.py", "--out", self.out], later)
        if status == "ok":
            for rec in read_figures(self.out):
                if rec.get("what") == "matmul_peak":
                    self.peak = rec["tflops"]

    def bench(self, name, batch, seq, later):
        a = self.a
        part = f"trainer_bench {name}"
        if not a.bench:
            self.fig.emit("skipped", part=part, reason="no trainer bench binary (build it: cargo build --profile ship -p graft-trainer --bench trainer)")
            return None
        plan = a.plan
        # The per-step path writes a checkpoint (weights + AdamW state, ~16 bytes a parameter)
        # to TMPDIR: /dev/shm when it fits there (so the figure is the trainer's, not a disk's).
        need = 16 * parameters(SHAPES[name]) * 1.1 / 2**30 if name in SHAPES else 0
        shm = free_gib("/dev/shm")
        env = {"GRAFT_LOG": os.environ.get("GRAFT_LOG", "info")}
        base = os.environ.get("TMPDIR", "/tmp")
        if shm is not None and shm > need and os.access("/dev/shm", os.W_OK):
            base = "/dev/shm"
        # A folder of its own, removed after the part: a bench killed mid-checkpoint would
        # otherwise leave gigabytes in /dev/shm (memory) for the parts after it.
        tmp = tempfile.mkdtemp(prefix="graft-gpu-check-", dir=base)
        env["TMPDIR"] = tmp
        md = os.path.join(self.out, f"trainer-{name}.md")
        cmd = [a.bench, "--shape", name, "--batch", str(batch), "--seq", str(seq), "--steps", str(plan["steps"]),
               "--gen-batch", str(plan["gen_batch"]), "--gen-tokens", str(plan["gen_tokens"]), "--out", md,
               *plan["bench_flags"]]
        if name in plan["checkpoint_layers"]:
            cmd.append("--checkpoint-layers")
        if self.peak:
            cmd += ["--peak-tflops", str(self.peak)]
        log = os.path.join(self.out, f"trainer-{name}.log")
        try:
            status, _, _ = self.part(part, "trainer_bench", cmd, later, env=env, log=log,
                                     skip_if=(r"unknown shape", f"the bench binary has no shape {name}"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if status != "ok":
            return None
        with open(log, errors="replace") as f:
            text = f.read()
        table = parse_table(open(md).read() if os.path.exists(md) else text, name)
        js = [o for o in json_lines(text) if o.get("shape", name) == name]
        rec = dict(shape=name, batch=batch, seq=seq, steps=plan["steps"], flags=cmd[cmd.index("--out") + 2:], tmpdir=base, tmpdir_free_gib=free_gib(base),
                   checkpoint_gib_est=round(need, 1), table=table, bench_json=js)
        rec["tokens_s"] = table.get("grpo_step_tokens_s")
        rec["mfu_pct"] = table.get("mfu_pct")
        self.fig.emit("trainer_bench", **rec)
        return rec

    def hf_train(self, name, batch, seq, later):
        part = f"hf_train {name}"
        if not self.a.hf_python:
            self.fig.emit("skipped", part=part, reason=self.a.hf_missing)
            return None
        cmd = [self.a.hf_python, "hf_train.py", "--shape", name, "--batch", str(batch), "--seq", str(seq),
               "--steps", str(self.a.plan["steps"]), "--out", self.out]
        if self.peak:
            cmd += ["--peak", str(self.peak)]
        status, _, _ = self.part(part, "hf_train", cmd, later, log=os.path.join(self.out, f"hf-train-{name}.log"))
        if status != "ok":
            return None
        recs = [r for r in read_figures(self.out) if r.get("what") == "hf_train" and r.get("shape") == name]
        return recs[-1] if recs else None

    def serve(self, later):
        a = self.a
        s = a.plan["serve"]
        py = a.hf_python or sys.executable
        # The pushed checkpoint goes to /dev/shm when it fits there twice over (a container's
        # /dev/shm can be 64 MB), else next to the served weights.
        need = 2 * 2 * parameters(shape(s["shape"])) / 2**30
        shm_free = free_gib("/dev/shm")
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) and shm_free is not None and shm_free > need else a.work
        shm = tempfile.mkdtemp(prefix="graft-gpu-check-", dir=base)  # removed after, even if serve.py was killed
        cmd = [py, "serve.py", "--graft", a.graft, "--shape", s["shape"], "--batches", s["batches"],
               "--tokens", str(s["tokens"]), "--prompt", str(s["prompt"]), "--rounds", str(s["rounds"]),
               "--lp-tokens", str(s["lp_tokens"]), "--work", a.work, "--shm", shm, "--out", self.out]
        try:
            self.part("serve", "serve", cmd, later, log=os.path.join(self.out, "serve.log"))
        finally:
            shutil.rmtree(shm, ignore_errors=True)

    def engine(self, later):
        a = self.a
        if not a.engine_bench:
            self.fig.emit("skipped", part="engine", reason="no engine bench binary (cargo build --profile ship -p graft-trainer --bench engine)")
            return
        e = a.plan["engine"]
        js = os.path.join(self.out, "engine.jsonl")
        cmd = [a.engine_bench, "--shape", e["shape"], "--tokens", str(e["tokens"]), "--prompt", str(e["prompt"]),
               "--json", js]
        for b in e["batches"]:
            cmd += ["--batch", str(b)]
        status, _, _ = self.part("engine", "engine", cmd, later, env={"GRAFT_ENGINE_SYNC_TIMING": "1"},
                                 log=os.path.join(self.out, "engine.log"))
        if status == "ok" and os.path.exists(js):
            with open(js) as f:
                for line in f:
                    rec = json.loads(line)
                    rec.pop("what", None)
                    self.fig.emit("engine_step", sync_timing=True, **rec)


def free_gib(path):
    try:
        st = os.statvfs(path)
        return round(st.f_bavail * st.f_frsize / 2**30, 1)
    except OSError:
        return None


def read_figures(out):
    with open(os.path.join(out, "figures.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def json_lines(text):
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                v = json.loads(line)
            except ValueError:
                continue
            if isinstance(v, dict):
                out.append(v)
    return out


def key(header):
    """'GRPO step tokens/s' -> 'grpo_step_tokens_s'; 'MFU' -> 'mfu_pct' (its cells are %)."""
    k = re.sub(r"[^a-z0-9]+", "_", header.lower()).strip("_")
    return "mfu_pct" if k == "mfu" else k


def number(cell):
    """'596.0M' -> 596000000.0, '1.27x' -> 1.27, '20.8%' -> 20.8, 'n/a' -> None; else the text."""
    c = cell.strip().replace("\u00d7", "").replace("%", "").strip()
    scale = 1.0
    if c[-1:] in ("M", "B", "k") and re.fullmatch(r"[0-9.]+[MBk]", c):
        scale = {"M": 1e6, "B": 1e9, "k": 1e3}[c[-1]]
        c = c[:-1]
    try:
        return float(c) * scale
    except ValueError:
        return None if c in ("n/a", "", "-") else cell.strip()


def parse_table(text, name):
    """The bench's Markdown row for `name`, keyed by its header."""
    header = None
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == "shape":
            header = [key(c) for c in cells]
        elif header and cells and cells[0] == name and len(cells) == len(header):
            return {k: number(v) for k, v in zip(header[1:], cells[1:])}
    return {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", choices=list(PLANS), required=True)
    ap.add_argument("--graft", required=True)
    ap.add_argument("--bench", default="")
    ap.add_argument("--engine-bench", default=os.environ.get("GRAFT_GPU_CHECK_ENGINE_BENCH", ""))
    ap.add_argument("--hf-python", default="", help="a Python with torch + transformers ('' for none)")
    ap.add_argument("--hf-missing", default="no torch + transformers Python")
    ap.add_argument("--manifest", default="")
    ap.add_argument("--work", required=True, help="scratch space (the served model directory)")
    ap.add_argument("--budget", type=int, default=0, help="seconds for the whole run (default: the plan's)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    a.plan_name = a.plan
    a.plan = PLANS[a.plan]
    a.budget = a.budget or a.plan["budget"]
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    r = Run(a)
    r.header()
    caps = a.plan["caps"]
    train = a.plan["train"]
    # The order: matmul, the first two shapes (bench, then transformers), serve, the last shape.
    steps = [("matmul", None)] if a.plan.get("matmul", True) else []
    first = 0 if a.plan_name in ("serve", "decode") else 2
    for t in train[:first]:
        steps += [("bench", t), ("hf", t)]
    steps.append(("serve", None))
    steps.append(("engine", None))
    for t in train[first:]:
        steps += [("bench", t), ("hf", t)]
    floors = {"matmul": caps["matmul_peak"][1], "bench": caps["trainer_bench"][1], "hf": caps["hf_train"][1],
              "serve": caps["serve"][1], "engine": caps["engine"][1]}
    benches = {}
    for i, (what, t) in enumerate(steps):
        later = sum(floors[w] for w, _ in steps[i + 1:])
        if what == "matmul":
            r.matmul(later)
        elif what == "bench":
            benches[t[0]] = r.bench(*t, later)
        elif what == "hf":
            h = r.hf_train(*t, later)
            g = benches.get(t[0])
            if g and h and g.get("tokens_s") and h.get("tokens_s"):
                r.fig.emit("train_compare", shape=t[0], batch=t[1], seq=t[2], graft_tokens_s=g["tokens_s"],
                           hf_tokens_s=h["tokens_s"], graft_over_hf=round(g["tokens_s"] / h["tokens_s"], 3),
                           graft_mfu_pct=g.get("mfu_pct"), hf_mfu_pct=h.get("mfu_pct"),
                           hf_peak_mem_gib=h.get("peak_mem_gib"))
        elif what == "engine":
            r.engine(later)
        else:
            r.serve(later)
    r.fig.emit("run_end", seconds=round(time.monotonic() - r.t0, 1), failed=r.failed)
    text = summary(read_figures(a.out))
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write(text)
    print(text, file=sys.stderr, flush=True)
    sys.exit(1 if r.failed else 0)


def summary(figs):
    """A few lines for a person reading the run's output (the figures file has it all)."""
    out = []

    def line(*parts):
        out.append(" ".join(str(p) for p in parts))

    for f in figs:
        w = f["what"]
        if w == "gpu":
            line("gpu:", f.get("name"), f.get("memory_mib"), "MiB, driver", f.get("driver"))
        elif w == "matmul_peak":
            line("matmul peak:", f["tflops"], "TFLOP/s", f["dtype"])
        elif w == "trainer_bench":
            line(f"graft train {f['shape']} {f['batch']}x{f['seq']}:", f.get("tokens_s"), "tok/s, MFU", f.get("mfu_pct"),
                 "%, per-step path", f["table"].get("per_step_path_s"), "s, handoff", f["table"].get("handoff_s"), "s")
        elif w == "hf_train":
            line(f"hf    train {f['shape']} {f['batch']}x{f['seq']}:", f.get("tokens_s"), "tok/s, MFU", f.get("mfu_pct"),
                 "%, peak mem", f.get("peak_mem_gib", f.get("peak_rss_gib")), "GiB", f.get("error", ""))
        elif w == "train_compare":
            line(f"  graft / hf {f['shape']}:", f["graft_over_hf"])
        elif w == "gpu_mem_peak":
            line(f"gpu mem peak {f['part']}:", f["mib"], "MiB")
        elif w == "logprob_agreement":
            line("logprobs max|diff| vs hf bf16", f["vs_hf_bf16"]["max_abs"], "fp32", f["vs_hf_fp32"]["max_abs"],
                 "floor (hf bf16 vs fp32)", f["floor_hf_bf16_vs_fp32"]["max_abs"])
        elif w == "decode_summary":
            line(f"decode batch {f['batch']}: graft", f["graft_tok_s"], "tok/s, hf", f.get("hf_tok_s"), "tok/s, graft/hf",
                 f.get("graft_over_hf"))
        elif w == "weight_push":
            line(f"push {f['push']} ({f['dir_fs']}): update_weights_from_disk", f["seconds"].get("update_weights_from_disk"),
                 "s, whole push", f["push_s"], "s, version ok", f["version_ok"])
        elif w == "engine_info" and f.get("status") == 200:
            line(f"engine_info {f['endpoint']}:", json.dumps(f["body"])[:300])
        elif w == "part" and f["status"] != "ok":
            line(f"part {f['part']}: {f['status']}", f.get("reason", f.get("log", "")))
        elif w == "skipped":
            line(f"skipped {f['part']}: {f['reason']}")
        elif w == "run_end":
            line("run:", f["seconds"], "s; failed:", ", ".join(f["failed"]) or "none")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
