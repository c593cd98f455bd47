"""graft's rollout service as a slime rollout function (THUDM/slime; not on PyPI).

slime calls the function named by ``--rollout-function-path`` as
``generate_rollout(args, rollout_id, data_source, evaluation=False)`` and trains on the
``RolloutFnTrainOutput(samples=list[list[Sample]])`` it returns (``slime/rollout/
base_types.py``; a bare ``list[list[Sample]]`` is read the same way by
``call_rollout_fn``). Here each group from ``data_source.get_samples(args.rollout_batch_size)``
(``n_samples_per_prompt`` ``Sample`` objects of one prompt) becomes one graft task run as a
group of that many rollouts; each rollout's ``Sample`` is filled in place, as slime's own
rollout fills it: ``tokens`` (prompt + response), ``response_length``, ``loss_mask`` and
``rollout_log_probs`` over the response, ``reward``, ``weight_versions`` (one per model
turn), ``status`` (``COMPLETED``; ``TRUNCATED`` when the last call stopped at ``length``;
``ABORTED`` with ``remove_sample=True`` for a rollout that was not scored), ``session_id``
(graft's session) and graft's ids in ``metadata``. A rollout that reconstructs into several
samples gives them all, as a list of sibling ``Sample``s sharing ``rollout_id`` (slime's
contract for one rollout split into segments, ``docs/en/get_started/customization.md``).

The task of a group: its first sample's ``metadata["graft_task"]`` (``--metadata-key``), else
its ``label`` (``--label-key``), a dict or its JSON text.

slime config::

    --rollout-function-path graft_rl.adapters.slime.generate_rollout
    --eval-function-path slime.rollout.sglang_rollout.generate_rollout   # eval stays slime's
    # and GRAFT_ROLLOUTS_URL (optionally GRAFT_WEIGHT_VERSION) in the Ray runtime env

slime cannot be installed from PyPI, so this module imports nothing from it at import time
and is tested against slime's documented signature and ``Sample`` fields, not slime itself.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

from ..samples import SampleError, group_key
from ..service import RolloutClient, task_from
from ..slime import to_slime

FILLED = ("tokens", "response_length", "loss_mask", "rollout_log_probs", "reward", "weight_versions")
"""The fields of slime's ``Sample`` a rollout fills (besides status, session, metadata)."""


def _status(sample, name: str):
    st = getattr(type(sample), "Status", None)
    return getattr(st, name.upper()) if st is not None else name


def _task_of_group(group) -> dict:
    first = group[0]
    meta = getattr(first, "metadata", None) or {}
    if meta.get("graft_task") is not None:
        return task_from(meta["graft_task"], "the sample's metadata['graft_task']")
    if getattr(first, "label", None):
        return task_from(first.label, "the sample's label")
    raise SampleError(
        "the slime sample has no graft task: put {\"id\", \"prompt\", \"reward\": {\"command\"}} in the "
        "dataset column named by --metadata-key (as \"graft_task\") or by --label-key"
    )


def fill_group(group: list, results, stop_reasons_known: bool = True) -> list:
    """Fills a slime group (its ``Sample`` objects, in rollout order) from a graft group's
    rollouts; returns the group, a rollout with several samples as a list of siblings."""
    out = []
    for base, r in zip(group, results):
        rid = base.rollout_id if getattr(base, "rollout_id", None) is not None else base.index
        meta = dict(getattr(base, "metadata", None) or {})
        if not r.samples:
            base.tokens, base.response_length, base.loss_mask = list(base.tokens or [0]), 0, []
            base.rollout_log_probs, base.reward, base.weight_versions = None, 0.0, []
            base.remove_sample = True
            base.status = _status(base, "aborted")
            base.session_id = r.session_id
            base.metadata = {**meta, "graft_session_id": r.session_id, "graft_stop_reason": r.stop_reason,
                             "graft_outcome": r.outcome}
            out.append(base)
            continue
        siblings = []
        dicts = to_slime(r.samples)
        for k, (s, d, why) in enumerate(zip(r.samples, dicts, r.sample_stop_reasons)):
            x = base if k == 0 else copy.copy(base)
            for f in FILLED:
                setattr(x, f, d[f])
            x.rollout_id = rid
            x.session_id = r.session_id
            x.status = _status(x, "truncated" if why == "length" else "completed")
            x.metadata = {**meta, "graft_sample_id": s.sample_id, "graft_group_id": s.group_id,
                          "graft_stop_reason": why, "graft_group": group_key(s)}
            siblings.append(x)
        out.append(siblings[0] if len(siblings) == 1 else siblings)
    return out


def generate_rollout(args, rollout_id: int, data_source: Any, evaluation: bool = False):
    if evaluation:
        raise SampleError(
            "graft's slime rollout function runs training rollouts only; keep slime's own for evaluation: "
            "--eval-function-path slime.rollout.sglang_rollout.generate_rollout"
        )
    url = getattr(args, "graft_rollouts_url", None) or os.environ.get("GRAFT_ROLLOUTS_URL")
    if not url:
        raise SampleError("set GRAFT_ROLLOUTS_URL (the rollout service) in the environment of slime's rollout actor")
    version = getattr(args, "graft_weight_version", None) or os.environ.get("GRAFT_WEIGHT_VERSION")
    temperature = getattr(args, "rollout_temperature", None)
    started = time.monotonic()
    groups = data_source.get_samples(args.rollout_batch_size)
    client = RolloutClient(url)
    by_size: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_size.setdefault(len(g), []).append(i)
    out: list = [None] * len(groups)
    stale = unscored = 0
    for size, idx in by_size.items():
        tasks = []
        for i in idx:
            t = dict(_task_of_group(groups[i]))
            t["id"] = f"{t['id']}.{i}"
            tasks.append(t)
        answer = client.run(tasks, size, weight_version=version, temperature=temperature)
        for i, t in zip(idx, tasks):
            g = answer[t["id"]]
            stale += g.stale_calls
            results = g.results()
            unscored += sum(1 for r in results if not r.samples)
            out[i] = fill_group(groups[i], results)
    metrics = {
        "graft/stale_calls": stale,
        "graft/unscored_rollouts": unscored,
        "graft/rollout_secs": time.monotonic() - started,
        "graft/rollout_id": rollout_id,
    }
    try:
        from slime.rollout.base_types import RolloutFnTrainOutput
    except ImportError:  # slime not importable: its legacy return shape, which it reads the same
        return out
    return RolloutFnTrainOutput(samples=out, metrics=metrics)
