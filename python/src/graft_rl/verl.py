"""graft samples → verl (``verl==0.9.1``).

Field names and layout follow verl's own source:

- ``AgentLoopOutput`` (``verl/experimental/agent_loop/agent_loop.py``): ``prompt_ids``,
  ``response_ids``, ``response_mask`` (1 on LLM-generated tokens, 0 on tool responses),
  ``response_logprobs``, ``reward_score``, ``num_turns``, ``metrics``, ``extra_fields``.
- The batch ``AgentLoopWorker._postprocess`` builds from them (same file): ``prompts`` left
  padded, ``responses``/``response_mask`` right padded, ``input_ids`` = their concatenation,
  ``attention_mask``, ``position_ids`` (verl's ``compute_position_id_with_mask``:
  ``clip(cumsum(mask) - 1, 0)``), ``rollout_log_probs`` (0.0 padding), ``rm_scores`` with the
  reward on the last valid response token; ``token_level_scores`` is what
  ``verl/trainer/ppo/ray_trainer.py`` names that tensor after the reward step. ``uid`` (the
  GRPO group, read by ``compute_grpo_outcome_advantage(index=...)`` in
  ``verl/trainer/ppo/core_algos.py``) lives in ``non_tensor_batch`` as an object array.

:func:`verl_layout` needs only numpy; :func:`to_verl` and :func:`to_agent_loop_outputs`
build verl's own objects and need verl installed.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .samples import Sample, SampleError, batch_response_logprobs, group_key, response_scores, rewards


def verl_layout(
    samples: Sequence[Sample],
    prompt_length: Optional[int] = None,
    response_length: Optional[int] = None,
    pad_token_id: int = 0,
    missing_reward: Optional[float] = None,
    call_rewards: bool = True,
) -> dict[str, np.ndarray]:
    """The DataProto batch as numpy arrays (tensors int64/float32, the rest object arrays).
    ``call_rewards=False`` leaves posted per-call rewards out of the token-level scores."""
    if not samples:
        raise SampleError("no samples to export")
    prompts = [s.prompt_ids for s in samples]
    responses = [s.response_ids for s in samples]
    P = max(len(p) for p in prompts) if prompt_length is None else prompt_length
    R = max(len(r) for r in responses) if response_length is None else response_length
    for s, p, r in zip(samples, prompts, responses):
        if len(p) > P or len(r) > R:
            raise SampleError(
                f"sample {s.sample_id!r}: prompt {len(p)} / response {len(r)} tokens do not fit "
                f"prompt_length={P} / response_length={R}; raise them (verl's rollout.prompt_length "
                "and rollout.response_length)"
            )
    B = len(samples)
    out_prompts = np.full((B, P), pad_token_id, dtype=np.int64)
    out_resp = np.full((B, R), pad_token_id, dtype=np.int64)
    p_attn = np.zeros((B, P), dtype=np.int64)
    r_attn = np.zeros((B, R), dtype=np.int64)
    resp_mask = np.zeros((B, R), dtype=np.int64)
    scores = np.zeros((B, R), dtype=np.float32)
    lps = batch_response_logprobs(samples)
    rollout_lp = np.zeros((B, R), dtype=np.float32)
    r = rewards(samples, missing_reward)
    for i, s in enumerate(samples):
        p, resp = prompts[i], responses[i]
        if p:
            out_prompts[i, P - len(p):] = p
            p_attn[i, P - len(p):] = 1
        out_resp[i, : len(resp)] = resp
        r_attn[i, : len(resp)] = 1
        resp_mask[i, : len(resp)] = s.response_mask
        scores[i, : len(resp)] = response_scores(s, r[i], call_rewards)
        if lps is not None:
            rollout_lp[i, : len(resp)] = lps[i]
    attention_mask = np.concatenate([p_attn, r_attn], axis=1)
    position_ids = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None).astype(np.int64)
    out = {
        "prompts": out_prompts,
        "responses": out_resp,
        "response_mask": resp_mask,
        "input_ids": np.concatenate([out_prompts, out_resp], axis=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "rm_scores": scores,
        "token_level_scores": scores.copy(),
    }
    if lps is not None:
        out["rollout_log_probs"] = rollout_lp

    def obj(values) -> np.ndarray:
        a = np.empty(B, dtype=object)
        a[:] = list(values)
        return a

    out["uid"] = obj(group_key(s) for s in samples)
    out["graft_sample_id"] = obj(s.sample_id for s in samples)
    out["graft_session_id"] = obj(s.session_id for s in samples)
    out["graft_thread"] = obj(s.thread for s in samples)
    out["graft_parent_sample"] = obj(s.parent_sample for s in samples)
    out["__num_turns__"] = np.array([s.num_turns for s in samples], dtype=np.int32)
    return out


def to_verl(samples: Sequence[Sample], **layout_kwargs):
    """A ``verl.DataProto`` in the shape the agent loop hands to the PPO/GRPO trainer."""
    import torch
    from verl import DataProto

    lay = verl_layout(samples, **layout_kwargs)
    tensors = {k: torch.from_numpy(v) for k, v in lay.items() if v.dtype != object and k != "__num_turns__"}
    non_tensors = {k: v for k, v in lay.items() if v.dtype == object or k == "__num_turns__"}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"source": "graft"})


def to_agent_loop_outputs(samples: Sequence[Sample], missing_reward: Optional[float] = None):
    """One ``AgentLoopOutput`` per sample (what an ``AgentLoopBase.run`` returns)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    r = rewards(samples, missing_reward)
    lps = batch_response_logprobs(samples)
    out = []
    for i, s in enumerate(samples):
        out.append(
            AgentLoopOutput(
                prompt_ids=s.prompt_ids,
                response_ids=s.response_ids,
                response_mask=s.response_mask,
                response_logprobs=None if lps is None else lps[i],
                reward_score=r[i],
                num_turns=2 * s.num_turns,
                metrics=AgentLoopMetrics(),
                extra_fields={
                    "uid": group_key(s),
                    "graft_sample_id": s.sample_id,
                    "graft_thread": s.thread,
                    "graft_parent_sample": s.parent_sample,
                },
            )
        )
    return out
