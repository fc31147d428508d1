"""Sampling from the model, in four rooms (each a floor above the one before):

  sampling   the sampling math: `SamplingParams`, `sample_token` and the logprobs of the distribution sampled
             from, the Engine's per-row sampling in its decode step (bias, penalties, stop strings, top logprobs)
  decode     prefill and cached decode of a batch of prompts (`prefill`, `decode_step`, `append`, `generate`)
  engine     continuous batching over decode rows: the `Engine` (submit / feed / step / release, per-row sampling,
             pictures, adapters swapped in between steps) and `continuous_generate`; `Sampler`, the interface an
             episode driver samples through (the Engine and the rollout worker's HTTP sampler implement it)
  cli        `nemo-jax generate`

Every public name is importable from `nemo_jax.generate` as before the split.
"""

from nemo_jax.generate.decode import (Generation, append, decode_step, generate, left_pad,  # noqa: F401
                                      prefill, prompt_images)
from nemo_jax.generate.engine import (Engine, Finished, chunk_images, chunk_rows, continuous_generate,  # noqa: F401
                                      decode_program, widen_images)
from nemo_jax.generate.sampler import Sampler, TurnEnd  # noqa: F401
from nemo_jax.generate.sampling import (MAX_STOP_BYTES, MIN_WIDTHS, TOP_LOGPROBS, RowSampling,  # noqa: F401
                                        SamplingParams, process_logits, row_sampling_logprobs, sample_rows,
                                        sample_step, sample_token, sampling_logprobs, stop_string_hits,
                                        token_table)
from nemo_jax.sources import load_for_generation, restore_run_params  # noqa: F401 (where they were found before)

