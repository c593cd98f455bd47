"""graft's rollout service (``graft rollouts serve``) behind each trainer's own extension point.

Each module subclasses that framework's own base class (and so imports the framework):

- :mod:`graft_rl.adapters.verl`: ``GraftAgentLoop``, a verl ``AgentLoopBase`` returning
  ``AgentLoopOutput`` (``actor_rollout_ref.rollout.agent.agent_loop_config_path``);
- :mod:`graft_rl.adapters.skyrl`: ``GraftGenerator``, a SkyRL ``GeneratorInterface``
  returning ``GeneratorOutput`` (override ``BasePPOExp.get_generator``);
- :mod:`graft_rl.adapters.openrlhf`: ``GraftAgentExecutor``, an OpenRLHF
  ``AgentExecutorBase`` (``--train.agent_func_path``);
- :mod:`graft_rl.adapters.slime`: ``generate_rollout``, a slime rollout function
  (``--rollout-function-path``; slime is not on PyPI, so this one follows slime's source and
  docs without importing slime unless it is there);
- TRL's is :func:`graft_rl.service.trl_rollout_func`.

What each does: the trainer's batch becomes graft tasks (each row names its task, see each
adapter), graft runs them as groups of rollouts in its harness (envd sandboxes, gateway
sessions, the reward command) against the backend its config names, and the answer
becomes the framework's own rollout type. What graft does not do here: the trainer's
weights. It serves them (``GRAFT_BACKENDS``, comma-separated URLs of its SGLang servers, in
its workers' environment; ``backend.urls`` in the service's config otherwise) and says which
``weight_version`` they are: graft refuses a batch while a server reports another version
(HTTP 409, raised as ``SampleError``), leaves out samples with tokens that other weights
sampled (a server updated mid-batch; counted in ``stale_samples``), and counts the calls
other weights answered (``stale_calls``).

One sequence per rollout (verl, SkyRL, OpenRLHF): a rollout that reconstructs into several
samples (a fork, or a harness's side call) gives the one with the most trained tokens; the
others are counted in the output's metadata. A rollout that was not scored (timed out, its
harness or backend failed) has no samples: it comes back fully masked (nothing trained)
with reward 0.0 and its stop reason, or raises with ``unscored="raise"``.
"""
