"""Property tests for every exporter, on samples written with pyarrow in graft's exact
schema (hypothesis) and on the samples real graft made (``GRAFT_SAMPLES``):

- the response tokens with mask 1 are exactly the sampled (loss-mask-1) tokens, in order;
- logprobs stay aligned to them (and a batch with an unknown sampled logprob carries none,
  or null per token where the format has a per-token null); a ``pre_temperature`` sample's
  logprobs count as unknown (no framework compares raw logprobs with tempered ones);
- the reward sits on the last response token where the format wants token-level scores;
- GRPO groups follow ``group_id``.

Needs pyarrow, numpy, pytest and hypothesis only (no framework).
"""

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import GRAFT_SCHEMA, write_graft_samples
from graft_rl import (
    SampleError,
    grpo_advantages,
    read_samples,
    response_scores,
    skyrl_layout,
    tinker_layout,
    to_openrlhf,
    to_slime,
    to_trl,
    to_trl_sft,
    verl_layout,
)
from graft_rl.samples import group_key, rewards

f32 = lambda x: float(np.float32(x))  # noqa: E731  graft stores logprobs as float32

# -- generated samples ------------------------------------------------------------------

token = st.integers(min_value=0, max_value=2**20)
logprob = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False, width=32)


@st.composite
def sample_row(draw, idx: int, groups: list):
    """A multi-turn sample: prompt, then completions with context (tool results) between."""
    turns = draw(st.integers(1, 4))
    tokens, mask, lps, tv = [], [], [], []
    missing_lp = draw(st.booleans()) and draw(st.booleans())  # about 1 in 4 has gaps
    versions = draw(st.lists(st.sampled_from(["w0", "w1", "w2"]), min_size=1, max_size=2, unique=True))
    for t in range(turns):
        ctx = draw(st.lists(token, min_size=1, max_size=12))
        tokens += ctx
        mask += [0] * len(ctx)
        lps += [None] * len(ctx)
        tv += [None] * len(ctx)
        comp = draw(st.lists(token, min_size=1, max_size=12))
        v = draw(st.sampled_from(versions))
        for c in comp:
            tokens.append(c)
            mask.append(1)
            lps.append(None if (missing_lp and draw(st.booleans())) else draw(logprob))
            tv.append(v)
    reward = draw(st.one_of(st.floats(-1.0, 1.0, allow_nan=False), st.just(1.0), st.just(0.0)))
    return {
        "sample_id": f"s{idx}/0",
        "session_id": f"s{idx}",
        "group_id": draw(st.sampled_from(groups)),
        "tokens": tokens,
        "loss_mask": mask,
        "logprobs": lps,
        "reward": reward,
        "weight_versions": versions,
        "call_ids": [f"c{idx}-{t}" for t in range(turns)],
        "fork_reason": None,
        "tokenizer_fingerprint": "tok",
        "template_fingerprint": "tpl",
        "schema_version": 2,
        "token_weight_versions": tv,
        "logprob_kind": draw(st.sampled_from(["post_temperature", "post_temperature", "pre_temperature"])),
    }


@st.composite
def batches(draw):
    groups = draw(st.lists(st.sampled_from(["g0", "g1", "g2", None]), min_size=1, max_size=3, unique=True))
    n = draw(st.integers(1, 6))
    return [draw(sample_row(i, groups)) for i in range(n)]


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def sampled(row):
    return [t for t, m in zip(row["tokens"], row["loss_mask"]) if m == 1]


def sampled_lps(row):
    """The sampled tokens' logprobs as the exporters hand them over: unknown (None) for a
    ``pre_temperature`` sample."""
    lps = [lp for lp, m in zip(row["logprobs"], row["loss_mask"]) if m == 1]
    if row.get("logprob_kind", "post_temperature") != "post_temperature":
        return [None] * len(lps)
    return lps


def all_known(rows):
    return all(lp is not None for r in rows for lp in sampled_lps(r))


def check_all(rows, samples):
    """Every exporter's invariants, for source rows and the samples read back from them."""
    assert [s.tokens for s in samples] == [r["tokens"] for r in rows]
    known = all_known(rows)
    key = [r["group_id"] if r["group_id"] is not None else f"session:{r['session_id']}" for r in rows]

    # verl: the DataProto batch.
    v = verl_layout(samples)
    P = v["prompts"].shape[1]
    for i, r in enumerate(rows):
        m = v["response_mask"][i] == 1
        assert v["responses"][i][m].tolist() == sampled(r)
        valid = v["attention_mask"][i] == 1
        assert v["input_ids"][i][valid].tolist() == r["tokens"], "prompt + response is the whole sequence"
        n = int(v["attention_mask"][i, P:].sum())
        assert np.nonzero(v["token_level_scores"][i])[0].tolist() in ([n - 1], []), "reward on the last response token"
        assert v["token_level_scores"][i, n - 1] == np.float32(r["reward"])
        assert v["response_mask"][i, n - 1] == 1, "the last response token is sampled"
        assert v["position_ids"][i][valid].tolist() == list(range(len(r["tokens"])))
        if known:
            assert v["rollout_log_probs"][i][m].tolist() == [f32(x) for x in sampled_lps(r)]
    assert ("rollout_log_probs" in v) == known
    assert v["uid"].tolist() == key

    # TRL rollout_func: groups consecutive, per-token None kept.
    t = to_trl(samples)
    order = [i for g in dict.fromkeys(key) for i, k in enumerate(key) if k == g]
    for j, i in enumerate(order):
        r = rows[i]
        comp, mask, lp = t["completion_ids"][j], t["env_mask"][j], t["logprobs"][j]
        assert [c for c, e in zip(comp, mask) if e == 1] == sampled(r)
        assert t["prompt_ids"][j] + comp == r["tokens"]
        got = [x for x, e in zip(lp, mask) if e == 1]
        assert [None if x is None else f32(x) for x in got] == [None if x is None else f32(x) for x in sampled_lps(r)]
        assert t["graft_reward"][j] == r["reward"]
    sft = to_trl_sft(samples)
    for row, r in zip(sft, rows):
        assert [x for x, m in zip(row["input_ids"], row["assistant_masks"]) if m] == sampled(r)

    # SkyRL GeneratorOutput (float and token-level rewards).
    for token_level in (False, True):
        k = skyrl_layout(samples, token_level_rewards=token_level)
        for i, r in enumerate(rows):
            assert [x for x, m in zip(k["response_ids"][i], k["loss_masks"][i]) if m] == sampled(r)
            if token_level:
                assert k["rewards"][i][-1] == r["reward"] and not any(k["rewards"][i][:-1])
            else:
                assert k["rewards"][i] == r["reward"]
            if known:
                got = [x for x, m in zip(k["rollout_logprobs"][i], k["loss_masks"][i]) if m]
                assert [f32(x) for x in got] == [f32(x) for x in sampled_lps(r)]
            assert k["trajectory_ids"][i][0] == key[i]
        assert (k["rollout_logprobs"] is not None) == known
        reps = {}
        for g, rep in k["trajectory_ids"]:
            assert rep == reps.get(g, 0)
            reps[g] = rep + 1

    # OpenRLHF agent output.
    for d, r in zip(to_openrlhf(samples), rows):
        obs = d["observation_tokens"]
        assert [x for a, b in d["action_ranges"] for x in obs[a:b]] == sampled(r)
        assert d["reward"] == r["reward"]
        if known:
            got = [d["rollout_log_probs"][j] for a, b in d["action_ranges"] for j in range(a, b)]
            assert [f32(x) for x in got] == [f32(x) for x in sampled_lps(r)]
        else:
            assert d["rollout_log_probs"] is None

    # slime Sample dicts.
    sl = to_slime(samples)
    gi = {}
    for d, r, kk, smp in zip(sl, rows, key, samples):
        resp = d["tokens"][len(d["tokens"]) - d["response_length"]:]
        assert len(d["loss_mask"]) == d["response_length"]
        assert [x for x, m in zip(resp, d["loss_mask"]) if m] == sampled(r)
        assert d["tokens"] == r["tokens"]
        assert d["reward"] == r["reward"] and d["status"] == "completed"
        assert gi.setdefault(kk, d["group_index"]) == d["group_index"]
        runs = smp.action_ranges()
        assert len(d["weight_versions"]) == len(runs), "one weight version per model turn"
        assert d["weight_versions"] == [r["token_weight_versions"][a] for a, _ in runs]
        if known:
            got = [x for x, m in zip(d["rollout_log_probs"], d["loss_mask"]) if m]
            assert [f32(x) for x in got] == [f32(x) for x in sampled_lps(r)]
            assert len(d["rollout_log_probs"]) == d["response_length"]
    assert len(set(gi.values())) == len(gi), "one group_index per group"

    # Tinker Datum inputs: next-token targets, advantages on sampled targets.
    adv = grpo_advantages(samples)
    for d, r, a in zip(tinker_layout(samples), rows, adv):
        assert d["model_input"] + [int(d["target_tokens"][-1])] == r["tokens"]
        m = d["mask"] == 1
        assert d["target_tokens"][m].tolist() == sampled(r)
        assert np.allclose(d["advantages"][m], a, atol=1e-6) and not d["advantages"][~m].any()
        if known:
            assert [f32(x) for x in d["logprobs"][m].tolist()] == [f32(x) for x in sampled_lps(r)]
        assert ("logprobs" in d) == known


@SETTINGS
@given(rows=batches())
def test_every_exporter_keeps_sampled_tokens_logprobs_rewards_and_groups(rows, tmp_path_factory):
    path = write_graft_samples(rows, tmp_path_factory.mktemp("gen") / "samples.parquet")
    samples = read_samples(path)
    check_all(rows, samples)


@SETTINGS
@given(rows=batches())
def test_grpo_advantages_are_reward_minus_the_group_mean(rows, tmp_path_factory):
    samples = read_samples(write_graft_samples(rows, tmp_path_factory.mktemp("adv") / "s.parquet"))
    adv = grpo_advantages(samples)
    by = {}
    for r, a in zip(rows, adv):
        by.setdefault(group_key(read_samples_one(r)), []).append((r["reward"], a))
    for members in by.values():
        mean = sum(x for x, _ in members) / len(members)
        for x, a in members:
            assert math.isclose(a, x - mean, abs_tol=1e-9)


def read_samples_one(row):
    from graft_rl.samples import Sample

    return Sample(**{k: row[k] for k in ("sample_id", "session_id", "group_id", "tokens", "loss_mask", "logprobs", "reward")})


def test_a_sample_without_a_sampled_token_is_refused(tmp_path):
    row = {
        "sample_id": "x/0", "session_id": "x", "group_id": "g", "tokens": [1, 2], "loss_mask": [0, 0],
        "logprobs": [None, None], "reward": 1.0, "weight_versions": [], "call_ids": [], "fork_reason": None,
        "tokenizer_fingerprint": "", "template_fingerprint": "", "schema_version": 2, "token_weight_versions": [None, None],
    }
    samples = read_samples(write_graft_samples([row], tmp_path / "s.parquet"))
    with pytest.raises(SampleError, match="no sampled token"):
        verl_layout(samples)


def test_a_sample_without_a_reward_is_refused_unless_a_value_is_given(tmp_path):
    row = {
        "sample_id": "x/0", "session_id": "x", "group_id": None, "tokens": [1, 2, 3], "loss_mask": [0, 1, 1],
        "logprobs": [None, -0.5, -0.25], "reward": None, "weight_versions": ["w"], "call_ids": ["c"],
        "fork_reason": None, "tokenizer_fingerprint": "", "template_fingerprint": "", "schema_version": 2,
        "token_weight_versions": [None, "w", "w"],
    }
    samples = read_samples(write_graft_samples([row], tmp_path / "s.parquet"))
    with pytest.raises(SampleError, match="has no reward"):
        to_trl(samples)
    assert to_trl(samples, missing_reward=0.0)["graft_reward"] == [0.0]


def _one_turn_row(**over):
    row = {
        "sample_id": "x/1", "session_id": "x", "group_id": "g", "tokens": [1, 2, 3], "loss_mask": [0, 1, 1],
        "logprobs": [None, -0.5, -0.25], "reward": 1.0, "weight_versions": ["w"], "call_ids": ["c"],
        "fork_reason": "template_drift", "tokenizer_fingerprint": "", "template_fingerprint": "",
        "schema_version": 3, "token_weight_versions": [None, "w", "w"],
    }
    row.update(over)
    return row


def test_events_read_back_and_files_before_v3_have_none(tmp_path):
    ev = {"kind": "fork", "at": 1, "len": 0, "reason": "template_drift", "call_id": "c", "other_sample": "x/0"}
    [s] = read_samples(write_graft_samples([_one_turn_row(events=[ev])], tmp_path / "v3.parquet"))
    assert s.events == [ev]
    v2 = pa.schema([f for f in GRAFT_SCHEMA if f.name not in ("events", "token_calls", "call_rewards", "logprob_kind") + V4])
    [old] = read_samples(write_graft_samples([_one_turn_row(schema_version=2)], tmp_path / "v2.parquet", v2))
    assert old.events == [] and old.schema_version == 2
    assert old.logprob_kind == "post_temperature", "a file without the column: post-temperature"
    # One run of sampled tokens, one call: the call of each sampled token is known.
    assert old.token_calls == [None, 0, 0] and old.call_rewards == [None]


V4 = ("thread", "thread_id", "thread_name", "parent_sample", "rewrites")


def test_threads_and_rewrites_read_back_and_files_before_v4_are_main(tmp_path):
    rw = {"kind": "assistant_reserialized", "call_id": "c", "against_call": "b", "message": 2,
          "role": "assistant", "before": "shell({})", "after": "Calling tools: [...]"}
    main = _one_turn_row(schema_version=4, rewrites=[rw], thread_id="abc")
    side = _one_turn_row(
        sample_id="x/2", schema_version=4, thread="side", thread_id="def", thread_name="title (0 tools)",
        parent_sample="x/1", reward=None, call_rewards=[0.5], token_calls=[None, 0, 0],
    )
    got = read_samples(write_graft_samples([main, side], tmp_path / "v4.parquet"))
    assert [(s.thread, s.parent_sample) for s in got] == [("main", None), ("side", "x/1")]
    assert got[0].rewrites == [rw] and got[1].thread_name == "title (0 tools)"
    # A side sample kept for its own call rewards has no outcome of its own: 0.0.
    assert rewards(got) == [1.0, 0.0]
    lay = to_trl(got)
    assert lay["graft_thread"] == ["main", "side"] and lay["graft_parent_sample"] == [None, "x/1"]
    v3 = pa.schema([f for f in GRAFT_SCHEMA if f.name not in V4])
    [old] = read_samples(write_graft_samples([_one_turn_row()], tmp_path / "v3.parquet", v3))
    assert (old.thread, old.thread_id, old.parent_sample, old.rewrites) == ("main", "unknown", None, [])


def test_call_rewards_and_token_calls_read_back(tmp_path):
    row = _one_turn_row(
        tokens=[1, 2, 3, 4, 5], loss_mask=[0, 1, 0, 1, 1], logprobs=[None, -0.1, None, -0.2, -0.3],
        call_ids=["c0", "c1"], token_weight_versions=[None, "w", None, "w", "w"],
        token_calls=[None, 0, None, 1, 1], call_rewards=[0.5, None],
    )
    [s] = read_samples(write_graft_samples([row], tmp_path / "s.parquet"))
    assert (s.token_calls, s.call_rewards) == ([None, 0, None, 1, 1], [0.5, None])
    with pytest.raises(SampleError, match="must align"):
        read_samples(write_graft_samples([{**row, "call_rewards": [0.5]}], tmp_path / "bad.parquet"))


def test_call_rewards_land_on_the_last_token_of_their_call_in_token_level_scores(tmp_path):
    # Three calls: c0 sampled tokens 1-2, c1 is context only (tool result tokens 3-4 are
    # mask 0 and belong to no call), c2 sampled tokens 5-6. c0 and c2 have call rewards.
    row = _one_turn_row(
        tokens=[9, 1, 2, 3, 4, 5, 6], loss_mask=[0, 1, 1, 0, 0, 1, 1],
        logprobs=[None, -0.1, -0.2, None, None, -0.3, -0.4], call_ids=["c0", "c1", "c2"],
        token_weight_versions=[None, "w", "w", None, None, "w", "w"],
        token_calls=[None, 0, 0, None, None, 2, 2], call_rewards=[0.5, 7.0, -0.25], reward=1.0,
    )
    plain = _one_turn_row(sample_id="y/0", session_id="y", reward=0.0)
    samples = read_samples(write_graft_samples([row, plain], tmp_path / "s.parquet"))
    # Response = tokens 1..6: c0's last token is response index 1, c2's (the last) index 5.
    want = [0.0, 0.5, 0.0, 0.0, 0.0, 1.0 - 0.25]
    assert response_scores(samples[0], 1.0) == want
    assert response_scores(samples[0], 1.0, call_rewards=False) == [0.0] * 5 + [1.0]
    v = verl_layout(samples)
    assert v["token_level_scores"][0, :6].tolist() == want
    assert v["rm_scores"][0, :6].tolist() == want
    assert v["token_level_scores"][1].tolist() == [0.0] * 6, "no call rewards: the reward (0) alone"
    assert verl_layout(samples, call_rewards=False)["token_level_scores"][0, :6].tolist() == [0.0] * 5 + [1.0]
    # SkyRL: per-token rewards exactly when a sample has call rewards, unless asked.
    assert skyrl_layout(samples)["rewards"][0] == want
    assert skyrl_layout(samples, token_level_rewards=False)["rewards"] == [1.0, 0.0]
    assert skyrl_layout([samples[1]])["rewards"] == [0.0]
    assert skyrl_layout(samples, call_rewards=False)["rewards"] == [1.0, 0.0]


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "fork", "at": 4, "len": 0, "reason": "other", "call_id": "c", "other_sample": None},
        {"kind": "teleport", "at": 0, "len": 0, "reason": "other", "call_id": "c", "other_sample": None},
    ],
)
def test_an_event_off_the_tokens_or_of_an_unknown_kind_is_refused(tmp_path, bad):
    with pytest.raises(SampleError, match="is not a fork, branch or drift"):
        read_samples(write_graft_samples([_one_turn_row(events=[bad])], tmp_path / "bad.parquet"))


# -- the samples real graft made --------------------------------------------------------


def test_real_graft_file_has_this_schema(graft_samples_path):
    assert pq.read_schema(graft_samples_path).remove_metadata() == GRAFT_SCHEMA


def test_every_exporter_on_real_graft_samples(graft_samples_path):
    table = pq.read_table(graft_samples_path)
    rows = table.to_pylist()
    assert len(rows) >= 2
    assert all(any(r["loss_mask"]) for r in rows)
    assert all_known(rows), "graft rl in exact mode records every sampled token's logprob"
    assert len({r["group_id"] for r in rows}) >= 2, "more than one GRPO group"
    samples = read_samples(graft_samples_path)
    check_all(rows, samples)


# -- the rollout service's answer, as the adapters split it ------------------------------


@given(batches(), st.lists(st.sampled_from(["stop", "length", "tool_calls", None]), min_size=6, max_size=6))
@SETTINGS
def test_service_groups_split_into_rollouts_and_slime_groups_train_the_sampled_tokens(rows, whys):
    """A group line as ``graft rollouts serve`` sends it (every sample of a session its
    rollout's, each with a stop reason), read by the client, split per rollout by
    ``Group.results()``, and filled into slime-shaped samples by the slime adapter."""
    import dataclasses
    import enum

    from graft_rl.adapters.slime import fill_group
    from graft_rl.service import Group, _sample

    # A second sample for the first session (a fork that trains 2 tokens more), so one rollout
    # has two and its main sample is the fork.
    r0 = rows[0]
    fork = dict(r0, sample_id=r0["sample_id"][:-1] + "1", tokens=r0["tokens"] + [7, 8],
                loss_mask=r0["loss_mask"] + [1, 1], logprobs=r0["logprobs"] + [-0.5, -0.25],
                token_weight_versions=r0["token_weight_versions"] + [r0["weight_versions"][0]] * 2)
    rows = rows + [fork]
    sessions = list(dict.fromkeys(r["session_id"] for r in rows)) + ["unscored"]
    line_samples = [dict(r, stop_reason=whys[i % len(whys)]) for i, r in enumerate(rows)]
    g = Group(
        group_id="g", task_id="t",
        rollouts=[{"session_id": s, "reward": None if s == "unscored" else 1.0,
                   "outcome": "timed_out" if s == "unscored" else "scored",
                   "stop_reason": "timeout" if s == "unscored" else "stop"} for s in sessions],
        samples=[_sample(d) for d in line_samples],
        stop_reasons=[d["stop_reason"] for d in line_samples],
    )
    results = g.results()
    assert [r.session_id for r in results] == sessions
    for r in results:
        assert [s.session_id for s in r.samples] == [r.session_id] * len(r.samples)
        assert r.sample_stop_reasons == [d["stop_reason"] for d in line_samples if d["session_id"] == r.session_id]
        main, why = r.main_sample()
        if r.session_id == "unscored":
            assert (main, why, r.scored, r.stop_reason) == (None, None, False, "timeout")
        else:
            assert sum(main.loss_mask) == max(sum(s.loss_mask) for s in r.samples)
            if r.session_id == r0["session_id"]:
                assert main.sample_id == fork["sample_id"]
            assert why == r.sample_stop_reasons[r.samples.index(main)]

    @dataclasses.dataclass
    class SlimeSample:  # slime's field names (slime/utils/types.py); slime is not on PyPI
        index: int = 0
        rollout_id: int = None
        tokens: list = dataclasses.field(default_factory=list)
        response_length: int = 0
        reward: float = None
        loss_mask: list = None
        weight_versions: list = dataclasses.field(default_factory=list)
        rollout_log_probs: list = None
        remove_sample: bool = False
        Status = enum.Enum("Status", {"PENDING": "pending", "COMPLETED": "completed", "TRUNCATED": "truncated",
                                      "ABORTED": "aborted"})
        status: object = None
        metadata: dict = dataclasses.field(default_factory=dict)
        session_id: str = None

    filled = fill_group([SlimeSample(index=i, status=SlimeSample.Status.PENDING) for i in range(len(results))], results)
    for r, x in zip(results, filled):
        xs = x if isinstance(x, list) else [x]
        if not r.samples:
            assert xs[0].remove_sample and xs[0].status is SlimeSample.Status.ABORTED
            continue
        assert len(xs) == len(r.samples) and {y.rollout_id for y in xs} == {xs[0].index}
        for y, s, why in zip(xs, r.samples, r.sample_stop_reasons):
            resp = y.tokens[len(y.tokens) - y.response_length:]
            assert [t for t, m in zip(resp, y.loss_mask) if m == 1] == s.sampled_tokens()
            assert y.status is (SlimeSample.Status.TRUNCATED if why == "length" else SlimeSample.Status.COMPLETED)
            assert y.metadata["graft_stop_reason"] == why and y.session_id == r.session_id
