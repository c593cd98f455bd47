"""graft samples → SkyRL (``skyrl==0.4.0``).

``GeneratorOutput`` (``skyrl/train/generators/base.py``, a ``TypedDict``):
``prompt_token_ids``, ``response_ids``, ``rewards`` (a float per trajectory, or per token),
``loss_masks``, ``stop_reasons``, ``rollout_metrics``, ``rollout_logprobs`` (one float per
response token, or ``None``), ``trajectory_ids`` (``TrajectoryID(instance_id,
repetition_id)``, the GRPO group is the instance), and optional side channels left ``None``.
SkyRL's trainer checks it with ``validate_generator_output``
(``skyrl/train/utils/trainer_utils.py``).

A samples file does not record why generation stopped, so ``stop_reasons`` is ``None``
unless given: the rollout service's answer has one per sample
(``RolloutClient.samples_with_stop_reasons``), and :mod:`graft_rl.adapters.skyrl` fills them.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .samples import Sample, SampleError, batch_response_logprobs, group_key, has_call_rewards, response_scores, rewards


def skyrl_layout(
    samples: Sequence[Sample],
    token_level_rewards: Optional[bool] = None,
    stop_reasons: Optional[list[str]] = None,
    missing_reward: Optional[float] = None,
    call_rewards: bool = True,
) -> dict:
    """``token_level_rewards``: a list of floats per trajectory (the reward on the last
    response token, each posted call reward on its call's last token) instead of one float;
    ``None`` (the default) picks per-token exactly when some sample has a call reward, since
    a float per trajectory cannot carry them. ``call_rewards=False`` leaves them out."""
    r = rewards(samples, missing_reward)
    if token_level_rewards is None:
        token_level_rewards = call_rewards and has_call_rewards(samples)
    if stop_reasons is not None and len(stop_reasons) != len(samples):
        raise SampleError(
            f"{len(stop_reasons)} stop reasons for {len(samples)} samples; give one per sample, in order"
        )
    if token_level_rewards:
        rw = []
        for s, x in zip(samples, r):
            rw.append(response_scores(s, x, call_rewards))
    else:
        rw = r
    seen: dict[str, int] = {}
    traj = []
    for s in samples:
        g = group_key(s)
        traj.append((g, seen.get(g, 0)))
        seen[g] = seen.get(g, 0) + 1
    return {
        "prompt_token_ids": [s.prompt_ids for s in samples],
        "response_ids": [s.response_ids for s in samples],
        "rewards": rw,
        "loss_masks": [s.response_mask for s in samples],
        "stop_reasons": stop_reasons,
        "rollout_metrics": None,
        "rollout_logprobs": batch_response_logprobs(samples),
        "trajectory_ids": traj,
        "trajectory_generation_times": None,
        "trajectory_time_splits": None,
        "rollout_expert_indices": None,
        "rollout_sample_support": None,
        "is_last_step": None,
        "env_metrics": None,
        "pixel_values": None,
        "image_grid_thw": None,
    }


def to_skyrl(samples: Sequence[Sample], **kwargs):
    """A SkyRL ``GeneratorOutput`` with SkyRL's own ``TrajectoryID`` objects."""
    from skyrl.train.generators.base import GeneratorOutput, TrajectoryID

    lay = skyrl_layout(samples, **kwargs)
    lay["trajectory_ids"] = [TrajectoryID(instance_id=g, repetition_id=k) for g, k in lay["trajectory_ids"]]
    return GeneratorOutput(**lay)
