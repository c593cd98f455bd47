"""graft's samples (made by real graft: ``GRAFT_SAMPLES``) through each framework's own types
and checks. Each ``test_NAME_*`` runs in its framework's own venv (``bash
scripts/setup-test-env.sh rlfw`` makes ``rlfw/NAME`` from ``scripts/test-env/frameworks.txt``;
``tests/interop.rs`` runs ``-k test_NAME_`` there): verl 0.9.1, TRL 1.16.0, SkyRL 0.4.0,
OpenRLHF 0.11.2, slime's file and adapter (torch), Tinker 0.38.0.
"""

import os
import sys
import types
from pathlib import Path

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


def _tiny_qwen3_and_tasks():
    """The example's tasks by prompt, the first two prompts, Qwen3's tokenizer and a tiny
    random Qwen3 over its vocabulary (the policy TRL trains)."""
    import json

    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tasks_file = os.environ.get("GRAFT_TASKS")
    assert tasks_file, "GRAFT_TASKS (tests/interop.rs sets it)"
    tasks = {t["prompt"]: t for t in map(json.loads, open(tasks_file))}
    tok = AutoTokenizer.from_pretrained(os.environ["GRAFT_QWEN3_DIR"])
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=False,
    ))
    return tasks, list(tasks)[:2], tok, model


def _grpo_step(model, tok, prompts, rollout_func, tmp_path):
    """One GRPOTrainer step (2 prompts × 2 generations) through ``rollout_func``, with graft's
    reward as the reward function: the trainer, what the rollout function returned, and the
    rewards TRL read."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    seen, rewards = [], []

    def recording(prompts_, trainer):
        out = rollout_func(prompts_, trainer)
        seen.append(out)
        return out

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
        train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok, rollout_func=recording,
    )
    trainer.train()
    return trainer, seen, rewards


def test_trl_grpo_trainer_steps_with_graft_rollout_service_driving_real_rollouts(tmp_path):
    """``trl_rollout_func`` against a running ``graft rollouts serve`` (``GRAFT_ROLLOUTS_URL``;
    tests/interop.rs starts it): each TRL prompt is an example task, run as a group of
    ``num_generations`` rollouts of the example agent in envd sandboxes, scored, and handed to
    GRPOTrainer as token ids, logprobs, env_mask and graft's reward."""
    from graft_rl.service import RolloutClient, trl_rollout_func

    url = os.environ.get("GRAFT_ROLLOUTS_URL")
    assert url, "GRAFT_ROLLOUTS_URL (tests/interop.rs sets it)"
    tasks, prompts, tok, model = _tiny_qwen3_and_tasks()
    client = RolloutClient(url)
    inner = trl_rollout_func(client, lambda p: tasks[p], weight_version="default")
    trainer, seen, rewards = _grpo_step(model, tok, prompts, inner, tmp_path)
    assert trainer.state.global_step == 1
    assert len(seen) == 1 and len(seen[0]["completion_ids"]) == 4
    assert client.last_summary["rollouts"] == 4
    # real rollouts: the agent's completions were sampled (env_mask 1) and scored by the task
    assert all(sum(m) > 10 for m in seen[0]["env_mask"])
    assert sorted(rewards) == [0.0, 0.0, 1.0, 1.0]



def test_trl_grpo_trainer_steps_on_rollouts_graft_serve_samples_from_the_trainers_own_model(tmp_path):
    """The backend is the trainer's own: TRL's tiny Qwen3 is saved, served by ``graft serve``
    (``GRAFT_BIN``) under a weight version of the trainer's, and named per batch
    (``backends``); the rollout service runs the example agent in envd sandboxes against it,
    so every completion GRPOTrainer trains on was sampled by that very model, and TRL takes
    its step on them."""
    import subprocess

    from graft_rl.service import RolloutClient, trl_rollout_func

    url, graft = os.environ.get("GRAFT_ROLLOUTS_URL"), os.environ.get("GRAFT_BIN")
    assert url and graft, "GRAFT_ROLLOUTS_URL and GRAFT_BIN (tests/interop.rs sets them)"
    tasks, prompts, tok, model = _tiny_qwen3_and_tasks()
    model.save_pretrained(tmp_path / "policy", safe_serialization=True)
    tok.save_pretrained(tmp_path / "policy")
    serve = subprocess.Popen(
        [graft, "serve", "--model", str(tmp_path / "policy"), "--listen", "127.0.0.1:0",
         "--weight-version", "trl-step-0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
        env={**os.environ, "GRAFT_LOG": "warn"},
    )
    try:
        line = serve.stdout.readline()
        assert line.startswith("graft serve listening on "), line
        backend = line.split()[4]
        client = RolloutClient(url, backends=[backend])
        # A random model rarely stops on its own: the batch's policy caps each answer.
        policy = {"mode": "enforce", "temperature": 1.0, "max_new_tokens": 48}
        inner = trl_rollout_func(client, lambda p: tasks[p], weight_version="trl-step-0", sampling=policy)
        trainer, seen, rewards = _grpo_step(model, tok, prompts, inner, tmp_path)
    finally:
        serve.terminate()
        serve.wait(30)
    assert trainer.state.global_step == 1
    assert len(seen) == 1 and len(seen[0]["completion_ids"]) == 4
    assert client.last_summary["rollouts"] == 4
    # Sampled by the served model under the batch's cap (48 per answer, at most 4 answers per
    # rollout: AGENT_MAX_STEPS): each rollout's tokens are trained, with the model's logprobs.
    for mask, lps in zip(seen[0]["env_mask"], seen[0]["logprobs"]):
        sampled = [lp for m, lp in zip(mask, lps) if m == 1]
        assert 0 < len(sampled) <= 4 * 48, mask
        assert all(lp is not None and lp <= 0.0 for lp in sampled), sampled
    assert len(rewards) == 4 and all(r in (0.0, 1.0) for r in rewards)

# -- the rollout service behind each trainer's own extension point ---------------------------
#
# Each test drives the running ``graft rollouts serve`` (``GRAFT_ROLLOUTS_URL``, started by
# tests/interop.rs: the example agent in envd sandboxes, the scripted backend with real Qwen3
# ids) through one adapter of ``graft_rl.adapters`` and checks the result with the
# framework's own code. The scripted model solves the addition and miscounts the lines.


def _service_tasks():
    import json
    import os

    url = os.environ.get("GRAFT_ROLLOUTS_URL")
    tasks_file = os.environ.get("GRAFT_TASKS")
    assert url and tasks_file, "GRAFT_ROLLOUTS_URL and GRAFT_TASKS (tests/interop.rs sets them)"
    tasks = [json.loads(line) for line in open(tasks_file)][:2]
    assert [t["id"] for t in tasks] == ["add-17-25", "count-lines"]
    return url, tasks


WANT_REWARD = {"add-17-25": 1.0, "count-lines": 0.0}
SCRIPTED_FIRST_TURN = {"add-17-25": "I will write the sum.", "count-lines": "I will write the count."}


def _assert_turns_are_the_models(tok, tokens, mask):
    """Each run of trained tokens is exactly one model turn of Qwen3's template: it starts
    right after ``<|im_start|>assistant\\n`` and ends with ``<|im_end|>`` (so a range shifted
    by one token either way fails), and there are the scripted model's two turns."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    assert len(runs) == 2, runs
    for a, b in runs:
        assert tok.decode(tokens[max(a - 3, 0):a]).endswith("<|im_start|>assistant\n")
        text = tok.decode(tokens[a:b])
        assert text.startswith("<think>") and text.endswith("<|im_end|>"), text


def _qwen3_model_dir(tmp_path):
    """The real Qwen3 tokenizer plus a tiny Qwen3 ``config.json``: what verl's
    ``HFModelConfig`` loads from ``actor_rollout_ref.model.path``."""
    import os
    import shutil

    from transformers import Qwen3Config

    src = os.environ["GRAFT_QWEN3_DIR"]
    d = tmp_path / "qwen3"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), d)
    Qwen3Config(
        vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(d)
    return d


def test_verl_agent_loop_worker_runs_graft_rollouts_through_graft_agent_loop(tmp_path):
    """verl's own ``AgentLoopWorker`` (built from verl's ``ppo_trainer`` config, the agent loop
    named in an ``agent_loop_config_path`` file as a user would) runs a 2 prompts × 2 batch
    plus a row whose task cannot be set up (masked out, stop reason ``error``):
    hydra instantiates ``GraftAgentLoop`` per row, each row is one rollout through the service,
    and verl's post-processing builds the ``DataProto`` the trainer gets."""
    import asyncio
    import json

    import verl
    from hydra import compose, initialize_config_dir
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    url, tasks = _service_tasks()
    model = _qwen3_model_dir(tmp_path)
    loops = tmp_path / "graft_agent.yaml"
    loops.write_text(
        f"- name: graft\n  _target_: graft_rl.adapters.verl.GraftAgentLoop\n  graft_url: {url}\n"
        "  weight_version: default\n"
    )
    cfgdir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=cfgdir, version_base=None):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model}",
                "actor_rollout_ref.rollout.name=sglang",
                "actor_rollout_ref.rollout.prompt_length=2048",
                "actor_rollout_ref.rollout.response_length=4096",
                "actor_rollout_ref.rollout.calculate_log_probs=true",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
                "actor_rollout_ref.rollout.agent.default_agent_loop=graft",
            ],
        )
    worker = AgentLoopWorker(cfg, llm_client=None)
    # 2 prompts × 2, and a fifth row whose set-up fails: not scored, masked out.
    broken = {"id": "broken-setup", "prompt": tasks[0]["prompt"], "setup": ["exit 3"], "reward": {"command": "true"}}
    rows = [t for t in tasks for _ in range(2)] + [broken]

    def obj(xs):
        a = np.empty(len(xs), dtype=object)
        a[:] = xs
        return a

    batch = DataProto.from_dict(
        non_tensors={
            "raw_prompt": obj([[{"role": "user", "content": t["prompt"]}] for t in rows]),
            "graft_task": obj([json.dumps(t) for t in rows]),
            "uid": obj([t["id"] for t in rows]),
            "index": np.array([0, 0, 1, 1, 2]),
        },
        meta_info={"global_steps": 1},
    )
    out = asyncio.run(worker.generate_sequences(batch))
    assert isinstance(out, DataProto)
    out.check_consistency()
    assert len(out) == 5
    b = out.batch
    nt = out.non_tensor_batch
    assert b["responses"].shape[1] == 4096 and b["prompts"].shape[1] == 2048
    assert list(nt["uid"]) == [t["id"] for t in rows]
    assert len(set(nt["graft_session_id"])) == 5, "one graft rollout per verl row"
    assert list(nt["graft_stop_reason"]) == ["stop"] * 4 + ["error"]
    assert list(nt["graft_outcome"])[:4] == ["scored"] * 4
    assert not b["response_mask"][4].any() and not b["rm_scores"][4].any(), "nothing unscored is trained"
    for i, t in enumerate(rows[:4]):
        m = b["response_mask"][i]
        n = int(b["attention_mask"][i, 2048:].sum())
        assert m.sum() > 10, "the agent's sampled tokens are trained"
        assert not m[n:].any()
        # the reward on the last response token (verl's rm_scores), nowhere else
        assert b["rm_scores"][i, n - 1].item() == WANT_REWARD[t["id"]]
        assert b["rm_scores"][i].abs().sum().item() == WANT_REWARD[t["id"]]
        lp = b["rollout_log_probs"][i][m.bool()]
        assert (lp < 0).any() and not lp.isnan().any() and (lp <= 0).all()
        said = worker.tokenizer.decode(b["responses"][i][m.bool()].tolist())
        assert SCRIPTED_FIRST_TURN[t["id"]] in said and "Done." in said and t["prompt"] not in said
        assert t["prompt"] in worker.tokenizer.decode(b["prompts"][i][b["attention_mask"][i, :2048].bool()].tolist())
        p = b["prompts"][i][b["attention_mask"][i, :2048].bool()].tolist()
        _assert_turns_are_the_models(worker.tokenizer, p + b["responses"][i, :n].tolist(), [0] * len(p) + m[:n].tolist())
    adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards=b["rm_scores"], response_mask=b["response_mask"], index=nt["uid"],
    )
    assert adv.shape == b["response_mask"].shape


def test_skyrl_graft_generator_output_passes_skyrls_checks_with_stop_reasons():
    """``GraftGenerator.generate`` on a SkyRL ``GeneratorInput`` (2 instances × 2
    repetitions, in interleaved order, and one instance that cannot be set up): answers in
    the input's order,
    checked by SkyRL's ``validate_generator_output``, its overlong filtering (which reads the
    stop reasons) and its own tensor conversion."""
    import asyncio
    import json
    import os

    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
    from skyrl.train.generators.base import BatchMetadata, GeneratorInput, TrajectoryID
    from skyrl.train.generators.utils import apply_overlong_filtering
    from skyrl.train.utils.trainer_utils import validate_generator_output
    from transformers import AutoTokenizer

    from graft_rl.adapters.skyrl import GraftGenerator

    url, tasks = _service_tasks()
    tok = AutoTokenizer.from_pretrained(os.environ["GRAFT_QWEN3_DIR"])
    order = [(0, 0), (1, 0), (0, 1), (1, 1)]
    # A fifth row whose task's set-up fails: a rollout that is not scored (and a group of one,
    # so a second request), masked out with stop reason "error".
    broken = {"id": "broken-setup", "prompt": tasks[0]["prompt"], "setup": ["exit 3"], "reward": {"command": "true"}}
    rows = [tasks[t] for t, _ in order] + [broken]
    inp = GeneratorInput(
        prompts=[[{"role": "user", "content": t["prompt"]}] for t in rows],
        env_classes=["graft"] * 5,
        env_extras=[{"graft_task": t} for t in rows],
        sampling_params={"temperature": 1.0, "logprobs": 0},
        trajectory_ids=[TrajectoryID(instance_id=f"inst-{t}", repetition_id=k) for t, k in order]
        + [TrajectoryID(instance_id="inst-broken", repetition_id=0)],
        batch_metadata=BatchMetadata(global_step=1, training_phase="train"),
    )
    gen = GraftGenerator(url, tokenizer=tok, weight_version="default")
    out = asyncio.run(gen.generate(inp))
    validate_generator_output(5, out)
    assert out["stop_reasons"] == ["stop"] * 4 + ["error"]
    assert out["rewards"] == [WANT_REWARD[t["id"]] for t in rows[:4]] + [0.0]
    assert out["trajectory_ids"] == inp["trajectory_ids"]
    assert out["rollout_logprobs"] is not None
    assert out["rollout_metrics"]["graft/unscored_rollouts"] == 1
    em = out["env_metrics"]
    assert len({m["graft_session_id"] for m in em}) == 5, "one graft rollout per SkyRL row"
    assert [m["graft_outcome"] for m in em[:4]] == ["scored"] * 4
    assert "setup command 1 ('exit 3') failed" in json.loads(em[4]["graft_outcome"])["failed"]
    assert sum(out["loss_masks"][4]) == 0, "nothing of an unscored rollout is trained"
    # an instance's repetitions are one graft group, and the three instances are three
    group_of = {}
    for key, m in zip([f"inst-{t}" for t, _ in order] + ["inst-broken"], em):
        group_of.setdefault(key, set()).add(m["graft_group_id"])
    assert all(len(v) == 1 for v in group_of.values()) and len(set.union(*group_of.values())) == 3
    assert all(sum(m) > 10 for m in out["loss_masks"][:4])
    for p, r, m in list(zip(out["prompt_token_ids"], out["response_ids"], out["loss_masks"]))[:4]:
        _assert_turns_are_the_models(tok, p + r, [0] * len(p) + m)
    # SkyRL's DAPO overlong filter keeps every mask of a rollout that stopped...
    assert apply_overlong_filtering(out["loss_masks"], out["stop_reasons"]) == out["loss_masks"]
    # ...and would drop one that hit the length limit: the stop reasons carry meaning.
    cut = apply_overlong_filtering(out["loss_masks"], ["length"] + out["stop_reasons"][1:])
    assert sum(cut[0]) == 0 and cut[1:] == out["loss_masks"][1:]
    token_rewards = [[0.0] * (len(r) - 1) + [x] for r, x in zip(out["response_ids"], out["rewards"])]
    _, attn, _, rw, masks, lps, _, _ = convert_prompts_responses_to_batch_tensors(
        tok.pad_token_id, out["prompt_token_ids"], out["response_ids"], token_rewards, out["loss_masks"],
        out["rollout_logprobs"],
    )
    assert masks.sum().item() == sum(sum(m) for m in out["loss_masks"])
    assert rw.sum().item() == sum(out["rewards"])
    assert attn.sum().item() == sum(len(p) + len(r) for p, r in zip(out["prompt_token_ids"], out["response_ids"]))


def test_openrlhf_graft_agent_executor_output_becomes_an_openrlhf_experience(monkeypatch, tmp_path):
    """OpenRLHF's agent file (``AgentExecutor`` imported from graft_rl, loaded the way
    ``_load_agent_executor`` loads ``--train.agent_func_path``), ``execute`` once per sample
    (2 prompts × 2, and one task that cannot be set up), each result through OpenRLHF's own
    ``_process_response_into_experience``.
    ``sampling_params`` stands in for vLLM's ``SamplingParams`` (not installed: CUDA wheels):
    the executor reads its ``temperature`` and ``logprobs``."""
    import asyncio
    import importlib.util
    import json
    import os

    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.utils.agent import AgentExecutorBase
    from transformers import AutoTokenizer

    url, tasks = _service_tasks()
    monkeypatch.setenv("GRAFT_ROLLOUTS_URL", url)
    agent = tmp_path / "graft_agent.py"
    agent.write_text("from graft_rl.adapters.openrlhf import GraftAgentExecutor as AgentExecutor\n")
    spec = importlib.util.spec_from_file_location("agent_module", agent)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert issubclass(mod.AgentExecutor, AgentExecutorBase)
    executor = mod.AgentExecutor()
    tok = AutoTokenizer.from_pretrained(os.environ["GRAFT_QWEN3_DIR"])
    params = types.SimpleNamespace(temperature=1.0, logprobs=0, max_tokens=None)
    labels = [json.dumps(t) for t in tasks for _ in range(2)]

    async def all_of():
        return await asyncio.gather(
            *(executor.execute(t, lab, params, 100_000, tok, None) for t, lab in zip(["p"] * 4, labels))
        )

    outs = asyncio.run(all_of())
    gen = _openrlhf_samples_generator(monkeypatch)
    for d, lab in zip(outs, labels):
        want = WANT_REWARD[json.loads(lab)["id"]]
        e = gen._process_response_into_experience(None, d, max_len=100_000)
        assert isinstance(e, Experience)
        am = e.action_mask[0].bool()
        assert am.sum().item() > 10
        seq = e.sequences[0]
        acts = [t for a, b in d["action_ranges"] for t in d["observation_tokens"][a:b]]
        assert seq[1:][am].tolist() == acts
        # The actions are the scripted model's two turns, the rest is context: the task's
        # prompt before the first action, the tool's result between them.
        task = json.loads(lab)
        said = tok.decode(acts)
        assert SCRIPTED_FIRST_TURN[task["id"]] in said and "Done." in said and task["prompt"] not in said
        first = d["action_ranges"][0][0]
        assert task["prompt"] in tok.decode(d["observation_tokens"][:first])
        obs = d["observation_tokens"]
        _assert_turns_are_the_models(tok, obs, [int(any(a <= i < b for a, b in d["action_ranges"])) for i in range(len(obs))])
        lp = e.rollout_log_probs[0][am]
        assert (lp < 0).any() and (lp <= 0).all()
        assert e.rewards.item() == want
        assert not e.truncated.item()
        assert e.info["graft_unscored"].item() == 0
    # A task whose set-up fails: not scored, an Experience that trains nothing.
    broken = {"id": "broken-setup", "prompt": tasks[0]["prompt"], "setup": ["exit 3"], "reward": {"command": "true"}}
    d = asyncio.run(executor.execute("p", json.dumps(broken), params, 100_000, tok, None))
    e = gen._process_response_into_experience(None, d, max_len=100_000)
    assert isinstance(e, Experience)
    assert not e.action_mask.any() and e.rewards.item() == 0.0 and e.info["graft_unscored"].item() == 1


def test_slime_rollout_function_fills_each_group_from_graft_rollouts():
    """``generate_rollout(args, rollout_id, data_source)`` with slime's signature. slime is not
    on PyPI, so its ``Sample`` and data source are stand-ins here with the field names and
    ``Status`` values of ``slime/utils/types.py`` and the ``get_samples(n) ->
    list[list[Sample]]`` of ``slime/rollout/data_source.py``."""
    import argparse
    import dataclasses
    import enum
    import json

    import os

    from transformers import AutoTokenizer

    from graft_rl.adapters.slime import FILLED, generate_rollout

    url, tasks = _service_tasks()
    tok = AutoTokenizer.from_pretrained(os.environ["GRAFT_QWEN3_DIR"])

    @dataclasses.dataclass
    class Sample:
        group_index: int = None
        index: int = None
        rollout_id: int = None
        prompt: str = ""
        tokens: list = dataclasses.field(default_factory=list)
        response: str = ""
        response_length: int = 0
        label: str = None
        reward: float = None
        loss_mask: list = None
        weight_versions: list = dataclasses.field(default_factory=list)
        rollout_log_probs: list = None
        remove_sample: bool = False

        class Status(enum.Enum):
            PENDING = "pending"
            COMPLETED = "completed"
            TRUNCATED = "truncated"
            ABORTED = "aborted"
            FAILED = "failed"

        status: Status = Status.PENDING
        metadata: dict = dataclasses.field(default_factory=dict)
        session_id: str = None

    class DataSource:
        def get_samples(self, n):
            return [
                [Sample(group_index=g, index=2 * g + k, prompt=t["prompt"], label=json.dumps(t)) for k in range(2)]
                for g, t in enumerate(tasks[:n])
            ]

    assert set(FILLED) <= {f.name for f in dataclasses.fields(Sample)}
    args = argparse.Namespace(rollout_batch_size=2, n_samples_per_prompt=2, rollout_temperature=1.0,
                              graft_rollouts_url=url, graft_weight_version="default")
    groups = generate_rollout(args, 0, DataSource())
    assert len(groups) == 2
    for g, t in zip(groups, tasks):
        assert len(g) == 2
        assert len({s.session_id for s in g}) == 2
        for k, s in enumerate(g):
            assert isinstance(s, Sample), "one sample per rollout for the example agent"
            assert s.status is Sample.Status.COMPLETED and not s.remove_sample
            assert s.reward == WANT_REWARD[t["id"]]
            assert s.rollout_id == s.index
            assert s.metadata["graft_stop_reason"] == "stop"
            n = s.response_length
            assert len(s.loss_mask) == len(s.rollout_log_probs) == n and 0 < n < len(s.tokens)
            assert sum(s.loss_mask) > 10 and s.loss_mask[0] == 1 and s.loss_mask[-1] == 1
            assert all(lp <= 0 for lp in s.rollout_log_probs)
            resp = s.tokens[len(s.tokens) - n:]
            said = tok.decode([x for x, m in zip(resp, s.loss_mask) if m == 1])
            assert SCRIPTED_FIRST_TURN[t["id"]] in said and "Done." in said
            assert t["prompt"] in tok.decode(s.tokens[: len(s.tokens) - n])
            _assert_turns_are_the_models(tok, s.tokens, [0] * (len(s.tokens) - n) + s.loss_mask)
            assert len(s.weight_versions) == sum(
                1 for i in range(n) if s.loss_mask[i] == 1 and (i == 0 or s.loss_mask[i - 1] == 0)
            ), "one weight version per model turn"
