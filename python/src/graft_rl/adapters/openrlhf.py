"""graft's rollout service as an OpenRLHF agent executor (``openrlhf==0.11.2``).

OpenRLHF loads ``AgentExecutor`` from the file named by ``--train.agent_func_path``
(``openrlhf/trainer/ray/vllm_engine.py``: a subclass of ``AgentExecutorBase``, built with no
arguments) and calls ``execute(prompt, label, sampling_params, max_length, hf_tokenizer,
llm_engine, images)`` once per sample (``n_samples_per_prompt`` times per prompt). Each call
here is one rollout of the graft task its ``label`` holds (a dict or its JSON text:
``--data.label_key`` names that column), run through ``graft rollouts serve`` instead of
OpenRLHF's vLLM engine; the answer is the dict ``MultiTurnAgentExecutor.execute`` returns
(``openrlhf/utils/agent.py``): ``observation_tokens``, ``action_ranges`` from graft's loss
mask, ``rollout_log_probs`` aligned to the observation (0.0 outside actions; ``None`` when
``sampling_params.logprobs`` is unset), ``reward``/``scores`` from graft's reward,
``truncated`` when the last call stopped at ``length`` or the rollout timed out.

OpenRLHF config: a file ``graft_agent.py`` with::

    from graft_rl.adapters.openrlhf import GraftAgentExecutor as AgentExecutor

and ``--train.agent_func_path graft_agent.py --data.label_key graft_task``, with
``GRAFT_ROLLOUTS_URL`` set in the Ray workers' environment (``--runtime_env`` /
``ray job submit --runtime-env-json``); ``GRAFT_WEIGHT_VERSION`` likewise, optionally.
"""

from __future__ import annotations

import os
from typing import Optional

from openrlhf.utils.agent import AgentExecutorBase

from ..samples import SampleError
from ..service import RolloutClient, task_from


class GraftAgentExecutor(AgentExecutorBase):
    def __init__(self, url: Optional[str] = None, weight_version: Optional[str] = None, unscored: str = "mask"):
        url = url or os.environ.get("GRAFT_ROLLOUTS_URL")
        if not url:
            raise SampleError(
                "GraftAgentExecutor needs the rollout service's URL: set GRAFT_ROLLOUTS_URL in the "
                "environment of OpenRLHF's Ray workers (its vLLM engine actors build the executor)"
            )
        if unscored not in ("mask", "raise"):
            raise SampleError(f"unscored={unscored!r}: use \"mask\" or \"raise\"")
        self.client = RolloutClient(url)
        self.weight_version = weight_version or os.environ.get("GRAFT_WEIGHT_VERSION")
        self.unscored = unscored

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        task = task_from(label, "the OpenRLHF label (--data.label_key)")
        groups = await self.client.arun(
            [task], 1, weight_version=self.weight_version, temperature=getattr(sampling_params, "temperature", None)
        )
        g = groups[task["id"]]
        (r,) = g.results()
        s, why = r.main_sample()
        want_lps = getattr(sampling_params, "logprobs", None) is not None
        logs = {"graft_stale_calls": g.stale_calls, "graft_samples_left_out": max(len(r.samples) - 1, 0)}
        if s is None:
            if self.unscored == "raise":
                raise SampleError(f"graft rollout {r.session_id} of task {task['id']!r} was not scored: {r.outcome}")
            eos = getattr(hf_tokenizer, "eos_token_id", None) or 0
            return {
                "prompt": prompt, "label": label, "images": images, "mm_train_inputs": None,
                "reward": 0.0, "scores": 0.0, "observation_tokens": [eos, eos], "action_ranges": [],
                "rollout_log_probs": [0.0, 0.0] if want_lps else None,
                "truncated": r.stop_reason == "timeout", "extra_logs": {**logs, "graft_unscored": 1},
            }
        end = s.span()[1]
        lps = None
        if want_lps:
            if not s.sampled_logprobs_known():
                raise SampleError(
                    f"sample {s.sample_id!r} has a sampled token without a logprob and OpenRLHF asked for "
                    "logprobs; record logprobs (exact mode) or leave sampling_params.logprobs unset"
                )
            lps = [0.0 if x is None else x for x in s.logprobs[:end]]
        reward = float(s.reward if s.reward is not None else r.reward or 0.0)
        return {
            "prompt": prompt,
            "label": label,
            "images": images,
            "mm_train_inputs": None,
            "reward": reward,
            "scores": reward,
            "observation_tokens": s.tokens[:end],
            "action_ranges": s.action_ranges(),
            "rollout_log_probs": lps,
            "truncated": why == "length",
            # OpenRLHF turns every extra_logs value into a tensor: numbers only.
            "extra_logs": {**logs, "graft_unscored": 0},
        }
