"""graft's samples (made by real graft: ``GRAFT_SAMPLES``) through each framework's own types
and checks. Needs the ``rlfw`` venv (``bash scripts/setup-test-env.sh rlfw``): verl 0.9.1,
TRL 1.16.0, SkyRL 0.4.0, OpenRLHF 0.11.2, Tinker 0.38.0 and torch from PyPI.
"""

import sys
import types

import numpy as np
import pytest
import torch

from graft_rl import (
    grpo_advantages,
    read_samples,
    to_agent_loop_outputs,
    to_openrlhf,
    to_skyrl,
    to_slime,
    to_tinker,
    to_trl,
    to_verl,
)


@pytest.fixture(scope="module")
def samples(graft_samples_path):
    return read_samples(graft_samples_path)


def test_verl_dataproto_passes_verls_checks_and_its_grpo_advantage(samples):
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils.model import compute_position_id_with_mask

    batch = to_verl(samples)
    assert isinstance(batch, DataProto)
    batch.check_consistency()
    assert len(batch) == len(samples)
    b = batch.batch
    assert torch.equal(b["position_ids"], compute_position_id_with_mask(b["attention_mask"]))
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    # verl's own GRPO advantage, grouped by uid, over the token-level scores.
    adv, ret = compute_grpo_outcome_advantage(
        token_level_rewards=b["token_level_scores"],
        response_mask=b["response_mask"],
        index=batch.non_tensor_batch["uid"],
        norm_adv_by_std_in_grpo=False,
    )
    want = grpo_advantages(samples)
    for i, a in enumerate(want):
        m = b["response_mask"][i].bool()
        assert torch.allclose(adv[i][m], torch.tensor(a, dtype=adv.dtype), atol=1e-5)
        assert not adv[i][~m].any()
    # DataProto's own slicing and concatenation keep the rows.
    halves = batch.chunk(2) if len(batch) % 2 == 0 else [batch]
    again = DataProto.concat(halves)
    assert torch.equal(again.batch["responses"], b["responses"])
    assert list(again.non_tensor_batch["uid"]) == list(batch.non_tensor_batch["uid"])


def test_verl_agent_loop_outputs_validate_and_match_the_batch(samples):
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    outs = to_agent_loop_outputs(samples)
    batch = to_verl(samples).batch
    P = batch["prompts"].shape[1]
    for i, (o, s) in enumerate(zip(outs, samples)):
        assert isinstance(o, AgentLoopOutput)
        AgentLoopOutput.model_validate(o.model_dump())
        d = o.as_dict()
        n = len(s.response_ids)
        assert torch.equal(d["responses"], batch["responses"][i, :n])
        assert torch.equal(d["response_mask"], batch["response_mask"][i, :n])
        assert d["rm_scores"][-1].item() == pytest.approx(s.reward)
        assert torch.allclose(d["rollout_log_probs"], batch["rollout_log_probs"][i, :n])
        assert torch.equal(d["prompts"], batch["prompts"][i, P - len(s.prompt_ids):])


def test_skyrl_generator_output_passes_validate_generator_output(samples):
    from skyrl.train.generators.base import TrajectoryID
    from skyrl.train.utils.trainer_utils import validate_generator_output

    for token_level in (False, True):
        out = to_skyrl(samples, token_level_rewards=token_level)
        validate_generator_output(len(samples), out)
        assert all(isinstance(t, TrajectoryID) for t in out["trajectory_ids"])
        assert [t.instance_id for t in out["trajectory_ids"]] == [s.group_id for s in samples]
    # and SkyRL's check does reject a broken one (so passing it means something)
    bad = to_skyrl(samples)
    bad["loss_masks"][0] = bad["loss_masks"][0][:-1]
    with pytest.raises(AssertionError):
        validate_generator_output(len(samples), bad)


def _openrlhf_samples_generator(monkeypatch):
    """OpenRLHF's ``SamplesGenerator`` module imports vLLM at the top for its engine calls;
    vLLM's wheels need CUDA and are not installed here. The method under test
    (``_process_response_into_experience``) does not use vLLM, so for the import the two
    engine-side modules are empty ones (removed again after the test: TRL probes for vLLM)
    and OpenRLHF's own code runs unchanged."""
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = object
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    engine = types.ModuleType("openrlhf.trainer.ray.vllm_engine")
    engine.batch_vllm_engine_call = None
    monkeypatch.setitem(sys.modules, "openrlhf.trainer.ray.vllm_engine", engine)
    monkeypatch.delitem(sys.modules, "openrlhf.trainer.ppo_utils.samples_generator", raising=False)
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    return SamplesGenerator


def test_openrlhf_agent_output_becomes_an_openrlhf_experience(samples, monkeypatch):
    from openrlhf.trainer.ppo_utils.experience import Experience

    gen = _openrlhf_samples_generator(monkeypatch)
    for d, s in zip(to_openrlhf(samples), samples):
        e = gen._process_response_into_experience(None, d, max_len=100_000)
        assert isinstance(e, Experience)
        # OpenRLHF's action mask is over next-token positions (shifted by one).
        am = e.action_mask[0]
        seq = e.sequences[0]
        assert seq[1:][am.bool()].tolist() == s.sampled_tokens()
        lp = e.rollout_log_probs[0][am.bool()]
        want = [lp_ for lp_, m in zip(s.logprobs, s.loss_mask) if m == 1]
        assert torch.allclose(lp, torch.tensor(want, dtype=lp.dtype))
        assert e.rewards.item() == pytest.approx(s.reward)


def test_tinker_datums_build_and_round_trip(samples):
    import tinker

    datums = to_tinker(samples)
    adv = grpo_advantages(samples)
    for d, s, a in zip(datums, samples, adv):
        assert isinstance(d, tinker.Datum)
        assert isinstance(d.model_input, tinker.ModelInput)
        assert d.model_input.to_ints() == s.tokens[:-1]
        assert d.model_input.length == len(s.tokens) - 1
        tgt = d.loss_fn_inputs["target_tokens"].to_numpy()
        mask = d.loss_fn_inputs["mask"].to_numpy() == 1
        assert tgt[mask].tolist() == s.sampled_tokens()
        assert np.allclose(d.loss_fn_inputs["advantages"].to_numpy()[mask], a)
        lp = d.loss_fn_inputs["logprobs"].to_numpy()[mask]
        assert np.allclose(lp, [x for x, m in zip(s.logprobs, s.loss_mask) if m == 1])


def test_trl_rollout_func_output_has_what_grpo_trainer_requires(samples):
    out = to_trl(samples)
    # GRPOTrainer._generate: these keys are required; env_mask becomes its tool_mask.
    assert {"prompt_ids", "completion_ids", "logprobs"} <= out.keys()
    for ids, mask, lps in zip(out["completion_ids"], out["env_mask"], out["logprobs"]):
        assert len(ids) == len(mask) == len(lps)
    # TRL maps None to NaN per token the way it does for vLLM's (grpo_trainer.py).
    t = [torch.tensor([float("nan") if x is None else x for x in lp]) for lp in out["logprobs"]]
    assert all(x.dtype == torch.float32 for x in t)


def test_slime_debug_rollout_data_round_trips_through_torch_save(samples, tmp_path):
    from graft_rl import save_debug_rollout_data

    p = tmp_path / "rollout_0.pt"
    save_debug_rollout_data(p, 0, samples)
    data = torch.load(p, weights_only=False)
    assert data["rollout_id"] == 0
    assert data["samples"] == to_slime(samples)


def test_trl_grpo_trainer_takes_a_step_on_graft_samples_through_rollout_func(samples, tmp_path):
    """TRL's own GRPOTrainer, one optimizer step on a tiny random Qwen3 (CPU), with a
    ``rollout_func`` that hands it graft's samples (real graft rl rollouts) and a reward
    function that reads graft's reward. The tokenizer is the real Qwen3 one
    (``GRAFT_QWEN3_DIR``), so the ids graft recorded mean the same tokens here."""
    import os

    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    qwen3 = os.environ.get("GRAFT_QWEN3_DIR")
    assert qwen3, "GRAFT_QWEN3_DIR names the Qwen3 tokenizer dir (tests/interop.rs sets it)"
    tok = AutoTokenizer.from_pretrained(qwen3)
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
    )
    model = Qwen3ForCausalLM(cfg)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}

    # The scripted model solves one task and fails the other every time, so no task's group
    # has a reward spread and GRPO's advantages would all be 0; the step takes the batch as
    # one group of len(samples) (TRL's groups are positional), which has one.
    n = len(samples)
    assert len({s.reward for s in samples}) > 1
    calls = []

    def rollout_func(prompts, trainer):
        calls.append(list(prompts))
        return to_trl(samples)

    rewards_seen = []

    def graft_reward(completions, graft_reward, **kwargs):
        rewards_seen.extend(graft_reward)
        return graft_reward

    ds = Dataset.from_dict({"prompt": ["the graft rl batch"]})
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(samples), num_generations=n,
        max_steps=1, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, bf16=False,
        learning_rate=1e-2, max_completion_length=4096, seed=0,
    )
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    trainer = GRPOTrainer(
        model=model, reward_funcs=[graft_reward], args=args, train_dataset=ds,
        processing_class=tok, rollout_func=rollout_func,
    )
    trainer.train()
    assert len(calls) == 1 and len(calls[0]) == len(samples)
    assert sorted(rewards_seen) == sorted(s.reward for s in samples)
    changed = [k for k, v in model.named_parameters() if not torch.equal(v.detach(), before[k])]
    assert changed, "one GRPO step changed no weight"
    assert trainer.state.global_step == 1


def test_trl_grpo_trainer_steps_with_graft_rollout_service_driving_real_rollouts(tmp_path):
    """``trl_rollout_func`` against a running ``graft rollouts serve`` (``GRAFT_ROLLOUTS_URL``;
    tests/interop.rs starts it): each TRL prompt is an example task, run as a group of
    ``num_generations`` rollouts of the example agent in envd sandboxes, scored, and handed to
    GRPOTrainer as token ids, logprobs, env_mask and graft's reward."""
    import json
    import os

    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from graft_rl.service import RolloutClient, trl_rollout_func

    url = os.environ.get("GRAFT_ROLLOUTS_URL")
    tasks_file = os.environ.get("GRAFT_TASKS")
    assert url and tasks_file, "GRAFT_ROLLOUTS_URL and GRAFT_TASKS (tests/interop.rs sets them)"
    tasks = {t["prompt"]: t for t in map(json.loads, open(tasks_file))}
    prompts = list(tasks)[:2]
    tok = AutoTokenizer.from_pretrained(os.environ["GRAFT_QWEN3_DIR"])
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
    ))
    client = RolloutClient(url)
    inner = trl_rollout_func(client, lambda p: tasks[p], weight_version="default")
    seen = []

    def rollout_func(prompts_, trainer):
        out = inner(prompts_, trainer)
        seen.append(out)
        return out

    rewards = []

    def graft_reward(completions, graft_reward, **kwargs):
        rewards.extend(graft_reward)
        return graft_reward

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, max_steps=1,
        use_cpu=True, report_to=[], save_strategy="no", bf16=False, max_completion_length=4096, seed=0,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=[graft_reward], args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok, rollout_func=rollout_func,
    )
    trainer.train()
    assert trainer.state.global_step == 1
    assert len(seen) == 1 and len(seen[0]["completion_ids"]) == 4
    assert client.last_summary["rollouts"] == 4
    # real rollouts: the agent's completions were sampled (env_mask 1) and scored by the task
    assert all(sum(m) > 10 for m in seen[0]["env_mask"])
    assert sorted(rewards) == [0.0, 0.0, 1.0, 1.0]
