"""Compare two checkpoints' logits: an HF dir (run in transformers, or in nemo_jax with --ours) vs a native
nemo_jax model dir (or another HF dir), on given text or token ids.

    python tools/probes/compare_logits.py HF_DIR NATIVE_DIR --text "Hello there" [--tokenizer DIR]
    python tools/probes/compare_logits.py HF_DIR NATIVE_DIR --ids 1,2,3,4

Prints max abs diff, mean KL(ref || ours) and top-1 agreement. The reference is transformers' forward when
torch/transformers are installed (dt clamp on, as transformers does), else nemo_jax on the HF weights.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir")
    ap.add_argument("other", help="native nemo_jax model dir or HF dir")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--text")
    g.add_argument("--ids", help="comma-separated token ids")
    ap.add_argument("--tokenizer", help="dir with tokenizer.json (default: HF_DIR)")
    ap.add_argument("--ours", action="store_true", help="run the reference in nemo_jax, not transformers")
    a = ap.parse_args(argv)

    from nemo_jax.sources import load_any
    from nemo_jax.model import forward

    if a.ids:
        ids = [int(x) for x in a.ids.split(",") if x.strip()]
    else:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(os.path.join(a.tokenizer or a.hf_dir, "tokenizer.json")).encode(a.text).ids
    if not ids:
        raise SystemExit("no tokens to compare")
    cfg, params = load_any(a.other, dtype=jnp.float32)
    ours = np.asarray(forward(params, jnp.asarray([ids]), cfg.replace(clamp_dt=not a.ours))[0][0])
    ref, how = None, "nemo_jax"
    if not a.ours:
        try:
            import torch
            import transformers

            m = transformers.NemotronHForCausalLM.from_pretrained(a.hf_dir, dtype=torch.float32).eval()
            with torch.no_grad():
                ref = m(torch.tensor([ids])).logits[0].float().numpy()
            how = "transformers"
        except ImportError:
            pass
    if ref is None:
        rcfg, rparams = load_any(a.hf_dir, dtype=jnp.float32)
        ref = np.asarray(forward(rparams, jnp.asarray([ids]), rcfg)[0][0])
    lp_ref = jax.nn.log_softmax(ref, -1)
    lp_ours = jax.nn.log_softmax(ours, -1)
    kl = float(jnp.mean(jnp.sum(jnp.exp(lp_ref) * (lp_ref - lp_ours), -1)))
    out = {"reference": how, "tokens": len(ids), "max_abs_diff": float(np.max(np.abs(ours - ref))),
           "mean_kl": kl, "top1_agreement": float(np.mean(np.argmax(ours, -1) == np.argmax(ref, -1)))}
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
