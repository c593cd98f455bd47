"""graft's rollout service as a SkyRL generator (``skyrl==0.4.0``).

SkyRL's trainer calls ``GeneratorInterface.generate(GeneratorInput) -> GeneratorOutput``
(``skyrl/train/generators/base.py``) with each prompt repeated ``n_samples_per_prompt``
times and ``trajectory_ids`` naming the group (``instance_id``) and the repetition.
:class:`GraftGenerator` runs each instance as one graft task's group of that many rollouts
(one ``POST /rollouts`` per distinct group size) and answers in the input's order, with
``stop_reasons`` from the service (the last call's ``finish_reason``: ``stop``, ``length``,
``tool_calls``, ``abort``; or ``timeout`` / ``error`` for a rollout cut short), so SkyRL's
``zero_reward_on_non_stop`` and ``apply_overlong_filtering`` apply as to its own generator.
``env_metrics`` (one dict per row) names each row's graft session, group and outcome.

The task of a row: ``env_extras[i]["graft_task"]`` (a dict or its JSON text; a dataset
column SkyRL passes through as an env extra), or ``task_of(prompt, env_extra)``.

SkyRL config: subclass its experiment and return this generator::

    from skyrl.train.entrypoints.main_base import BasePPOExp
    from graft_rl.adapters.skyrl import GraftGenerator

    class GraftExp(BasePPOExp):
        def get_generator(self, cfg, tokenizer, inference_engine_client):
            return GraftGenerator("http://127.0.0.1:8500", tokenizer=tokenizer)
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Optional

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput
from skyrl.train.generators.utils import get_rollout_metrics

from ..samples import SampleError
from ..service import RolloutClient, task_from


def _default_task_of(prompt, extra) -> dict:
    if not extra or "graft_task" not in extra:
        raise SampleError(
            "the SkyRL row has no graft task: give the dataset a \"graft_task\" column (it reaches the "
            "generator in env_extras) holding {\"id\", \"prompt\", \"reward\": {\"command\"}}, or pass task_of"
        )
    return task_from(extra["graft_task"], "env_extras[i]['graft_task']")


class GraftGenerator(GeneratorInterface):
    def __init__(
        self,
        url: str,
        tokenizer=None,
        task_of: Optional[Callable[[Any, Optional[dict]], dict]] = None,
        weight_version: Optional[Callable[[Any], Optional[str]] | str] = None,
        unscored: str = "mask",
        timeout: float = 3600.0,
    ):
        if unscored not in ("mask", "raise"):
            raise SampleError(f"unscored={unscored!r}: use \"mask\" or \"raise\"")
        self.client = RolloutClient(url, timeout=timeout)
        self.eos = getattr(tokenizer, "eos_token_id", None) or 0
        self.task_of = task_of or _default_task_of
        self.weight_version = weight_version
        self.unscored = unscored

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        prompts = input_batch["prompts"]
        n = len(prompts)
        extras = input_batch.get("env_extras") or [None] * n
        tids = input_batch.get("trajectory_ids")
        sp = input_batch.get("sampling_params") or {}
        meta = input_batch.get("batch_metadata")
        version = self.weight_version(meta) if callable(self.weight_version) else self.weight_version
        started = time.monotonic()

        # Rows by group, in first-seen order; a group's rows are its rollouts in order.
        rows_of: dict[str, list[int]] = {}
        task_of_group: dict[str, dict] = {}
        for i in range(n):
            task = self.task_of(prompts[i], extras[i])
            key = tids[i].instance_id if tids is not None else task["id"]
            rows_of.setdefault(key, []).append(i)
            task_of_group.setdefault(key, task)
        # One request per group size; task ids made distinct within a request.
        by_size: dict[int, list[str]] = {}
        for key, rows in rows_of.items():
            by_size.setdefault(len(rows), []).append(key)
        sent: list[tuple[int, list[tuple[str, dict]]]] = []
        for size, keys in by_size.items():
            tasks = []
            for k, key in enumerate(keys):
                t = dict(task_of_group[key])
                t["id"] = f"{t['id']}.{k}"
                tasks.append((key, t))
            sent.append((size, tasks))
        answers = await asyncio.gather(
            *(
                self.client.arun([t for _, t in tasks], size, weight_version=version, temperature=sp.get("temperature"))
                for size, tasks in sent
            )
        )

        out_prompt: list = [None] * n
        out_resp: list = [None] * n
        out_mask: list = [None] * n
        out_lps: list = [None] * n
        rewards: list = [None] * n
        stops: list = [None] * n
        env_metrics: list = [None] * n
        left_out = unscored = stale = 0
        for (size, tasks), groups in zip(sent, answers):
            for key, t in tasks:
                g = groups[t["id"]]
                stale += g.stale_calls
                results = g.results()
                if len(results) != size:
                    raise SampleError(f"group {g.group_id}: {len(results)} rollouts for {size} SkyRL rows")
                for row, r in zip(rows_of[key], results):
                    s, why = r.main_sample()
                    env_metrics[row] = {
                        "graft_session_id": r.session_id,
                        "graft_group_id": g.group_id,
                        "graft_outcome": r.outcome if isinstance(r.outcome, str) else json.dumps(r.outcome),
                        "graft_samples": len(r.samples),
                    }
                    if s is None:
                        if self.unscored == "raise":
                            raise SampleError(f"graft rollout {r.session_id} of task {t['id']!r} was not scored: {r.outcome}")
                        unscored += 1
                        out_prompt[row], out_resp[row], out_mask[row] = [self.eos], [self.eos], [0]
                        out_lps[row], rewards[row], stops[row] = [0.0], 0.0, r.stop_reason or "error"
                        continue
                    left_out += len(r.samples) - 1
                    out_prompt[row], out_resp[row], out_mask[row] = s.prompt_ids, s.response_ids, s.response_mask
                    known = s.sampled_logprobs_known()
                    out_lps[row] = [0.0 if x is None else x for x in s.response_logprobs] if known else None
                    rewards[row] = float(s.reward if s.reward is not None else r.reward or 0.0)
                    stops[row] = why or r.stop_reason
        # SkyRL takes logprobs for the whole batch or for none of it.
        logprobs = out_lps if all(x is not None for x in out_lps) else None
        metrics = get_rollout_metrics(out_resp, rewards, loss_masks=out_mask)
        metrics.update(
            {
                "graft/unscored_rollouts": unscored,
                "graft/samples_left_out": left_out,
                "graft/stale_calls": stale,
                "graft/generate_secs": time.monotonic() - started,
            }
        )
        return GeneratorOutput(
            prompt_token_ids=out_prompt,
            response_ids=out_resp,
            rewards=rewards,
            loss_masks=out_mask,
            stop_reasons=stops,
            rollout_metrics=metrics,
            rollout_logprobs=logprobs,
            trajectory_ids=list(tids) if tids is not None else None,
            trajectory_generation_times=None,
            trajectory_time_splits=None,
            rollout_expert_indices=None,
            rollout_sample_support=None,
            is_last_step=None,
            env_metrics=env_metrics,
            pixel_values=None,
            image_grid_thw=None,
        )
