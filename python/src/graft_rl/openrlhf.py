"""graft samples → OpenRLHF (``openrlhf==0.11.2``).

The agent executors in ``openrlhf/utils/agent.py`` (``MultiTurnAgentExecutor.execute``)
return one dict per rollout: ``observation_tokens`` (the whole sequence), ``action_ranges``
(``[start, end)`` of each model turn in it), ``rollout_log_probs`` (aligned to
``observation_tokens``, 0.0 on prompt/feedback tokens, or ``None``), ``reward``, ``scores``,
``truncated``, ``extra_logs`` and the echoed ``prompt``/``label``/``images``. graft fills
``action_ranges`` from the runs of loss-mask-1 tokens.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .samples import Sample, group_key, rewards


def to_openrlhf(samples: Sequence[Sample], missing_reward: Optional[float] = None) -> list[dict]:
    r = rewards(samples, missing_reward)
    known = all(s.sampled_logprobs_known() for s in samples)
    out = []
    for s, x in zip(samples, r):
        end = s.span()[1]
        out.append(
            {
                "prompt": "",
                "label": None,
                "images": None,
                "mm_train_inputs": None,
                "reward": x,
                "scores": x,
                "observation_tokens": s.tokens[:end],
                "action_ranges": s.action_ranges(),
                "rollout_log_probs": [0.0 if lp is None else lp for lp in s.logprobs[:end]] if known else None,
                "truncated": False,
                # OpenRLHF turns every extra_logs value into a tensor: numbers only.
                "extra_logs": {"graft_trained_tokens": sum(s.loss_mask)},
                "graft_sample_id": s.sample_id,
                "graft_group": group_key(s),
                "graft_thread": s.thread,
                "graft_parent_sample": s.parent_sample,
            }
        )
    return out
