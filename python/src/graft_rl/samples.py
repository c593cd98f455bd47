"""graft's samples Parquet, read with pyarrow, and the response-only view every exporter uses.

A graft sample is one token sequence (``tokens``) with a ``loss_mask`` that is 1 exactly on
the tokens the policy sampled, ``logprobs`` aligned to ``tokens`` (null where unknown:
every mask-0 token, and sampled tokens whose logprob was not recorded), the session's
``reward`` and its ``group_id`` (the GRPO group). The layout is documented in graft's
``reconstruct/src/sample.rs``; version 1 files (no ``token_weight_versions``, 0.0 where a
logprob was unknown) read back as version 2 says, the same way graft's own reader does, and
files before version 3 (no ``events``) with no events and no call rewards. ``events`` are the forks and drift
events at their token positions (``kind`` fork | branch | drift, ``at``, ``len``,
``reason``, ``call_id``, ``other_sample``); exporters do not need them, the viewer and
debugging do. ``token_calls`` (aligned to ``tokens``: the index in ``call_ids`` of the call
that sampled each token, null on mask-0 tokens) and ``call_rewards`` (aligned to
``call_ids``: process rewards posted for single calls, null where none) carry per-turn
rewards. ``logprob_kind`` says which distribution ``logprobs`` come from:
``post_temperature`` (the one sampled from: SGLang, ``graft serve``, vLLM with
``--logprobs-mode processed_logprobs``; also every file without the column) or
``pre_temperature`` (vLLM's default ``raw_logprobs``, before temperature, penalties and
bias). Every framework here compares rollout logprobs with its own temperature-scaled
ones, so a ``pre_temperature`` sample's logprobs are handed to none of them: they count as
unknown (``sampled_logprobs_known`` is false, TRL gets ``None`` per token) and the
framework recomputes its old policy.

Since version 4 every sample names its ``thread``: ``main`` (the agent) or ``side`` (a
harness's title call, a sub-agent, memory extraction: a conversation of its own with
another system prompt or tool set), its ``thread_id`` (the thread's shape fingerprint),
``thread_name`` and, for a side sample, ``parent_sample`` (the main sample that was
running when it started); ``rewrites`` say what the fork or drift events at the sample
changed, message by message (``kind``, ``call_id``, ``against_call``, ``message``,
``role``, ``before``, ``after``). ``graft reconstruct`` leaves side threads out unless a
reward was posted for one of their calls (``--side-threads``); such a side sample has no
``reward`` of its own: :func:`rewards` gives it 0.0 and its call rewards carry its signal.
Exporters pass ``thread`` and ``parent_sample`` on beside ``graft_sample_id``.

Frameworks that split a sequence into prompt and response get:

- ``prompt`` = the tokens before the first sampled token;
- ``response`` = from the first sampled token through the last one, with
  ``response_mask`` = the loss mask over that span (0 on tool results and other context
  between turns). Tokens after the last sampled token are never trained on and carry no
  reward; they are left out (graft's merge ends every sample with a completion, so there
  are none in its files).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 4
"""The newest sample layout this package reads (graft's ``SAMPLE_SCHEMA_VERSION``)."""

EVENT_KINDS = ("fork", "branch", "drift")
"""The ``kind`` of an event (graft's ``EventKind``)."""

REQUIRED_COLUMNS = ("sample_id", "session_id", "group_id", "tokens", "loss_mask", "logprobs", "reward")


class SampleError(ValueError):
    """A samples file or a sample that an exporter cannot turn into training data."""


@dataclass
class Sample:
    sample_id: str
    session_id: str
    group_id: Optional[str]
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[Optional[float]]
    reward: Optional[float]
    weight_versions: list[str] = field(default_factory=list)
    token_weight_versions: list[Optional[str]] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    token_calls: list[Optional[int]] = field(default_factory=list)
    call_rewards: list[Optional[float]] = field(default_factory=list)
    fork_reason: Optional[str] = None
    events: list[dict] = field(default_factory=list)
    tokenizer_fingerprint: str = ""
    template_fingerprint: str = ""
    schema_version: int = SCHEMA_VERSION
    logprob_kind: str = "post_temperature"
    thread: str = "main"
    thread_id: str = "unknown"
    thread_name: str = ""
    parent_sample: Optional[str] = None
    rewrites: list[dict] = field(default_factory=list)
    # A branch session's sample: the parent session and the branch point (the parent's
    # calls replayed there, mask 0 in this sample). None for a sample of a whole rollout.
    branch_of: Optional[str] = None
    branch_at: Optional[int] = None

    # -- the response-only view -------------------------------------------------------

    def span(self) -> tuple[int, int]:
        """(first, end): the response is ``tokens[first:end]``; ``end`` is one past the
        last sampled token. Raises :class:`SampleError` for a sample with no sampled token."""
        first = next((i for i, m in enumerate(self.loss_mask) if m == 1), None)
        if first is None:
            raise SampleError(
                f"sample {self.sample_id!r} has no sampled token (loss_mask is all 0): there is "
                "no response to train on; leave it out (graft reconstruct never writes one)"
            )
        last = max(i for i, m in enumerate(self.loss_mask) if m == 1)
        return first, last + 1

    @property
    def prompt_ids(self) -> list[int]:
        return self.tokens[: self.span()[0]]

    @property
    def response_ids(self) -> list[int]:
        a, b = self.span()
        return self.tokens[a:b]

    @property
    def response_mask(self) -> list[int]:
        a, b = self.span()
        return [int(m) for m in self.loss_mask[a:b]]

    @property
    def response_logprobs(self) -> list[Optional[float]]:
        a, b = self.span()
        return self.logprobs[a:b]

    @property
    def response_sampler_logprobs(self) -> list[Optional[float]]:
        """``response_logprobs`` as the sampling distribution's: all ``None`` for a
        ``pre_temperature`` sample (not comparable with a temperature-scaled logprob)."""
        if self.logprob_kind != "post_temperature":
            return [None] * len(self.response_logprobs)
        return self.response_logprobs

    def sampled_logprobs_known(self) -> bool:
        """Every sampled token's logprob was recorded, as the sampling distribution's
        (post-temperature; a ``pre_temperature`` sample's count as unknown)."""
        if self.logprob_kind != "post_temperature":
            return False
        return all(lp is not None for lp, m in zip(self.logprobs, self.loss_mask) if m == 1)

    def sampled_tokens(self) -> list[int]:
        return [t for t, m in zip(self.tokens, self.loss_mask) if m == 1]

    @property
    def num_turns(self) -> int:
        """Completions merged into this sample: runs of sampled tokens."""
        runs, prev = 0, 0
        for m in self.loss_mask:
            if m == 1 and prev == 0:
                runs += 1
            prev = m
        return runs

    def action_ranges(self) -> list[tuple[int, int]]:
        """[start, end) of each run of sampled tokens, in ``tokens`` positions."""
        out, start = [], None
        for i, m in enumerate(self.loss_mask):
            if m == 1 and start is None:
                start = i
            elif m != 1 and start is not None:
                out.append((start, i))
                start = None
        if start is not None:
            out.append((start, len(self.loss_mask)))
        return out


def _upgrade_v1(s: Sample) -> None:
    """Version 1 as version 2 says it (graft's ``upgrade_v1``)."""
    sampled_known = any(m == 1 and lp != 0.0 for m, lp in zip(s.loss_mask, s.logprobs))
    s.logprobs = [lp if (m == 1 and sampled_known) else None for lp, m in zip(s.logprobs, s.loss_mask)]
    one = s.weight_versions[0] if len(s.weight_versions) == 1 else None
    s.token_weight_versions = [one if m == 1 else None for m in s.loss_mask]


def _upgrade_v2(s: Sample) -> None:
    """Before version 3 as version 3 says it (graft's ``upgrade_v2``): no call rewards; each
    sampled token's call from the runs of sampled tokens when there is one run per call."""
    s.call_rewards = [None] * len(s.call_ids)
    runs, prev, calls = 0, 0, []
    for m in s.loss_mask:
        if m == 1 and prev == 0:
            runs += 1
        prev = m
        calls.append(runs - 1 if m == 1 else None)
    s.token_calls = calls if runs == len(s.call_ids) else [None] * len(s.loss_mask)


def _check(s: Sample) -> None:
    n = len(s.tokens)
    if len(s.loss_mask) != n or len(s.logprobs) != n:
        raise SampleError(
            f"sample {s.sample_id!r}: tokens ({n}), loss_mask ({len(s.loss_mask)}) and logprobs "
            f"({len(s.logprobs)}) differ in length; the file is not graft's sample layout"
        )
    if len(s.token_calls) != n or len(s.call_rewards) != len(s.call_ids):
        raise SampleError(
            f"sample {s.sample_id!r}: token_calls ({len(s.token_calls)}) must align to tokens ({n}) "
            f"and call_rewards ({len(s.call_rewards)}) to call_ids ({len(s.call_ids)})"
        )
    bad = [m for m in s.loss_mask if m not in (0, 1)]
    if bad:
        raise SampleError(f"sample {s.sample_id!r}: loss_mask holds {bad[0]!r}; it must be 0 or 1")
    for e in s.events:
        if e.get("kind") not in EVENT_KINDS or not isinstance(e.get("at"), int) or not 0 <= e["at"] <= n:
            raise SampleError(
                f"sample {s.sample_id!r}: event {e!r} is not a fork, branch or drift at a token "
                f"position (0..{n}); the file is not graft's sample layout"
            )
    if s.logprob_kind not in ("post_temperature", "pre_temperature"):
        raise SampleError(
            f"sample {s.sample_id!r} has logprob_kind {s.logprob_kind!r}; this package knows "
            "post_temperature and pre_temperature"
        )
    if s.schema_version > SCHEMA_VERSION:
        raise SampleError(
            f"sample {s.sample_id!r} has schema_version {s.schema_version}, newer than this package "
            f"reads ({SCHEMA_VERSION}); upgrade graft-rl"
        )


def from_table(table: pa.Table) -> list[Sample]:
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise SampleError(f"not a graft samples table: columns {missing} are missing")
    cols = table.to_pydict()
    n = table.num_rows

    def col(name: str, default):
        return cols.get(name, [default() for _ in range(n)])

    out = []
    has_tv = "token_weight_versions" in cols
    has_tc = "token_calls" in cols and "call_rewards" in cols
    for i in range(n):
        s = Sample(
            sample_id=cols["sample_id"][i],
            session_id=cols["session_id"][i],
            group_id=cols["group_id"][i],
            tokens=[int(t) for t in (cols["tokens"][i] or [])],
            loss_mask=[int(m) for m in (cols["loss_mask"][i] or [])],
            logprobs=[None if lp is None else float(lp) for lp in (cols["logprobs"][i] or [])],
            reward=cols["reward"][i],
            weight_versions=list(col("weight_versions", list)[i] or []),
            token_weight_versions=list(cols["token_weight_versions"][i] or []) if has_tv else [],
            call_ids=list(col("call_ids", list)[i] or []),
            fork_reason=col("fork_reason", lambda: None)[i],
            events=[dict(e) for e in (col("events", list)[i] or [])],
            token_calls=list(cols["token_calls"][i] or []) if has_tc else [],
            call_rewards=list(cols["call_rewards"][i] or []) if has_tc else [],
            tokenizer_fingerprint=col("tokenizer_fingerprint", str)[i] or "",
            template_fingerprint=col("template_fingerprint", str)[i] or "",
            schema_version=int(col("schema_version", lambda: 1)[i] or 1),
            logprob_kind=col("logprob_kind", lambda: None)[i] or "post_temperature",
            thread=col("thread", lambda: None)[i] or "main",
            thread_id=col("thread_id", lambda: None)[i] or "unknown",
            thread_name=col("thread_name", str)[i] or "",
            parent_sample=col("parent_sample", lambda: None)[i],
            rewrites=[dict(r) for r in (col("rewrites", list)[i] or [])],
            branch_of=col("branch_of", lambda: None)[i],
            branch_at=col("branch_at", lambda: None)[i],
        )
        if not has_tv:
            _upgrade_v1(s)
        if not has_tc:
            _upgrade_v2(s)
        _check(s)
        out.append(s)
    return out


def read_samples(path: str | Path | Sequence[str | Path]) -> list[Sample]:
    """Every sample of one graft samples file (or several, in order)."""
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    out: list[Sample] = []
    for p in paths:
        out.extend(from_table(pq.read_table(p)))
    return out


def groups(samples: Iterable[Sample]) -> dict[str, list[int]]:
    """GRPO groups: ``group_id`` → indices of its samples, in order of first appearance. A
    sample without a group is a group of its own, keyed by its session."""
    g: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        g.setdefault(group_key(s), []).append(i)
    return g


def group_key(s: Sample) -> str:
    return s.group_id if s.group_id is not None else f"session:{s.session_id}"


def rewards(samples: Sequence[Sample], missing: Optional[float] = None) -> list[float]:
    """Each sample's reward; a sample without one raises, unless ``missing`` gives a value."""
    out = []
    for s in samples:
        if s.reward is None and s.thread == "side" and any(x is not None for x in s.call_rewards):
            # Kept for its own call rewards (``--side-threads own``): no outcome of its own.
            out.append(0.0)
            continue
        if s.reward is None or (isinstance(s.reward, float) and math.isnan(s.reward)):
            if missing is None:
                raise SampleError(
                    f"sample {s.sample_id!r} (session {s.session_id!r}) has no reward: post one to "
                    "the session before reconstructing, or pass missing_reward=VALUE"
                )
            out.append(float(missing))
        else:
            out.append(float(s.reward))
    return out


def grpo_advantages(samples: Sequence[Sample], missing_reward: Optional[float] = None, std_normalize: bool = False) -> list[float]:
    """Outcome advantage per sample: reward minus its group's mean (divided by the group's
    std + 1e-6 with ``std_normalize``), the GRPO baseline."""
    r = rewards(samples, missing_reward)
    adv = [0.0] * len(samples)
    for idx in groups(samples).values():
        vals = [r[i] for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
        for i in idx:
            a = r[i] - mean
            adv[i] = a / (std + 1e-6) if std_normalize else a
    return adv


def response_scores(s: Sample, reward: float, call_rewards: bool = True) -> list[float]:
    """Token-level scores over the response (one float per response token): ``reward`` on
    the last response token and, with ``call_rewards``, each posted call reward (a process
    reward for one turn) added on the last token that call sampled in this sample. A call
    reward whose call sampled no token of this sample (its tokens are another sample's
    context) is not placed. Summed over the response, they give the sequence score that
    outcome-level GRPO reads; per token, they are the dense rewards that GAE/PPO read."""
    a, b = s.span()
    out = [0.0] * (b - a)
    out[-1] += reward
    if call_rewards and any(x is not None for x in s.call_rewards):
        last: dict[int, int] = {}
        for i in range(a, min(b, len(s.token_calls))):
            c = s.token_calls[i]
            if c is not None:
                last[c] = i
        for c, i in last.items():
            x = s.call_rewards[c] if 0 <= c < len(s.call_rewards) else None
            if x is not None:
                out[i - a] += x
    return out


def has_call_rewards(samples: Iterable[Sample]) -> bool:
    return any(x is not None for s in samples for x in s.call_rewards)


def batch_response_logprobs(samples: Sequence[Sample], fill: float = 0.0) -> Optional[list[list[float]]]:
    """Response logprobs for formats that hold one float per token: ``fill`` on mask-0 tokens
    (the frameworks' own convention; they are masked out of the loss). ``None`` for the whole
    batch when any sampled token's logprob is unknown: those formats have no per-token null,
    and a made-up number would be trained on as if the sampler had produced it."""
    if not all(s.sampled_logprobs_known() for s in samples):
        return None
    return [[fill if lp is None else lp for lp in s.response_logprobs] for s in samples]
