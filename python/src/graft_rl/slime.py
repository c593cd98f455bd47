"""graft samples → slime (THUDM/slime, not on PyPI).

Dicts in the shape of ``Sample.to_dict()`` (``slime/utils/types.py``): ``tokens`` (prompt
+ response), ``response_length``, ``loss_mask`` and ``rollout_log_probs`` over the response
only, ``reward``, ``group_index`` (an int per GRPO group), ``index``, ``status`` (the enum's
value, ``"completed"``), ``weight_versions`` (one entry per generate call: the version that
sampled each model turn), plus the rest of the dataclass's fields at their defaults.
``Sample.from_dict`` reads them back. :func:`save_debug_rollout_data` writes what slime's
``--save-debug-rollout-data`` writes and ``--load-debug-rollout-data`` reads
(``slime/ray/rollout.py``): ``torch.save({"rollout_id": N, "samples": [dict, ...]})``.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .samples import Sample, group_key, groups, rewards


def to_slime(samples: Sequence[Sample], missing_reward: Optional[float] = None) -> list[dict]:
    r = rewards(samples, missing_reward)
    gindex = {g: k for k, g in enumerate(groups(samples))}
    known = all(s.sampled_logprobs_known() for s in samples)
    out = []
    for i, (s, x) in enumerate(zip(samples, r)):
        a, b = s.span()
        versions = []
        for start, _ in s.action_ranges():
            v = s.token_weight_versions[start] if start < len(s.token_weight_versions) else None
            versions.append(v if v is not None else (s.weight_versions[0] if len(s.weight_versions) == 1 else ""))
        out.append(
            {
                "group_index": gindex[group_key(s)],
                "index": i,
                "prompt": "",
                "tokens": s.tokens[:b],
                "multimodal_inputs": None,
                "multimodal_train_inputs": None,
                "response": "",
                "response_length": b - a,
                "label": None,
                "reward": x,
                "loss_mask": s.response_mask,
                "weight_versions": versions,
                "rollout_log_probs": [0.0 if lp is None else lp for lp in s.response_logprobs] if known else None,
                "rollout_routed_experts": None,
                "remove_sample": False,
                "teacher_log_probs": None,
                "mopd_teacher_log_probs": None,
                "status": "completed",
                "metadata": {
                    "graft_sample_id": s.sample_id,
                    "graft_group_id": s.group_id,
                    "graft_thread": s.thread,
                    "graft_parent_sample": s.parent_sample,
                },
                "generate_function_path": None,
                "train_metadata": None,
                "session_id": s.session_id,
                "non_generation_time": 0.0,
                "spec_info": {
                    "spec_accept_token_num": 0,
                    "spec_draft_token_num": 0,
                    "spec_verify_ct": 0,
                    "completion_token_num": 0,
                },
                "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0},
            }
        )
    return out


def save_debug_rollout_data(path, rollout_id: int, samples: Sequence[Sample], **kwargs) -> None:
    import torch

    torch.save({"rollout_id": rollout_id, "samples": to_slime(samples, **kwargs)}, path)
