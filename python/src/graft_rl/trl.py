"""graft samples → TRL (``trl==1.16.0``).

- GRPO: ``GRPOTrainer(rollout_func=...)`` (``trl/trainer/grpo_trainer.py``,
  ``_generate``): the function returns a dict with ``prompt_ids``, ``completion_ids`` and
  ``logprobs`` (one list per completion, ``None`` allowed per token: TRL maps it to NaN and
  leaves it out of the importance-sampling correction), and optionally ``env_mask`` (1 on
  model tokens, 0 on tool/environment tokens); any other key reaches the reward functions.
  graft's reward rides along as ``graft_reward``. TRL's groups are ``num_generations``
  consecutive completions of the same prompt, so :func:`to_trl` orders samples by group.
- SFT: ``SFTTrainer`` on a dataset with ``input_ids`` and ``assistant_masks``
  (``trl/trainer/sft_trainer.py``: labels are -100 where ``assistant_masks == 0``).

Plain dicts of lists: TRL's own types for both are dicts, so no TRL import is needed here.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .samples import Sample, SampleError, groups, rewards


def to_trl(
    samples: Sequence[Sample],
    num_generations: Optional[int] = None,
    missing_reward: Optional[float] = None,
) -> dict[str, list]:
    """``rollout_func`` output for ``samples``, grouped (each group's samples consecutive).
    With ``num_generations`` every group must have exactly that many samples."""
    order = [i for idx in groups(samples).values() for i in idx]
    if num_generations is not None:
        for g, idx in groups(samples).items():
            if len(idx) != num_generations:
                raise SampleError(
                    f"group {g!r} has {len(idx)} samples; TRL's GRPO needs exactly num_generations="
                    f"{num_generations} completions per prompt"
                )
    ss = [samples[i] for i in order]
    r = rewards(ss, missing_reward)
    return {
        "prompt_ids": [s.prompt_ids for s in ss],
        "completion_ids": [s.response_ids for s in ss],
        "logprobs": [s.response_sampler_logprobs for s in ss],
        "env_mask": [s.response_mask for s in ss],
        "graft_reward": r,
        "graft_sample_id": [s.sample_id for s in ss],
        "graft_group_id": [s.group_id for s in ss],
        "graft_thread": [s.thread for s in ss],
        "graft_parent_sample": [s.parent_sample for s in ss],
    }


def to_trl_sft(samples: Sequence[Sample]) -> list[dict[str, list[int]]]:
    """Rows for ``SFTTrainer``: the whole sequence, trained where graft's loss mask is 1."""
    return [{"input_ids": list(s.tokens), "assistant_masks": list(s.loss_mask)} for s in samples]
