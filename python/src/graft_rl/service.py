"""A client of graft's rollout service (``graft rollouts serve``), and adapters that plug it
into a trainer's own extension point.

The service runs each task's group of rollouts in the harness (envd sandboxes, gateway
sessions, the reward command) against the trainer's backends and streams one NDJSON line per
finished group; :meth:`RolloutClient.groups` yields them as they come, with the samples as
:class:`graft_rl.Sample` objects, so every ``to_*`` exporter applies. Standard library only
(``urllib``).
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from .samples import Sample, SampleError, _check


@dataclass
class Group:
    group_id: str
    task_id: str
    rollouts: list[dict]
    samples: list[Sample]
    stale_calls: int = 0
    calls_by_weight_version: dict = field(default_factory=dict)


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
    )
    _check(s)
    return s


class RolloutClient:
    """``RolloutClient("http://127.0.0.1:8500").groups(tasks, group_size=4, weight_version="step-3")``"""

    def __init__(self, url: str, timeout: float = 3600.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.last_summary: Optional[dict] = None

    def groups(
        self,
        tasks: Sequence[dict],
        group_size: int = 1,
        weight_version: Optional[str] = None,
        temperature: Optional[float] = None,
    ) -> Iterator[Group]:
        body = {"tasks": list(tasks), "group_size": group_size}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if temperature is not None:
            body["temperature"] = temperature
        req = urllib.request.Request(
            f"{self.url}/rollouts",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
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
                )
        raise SampleError("the rollout service closed the stream before its closing line")

    def samples(self, tasks: Sequence[dict], group_size: int = 1, **kwargs) -> list[Sample]:
        """Every sample of the batch, grouped, groups in the order of ``tasks``."""
        by_task = {g.task_id: g for g in self.groups(tasks, group_size, **kwargs)}
        return [s for t in tasks if t["id"] in by_task for s in by_task[t["id"]].samples]


def trl_rollout_func(client: RolloutClient, task_of_prompt: Callable[[object], dict], weight_version=None):
    """A TRL ``GRPOTrainer(rollout_func=...)``: TRL hands it the batch's prompts (each
    repeated ``num_generations`` times, consecutively); each distinct prompt becomes a task
    (``task_of_prompt(prompt)`` → ``{"id", "prompt", "reward": {"command"}}``) run as a group
    of ``num_generations`` rollouts, and the samples come back in TRL's order."""
    from .trl import to_trl

    def rollout_func(prompts, trainer):
        n = trainer.num_generations
        tasks = []
        for k in range(0, len(prompts), n):
            tasks.append(task_of_prompt(prompts[k]))
        version = weight_version(trainer) if callable(weight_version) else weight_version
        samples = client.samples(tasks, group_size=n, weight_version=version)
        return to_trl(samples, num_generations=n)

    return rollout_func
