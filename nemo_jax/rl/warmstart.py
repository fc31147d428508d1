"""SFT data an environment makes, for warm starts of RL experts (`data.sources` entries with an `env`):

    data:
      sources:
        - {env: swe, env_args: {...}, make: demonstrations, tasks: 512}        # the expert's conversations
        - {env: constraints, env_args: {...}, make: rejection_sampling,        # the start's own verified
           attempts: 8, max_new_tokens: 24, temperature: 1.0, seed: 0}         #   successes (one round)
        - {path: builtin:tiny_chat/train.jsonl, weight: 0.5}                   # (any other source beside them)

`demonstrations`: `env.demonstrations("train", tasks)`: each expert conversation run through a real episode.
`rejection_sampling` (rejection-sampling fine-tuning, ReST-EM's round, NeMo-Gym's "SFT on high-reward rollouts"):
the run's starting model attempts each of the first `tasks` train tasks `attempts` times; the conversations that
succeed are kept (each distinct one once, at most `per_task` per task). Both use the environment's train split:
its held-out eval tasks stay unseen. The records are written once into the run (RUN/data/env-<i>.jsonl) by
`make_source`, which `nemo-jax sft` and a GRPO run's `lora.init_sft_config` hand to the SFT trainer."""

from __future__ import annotations

import json

from nemo_jax.fields import Fields
from nemo_jax.fsutil import atomic_write_text
from nemo_jax.rl.envs import make_env

KINDS = ("demonstrations", "rejection_sampling")
KEYS = {"env", "env_args", "make", "tasks", "weight", "attempts", "max_new_tokens", "temperature", "seed", "per_task",
        "rows", "max_len"}


def make_source(entry: dict, where: str, path: str, model) -> int:
    """Write the chat records `entry` describes to `path` (JSONL, whole or not at all) -> how many. `model`:
    (config, params, tokenizer) of the run's starting model (what rejection sampling samples)."""
    unknown = set(entry) - KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (an environment source takes {sorted(KEYS)})")
    f = Fields(entry, lambda message, key: ValueError(f"{where}: {message}"))
    kind = f.one_of("make", "demonstrations", KINDS)
    env_args = f.mapping("env_args")
    env = make_env(f.string("env"), **env_args)
    n = f.integer("tasks", None, 1, 1 << 30)
    if kind == "demonstrations":
        if not callable(getattr(env, "demonstrations", None)):
            raise ValueError(f"{where}: environment {entry['env']} has no expert demonstrations (make: "
                             "rejection_sampling samples the start's own successes instead)")
        records = env.demonstrations("train", n)
        print(f"{where}: {len(records)} {entry['env']} demonstrations", flush=True)
    else:
        records = rejection_sampling(env, model, where, n, attempts=f.integer("attempts", 8, 1, 1024),
                                     max_new_tokens=f.integer("max_new_tokens", 64, 1, 1 << 20),
                                     temperature=float(f.number("temperature", 1.0, 0, 100)),
                                     seed=f.integer("seed", 0, 0, 2 ** 31 - 1),
                                     per_task=f.integer("per_task", None, 1, 1 << 20),
                                     rows=f.integer("rows", 64, 1, 1 << 16),
                                     max_len=f.integer("max_len", 1024, 2, 1 << 24))
    if not records:
        raise ValueError(f"{where}: {entry['env']} made no records (no success to keep)")
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
    return len(records)


def rejection_sampling(env, model, where: str, n: int | None, *, attempts: int, max_new_tokens: int,
                       temperature: float, seed: int, per_task: int | None, rows: int, max_len: int) -> list[dict]:
    """The start model's successful conversations on the first `n` train tasks, `attempts` each: every distinct
    success once, at most `per_task` of a task -> SFT records {"messages", "tools"?} (pictures as PNG data URLs,
    as the chat data reads them)."""
    import jax

    from nemo_jax.generate import Engine
    from nemo_jax.rl.envs.episode import portable
    from nemo_jax.rl.transport.producer import sample_rollouts

    cfg, params, tok = model
    tasks = list(env.tasks("train")[:n])
    engine = Engine(params, cfg, batch=rows, max_len=max_len, key=jax.random.key(seed))
    got = sample_rollouts(engine, tok, cfg, env, [(t, f"rft-{t.id}") for t in tasks], attempts, max_new_tokens,
                          temperature, seed=seed)
    records, seen, per = [], set(), {}
    wins = sum(r.success for r in got)
    for r in got:
        if not r.success or (per_task and per.get(r.task_id, 0) >= per_task):
            continue
        rec = {"messages": [portable(m) for m in r.messages], **({"tools": r.tools} if r.tools else {})}
        key = json.dumps(rec, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        per[r.task_id] = per.get(r.task_id, 0) + 1
        records.append(rec)
    print(f"{where}: rejection sampling: {len(tasks)} tasks x {attempts} attempts, {wins} successes on {len(per)} "
          f"tasks, {len(records)} distinct conversations kept", flush=True)
    return records
