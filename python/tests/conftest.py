"""Shared pieces: graft's samples schema written with pyarrow, and the samples real graft made.

``GRAFT_SAMPLES`` names a samples Parquet that real graft wrote (``tests/interop.rs`` runs
``graft rl`` in sandboxes and sets it); tests that read it fail, never skip, without it.
"""

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def _list(item):
    return pa.list_(pa.field("item", item, nullable=True))


# graft's `samples_schema()` (reconstruct/src/sample.rs), column for column, written out
# here on its own so that the reader is tested against the layout, not against itself;
# `test_real_graft_file_has_this_schema` checks it against a file graft wrote.
GRAFT_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.utf8(), nullable=False),
        pa.field("session_id", pa.utf8(), nullable=False),
        pa.field("group_id", pa.utf8(), nullable=True),
        pa.field("tokens", _list(pa.uint32()), nullable=False),
        pa.field("loss_mask", _list(pa.uint8()), nullable=False),
        pa.field("logprobs", _list(pa.float32()), nullable=False),
        pa.field("reward", pa.float64(), nullable=True),
        pa.field("weight_versions", _list(pa.utf8()), nullable=False),
        pa.field("call_ids", _list(pa.utf8()), nullable=False),
        pa.field("fork_reason", pa.utf8(), nullable=True),
        pa.field("tokenizer_fingerprint", pa.utf8(), nullable=False),
        pa.field("template_fingerprint", pa.utf8(), nullable=False),
        pa.field("schema_version", pa.uint32(), nullable=False),
        pa.field("token_weight_versions", _list(pa.utf8()), nullable=False),
        pa.field("token_calls", _list(pa.uint32()), nullable=False),
        pa.field("call_rewards", _list(pa.float64()), nullable=False),
        pa.field(
            "events",
            _list(
                pa.struct(
                    [
                        pa.field("kind", pa.utf8(), nullable=False),
                        pa.field("at", pa.uint32(), nullable=False),
                        pa.field("len", pa.uint32(), nullable=False),
                        pa.field("reason", pa.utf8(), nullable=False),
                        pa.field("call_id", pa.utf8(), nullable=False),
                        pa.field("other_sample", pa.utf8(), nullable=True),
                    ]
                )
            ),
            nullable=False,
        ),
        pa.field("logprob_kind", pa.utf8(), nullable=False),
        pa.field("thread", pa.utf8(), nullable=False),
        pa.field("thread_id", pa.utf8(), nullable=False),
        pa.field("thread_name", pa.utf8(), nullable=False),
        pa.field("parent_sample", pa.utf8(), nullable=True),
        pa.field(
            "rewrites",
            _list(
                pa.struct(
                    [
                        pa.field("kind", pa.utf8(), nullable=False),
                        pa.field("call_id", pa.utf8(), nullable=False),
                        pa.field("against_call", pa.utf8(), nullable=False),
                        pa.field("message", pa.uint32(), nullable=False),
                        pa.field("role", pa.utf8(), nullable=False),
                        pa.field("before", pa.utf8(), nullable=False),
                        pa.field("after", pa.utf8(), nullable=False),
                    ]
                )
            ),
            nullable=False,
        ),
        pa.field("branch_of", pa.utf8(), nullable=True),
        pa.field("branch_at", pa.uint32(), nullable=True),
    ]
)


def write_graft_samples(rows: list[dict], path: Path, schema: pa.Schema = GRAFT_SCHEMA) -> Path:
    """Rows (dicts by column name) as graft writes them, or in an older ``schema`` (a subset
    of the columns). Left out of a row: ``events`` (none), ``token_calls`` (unknown), ``call_rewards`` (none),
``logprob_kind`` (``post_temperature``), ``thread`` (``main``), ``thread_id`` (``unknown``),
``thread_name`` (empty), ``parent_sample`` (null) and ``rewrites`` (none)."""

    def value(r: dict, name: str):
        if name in r:
            return r[name]
        if name == "events":
            return []
        if name == "call_rewards":
            return [None] * len(r["call_ids"])
        if name == "token_calls":
            return [None] * len(r["tokens"])
        if name == "logprob_kind":
            return "post_temperature"
        defaults = {"thread": "main", "thread_id": "unknown", "thread_name": "", "parent_sample": None, "rewrites": [],
                "branch_of": None, "branch_at": None}
        if name in defaults:
            return defaults[name]
        raise KeyError(name)

    cols = {f.name: [value(r, f.name) for r in rows] for f in schema}
    pq.write_table(pa.Table.from_pydict(cols, schema=schema), path, compression="zstd")
    return path


@pytest.fixture(scope="session")
def graft_samples_path() -> Path:
    p = os.environ.get("GRAFT_SAMPLES")
    assert p, (
        "GRAFT_SAMPLES is not set: it names a samples Parquet made by real graft; "
        "`cargo test -p graft --features testkit --test interop` makes one and runs these tests"
    )
    path = Path(p)
    assert path.is_file(), f"GRAFT_SAMPLES={p} is not a file"
    return path
