#!/usr/bin/env python3
"""Splits `perf record` samples of graft's gateway (and of the scripted upstream, the
baseline) into the call pipeline's phases and prints CPU microseconds per call.

Each sample is given to the innermost frame on its stack that names a phase (so serde_json
under `parse_request` counts as parsing, a `write` syscall under the WAL append as the WAL).
Used by scripts/profile-gateway.sh; run alone:
    python3 scripts/profile-phases.py --calls N --secs S --hz 997 gateway.perf.data [upstream.perf.data]
"""
import argparse
import collections
import re
import subprocess

# (phase, regex on a frame's symbol); the first phase whose pattern matches the innermost
# matching frame wins. Order matters only among patterns that can match the same frame.
PHASES = [
    ("socket I/O (read/write syscalls, both connections)", r"Registration::poll_io|Registration::poll_read_io|Registration::poll_write_io"),
    ("recorder hand-off to the blocking pool", r"blocking::pool|BlockingTask"),
    ("read + validate request", r"pipeline::parse_request|pipeline::read_body"),
    ("plan (dialect parse, upstream body)", r"Backend.*::plan|backend::openai::OpenAi::plan|dialect::.*::parse"),
    ("answer (parse upstream JSON, capture ids)", r"Passthrough as .*Answering.*::whole|pipeline::whole|Answering.*::event|pipeline::relay"),
    ("record build (copy + redact)", r"Call::build_record|redact_json"),
    ("WAL append + fsync", r"WalState::append|WalState::fsync|sync_data|fdatasync"),
    ("record encode (deltas + JSON)", r"WalState::encode|best_delta|Serialize for graft_recorder::record::StoredRecord|StoredRecord::from_call|writer::sanitize|serde_json::ser::to_vec|WalState::write_batch|graft_recorder::delta"),
    ("sealing (WAL to Parquet, in the background)", r"graft_recorder::seal|parquet::|arrow_|wal::SegmentReader|Deserialize for graft_recorder::record::StoredRecord"),
    ("recorder queue / acks", r"graft_recorder::writer::(Recorder::record|Writer)"),
    ("metrics", r"Call::observe|prometheus_client"),
    ("tracing", r"^tracing|tracing_subscriber|tracing_core"),
    ("upstream client (hyper client, pool)", r"hyper_util::client|hyper::client|backend::openai::OpenAi::request"),
    ("server (hyper h1 parse/encode, accept)", r"hyper::proto|hyper::server|hyper_util::server|testkit::server"),
    ("scripted upstream's own work", r"graft_testkit::(?!server)"),
    ("tokio scheduler, wakeups, epoll", r"tokio::runtime|epoll"),
]
COMPILED = [(name, re.compile(p)) for name, p in PHASES]


def samples(path):
    """Yields each sample's stack as a list of symbols, leaf first."""
    out = subprocess.run(
        ["perf", "script", "-i", path, "-F", "ip,sym", "--no-inline"],
        check=True, capture_output=True, text=True, errors="replace",
    ).stdout
    stack = []
    for line in out.splitlines():
        line = line.strip()
        if not line:
            if stack:
                yield stack
            stack = []
            continue
        parts = line.split(None, 1)
        stack.append(parts[1] if len(parts) > 1 else "[unknown]")
    if stack:
        yield stack


def classify(stack):
    for sym in stack:
        for name, rx in COMPILED:
            if rx.search(sym):
                return name
    leaf = stack[0] if stack else ""
    if "[unknown]" in leaf or leaf.startswith("0x"):
        return "kernel / unresolved (syscalls, TCP)"
    return "other"


def table(path, calls, hz):
    counts = collections.Counter(classify(s) for s in samples(path))
    total = sum(counts.values())
    per_sample_us = 1e6 / hz
    rows = []
    for name, n in counts.most_common():
        rows.append((name, n, n * per_sample_us / max(calls, 1)))
    return total, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, required=True)
    ap.add_argument("--secs", type=float, required=True)
    ap.add_argument("--hz", type=float, default=997)
    ap.add_argument("data", nargs="+")
    a = ap.parse_args()
    for path in a.data:
        total, rows = table(path, a.calls, a.hz)
        cpu = total / a.hz
        print(f"\n`{path.rsplit('/', 1)[-1]}`: {total} samples = {cpu:.2f} CPU-s over {a.secs:g} s "
              f"({cpu / a.secs:.2f} cores), {a.calls} calls, "
              f"{total * 1e6 / a.hz / max(a.calls, 1):.1f} µs CPU per call\n")
        print("| phase | samples | share | µs per call |")
        print("|---|---:|---:|---:|")
        for name, n, us in rows:
            print(f"| {name} | {n} | {100 * n / max(total, 1):.1f}% | {us:.1f} |")


if __name__ == "__main__":
    main()
