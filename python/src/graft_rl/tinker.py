"""graft samples → Tinker (``tinker==0.38.0``).

``tinker.Datum(model_input, loss_fn_inputs)`` (``tinker/types/datum.py``), built the way the
Tinker cookbook's RL code builds it: ``model_input`` = the tokens but the last
(``ModelInput.from_ints``), and per input position ``target_tokens`` (the next token),
``logprobs`` (the sampler's logprob of the target, 0.0 where it is not sampled),
``advantages`` (the GRPO outcome advantage on sampled targets, 0 elsewhere) and ``mask``
(1.0 on sampled targets). The cookbook drops ``mask`` before ``forward_backward`` with the
``importance_sampling`` loss; it is kept here so nothing is lost. When some sampled token's
logprob is unknown, ``logprobs`` is left out (there is no per-token null in ``TensorData``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .samples import Sample, grpo_advantages


def tinker_layout(samples: Sequence[Sample], missing_reward: Optional[float] = None, std_normalize: bool = False) -> list[dict]:
    adv = grpo_advantages(samples, missing_reward, std_normalize)
    known = all(s.sampled_logprobs_known() for s in samples)
    out = []
    for s, a in zip(samples, adv):
        end = s.span()[1]
        toks = s.tokens[:end]
        mask = np.array(s.loss_mask[1:end], dtype=np.float32)
        d = {
            "model_input": list(toks[:-1]),
            "target_tokens": np.array(toks[1:], dtype=np.int64),
            "advantages": (mask * np.float32(a)).astype(np.float32),
            "mask": mask,
        }
        if known:
            d["logprobs"] = np.array([0.0 if lp is None else lp for lp in s.logprobs[1:end]], dtype=np.float32)
        out.append(d)
    return out


def to_tinker(samples: Sequence[Sample], **kwargs):
    """A list of ``tinker.Datum``."""
    import tinker

    out = []
    for d in tinker_layout(samples, **kwargs):
        inputs = {k: tinker.TensorData.from_numpy(v) for k, v in d.items() if k != "model_input"}
        out.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(d["model_input"]), loss_fn_inputs=inputs))
    return out
