"""graft's rollout service as a verl agent loop (``verl==0.9.1``).

verl runs one ``AgentLoopBase.run(sampling_params, **row)`` per row of its batch (each
prompt repeated ``rollout.n`` times, GRPO groups by ``uid``) and turns the
``AgentLoopOutput`` it returns into the training batch (``AgentLoopWorker._postprocess``,
``verl/experimental/agent_loop/agent_loop.py``). :class:`GraftAgentLoop` runs that row as one
rollout of a graft task through ``graft rollouts serve``: the row's ``graft_task`` column
(or ``extra_info["graft_task"]``; a dict or its JSON text) is the task.

verl config (the agent loop file and the dataset column)::

    # graft_agent.yaml
    - name: graft
      _target_: graft_rl.adapters.verl.GraftAgentLoop
      graft_url: http://127.0.0.1:8500        # or GRAFT_ROLLOUTS_URL in the workers' env

    actor_rollout_ref.rollout.mode=async
    actor_rollout_ref.rollout.agent.agent_loop_config_path=graft_agent.yaml
    actor_rollout_ref.rollout.agent.default_agent_loop=graft   # or an agent_name column

The output: ``prompt_ids`` / ``response_ids`` / ``response_mask`` from graft's loss mask,
``response_logprobs`` (when ``rollout.calculate_log_probs``; 0.0 on mask-0 tokens), graft's
reward as ``reward_score`` (so verl's reward loop does not score it again), and in
``extra_fields`` the session, sample, stop reason, outcome and left-out samples. Too long
for ``rollout.prompt_length`` / ``response_length``: cut the way verl's own loops cut
(the prompt's start, the response's end), marked ``graft_truncated``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from ..samples import SampleError
from ..service import RolloutClient, task_from


def _task_of_row(row: dict, key: str) -> dict:
    if key in row and row[key] is not None:
        return task_from(row[key], f"the row's {key!r} column")
    extra = row.get("extra_info")
    if extra is not None and hasattr(extra, "get") and extra.get(key) is not None:
        return task_from(extra.get(key), f"the row's extra_info[{key!r}]")
    raise SampleError(
        f"the verl row has no graft task: give the dataset a {key!r} column (or extra_info[{key!r}]) "
        f"holding {{\"id\", \"prompt\", \"reward\": {{\"command\"}}}}; its columns: {sorted(row)}"
    )


@register("graft")
class GraftAgentLoop(AgentLoopBase):
    def __init__(
        self,
        trainer_config,
        server_manager,
        tokenizer,
        processor,
        dataset_cls,
        data_config,
        graft_url: Optional[str] = None,
        weight_version: Optional[str] = None,
        task_key: str = "graft_task",
        unscored: str = "mask",
        timeout: float = 3600.0,
        **kwargs,
    ):
        super().__init__(trainer_config, server_manager, tokenizer, processor, dataset_cls, data_config, **kwargs)
        url = graft_url or os.environ.get("GRAFT_ROLLOUTS_URL")
        if not url:
            raise SampleError(
                "GraftAgentLoop needs the rollout service's URL: graft_url in the agent loop config "
                "or GRAFT_ROLLOUTS_URL in the environment of verl's workers"
            )
        if unscored not in ("mask", "raise"):
            raise SampleError(f"unscored={unscored!r}: use \"mask\" or \"raise\"")
        self.client = RolloutClient(url, timeout=timeout)
        self.weight_version = weight_version
        self.task_key = task_key
        self.unscored = unscored

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        task = _task_of_row(kwargs, self.task_key)
        started = time.monotonic()
        groups = await self.client.arun(
            [task], 1, weight_version=self.weight_version, temperature=sampling_params.get("temperature")
        )
        g = groups[task["id"]]
        (r,) = g.results()
        s, why = r.main_sample()
        want_lps = bool(sampling_params.get("logprobs"))
        extra = {
            "graft_session_id": r.session_id,
            "graft_outcome": r.outcome if isinstance(r.outcome, str) else json.dumps(r.outcome),
            "graft_stop_reason": why if s is not None else r.stop_reason,
            "graft_samples_left_out": max(len(r.samples) - 1, 0),
            "graft_stale_calls": g.stale_calls,
        }
        metrics = AgentLoopMetrics(generate_sequences=time.monotonic() - started)
        if s is None:
            if self.unscored == "raise":
                raise SampleError(f"graft rollout {r.session_id} of task {task['id']!r} was not scored: {r.outcome}")
            eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
            return AgentLoopOutput(
                prompt_ids=[eos], response_ids=[eos], response_mask=[0],
                response_logprobs=[0.0] if want_lps else None, reward_score=0.0, num_turns=0,
                metrics=metrics, extra_fields={**extra, "graft_sample_id": None, "graft_truncated": False},
            )
        prompt, resp, mask = s.prompt_ids, s.response_ids, s.response_mask
        lps = None
        if want_lps:
            lps = []
            for lp, m in zip(s.response_logprobs, mask):
                if lp is None and m == 1:
                    raise SampleError(
                        f"sample {s.sample_id!r} has a sampled token without a logprob and verl's "
                        "rollout.calculate_log_probs is on; record logprobs (exact mode) or turn it off"
                    )
                lps.append(0.0 if lp is None else lp)
        P = self.rollout_config.prompt_length
        R = self.rollout_config.response_length
        truncated = len(prompt) > P or len(resp) > R
        prompt = prompt[-P:]
        resp, mask = resp[:R], mask[:R]
        lps = None if lps is None else lps[:R]
        return AgentLoopOutput(
            prompt_ids=prompt,
            response_ids=resp,
            response_mask=mask,
            response_logprobs=lps,
            reward_score=float(s.reward if s.reward is not None else r.reward or 0.0),
            num_turns=2 * s.num_turns,
            metrics=metrics,
            extra_fields={**extra, "graft_sample_id": s.sample_id, "graft_truncated": truncated},
        )
