"""graft's token-masked samples in the native types of RL training frameworks.

    from graft_rl import read_samples, to_verl, to_trl, to_skyrl, to_openrlhf, to_slime, to_tinker
    samples = read_samples("samples/step-00000.parquet")
    batch = to_verl(samples)          # verl.DataProto

Each ``to_*`` builds that framework's own objects (verl, SkyRL and Tinker need the framework
installed); the ``*_layout`` functions give the same fields with numpy only.
"""

from .openrlhf import to_openrlhf
from .samples import Sample, SampleError, groups, grpo_advantages, read_samples, response_scores
from .skyrl import skyrl_layout, to_skyrl
from .slime import save_debug_rollout_data, to_slime
from .tinker import tinker_layout, to_tinker
from .trl import to_trl, to_trl_sft
from .verl import to_agent_loop_outputs, to_verl, verl_layout

__all__ = [
    "Sample",
    "SampleError",
    "groups",
    "grpo_advantages",
    "read_samples",
    "response_scores",
    "to_verl",
    "verl_layout",
    "to_agent_loop_outputs",
    "to_trl",
    "to_trl_sft",
    "to_skyrl",
    "skyrl_layout",
    "to_openrlhf",
    "to_slime",
    "save_debug_rollout_data",
    "to_tinker",
    "tinker_layout",
]
