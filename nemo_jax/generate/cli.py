"""`nemo-jax generate`: chat-templated sampling from a model, tokens printed as they come."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from nemo_jax.model import model as M
from nemo_jax.generate.decode import generate, prompt_images
from nemo_jax.generate.sampling import SamplingParams
from nemo_jax.sources import load_for_generation


def cli_generate(a):
    import sys

    from nemo_jax.data.chat import ChatTokenizer

    mesh = None
    if getattr(a, "mesh", None):
        from nemo_jax.parallel.mesh import make_mesh, read_mesh_sizes

        sizes = read_mesh_sizes(a.mesh)
        mesh = make_mesh(sizes, devices_per_node=sizes.pop("devices_per_node", 0))
    cfg, params, tok_dir = load_for_generation(a.ckpt, mesh=mesh, dtype=jnp.float32)
    tok = ChatTokenizer.load(a.tokenizer or tok_dir)
    images = None
    if a.image:
        ids, images = prompt_images(tok, cfg, a.prompt, a.image, chat_template=not a.no_chat_template)
    else:
        text = a.prompt if a.no_chat_template else tok.render([{"role": "user", "content": a.prompt}],
                                                              add_generation_prompt=True)
        ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    stop = tuple(sorted({*cfg.eos_ids, *tok.eos_ids()}))
    sp = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                        stop_token_ids=stop)
    printed: list[int] = []
    shown = [""]

    def on_token(i, t, done):
        if bool(done[0]):
            return
        printed.append(int(t[0]))
        s = tok.tokenizer.decode(printed, skip_special_tokens=True)
        sys.stdout.write(s[len(shown[0]):])
        sys.stdout.flush()
        shown[0] = s

    # the mesh in the options too: the kernels run per device inside shard_map (GSPMD does not partition them)
    opts = M.Options(kernels=getattr(a, "kernels", "auto"), mesh=mesh if mesh is not None and mesh.size > 1 else None)
    g = generate(params, [ids], cfg, sp, key=jax.random.key(a.seed), opts=opts, on_token=on_token, images=images)
    sys.stdout.write("\n")
    print(f"[{len(g.tokens[0])} tokens, finish: {g.finish_reason[0]}, "
          f"mean logprob {np.mean(g.logprobs[0]) if g.logprobs[0] else 0.0:.3f}]", file=sys.stderr)
