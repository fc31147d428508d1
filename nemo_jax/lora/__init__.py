"""LoRA adapters as a pytree beside the params (applied unmerged).

An adapter tree mirrors the parameter tree down to linear layers; at a linear it holds
`lora_a [..., in, r]`, `lora_b [..., r, out]` and `lora_scale [...]` (alpha / r, or alpha / sqrt(r) for
rsLoRA), with the same leading `layers` axis as the kernel it adapts. `attach` places them next to the
kernels so that `linear` computes x W + scale * (x A) B without ever forming W + scale * A B.
"""

from __future__ import annotations


def attach(params, adapters):
    """Params with adapter leaves merged in beside their kernels (a tree union; no weights are changed)."""
    if not adapters:
        return params
    return _union(params, adapters, "")


def _union(p, a, where):
    if not isinstance(a, dict):
        raise ValueError(f"adapter tree: expected a mapping at {where or '/'}")
    if isinstance(p, list):
        return [_union(p[int(k)], v, f"{where}/{k}") if str(i) in a else p[i] for i, (k, v) in
                enumerate((str(i), a.get(str(i), a.get(i))) for i in range(len(p)))]
    out = dict(p)
    for k, v in a.items():
        if k.startswith("lora_"):
            if "kernel" not in p:
                raise ValueError(f"adapter {where}/{k}: no kernel to adapt at {where}")
            out[k] = v
        elif k not in p:
            raise ValueError(f"adapter path {where}/{k} does not exist in the params")
        elif v:
            out[k] = _union(p[k], v, f"{where}/{k}")
    return out
