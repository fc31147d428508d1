"""What moves between the learner and the samplers that feed it, named for what it carries:

  policy     weights out: each policy version published as an adapter dir (RUN/policy/<version>, LATEST), written
             by a background thread
  board      the work queue: the groups the learner wants sampled (RUN/requests), claimed by workers under leases
  rollouts   rollouts in: finished rollouts as files (RUN/spool), read, checked and pooled by the learner
  producer   the in-process sampler: episodes driven through an Engine (`EpisodeDriver`), the learner's sampler
             thread (`ThreadProducer`), `sample_rollouts` for evals
  worker     `nemo-jax rollout-worker`: samples the board's groups on vLLM, SGLang or `nemo-jax serve` over HTTP

The three file transports (policy, board, rollouts) are re-exported here: together they were `nemo_jax.rl.spool`.
"""

from nemo_jax.rl.transport.board import (CLOSED, Lease, RequestBoard, cancelled, claim_request,  # noqa: F401
                                         closed, complete, post_request, release, renew)
from nemo_jax.rl.transport.policy import (PolicyPublisher, clean_policy_temps, latest_policy,  # noqa: F401
                                          prune_policies, publish_policy, published_versions)
from nemo_jax.rl.transport.rollouts import SpoolReader, report_failure, write_rollouts  # noqa: F401
