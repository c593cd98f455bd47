"""Reads a graft Parquet export back with pyarrow AND duckdb; prints one JSON line.

usage: python read_parquet.py FILE
Both readers must agree on the row count and the call ids, else it exits non-zero.
"""

import json
import sys

import duckdb
import pyarrow
import pyarrow.parquet as pq


def main() -> None:
    path = sys.argv[1]
    table = pq.read_table(path)
    rows = table.to_pylist()
    con = duckdb.connect()
    duck = con.execute(
        "SELECT call_id, session_id, request FROM read_parquet(?) ORDER BY call_id", [path]
    ).fetchall()
    duck_columns = [d[0] for d in con.execute("DESCRIBE SELECT * FROM read_parquet(?)", [path]).fetchall()]
    if sorted(r["call_id"] for r in rows) != [d[0] for d in duck]:
        raise SystemExit(f"pyarrow and duckdb disagree on call ids: {rows} vs {duck}")

    def plain(v):
        # Parquet values as JSON: strings stay strings (the `request` column is a JSON string).
        if isinstance(v, (bytes, bytearray)):
            return v.decode("utf-8", "replace")
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (str, int, float, bool)) or v is None:
            return v
        return str(v)

    out = {
        "pyarrow_version": pyarrow.__version__,
        "duckdb_version": duckdb.__version__,
        "num_rows": table.num_rows,
        "columns": table.column_names,
        "column_types": {f.name: str(f.type) for f in table.schema},
        "duckdb_columns": duck_columns,
        "duckdb_rows": [{"call_id": c, "session_id": s, "request": plain(r)} for c, s, r in duck],
        "rows": [plain(r) for r in rows],
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
