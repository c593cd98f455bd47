#!/usr/bin/env python3
"""`graft serve` against transformers on one set of random Qwen3 weights, and the weight
push into graft serve. Run by scripts/gpu/check.py (the `serve` part); figure lines go to
OUTDIR/figures.jsonl, graft serve's log to OUTDIR/graft-serve.log, `nvidia-smi dmon -s u`
during the decode to OUTDIR/dmon.txt.

1. weights   common.write_model writes the shape once (bf16, seed 0) as an HF directory;
             graft serve and transformers both load it.
2. serve     `graft serve --model DIR --listen 127.0.0.1:0 --max-batch max(B)`; the time
             from the start to its first /health answer.
3. logprobs  graft's greedy tokens for one prompt (/generate with return_logprob), re-scored
             by transformers teacher-forced in bf16 and in fp32; the floor beside them is
             transformers bf16 against transformers fp32 on the same tokens.
4. decode    for each batch B: B concurrent /generate requests (each on a connection
             opened beforehand; greedy, ignore_eos) against one `generate` call on B
             copies of the prompt; N = 1 (median of 3) and N = --tokens, decode tokens/s =
             B (N - 1) / (t_N - t_1), so prefill, HTTP and start-up cancel out. --rounds
             rounds, alternating which side goes first; then the medians and graft / hf.
             A batch size that would not fit in the part's time limit (guessed from the
             previous one's time) is skipped with a `skipped` line, so steps 5 and 6 run.
5. engine    GET /get_server_info, /get_model_info and /graft/engine, each answer saved
             as it came (status and body): whatever the engine reports about itself,
             including where its steps spent their time, once it says so.
6. push      a second set of weights (seed 1) written to /dev/shm (--shm), then the
             trainer's push sequence (trainer/src/push.rs): /pause_generation {retract},
             /flush_cache, /update_weights_from_disk {model_path, load_format: auto,
             weight_version}, /continue_generation, each timed; twice (the second reloads
             the same directory). Checked: the version graft reports after, that its
             answer changed, and (first push) graft's logprobs against transformers on the
             new weights.

Without torch + transformers in this Python, steps 3 and the transformers side of 4 and 6
are skipped, each with a `skipped` figure line saying why; the graft side still runs.

Usage: serve.py --graft BIN --shape NAME --batches 1,32 --tokens N --prompt P --rounds R
                --work DIR --shm DIR --out OUTDIR"""
import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

from common import figures, init_rms, shape, write_model

try:
    import torch
    from transformers import Qwen3ForCausalLM
    HF_MISSING = None
except ImportError as e:
    torch = None
    HF_MISSING = f"no torch + transformers in {sys.executable} ({e})"

PREFIX = "graft serve listening on http://"
T0 = time.monotonic()


def log(msg):
    print(f"serve: {msg}", file=sys.stderr, flush=True)


class GraftServe:
    """`graft serve` on a free port; its stderr goes to log_path."""

    def __init__(self, graft, model, max_batch, log_path):
        self.log = open(log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [graft, "serve", "--model", model, "--listen", "127.0.0.1:0", "--max-batch", str(max_batch)],
            stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith(PREFIX):
            self.proc.kill()
            raise SystemExit(f"serve: graft serve did not start (first line {line!r}; its log: {log_path})")
        self.banner = line.strip()
        addr, _, rest = line[len(PREFIX):].strip().partition(" ")
        self.device = rest.strip("()")
        self.host, _, port = addr.rpartition(":")
        self.port = int(port)
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        deadline = time.monotonic() + 120
        while True:
            try:
                if self.call("GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"serve: graft serve did not answer /health within 120 s; its log: {log_path}")
            time.sleep(0.05)
        self.start_s = time.perf_counter() - t0

    def call(self, method, path, body=None, timeout=600):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def post(self, path, body):
        status, data = self.call("POST", path, body)
        if status != 200:
            raise SystemExit(f"serve: {path} answered {status}: {data[:300]!r}")
        return json.loads(data)

    def generate_batch(self, ids, batch, n):
        """`batch` concurrent /generate requests, each on a connection opened beforehand,
        released together; seconds from the release to the last answer read."""
        body = json.dumps({"input_ids": ids,
                           "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}).encode()
        conns = [http.client.HTTPConnection(self.host, self.port, timeout=600) for _ in range(batch)]
        for c in conns:
            c.connect()
        go = threading.Barrier(batch + 1)
        errors = []

        def one(c):
            try:
                go.wait()
                c.request("POST", "/generate", body, {"Content-Type": "application/json"})
                r = c.getresponse()
                data = r.read()
                if r.status != 200:
                    raise RuntimeError(f"/generate answered {r.status}: {data[:300]!r}")
                got = len(json.loads(data)["output_ids"])
                if got != n:
                    raise RuntimeError(f"/generate answered {got} tokens, not {n}")
            except Exception as e:  # reported below, with the others
                errors.append(e)

        workers = [threading.Thread(target=one, args=(c,)) for c in conns]
        for w in workers:
            w.start()
        go.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        secs = time.perf_counter() - t0
        for c in conns:
            c.close()
        if errors:
            raise SystemExit(f"serve: graft serve at batch {batch}: {errors[0]}")
        return secs

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def load_hf(model_dir, dtype, dev):
    return Qwen3ForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(dev).eval()


def hf_batch(model, ids, batch, n, dev):
    x = torch.tensor([ids] * batch, device=dev)
    sync()
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    sync()
    secs = time.perf_counter() - t
    if out.shape[1] != len(ids) + n:
        raise SystemExit(f"serve: transformers generated {out.shape[1] - len(ids)} tokens, not {n}")
    return secs


def graft_logprobs(s, ids, n):
    r = s.post("/generate", {"input_ids": ids, "return_logprob": True,
                             "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}})
    trip = r["meta_info"]["output_token_logprobs"]
    return [t[1] for t in trip], [t[0] for t in trip], r["meta_info"].get("weight_version")


def hf_logprobs(model, ids, out_ids, dev):
    """log-softmax (fp32) of the model's logits at each of out_ids' positions, teacher-forced."""
    full = torch.tensor([ids + out_ids], device=dev)
    with torch.inference_mode():
        logits = model(full).logits[0, len(ids) - 1:-1].float()
    return torch.log_softmax(logits, -1)


def compare(lp, out_ids, g_lp):
    """graft's logprobs of its tokens against lp's; argmax agreement with graft's tokens."""
    oi = torch.tensor(out_ids, device=lp.device)
    h = lp.gather(1, oi[:, None])[:, 0].double().cpu()
    d = (torch.tensor(g_lp, dtype=torch.float64) - h).abs()
    return dict(max_abs=round(d.max().item(), 5), mean_abs=round(d.mean().item(), 6),
                argmax_agree=round((lp.argmax(-1) == oi).float().mean().item(), 4))


def rate(batch, n, t1, tn):
    return batch * (n - 1) / max(tn - t1, 1e-9)


def start_dmon(path):
    if not shutil.which("nvidia-smi"):
        return None
    return subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "-o", "DT"], stdout=open(path, "w"),
                            stderr=subprocess.STDOUT)


def stop_dmon(p, path, fig):
    if p is None:
        return
    p.terminate()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
    sm = []
    with open(path) as f:
        for line in f:
            cols = line.split()
            # "#Date Time gpu sm mem enc dec jpg ofa": the sm column is the fourth.
            if line.startswith("#") or len(cols) < 4 or not cols[3].isdigit():
                continue
            sm.append(int(cols[3]))
    fig.emit("dmon", file=os.path.basename(path), samples=len(sm),
             sm_pct_mean=round(statistics.mean(sm), 1) if sm else None, sm_pct_max=max(sm) if sm else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graft", required=True)
    ap.add_argument("--shape", required=True)
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lp-tokens", type=int, default=64)
    ap.add_argument("--init-octave", type=int, default=-5)
    ap.add_argument("--work", required=True, help="where the served weights are written")
    ap.add_argument("--shm", required=True, help="where the pushed checkpoint is written (/dev/shm on the GPU machine)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    fig = figures(a.out)
    s = shape(a.shape)
    batches = [int(b) for b in a.batches.split(",")]
    hf = HF_MISSING is None
    dev = dtype = None
    if hf:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # The dtype transformers decodes in: graft's own on each device (bf16 on a GPU, fp32 on the CPU).
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    mdir = os.path.join(a.work, a.shape)
    t = time.perf_counter()
    size = write_model(mdir, a.shape, seed=0, init_octave=a.init_octave)
    fig.emit("weights", shape=a.shape, bytes=size, write_s=round(time.perf_counter() - t, 3), dtype="bfloat16",
             init_octave=a.init_octave, init_rms=round(init_rms(a.init_octave), 5), writer="scripts/gpu/common.py")

    g = __import__("random").Random(1)
    ids = [g.randrange(10, s["vocab_size"] - 10) for _ in range(a.prompt)]
    srv = GraftServe(a.graft, mdir, max(batches), os.path.join(a.out, "graft-serve.log"))
    fig.emit("serve_start", banner=srv.banner, device=srv.device, start_s=round(srv.start_s, 3), max_batch=max(batches))
    try:
        model = None
        if hf:
            model = load_hf(mdir, dtype, dev)
            out_ids, g_lp, _ = graft_logprobs(srv, ids, a.lp_tokens)
            model16 = model if dtype == torch.bfloat16 else load_hf(mdir, torch.bfloat16, dev)
            model32 = model if dtype == torch.float32 else load_hf(mdir, torch.float32, dev)
            lp16 = hf_logprobs(model16, ids, out_ids, dev)
            lp32 = hf_logprobs(model32, ids, out_ids, dev)
            oi = torch.tensor(out_ids, device=dev)[:, None]
            floor = (lp32.gather(1, oi) - lp16.gather(1, oi)).abs()
            fig.emit("logprob_agreement", shape=a.shape, tokens=len(out_ids), graft_device=srv.device,
                     vs_hf_bf16=compare(lp16, out_ids, g_lp), vs_hf_fp32=compare(lp32, out_ids, g_lp),
                     floor_hf_bf16_vs_fp32=dict(max_abs=round(floor.max().item(), 5), mean_abs=round(floor.mean().item(), 6),
                                                argmax_agree=round((lp32.argmax(-1) == lp16.argmax(-1)).float().mean().item(), 4)),
                     entropy_fp32_mean=round(-(lp32.exp() * lp32).sum(-1).mean().item(), 4))
            if model16 is not model:
                del model16
            if model32 is not model:
                del model32
        else:
            fig.emit("skipped", part="serve.logprob_agreement", reason=HF_MISSING)
            fig.emit("skipped", part="serve.decode.hf", reason=HF_MISSING)

        sides = [("graft", lambda b, n: srv.generate_batch(ids, b, n))]
        if hf:
            sides.append(("hf", lambda b, n: hf_batch(model, ids, b, n, dev)))
        dmon_path = os.path.join(a.out, "dmon.txt")
        dmon = start_dmon(dmon_path)
        # Warm-ups as long as the timed runs: transformers' cache grows by concatenation, so
        # its first run to a new length pays the allocator's growth (2-3x slower on an H200).
        warm = a.tokens
        try:
            for _, f in sides:
                f(2, warm)
            rates = {}
            # The part's time limit (check.py passes it): a batch size that would not leave
            # room for the engine report and the push is skipped, saying so. Its cost is
            # guessed from the previous one's times the batch ratio, at most 4 (decode time
            # grows with the batch, but far slower than it while the batch is small).
            limit = float(os.environ.get("GRAFT_GPU_CHECK_PART_LIMIT_S", "0"))
            reserve = max(15.0, 0.2 * limit)
            last = None
            for b in batches:
                took = time.monotonic()
                if limit and last is not None:
                    guess = last[1] * min(max(1.0, b / last[0]), 4.0)
                    if time.monotonic() - T0 + guess > limit - reserve:
                        fig.emit("skipped", part=f"serve.decode batch {b}",
                                 reason=f"batch {last[0]} took {last[1]:.0f} s; {limit - (time.monotonic() - T0):.0f} s of the part's {limit:.0f} s were left, {reserve:.0f} s kept for the push")
                        continue
                for _, f in sides:  # this batch size once, short, before it is timed
                    f(b, warm)
                for r in range(a.rounds):
                    order = sides if r % 2 == 0 else sides[::-1]
                    for name, f in order:
                        t1 = statistics.median(f(b, 1) for _ in range(3))
                        tn = f(b, a.tokens)
                        tok_s = rate(b, a.tokens, t1, tn)
                        rates.setdefault((name, b), []).append(tok_s)
                        fig.emit("decode", shape=a.shape, side=name, batch=b, round=r, tokens=a.tokens,
                                 t1_s=round(t1, 4), tn_s=round(tn, 4), tok_s=round(tok_s, 1), at=round(time.time(), 2))
                med = {name: statistics.median(rates[(name, b)]) for name, _ in sides}
                summary = dict(shape=a.shape, batch=b, rounds=a.rounds, graft_tok_s=round(med["graft"], 1))
                if "hf" in med:
                    summary.update(hf_tok_s=round(med["hf"], 1), graft_over_hf=round(med["graft"] / med["hf"], 3))
                fig.emit("decode_summary", **summary)
                last = (b, time.monotonic() - took)
        finally:
            stop_dmon(dmon, dmon_path, fig)

        for path in ("/get_server_info", "/get_model_info", "/graft/engine"):
            try:
                status, body = srv.call("GET", path, timeout=60)
                try:
                    body = json.loads(body)
                except ValueError:
                    body = body.decode(errors="replace")[:2000]
            except OSError as e:
                status, body = None, f"{type(e).__name__}: {e}"
            fig.emit("engine_info", endpoint=path, status=status, body=body)

        push(a, srv, ids, fig, hf, dev)
    finally:
        srv.close()


def push(a, srv, ids, fig, hf, dev):
    """The weight push: a checkpoint written to --shm, taken by graft serve through SGLang's
    update_weights_from_disk, between the trainer's pause and continue."""
    shm = os.path.join(a.shm, f"graft-gpu-check-{os.getpid()}")
    ckpt = os.path.join(shm, "ckpt")
    before_ids, before_lp, _ = graft_logprobs(srv, ids, 16)
    try:
        t = time.perf_counter()
        size = write_model(ckpt, a.shape, seed=1, init_octave=a.init_octave)
        write_s = time.perf_counter() - t
        for k in (1, 2):
            version = f"gpu-check-{k}"
            steps = {}
            t_all = time.perf_counter()
            for path, body in (
                ("/pause_generation", {"mode": "retract"}),
                ("/flush_cache", {}),
                ("/update_weights_from_disk", {"model_path": ckpt, "load_format": "auto", "weight_version": version}),
                ("/continue_generation", {}),
            ):
                t = time.perf_counter()
                status, data = srv.call("POST", path, body)
                steps[path.strip("/")] = round(time.perf_counter() - t, 4)
                if status != 200:
                    raise SystemExit(f"serve: push {k}: {path} answered {status}: {data[:300]!r}")
                if path == "/update_weights_from_disk":
                    answer = json.loads(data)
                    if not answer.get("success"):
                        raise SystemExit(f"serve: push {k}: update_weights_from_disk refused: {answer}")
            total = time.perf_counter() - t_all
            out_ids, g_lp, served_version = graft_logprobs(srv, ids, 16)
            rec = dict(shape=a.shape, push=k, dir_fs=fs_type(shm), bytes=size, write_s=round(write_s, 3) if k == 1 else None,
                       seconds=steps, push_s=round(total, 4), weight_version=served_version,
                       version_ok=served_version == version, changed=out_ids != before_ids or g_lp != before_lp)
            if hf and k == 1:
                new = load_hf(ckpt, torch.bfloat16 if dev.type == "cuda" else torch.float32, dev)
                rec["after_vs_hf"] = compare(hf_logprobs(new, ids, out_ids, dev), out_ids, g_lp)
                del new
            fig.emit("weight_push", **rec)
            if not rec["version_ok"] or not rec["changed"]:
                raise SystemExit(f"serve: push {k} did not land: {rec}")
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def fs_type(path):
    """The file system a path is on (tmpfs for /dev/shm), from /proc/mounts."""
    best, kind = "", "unknown"
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                cols = line.split()
                if len(cols) > 2 and (real == cols[1] or real.startswith(cols[1].rstrip("/") + "/")) and len(cols[1]) > len(best):
                    best, kind = cols[1], cols[2]
    except OSError:
        pass
    return kind


if __name__ == "__main__":
    main()
