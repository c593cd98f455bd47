#!/usr/bin/env python3
"""The measuring half of scripts/bench-decode.sh (run it through that script: it makes the
venv, the model directory and the thread settings): `graft serve` against transformers'
`generate` on one model directory, on CPU, greedy, side by side.

For each batch size B and each side, timed runs with N = 1 (three: their median) and with
N = --tokens new tokens per sequence; decode tokens/s = B * (N - 1) / (t_N - t_1), so prefill, start-up and (for graft)
HTTP cancel out. Rounds alternate which side goes first; the table shows medians, then
every round's numbers. Writes a Markdown fragment to --out.

With --context C the prompt is one chat-templated user message of filler text (FILLER,
repeated, cut at a word) then the question, C tokens in all (or a few fewer, never more:
the exact count is printed), and each side runs once a round with N tokens, timing
the tokens as they come, so prefill (tens of seconds at long contexts, and varying) is
left out: graft serve streams (`"stream": true`: one `data: {...}` SSE event per token,
then `data: [DONE]`), and decode tokens/s = B * (N - 1) / (max over the B requests of the
arrival of the N-th token - max over them of the arrival of the first): once the last
request has its first token all B decode together (the engine prefills newcomers in a step
of their own, decoding nobody, so none is ahead then). transformers gets a streamer whose
put() records the time (the first put is the prompt, the next the first new token, one
more per token): decode tokens/s = B * (N - 1) / (last put - first new token's put).

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
from transformers.generation.streamers import BaseStreamer

QUESTION = "Explain in a few sentences why the sky is blue."
# --context's filler: a fixed paragraph, repeated and cut at a word, before the question.
FILLER = (
    "The river town kept its records in a long stone hall beside the market. Every spring the "
    "clerks copied the ledgers of the year before, counted the barrels of grain and salt that "
    "had come down the water, and wrote the names of the boats, their owners and their loads in "
    "neat columns. Visitors who asked to see the old books were given a lamp, a stool and an "
    "hour, and most of them left before the hour was out."
)


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

    def _concurrently(self, body, batch, read):
        """POSTs `body` to /generate on `batch` connections at once (opened beforehand);
        `read(response)` reads each answer. Returns (the send time, the seconds until every
        answer was read, the reads in order)."""
        conns = [http.client.HTTPConnection(self.host, self.port, timeout=600) for _ in range(batch)]
        for c in conns:
            c.connect()
        go = threading.Barrier(batch + 1)
        reads = [None] * batch
        errors = []

        def one(i):
            try:
                go.wait()
                conns[i].request("POST", "/generate", body, {"Content-Type": "application/json"})
                r = conns[i].getresponse()
                if r.status != 200:
                    raise RuntimeError(f"/generate answered {r.status}: {r.read()[:300]!r}")
                reads[i] = read(r)
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
        return t0, secs, reads

    def generate_batch(self, ids, batch, n):
        """B concurrent /generate requests; returns (seconds, the answers)."""
        body = json.dumps(
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
            }
        ).encode()
        _, secs, answers = self._concurrently(body, batch, lambda r: json.loads(r.read()))
        for a in answers:
            got = len(a["output_ids"])
            if got != n:
                raise SystemExit(f"bench-decode: graft serve answered {got} tokens, not {n} (finish {a['meta_info'].get('finish_reason')})")
        return secs, answers

    def generate_batch_stream(self, ids, batch, n):
        """B concurrent streamed /generate requests; returns (first token seconds, decode
        seconds, the answers): the first is from sending to the last request's first token,
        the second from that to the last request's N-th token."""
        body = json.dumps(
            {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
                "stream": True,
            }
        ).encode()

        def read_events(r):
            """(arrival time, the event's JSON text) per event, parsed after the run."""
            got = []
            while True:
                line = r.readline()
                t = time.perf_counter()
                if not line:
                    raise RuntimeError("the event stream ended before data: [DONE]")
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):].strip()
                if data == b"[DONE]":
                    return got
                got.append((t, data))

        t0, _, events = self._concurrently(body, batch, read_events)
        firsts, lasts, answers = [], [], []
        for got in events:
            first = last = answer = None
            for t, data in got:
                answer = json.loads(data)
                if "error" in answer:
                    raise SystemExit(f"bench-decode: graft serve: {answer['error']}")
                k = len(answer["output_ids"])
                if first is None and k >= 1:
                    first = t
                if last is None and k >= n:
                    last = t
            if answer is None or len(answer["output_ids"]) != n or first is None or last is None:
                k = len(answer["output_ids"]) if answer else 0
                raise SystemExit(f"bench-decode: graft serve streamed {k} tokens, not {n}")
            firsts.append(first)
            lasts.append(last)
            answers.append(answer)
        self.spread = (max(firsts) - min(firsts), max(lasts) - min(lasts))  # for the log
        return max(firsts) - t0, max(lasts) - max(firsts), answers

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

    def _generate(self, ids, batch, n, streamer=None):
        """generate() on `batch` left-padded copies of `ids`, exactly n new tokens, greedy;
        returns (seconds, the new tokens)."""
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
                streamer=streamer,
            )
            secs = time.perf_counter() - t0
        new = out[:, enc["input_ids"].shape[1]:]
        if new.shape[1] != n:
            raise SystemExit(f"bench-decode: transformers generated {new.shape[1]} tokens, not {n}")
        return secs, new

    def generate_batch(self, ids, batch, n):
        secs, new = self._generate(ids, batch, n)
        return secs, new.tolist()

    def generate_batch_stream(self, ids, batch, n):
        """generate() with a streamer; returns (first token seconds, decode seconds, the new
        tokens): from the call to the first new token's put, and from that to the last put."""
        streamer = PutTimes()
        t0 = time.perf_counter()
        _, new = self._generate(ids, batch, n, streamer)
        # The prompt's put, then one per new token.
        if len(streamer.times) != n + 1:
            raise SystemExit(f"bench-decode: the streamer got {len(streamer.times)} puts, not 1 + {n}")
        first, last = streamer.times[1], streamer.times[-1]
        return first - t0, last - first, new.tolist()


class PutTimes(BaseStreamer):
    """A generate() streamer that only records when each put() comes."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def agreeing(a, b):
    """How many leading tokens two sequences share."""
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def chat_ids(tok, content):
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 answers a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def context_ids(tok, context):
    """The --context prompt: the longest filler (FILLER repeated, cut at a word) + the
    question whose chat-templated ids number at most `context`."""
    words = FILLER.split()
    words = (words * (context // len(words) + 1))[:context]  # every word is at least one token

    def ids_for(k):
        return chat_ids(tok, " ".join(words[:k]) + "\n\n" + QUESTION)

    if len(ids_for(0)) > context:
        raise SystemExit(f"bench-decode: --context must be at least {len(ids_for(0))} (the question alone), not {context}")
    lo, hi = 0, len(words)  # ids_for(lo) fits; find the largest k that does
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # tries past the model's length warn, harmlessly
    try:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(ids_for(mid)) <= context:
                lo = mid
            else:
                hi = mid - 1
    finally:
        transformers.logging.set_verbosity(verbosity)
    return ids_for(lo), lo


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graft", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    p.add_argument("--context", type=int, default=0, help="prompt tokens (filler + the question); 0: the question alone, t_N - t_1")
    p.add_argument("--serve-log", help="graft serve's log (default: bench-decode-serve.log next to --out)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",") if b]
    if not batches or min(batches) < 1:
        raise SystemExit(f"bench-decode: --batches takes sizes like 1,8, not {a.batches!r}")
    if a.tokens < 2:
        raise SystemExit(f"bench-decode: --tokens must be at least 2 (decode is t_N - t_1), not {a.tokens}")
    if a.rounds < 1:
        raise SystemExit(f"bench-decode: --rounds must be at least 1, not {a.rounds}")
    if a.context < 0:
        raise SystemExit(f"bench-decode: --context must be a token count (0: off), not {a.context}")
    n = a.tokens

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    ids = chat_ids(tok, QUESTION)
    if a.context:
        warm_ids = ids
        ids, words = context_ids(tok, a.context)
        with open(os.path.join(a.model, "config.json")) as f:
            most = json.load(f).get("max_position_embeddings")
        if most and len(ids) + n > most:
            raise SystemExit(f"bench-decode: {len(ids)} prompt + {n} new tokens pass the model's {most} positions")
        log(f"--context {a.context}: the prompt is {len(ids)} tokens ({words} filler words, then the question)")

    log(f"loading transformers ({a.attn}) and starting graft serve")
    hf = Transformers(a.model, a.attn, tok)
    serve_log = a.serve_log or os.path.join(os.path.dirname(os.path.abspath(a.out)), "bench-decode-serve.log")
    graft = GraftServe(a.graft, a.model, max(batches), serve_log)
    sides = {"graft": graft, "transformers": hf}
    if a.context:
        try:
            lines = run_streamed(a, batches, n, ids, warm_ids, sides, graft)
        finally:
            graft.close()
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        return
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
        header(a, graft, batches),
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


def header(a, graft, batches):
    return (
        f"{a.threads} threads on both sides (graft serve: OMP_NUM_THREADS={a.threads}, libtorch's default pool; "
        f"transformers: torch.set_num_threads({a.threads})), CPU, float32, greedy. "
        f"torch {torch.__version__}, transformers {transformers.__version__} ({a.attn} attention). "
        f"graft serve on {graft.device}, `--max-batch {max(batches)}`."
    )


def run_streamed(a, batches, n, ids, warm_ids, sides, graft):
    """--context: one streamed run per side, batch and round; returns the Markdown lines."""
    # res[side][batch] = [(first token s, decode s) per round]; last tokens for the check.
    res = {s: {b: [] for b in batches} for s in sides}
    seqs = {s: {} for s in sides}
    for b in batches:  # warm-up on the short prompt, not measured (prefill is left out anyway)
        for s in sides.values():
            s.generate_batch(warm_ids, b, 2)
    for r in range(a.rounds):
        order = ["graft", "transformers"] if r % 2 == 0 else ["transformers", "graft"]
        for b in batches:
            for name in order:
                first, dec, out = sides[name].generate_batch_stream(ids, b, n)
                res[name][b].append((first, dec))
                seqs[name][b] = [x["output_ids"] for x in out] if name == "graft" else out
                # graft: how far apart the B requests' first (and last) tokens came; apart
                # first tokens mean separate prefills, the earlier rows waiting meanwhile.
                spread = ""
                if name == "graft" and b > 1:
                    spread = f" (the {b} requests' first tokens {graft.spread[0] * 1000:.0f} ms apart, last {graft.spread[1] * 1000:.0f} ms)"
                log(
                    f"round {r + 1}/{a.rounds} batch {b} {name}: first token {first:.3f} s, "
                    f"{n - 1} more in {dec:.3f} s, decode {srate(b, n, dec):.1f} tok/s{spread}"
                )
    lines = [
        header(a, graft, batches),
        "",
        f"The prompt: one chat-templated user message, filler text (a fixed paragraph repeated) then the question: "
        f"{len(ids)} tokens (`--context {a.context}`); B copies of it; N = {n} new tokens each, "
        f"{a.rounds} round(s), median. Decode tok/s from streamed token times, prefill excluded: "
        "B·(N−1) / (time of the N-th token − time of the first). graft serve: `/generate` with `\"stream\": true`, "
        "the arrival of each request's first and N-th token event, the latest of each over the B requests; "
        "transformers: `generate` with a streamer that records when each token is put. "
        "First token ms: from sending (graft: to the last request's first token) or calling `generate`, "
        "i.e. prefill + the first token.",
        "",
        f"| batch | context tokens | graft serve decode tok/s | transformers decode tok/s | graft / transformers "
        "| graft first token ms | transformers first token ms | greedy tokens equal (of N) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in batches:
        g = statistics.median(srate(b, n, d) for _, d in res["graft"][b])
        h = statistics.median(srate(b, n, d) for _, d in res["transformers"][b])
        g1 = statistics.median(f for f, _ in res["graft"][b]) * 1000
        h1 = statistics.median(f for f, _ in res["transformers"][b]) * 1000
        same = min(agreeing(x, y) for x, y in zip(seqs["graft"][b], seqs["transformers"][b]))
        lines.append(f"| {b} | {len(ids)} | {g:.1f} | {h:.1f} | {g / h:.2f}x | {g1:.0f} | {h1:.0f} | {same} |")
    lines.append("")
    lines.append("Every round, decode tok/s (graft serve / transformers):")
    lines.append("")
    for b in batches:
        per = ", ".join(
            f"{srate(b, n, gd):.1f} / {srate(b, n, hd):.1f}"
            for (_, gd), (_, hd) in zip(res["graft"][b], res["transformers"][b])
        )
        lines.append(f"- batch {b}: {per}")
    return lines


def srate(batch, n, secs):
    return batch * (n - 1) / secs if secs > 0 else float("nan")


def rate(batch, n, t1, tn):
    return batch * (n - 1) / (tn - t1) if tn > t1 else float("nan")


if __name__ == "__main__":
    main()
