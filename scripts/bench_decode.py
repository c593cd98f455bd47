#!/usr/bin/env python3
"""The measuring half of scripts/bench-decode.sh (run it through that script: it makes the
venv, the model directory and the thread settings): `graft serve` against transformers'
`generate` on one model directory, on CPU, greedy, side by side.

For each batch size B and each side, timed runs with N = 1 (three: their median) and with
N = --tokens new tokens per sequence; decode tokens/s = B * (N - 1) / (t_N - t_1), so prefill, start-up and (for graft)
HTTP cancel out. Rounds alternate which side goes first; the table shows medians, then
every round's numbers. Writes a Markdown fragment to --out.

  graft serve:  started once (`--listen 127.0.0.1:0 --max-batch max(B)`, its stdout gives
                the address); batch B = B concurrent POST /generate with the prompt's
                `input_ids`, temperature 0, ignore_eos, max_new_tokens N, each on a
                connection opened beforehand; timed from the first request sent to the last
                answer read.
  transformers: AutoModelForCausalLM, float32, --attn attention, torch.set_num_threads;
                `generate` on B copies of the prompt (left-padded), do_sample False,
                min_new_tokens = max_new_tokens = N with no end-of-sequence token (the
                argmax is kept even when it is <|im_end|>, as graft's ignore_eos does),
                under inference_mode.
"""

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

QUESTION = "Explain in a few sentences why the sky is blue."


def log(msg):
    print(f"bench-decode: {msg}", file=sys.stderr, flush=True)


class GraftServe:
    """`graft serve` on a free port; its log goes to log_path."""

    def __init__(self, graft, model, max_batch, log_path):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [graft, "serve", "--model", model, "--listen", "127.0.0.1:0", "--max-batch", str(max_batch)],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        prefix = "graft serve listening on http://"
        line = self.proc.stdout.readline()
        if not line.startswith(prefix):
            self.proc.kill()
            raise SystemExit(f"bench-decode: graft serve did not start (first line {line!r}; its log: {log_path})")
        # "graft serve listening on http://127.0.0.1:PORT (Cpu)"
        addr, _, rest = line[len(prefix):].strip().partition(" ")
        self.device = rest.strip("()")
        self.host, _, port = addr.rpartition(":")
        self.port = int(port)
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        deadline = time.monotonic() + 60
        while True:
            try:
                status, _ = self.call("GET", "/health")
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"bench-decode: graft serve did not answer /health within 60 s; its log: {log_path}")
            time.sleep(0.1)

    def call(self, method, path, body=None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        try:
            conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def generate_batch(self, ids, batch, n):
        """B concurrent /generate requests; returns (seconds, the answers)."""
        body = json.dumps(
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            }
        ).encode()
        conns = [http.client.HTTPConnection(self.host, self.port, timeout=600) for _ in range(batch)]
        for c in conns:
            c.connect()
        go = threading.Barrier(batch + 1)
        answers = [None] * batch
        errors = []

        def one(i):
            try:
                go.wait()
                conns[i].request("POST", "/generate", body, {"Content-Type": "application/json"})
                r = conns[i].getresponse()
                data = r.read()
                if r.status != 200:
                    raise RuntimeError(f"/generate answered {r.status}: {data[:300]!r}")
                answers[i] = json.loads(data)
            except Exception as e:  # reported below, with the others
                errors.append(e)

        workers = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
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
            raise SystemExit(f"bench-decode: graft serve: {errors[0]}")
        for a in answers:
            got = len(a["output_ids"])
            if got != n:
                raise SystemExit(f"bench-decode: graft serve answered {got} tokens, not {n} (finish {a['meta_info'].get('finish_reason')})")
        return secs, answers

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Transformers:
    def __init__(self, model, attn, tokenizer):
        self.tok = tokenizer
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation=attn)
        self.model.eval()
        # No end-of-sequence token, as graft's ignore_eos: the argmax is taken even when it
        # is <|im_end|>, so both sides decode the same tokens. (min_new_tokens alone would
        # mask it instead, and the two would part at the model's first end.)
        self.model.generation_config.eos_token_id = None

    def generate_batch(self, ids, batch, n):
        enc = self.tok.pad({"input_ids": [ids] * batch}, padding=True, return_tensors="pt")
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(
                **enc,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=self.tok.pad_token_id,
            )
            secs = time.perf_counter() - t0
        new = out[:, enc["input_ids"].shape[1]:]
        if new.shape[1] != n:
            raise SystemExit(f"bench-decode: transformers generated {new.shape[1]} tokens, not {n}")
        return secs, new.tolist()


def agreeing(a, b):
    """How many leading tokens two sequences share."""
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graft", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",") if b]
    if not batches or min(batches) < 1:
        raise SystemExit(f"bench-decode: --batches takes sizes like 1,8, not {a.batches!r}")
    if a.tokens < 2:
        raise SystemExit(f"bench-decode: --tokens must be at least 2 (decode is t_N - t_1), not {a.tokens}")
    if a.rounds < 1:
        raise SystemExit(f"bench-decode: --rounds must be at least 1, not {a.rounds}")
    n = a.tokens

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 answers a BatchEncoding
        ids = ids["input_ids"]
    ids = [int(i) for i in ids]

    log(f"loading transformers ({a.attn}) and starting graft serve")
    hf = Transformers(a.model, a.attn, tok)
    serve_log = os.path.join(os.path.dirname(os.path.abspath(a.out)), "bench-decode-serve.log")
    graft = GraftServe(a.graft, a.model, max(batches), serve_log)
    sides = {"graft": graft, "transformers": hf}
    # secs[side][batch] = [(t_1, t_N) per round]; last tokens of each side for the check.
    secs = {s: {b: [] for b in batches} for s in sides}
    seqs = {s: {} for s in sides}
    try:
        for b in batches:  # warm-up, not measured
            for s in sides.values():
                s.generate_batch(ids, b, 2)
        for r in range(a.rounds):
            order = ["graft", "transformers"] if r % 2 == 0 else ["transformers", "graft"]
            for b in batches:
                for name in order:
                    # t_1 is short, so one stall would skew t_N - t_1: take the median of 3.
                    t1 = statistics.median(sides[name].generate_batch(ids, b, 1)[0] for _ in range(3))
                    tn, out = sides[name].generate_batch(ids, b, n)
                    secs[name][b].append((t1, tn))
                    seqs[name][b] = [x["output_ids"] for x in out] if name == "graft" else out
                    log(f"round {r + 1}/{a.rounds} batch {b} {name}: t_1 {t1:.3f} s, t_{n} {tn:.3f} s, decode {rate(b, n, t1, tn):.1f} tok/s")
    finally:
        graft.close()

    lines = [
        f"{a.threads} threads on both sides (graft serve: OMP_NUM_THREADS={a.threads}, libtorch's default pool; "
        f"transformers: torch.set_num_threads({a.threads})), CPU, float32, greedy. "
        f"torch {torch.__version__}, transformers {transformers.__version__} ({a.attn} attention). "
        f"graft serve on {graft.device}, `--max-batch {max(batches)}`.",
        "",
        f"The prompt: one chat-templated question ({len(ids)} tokens); B copies of it; N = {n} new tokens each, "
        f"{a.rounds} round(s), median. Decode tok/s = B·(N−1) / (t_N − t_1); t_1 (the median of 3 runs a round) "
        "is prefill + the first token (for graft, with the HTTP round trip).",
        "",
        "| batch | graft serve decode tok/s | transformers decode tok/s | graft / transformers "
        "| graft t_1 ms | transformers t_1 ms | greedy tokens equal (of N) |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in batches:
        g = statistics.median(rate(b, n, t1, tn) for t1, tn in secs["graft"][b])
        h = statistics.median(rate(b, n, t1, tn) for t1, tn in secs["transformers"][b])
        g1 = statistics.median(t1 for t1, _ in secs["graft"][b]) * 1000
        h1 = statistics.median(t1 for t1, _ in secs["transformers"][b]) * 1000
        same = min(agreeing(x, y) for x, y in zip(seqs["graft"][b], seqs["transformers"][b]))
        lines.append(f"| {b} | {g:.1f} | {h:.1f} | {g / h:.2f}x | {g1:.0f} | {h1:.0f} | {same} |")
    lines.append("")
    lines.append("Every round, decode tok/s (graft serve / transformers):")
    lines.append("")
    for b in batches:
        per = ", ".join(
            f"{rate(b, n, *gs):.1f} / {rate(b, n, *hs):.1f}" for gs, hs in zip(secs["graft"][b], secs["transformers"][b])
        )
        lines.append(f"- batch {b}: {per}")
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")


def rate(batch, n, t1, tn):
    return batch * (n - 1) / (tn - t1) if tn > t1 else float("nan")


if __name__ == "__main__":
    main()
