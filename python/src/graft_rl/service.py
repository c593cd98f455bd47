"""A client of graft's rollout service (``graft rollouts serve``), and adapters that plug it
into a trainer's own extension point.

The service runs each task's group of rollouts in the harness (envd sandboxes, gateway
sessions, the reward command) against the trainer's backends and streams one NDJSON line per
finished group (or, with ``arrow=True``, one Arrow IPC stream with a record batch per group,
read with pyarrow); :meth:`RolloutClient.groups` yields them as they come, with the samples
as :class:`graft_rl.Sample` objects, so every ``to_*`` exporter applies. HTTP through the
standard library (``urllib``).

Per batch the trainer decides: ``weight_version`` (graft refuses the batch with HTTP 409
while a backend serves another version, and leaves out samples with tokens sampled by
another version unless ``allow_stale=True``), ``backends`` (the trainer's own SGLang
servers; the batch's sessions are spread over them), ``harness`` (a label of the service
config's harnesses, for tasks that name none), and ``sampling`` (the sessions' sampling
policy, enforced by graft's gateway) or just ``temperature``.

Each rollout and each sample carries a stop reason (in the answer, not in the samples
file): a sample's is the ``finish_reason`` recorded for its last call (``stop``,
``length``, ``tool_calls``, ``abort``), a rollout's is its last model call's, or
``timeout`` / ``error`` when the rollout was cut short; ``None`` where none was recorded.

The adapters that plug this client into each trainer's own extension point live in
:mod:`graft_rl.adapters` (verl agent loop, SkyRL generator, OpenRLHF agent executor, slime
rollout function); :func:`trl_rollout_func` here is TRL's.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from .samples import Sample, SampleError, _check, from_table

ARROW_STREAM = "application/vnd.apache.arrow.stream"


@dataclass
class Rollout:
    """One rollout of a group: its session, reward (``None`` unless scored), outcome
    (``"scored"``, ``"timed_out"`` or ``{"failed": why}``-like), stop reason, and the
    samples reconstructed from its session (none unless it was scored), with theirs."""

    session_id: str
    reward: Optional[float]
    outcome: object
    stop_reason: Optional[str]
    samples: list[Sample]
    sample_stop_reasons: list[Optional[str]]

    @property
    def scored(self) -> bool:
        return self.outcome == "scored" and bool(self.samples)

    def main_sample(self) -> tuple[Optional[Sample], Optional[str]]:
        """For a trainer that takes one sequence per rollout: the sample with the most
        trained tokens (the agent's own trajectory, not a harness's side call such as a
        title), with its stop reason; ``(None, None)`` for a rollout with no sample."""
        if not self.samples:
            return None, None
        k = max(range(len(self.samples)), key=lambda i: sum(self.samples[i].loss_mask))
        return self.samples[k], self.sample_stop_reasons[k]


@dataclass
class Group:
    group_id: str
    task_id: str
    rollouts: list[dict]
    samples: list[Sample]
    stale_calls: int = 0
    calls_by_weight_version: dict = field(default_factory=dict)
    stop_reasons: list[Optional[str]] = field(default_factory=list)
    """Aligned to ``samples``: each sample's stop reason."""
    stale_samples: int = 0
    """Samples left out because a token of theirs was sampled by another weight version
    than the batch's (0 with ``allow_stale``)."""

    def results(self) -> list[Rollout]:
        """The group's rollouts in order, each with its own samples."""
        out = []
        for r in self.rollouts:
            mine = [(s, why) for s, why in zip(self.samples, self.stop_reasons) if s.session_id == r["session_id"]]
            out.append(
                Rollout(
                    session_id=r["session_id"],
                    reward=r.get("reward"),
                    outcome=r.get("outcome"),
                    stop_reason=r.get("stop_reason"),
                    samples=[s for s, _ in mine],
                    sample_stop_reasons=[w for _, w in mine],
                )
            )
        return out


def _sample(d: dict) -> Sample:
    s = Sample(
        sample_id=d["sample_id"],
        session_id=d["session_id"],
        group_id=d.get("group_id"),
        tokens=[int(t) for t in d["tokens"]],
        loss_mask=[int(m) for m in d["loss_mask"]],
        logprobs=[None if x is None else float(x) for x in d["logprobs"]],
        reward=d.get("reward"),
        weight_versions=list(d.get("weight_versions") or []),
        token_weight_versions=list(d.get("token_weight_versions") or []),
        call_ids=list(d.get("call_ids") or []),
        token_calls=list(d.get("token_calls") or [None] * len(d["tokens"])),
        call_rewards=list(d.get("call_rewards") or [None] * len(d.get("call_ids") or [])),
        fork_reason=d.get("fork_reason"),
        events=list(d.get("events") or []),
        tokenizer_fingerprint=d.get("tokenizer_fingerprint") or "",
        template_fingerprint=d.get("template_fingerprint") or "",
        schema_version=int(d.get("schema_version") or 2),
        logprob_kind=d.get("logprob_kind") or "post_temperature",
        thread=d.get("thread") or "main",
        thread_id=d.get("thread_id") or "unknown",
        thread_name=d.get("thread_name") or "",
        parent_sample=d.get("parent_sample"),
        rewrites=list(d.get("rewrites") or []),
    )
    _check(s)
    return s


class RolloutClient:
    """``RolloutClient("http://127.0.0.1:8500").groups(tasks, group_size=4, weight_version="step-3")``

    ``backends``: the trainer's own SGLang servers every batch of this client names (unless a
    call gives its own); by default ``GRAFT_BACKENDS`` (comma-separated URLs) when set, so the
    adapters, built by the trainers' workers, take them from the environment."""

    def __init__(self, url: str, timeout: float = 3600.0, backends: Optional[Sequence[str]] = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.last_summary: Optional[dict] = None
        if backends is None:
            env = os.environ.get("GRAFT_BACKENDS", "")
            backends = [b.strip() for b in env.split(",") if b.strip()] or None
        self.backends = list(backends) if backends is not None else None

    def groups(
        self,
        tasks: Sequence[dict],
        group_size: int = 1,
        weight_version: Optional[str] = None,
        temperature: Optional[float] = None,
        *,
        sampling: Optional[dict] = None,
        harness: Optional[str] = None,
        backends: Optional[Sequence[str]] = None,
        allow_stale: bool = False,
        arrow: bool = False,
    ) -> Iterator[Group]:
        body: dict = {"tasks": list(tasks), "group_size": group_size}
        for k, v in (("weight_version", weight_version), ("temperature", temperature),
                     ("sampling", sampling), ("harness", harness)):
            if v is not None:
                body[k] = v
        backends = backends if backends is not None else self.backends
        if backends is not None:
            body["backends"] = list(backends)
        if allow_stale:
            body["allow_stale"] = True
        headers = {"content-type": "application/json"}
        if arrow:
            headers["accept"] = ARROW_STREAM
        req = urllib.request.Request(
            f"{self.url}/rollouts",
            data=json.dumps(body).encode(),
            headers=headers,
            method="POST",
        )
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise SampleError(f"the rollout service refused the batch (HTTP {e.code}): {_message(e)}") from None
        with resp:
            if arrow:
                yield from self._arrow_groups(resp)
                return
            for raw in resp:
                line = json.loads(raw)
                if line.get("done"):
                    self.last_summary = line
                    return
                if "error" in line:
                    raise SampleError(f"group {line.get('group_id')!r}: {line['error']}")
                yield Group(
                    group_id=line["group_id"],
                    task_id=line["task_id"],
                    rollouts=line["rollouts"],
                    samples=[_sample(s) for s in line["samples"]],
                    stale_calls=line.get("stale_calls", 0),
                    calls_by_weight_version=line.get("calls_by_weight_version", {}),
                    stop_reasons=[s.get("stop_reason") for s in line["samples"]],
                    stale_samples=line.get("stale_samples", 0),
                )
        raise SampleError("the rollout service closed the stream before its closing line")

    def _arrow_groups(self, resp) -> Iterator[Group]:
        """Groups from the service's Arrow IPC answer: one record batch (one row) per group,
        ``samples`` a list of structs in the samples file's schema plus ``stop_reason``."""
        import pyarrow as pa

        n_groups = n_rollouts = 0
        reader = pa.ipc.open_stream(resp)
        for batch in reader:
            for row in range(batch.num_rows):
                group_id = batch.column("group_id")[row].as_py()
                error = batch.column("error")[row].as_py()
                if error is not None:
                    raise SampleError(f"group {group_id!r}: {error}")
                structs = batch.column("samples")[row].values
                table = pa.Table.from_struct_array(structs)
                rollouts = []
                for r in batch.column("rollouts")[row].as_py():
                    detail = r.pop("outcome_detail")
                    if r["outcome"] != "scored" and r["outcome"] != "timed_out":
                        r["outcome"] = {r["outcome"]: detail}
                    rollouts.append(r)
                n_groups += 1
                n_rollouts += len(rollouts)
                yield Group(
                    group_id=group_id,
                    task_id=batch.column("task_id")[row].as_py(),
                    rollouts=rollouts,
                    samples=from_table(table) if table.num_rows else [],
                    stale_calls=batch.column("stale_calls")[row].as_py(),
                    calls_by_weight_version={
                        v["weight_version"]: v["calls"]
                        for v in batch.column("calls_by_weight_version")[row].as_py()
                    },
                    stop_reasons=table.column("stop_reason").to_pylist() if table.num_rows else [],
                    stale_samples=batch.column("stale_samples")[row].as_py(),
                )
        self.last_summary = {"done": True, "groups": n_groups, "rollouts": n_rollouts}

    def run(self, tasks: Sequence[dict], group_size: int = 1, **kwargs) -> dict[str, Group]:
        """The whole batch: each task's group by task id (task ids must be distinct)."""
        ids = [t["id"] for t in tasks]
        if len(set(ids)) != len(ids):
            raise SampleError(f"task ids repeat in one batch ({ids}); the service answers one group per task id")
        by_task = {g.task_id: g for g in self.groups(tasks, group_size, **kwargs)}
        missing = [i for i in ids if i not in by_task]
        if missing:
            raise SampleError(f"the rollout service answered no group for tasks {missing}")
        return by_task

    def samples(self, tasks: Sequence[dict], group_size: int = 1, **kwargs) -> list[Sample]:
        """Every sample of the batch, grouped, groups in the order of ``tasks``."""
        return [s for _, s, _ in self.samples_with_stop_reasons(tasks, group_size, **kwargs)]

    def samples_with_stop_reasons(
        self, tasks: Sequence[dict], group_size: int = 1, **kwargs
    ) -> list[tuple[str, Sample, Optional[str]]]:
        """``(task_id, sample, stop_reason)`` for every sample, groups in the order of ``tasks``."""
        by_task = {g.task_id: g for g in self.groups(tasks, group_size, **kwargs)}
        return [
            (t["id"], s, why)
            for t in tasks
            if t["id"] in by_task
            for s, why in zip(by_task[t["id"]].samples, by_task[t["id"]].stop_reasons)
        ]

    async def arun(self, tasks: Sequence[dict], group_size: int = 1, **kwargs) -> dict[str, Group]:
        """:meth:`run` from an asyncio loop (the trainers' agent loops are async): the
        blocking HTTP read runs in a worker thread."""
        import asyncio

        return await asyncio.to_thread(self.run, tasks, group_size, **kwargs)


def _message(e) -> str:
    """The service's error message from an HTTP error's JSON body."""
    try:
        return json.loads(e.read())["error"]["message"]
    except Exception:  # not the service's JSON: say what came
        return str(e)


def task_from(value, where: str) -> dict:
    """A graft task (``{"id", "prompt", "reward": {"command"}, ...}``) given as a dict or as
    its JSON text, as a dataset column can hold it."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise SampleError(f"{where} is not a graft task's JSON ({e}): {value[:200]!r}") from None
    if hasattr(value, "items") and not isinstance(value, dict):
        value = dict(value.items())  # an OmegaConf / numpy-held mapping
    if not isinstance(value, dict) or "id" not in value or "prompt" not in value:
        raise SampleError(
            f"{where} is not a graft task: it needs at least \"id\" and \"prompt\" (and \"reward\": "
            f"{{\"command\": ...}}), got {value!r:.200}"
        )
    return value


def trl_rollout_func(client: RolloutClient, task_of_prompt: Callable[[object], dict], weight_version=None, **batch):
    """A TRL ``GRPOTrainer(rollout_func=...)``: TRL hands it the batch's prompts (each
    repeated ``num_generations`` times, consecutively); each distinct prompt becomes a task
    (``task_of_prompt(prompt)`` → ``{"id", "prompt", "reward": {"command"}}``) run as a group
    of ``num_generations`` rollouts, and the samples come back in TRL's order. ``batch``:
    more of :meth:`RolloutClient.groups`'s options for every batch (``sampling``,
    ``harness``, ``backends``, ``allow_stale``, ``arrow``)."""
    from .trl import to_trl

    def rollout_func(prompts, trainer):
        n = trainer.num_generations
        tasks = []
        for k in range(0, len(prompts), n):
            tasks.append(task_of_prompt(prompts[k]))
        version = weight_version(trainer) if callable(weight_version) else weight_version
        samples = client.samples(tasks, group_size=n, weight_version=version, **batch)
        return to_trl(samples, num_generations=n)

    return rollout_func
