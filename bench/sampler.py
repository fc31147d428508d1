"""Rollout sampling throughput, side by side in one run: our sampler (`nemo_jax.generate.generate`: jitted prefill,
cached decode with the state donated, behaviour logprobs) vs transformers' `generate` with its cache, on the same
model and weights (built by transformers, imported with `nemo_jax.hf`).

    python bench/sampler.py [--batch 16 --new-tokens 256 --min-prompt 16 --max-prompt 256 --iters 2]

Two workloads, prompts of mixed lengths (left-padded on both sides), temperature 1:
* fixed length: --batch rows, no stop token, every row generates exactly --new-tokens tokens;
* rollouts: --rollouts sequences, each ending at one of --stop-ids stop tokens (random lengths, capped at
  --new-tokens), like RL rollouts. Ours streams them through --batch decode rows with continuous batching
  (`continuous_generate`: a finished row is refilled at once); transformers generates them --batch at a time
  (a batch runs until its longest row ends). Tokens/s counts the tokens of the rollouts (up to their stop).
Goal (issue 14): ours >= 2x transformers' tokens/s.
"""

import argparse
import tempfile
import time

import common
import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.config.model import NemotronHConfig, parse_pattern
from nemo_jax.generate import SamplingParams, continuous_generate, generate


def bench_config() -> NemotronHConfig:
    return NemotronHConfig(vocab_size=8192, hidden_size=256, layer_kinds=parse_pattern("MEM*EM-ME"),
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=512,
                           mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=32, n_groups=2, chunk_size=64,
                           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                           moe_shared_expert_intermediate_size=256, routed_scaling_factor=1.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=48)
    ap.add_argument("--stop-ids", type=int, default=48, help="stop tokens among the vocabulary (sets the mean length)")
    a = ap.parse_args()
    import torch
    import transformers

    from nemo_jax.sources import load_any

    cfg = bench_config()
    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    d["time_step_limit"] = tuple(cfg.time_step_limit)
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**d)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        cfg, params = load_any(tmp, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    lens = rng.integers(a.min_prompt, a.max_prompt + 1, a.batch)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in lens]
    sp = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0)
    n_tokens = a.batch * a.new_tokens

    def ours(key):
        g = generate(params, prompts, cfg, sp, key=key, bucket=32)
        assert all(len(t) == a.new_tokens for t in g.tokens)

    t0 = time.perf_counter()
    ours(jax.random.key(0))  # compiles prefill and the decode step
    first = time.perf_counter() - t0
    t_ours = min(common.timeit(lambda: ours(jax.random.key(i + 1)), warmup=0, iters=1) for i in range(a.iters))

    width = int(lens.max())
    ids = torch.zeros((a.batch, width), dtype=torch.long)
    mask = torch.zeros((a.batch, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    def theirs():
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a.new_tokens,
                              min_new_tokens=a.new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              use_cache=True, pad_token_id=0)
        assert out.shape[1] == width + a.new_tokens

    theirs()  # warm up
    t_hf = min(common.timeit(theirs, warmup=0, iters=1) for _ in range(a.iters))
    print(f"sampler: batch {a.batch}, prompts {a.min_prompt}..{a.max_prompt} tokens (mixed), {a.new_tokens} new tokens "
          f"per row, temperature 1, pattern {cfg.pattern}, D={cfg.hidden_size}, V={cfg.vocab_size}, "
          f"{jax.devices()[0].device_kind}")
    common.table([
        {"impl": "nemo_jax generate (jit, cached decode, logprobs)", "s": f"{t_ours:.2f}",
         "tokens/s": f"{n_tokens / t_ours:,.0f}", "first call s (compile)": f"{first:.1f}"},
        {"impl": "transformers generate (cache)", "s": f"{t_hf:.2f}", "tokens/s": f"{n_tokens / t_hf:,.0f}",
         "first call s (compile)": "-"},
    ])
    print(f"fixed length: ours / transformers tokens/s: {t_hf / t_ours:.2f}x (goal >= 2x)")

    # ---- rollouts ending at stop tokens: continuous batching vs batch-at-a-time
    lens2 = rng.integers(a.min_prompt, a.max_prompt + 1, a.rollouts)
    many = [rng.integers(200, cfg.vocab_size, n).tolist() for n in lens2]  # prompts avoid the stop ids
    stops = tuple(range(100, 100 + a.stop_ids))
    sp2 = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0, stop_token_ids=stops)
    max_len = -(-a.max_prompt // 32) * 32 + a.new_tokens  # cache positions per row: the longest prompt + a turn

    def ours_stream(key):
        out = list(continuous_generate(params, many, cfg, sp2, batch=a.batch, max_len=max_len, key=key, bucket=32))
        return sum(len(f.turns[0][0]) for f in out)

    for i in range(2):  # compiles (refills of 1, 2, 4, 8 rows at each prompt width bucket)
        ours_stream(jax.random.key(100 + i))
    runs = []
    for i in range(a.iters):
        t0 = time.perf_counter()
        n_ours = ours_stream(jax.random.key(1))  # the same draws each time: the same token count
        runs.append(time.perf_counter() - t0)
    t_stream = min(runs)

    def theirs_batches():
        n = 0
        for s in range(0, a.rollouts, a.batch):
            chunk = many[s:s + a.batch]
            w = max(map(len, chunk))
            ids = torch.zeros((len(chunk), w), dtype=torch.long)
            mask = torch.zeros((len(chunk), w), dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, w - len(p):] = torch.tensor(p)
                mask[i, w - len(p):] = 1
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a.new_tokens, do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, use_cache=True, pad_token_id=0,
                                  eos_token_id=list(stops))
            for row in out[:, w:].tolist():  # tokens up to and including the first stop
                hit = [j for j, t in enumerate(row) if t in stops]
                n += hit[0] + 1 if hit else len(row)
        return n

    t0 = time.perf_counter()
    n_hf = theirs_batches()
    t_hf2 = time.perf_counter() - t0
    print(f"\nrollouts: {a.rollouts} prompts, {a.batch} rows, stop at any of {a.stop_ids} tokens or {a.new_tokens} "
          f"new tokens (mean rollout: ours {n_ours / a.rollouts:.0f}, transformers {n_hf / a.rollouts:.0f} tokens)")
    common.table([
        {"impl": "nemo_jax continuous_generate (rows refilled)", "s": f"{t_stream:.2f}",
         "tokens/s": f"{n_ours / t_stream:,.0f}"},
        {"impl": f"transformers generate, {a.batch} at a time", "s": f"{t_hf2:.2f}", "tokens/s": f"{n_hf / t_hf2:,.0f}"},
    ])
    print(f"rollouts: ours / transformers tokens/s: {(n_ours / t_stream) / (n_hf / t_hf2):.2f}x (goal >= 2x)")


if __name__ == "__main__":
    main()
