"""``python -m graft_rl export --to NAME --samples FILE --out PATH``: what ``graft export`` runs.

``--format jsonl`` (the default) writes one JSON object per sample in the framework's own
field names and needs only pyarrow and numpy. ``--format native`` writes the framework's
own file: verl ``DataProto.save_to_disk``, slime's debug rollout data
(``torch.save({"rollout_id", "samples"})``), a pickled SkyRL ``GeneratorOutput``; it
needs that framework (``NATIVE_NEEDS``): without it the error names the package and its
install line. Either format writes a temp file beside ``--out`` and renames it on success,
so a failed export leaves nothing behind. The last line on stdout is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import sys
from pathlib import Path

import numpy as np

from . import samples as S
from .openrlhf import to_openrlhf
from .skyrl import skyrl_layout
from .slime import save_debug_rollout_data, to_slime
from .tinker import tinker_layout
from .trl import to_trl, to_trl_sft
from .verl import verl_layout

FORMATS = ("verl", "trl", "trl-sft", "skyrl", "openrlhf", "slime", "tinker")

# What --format native imports per framework, and how to install it (the versions the
# interop tier runs; the whole line per framework, one venv each: docs/INTEGRATIONS.md,
# "Installing a framework", from scripts/test-env/frameworks.txt).
NATIVE_NEEDS = {
    "verl": (
        "verl and torch",
        'pip install "verl==0.9.1" torch (Python 3.10 to 3.12; the tested line: docs/INTEGRATIONS.md, "Installing a framework")',
    ),
    "skyrl": (
        "skyrl",
        'pip install --no-deps "skyrl==0.4.0" "skyrl-gym==0.4.0" (Python >= 3.12; with the dependencies of the tested line: docs/INTEGRATIONS.md, "Installing a framework")',
    ),
    "slime": ("torch", "pip install torch (slime itself is not needed to write its file)"),
}


def _plain(v):
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def rows(to: str, samples: list[S.Sample], missing_reward):
    """One JSON-able dict per sample (per sequence) in ``to``'s field names."""
    if to == "verl":
        lps = S.batch_response_logprobs(samples)
        r = S.rewards(samples, missing_reward)
        for i, s in enumerate(samples):
            yield {
                "prompt_ids": s.prompt_ids,
                "response_ids": s.response_ids,
                "response_mask": s.response_mask,
                "response_logprobs": None if lps is None else lps[i],
                "reward_score": r[i],
                "num_turns": 2 * s.num_turns,
                "uid": S.group_key(s),
                "graft_sample_id": s.sample_id,
            }
    elif to == "trl":
        d = to_trl(samples, missing_reward=missing_reward)
        for i in range(len(d["prompt_ids"])):
            yield {k: v[i] for k, v in d.items()}
    elif to == "trl-sft":
        yield from to_trl_sft(samples)
    elif to == "skyrl":
        d = skyrl_layout(samples, missing_reward=missing_reward)
        per = ["prompt_token_ids", "response_ids", "rewards", "loss_masks", "rollout_logprobs", "trajectory_ids", "stop_reasons"]
        for i in range(len(samples)):
            row = {k: (d[k][i] if d[k] is not None else None) for k in per}
            g, k = row["trajectory_ids"]
            row["trajectory_ids"] = {"instance_id": g, "repetition_id": k}
            row["trajectory_id"] = row.pop("trajectory_ids")
            row["prompt_token_ids"] = row["prompt_token_ids"]
            yield row
    elif to == "openrlhf":
        for d in to_openrlhf(samples, missing_reward=missing_reward):
            d["action_ranges"] = [list(r) for r in d["action_ranges"]]
            yield d
    elif to == "slime":
        yield from to_slime(samples, missing_reward=missing_reward)
    elif to == "tinker":
        for s, d in zip(samples, tinker_layout(samples, missing_reward=missing_reward)):
            yield {
                "model_input": d["model_input"],
                "loss_fn_inputs": {k: _plain(v) for k, v in d.items() if k != "model_input"},
                "graft_sample_id": s.sample_id,
            }
    else:
        raise S.SampleError(f"unknown format {to!r}; one of {', '.join(FORMATS)}")


def export(to: str, src: list[str], out: Path, fmt: str, missing_reward) -> dict:
    samples = S.read_samples(src)
    if not samples:
        raise S.SampleError(f"{', '.join(src)} holds no sample")
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        n = 0
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            with open(tmp, "w") as f:
                for row in rows(to, samples, missing_reward):
                    f.write(json.dumps(row, default=_plain) + "\n")
                    n += 1
            tmp.replace(out)
        finally:
            tmp.unlink(missing_ok=True)
    elif to in NATIVE_NEEDS:
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            _write_native(to, samples, tmp, missing_reward)
            tmp.replace(out)
        except ImportError as err:
            what, install = NATIVE_NEEDS[to]
            raise S.SampleError(
                f"--format native --to {to} needs {what}, and {sys.executable} cannot import "
                f"{err.name or err}: install it with `{sys.executable} -m {install}`, "
                f"or export --format jsonl (pyarrow and numpy only); nothing was written"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
        n = len(samples)
    else:
        raise S.SampleError(f"--format native is for verl, slime and skyrl; {to!r} has jsonl")
    return {"to": to, "format": fmt, "samples": len(samples), "rows": n, "out": str(out)}


def _write_native(to: str, samples, path: Path, missing_reward) -> None:
    """The framework's own file for ``to`` at ``path`` (imports the framework)."""
    if to == "verl":
        from .verl import to_verl

        to_verl(samples, missing_reward=missing_reward).save_to_disk(str(path))
    elif to == "slime":
        save_debug_rollout_data(path, 0, samples, missing_reward=missing_reward)
    else:
        from .skyrl import to_skyrl

        output = to_skyrl(samples, missing_reward=missing_reward)
        with open(path, "wb") as f:
            pickle.dump(output, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="graft_rl")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="graft samples → a framework's layout")
    e.add_argument("--to", required=True, choices=FORMATS)
    e.add_argument("--samples", required=True, action="append", help="a graft samples Parquet (repeatable)")
    e.add_argument("--out", required=True, type=Path)
    e.add_argument("--format", default="jsonl", choices=("jsonl", "native"))
    e.add_argument("--missing-reward", type=float, default=None, help="reward for samples without one (default: refuse)")
    a = p.parse_args(argv)
    try:
        summary = export(a.to, a.samples, a.out, a.format, a.missing_reward)
    except (S.SampleError, OSError) as err:
        print(f"graft_rl export: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0
