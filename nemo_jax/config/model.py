"""NemotronHConfig: every field that shapes the hybrid Mamba2 / attention / MoE network.

Field names follow transformers' `NemotronHConfig` (>= 5.3). `from_hf_dict` also reads the legacy
dialect (`hybrid_override_pattern`, `mamba_*` keys); `to_hf_dict` writes what transformers >= 5.3 reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from nemo_jax.config.vision import VisionConfig
from nemo_jax.fsutil import read_json

# One character per layer kind, as in the legacy `hybrid_override_pattern`.
KIND_BY_CHAR = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
HF_TYPE_BY_KIND = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp", "moe": "moe"}
KIND_BY_HF_TYPE = {v: k for k, v in HF_TYPE_BY_KIND.items()}
CHAR_BY_KIND = {v: k for k, v in KIND_BY_CHAR.items()}
# Older layer-type names some checkpoints carry.
_LEGACY_HF_TYPES = {"mamba": "linear_attention", "attention": "full_attention", "mamba2": "linear_attention"}

# Legacy key -> current key.
_LEGACY_KEYS = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}

# HF keys that do not shape the network and that we neither need nor keep.
_IGNORED_HF_KEYS = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "num_logits_to_keep", "attention_dropout", "hidden_dropout", "use_mamba_kernels", "sliding_window",
    "output_router_logits", "mamba_ssm_cache_dtype", "rescale_prenorm_residual", "residual_in_fp32",
    "moe_shared_expert_overlap", "num_hidden_layers", "auto_map", "_name_or_path", "mtp_hybrid_override_pattern",
    "hybrid_override_pattern", "layers_block_type", "mtp_layers_block_type", "mamba_hidden_act", "mlp_hidden_act",
    "rope_theta", "rope_scaling", "partial_rotary_factor", "position_embedding_type", "tie_word_embeddings",
}


def parse_pattern(pattern: str, field_name: str = "hybrid_override_pattern") -> tuple[str, ...]:
    kinds = []
    for i, ch in enumerate(pattern):
        if ch not in KIND_BY_CHAR:
            raise ValueError(f"{field_name}: unknown layer character {ch!r} at position {i} (expected one of M * - E)")
        kinds.append(KIND_BY_CHAR[ch])
    return tuple(kinds)


def _kinds_from_hf_types(types: list[str], field_name: str) -> tuple[str, ...]:
    if not isinstance(types, (list, tuple)):
        raise ValueError(f"{field_name}: expected a list of layer types, got {type(types).__name__}")
    out = []
    for i, t in enumerate(types):
        t = _LEGACY_HF_TYPES.get(t, t)
        if t not in KIND_BY_HF_TYPE:
            raise ValueError(f"{field_name}[{i}]: unknown layer type {t!r} (expected one of {sorted(KIND_BY_HF_TYPE)})")
        out.append(KIND_BY_HF_TYPE[t])
    return tuple(out)


@dataclass(frozen=True)
class NemotronHConfig:
    """Architecture of a Nemotron-H model. `layer_kinds` holds one of mamba/attention/mlp/moe per layer."""

    vocab_size: int = 131072
    hidden_size: int = 4096
    layer_kinds: tuple[str, ...] = ("mamba", "moe", "attention", "mlp")
    # attention
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    # dense MLP
    intermediate_size: int = 21504
    # mamba2
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    # MoE
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    # multi-token prediction
    num_nextn_predict_layers: int = 0
    mtp_layer_kinds: tuple[str, ...] = ("attention", "moe")
    # misc
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    max_position_embeddings: int = 4096
    use_bias: bool = False
    mlp_bias: bool = False
    attention_bias: bool = False
    mamba_proj_bias: bool = False
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2  # (a list in a config.json: held as a tuple, so hashable)
    # ours (not in HF): transformers clamps dt at time_step_min in its full forward (docs/design.md: the model, item 4)
    clamp_dt: bool = False
    # the vision tower of a `nemotron_h_omni` checkpoint (None: a text-only `nemotron_h` model)
    vision: VisionConfig | None = None
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    def __post_init__(self):
        object.__setattr__(self, "layer_kinds", tuple(self.layer_kinds))
        object.__setattr__(self, "mtp_layer_kinds", tuple(self.mtp_layer_kinds))
        object.__setattr__(self, "time_step_limit", tuple(float(x) for x in self.time_step_limit))
        if isinstance(self.eos_token_id, list):  # the config is a jit static argument: every field hashable
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self.validate()

    @property
    def eos_ids(self) -> list[int]:
        """The end-of-sequence token ids (config.json's `eos_token_id`: one id or a list)."""
        e = self.eos_token_id
        return [x for x in (e if isinstance(e, tuple) else (e,)) if x is not None]

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        def need(cond: bool, fld: str, msg: str):
            if not cond:
                raise ValueError(f"NemotronHConfig.{fld}: {msg}")

        for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                     "conv_kernel", "chunk_size", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "n_group", "topk_group"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, f"must be a positive int, got {v!r}")
        need(len(self.layer_kinds) > 0, "layers_block_type", "needs at least one layer")
        for i, k in enumerate(self.layer_kinds + self.mtp_layer_kinds):
            need(k in HF_TYPE_BY_KIND, "layers_block_type", f"unknown layer kind {k!r} at {i}")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_attention_heads",
             f"{self.num_attention_heads} heads not divisible by num_key_value_heads={self.num_key_value_heads}")
        need(self.mamba_num_heads % self.n_groups == 0, "mamba_num_heads",
             f"{self.mamba_num_heads} heads not divisible by n_groups={self.n_groups}")
        need(self.n_routed_experts % self.n_group == 0, "n_routed_experts",
             f"{self.n_routed_experts} experts not divisible by n_group={self.n_group}")
        need(self.topk_group <= self.n_group, "topk_group", f"{self.topk_group} > n_group={self.n_group}")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             f"{self.num_experts_per_tok} > n_routed_experts={self.n_routed_experts}")
        if self.n_group > 1:
            need(self.n_routed_experts // self.n_group >= 2, "n_group", "group-limited routing needs >= 2 experts per group")
            need(self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group), "num_experts_per_tok",
                 "more experts per token than the kept groups hold")
        uses_moe = "moe" in self.layer_kinds or (self.num_nextn_predict_layers > 0 and "moe" in self.mtp_layer_kinds)
        if self.moe_latent_size is not None:
            need(uses_moe, "moe_latent_size", "latent size set but the model has no MoE layer")
            need(self.moe_latent_size > 0, "moe_latent_size", "must be positive")
        need(self.n_shared_experts in (0, 1), "n_shared_experts", "only 0 or 1 shared expert is supported")
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
        if self.num_nextn_predict_layers > 0:
            need(len(self.mtp_layer_kinds) > 0, "mtp_layers_block_type", "needs at least one layer")
        for b in ("use_bias", "mlp_bias", "attention_bias", "mamba_proj_bias"):
            need(not getattr(self, b), b, "biases on linear layers are not supported (no released model uses them)")
        need(self.chunk_size >= 1, "chunk_size", "must be >= 1")

    # ----------------------------------------------------------------- derived sizes
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def in_proj_dim(self) -> int:
        return self.d_inner + self.conv_dim + self.mamba_num_heads

    @property
    def moe_input_size(self) -> int:
        return self.moe_latent_size or self.hidden_size

    @property
    def pattern(self) -> str:
        return "".join(CHAR_BY_KIND[k] for k in self.layer_kinds)

    @property
    def mtp_pattern(self) -> str:
        return "".join(CHAR_BY_KIND[k] for k in self.mtp_layer_kinds)

    def kind_indices(self) -> list[tuple[str, int]]:
        """(kind, index within that kind's stack) for each layer, in order."""
        seen: dict[str, int] = {}
        out = []
        for k in self.layer_kinds:
            out.append((k, seen.get(k, 0)))
            seen[k] = seen.get(k, 0) + 1
        return out

    def kind_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for k in self.layer_kinds:
            counts[k] = counts.get(k, 0) + 1
        return counts

    def replace(self, **kw) -> "NemotronHConfig":
        return dataclasses.replace(self, **kw)

    # ----------------------------------------------------------------- HF dialects
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], processor: dict[str, Any] | None = None, **overrides) -> "NemotronHConfig":
        """From a `nemotron_h` config.json, or a `nemotron_h_omni` one (its `text_config` is the language model,
        the rest the vision tower; `processor` is its preprocessor_config.json). An omni checkpoint's audio
        tower is not supported: its config is dropped (with a warning) and its tensors are not read."""
        d = dict(d)
        mt = d.get("model_type", "nemotron_h")
        if mt == "nemotron_h_omni":
            text = d.get("text_config") or d.get("llm_config")
            if not isinstance(text, dict):
                raise ValueError("config.json: a nemotron_h_omni config needs a `text_config` object")
            if d.get("audio_config") or d.get("sound_config"):
                import warnings

                warnings.warn("config.json: the audio tower of this nemotron_h_omni checkpoint is not supported and is "
                              "dropped (its tensors are skipped; an export writes audio_config: null)", stacklevel=2)
            text = dict(text, model_type="nemotron_h")
            overrides.setdefault("vision", VisionConfig.from_hf_dict(d, processor))
            return cls.from_hf_dict(text, **overrides)
        if mt != "nemotron_h":
            raise ValueError(f"config.json: model_type is {mt!r}, expected 'nemotron_h' or 'nemotron_h_omni'")
        for old, new in _LEGACY_KEYS.items():
            if old in d:
                val = d.pop(old)
                d.setdefault(new, val)
        if d.get("layers_block_type") is not None:
            kinds = _kinds_from_hf_types(d["layers_block_type"], "layers_block_type")
        elif d.get("hybrid_override_pattern") is not None:
            kinds = parse_pattern(d["hybrid_override_pattern"])
        else:
            raise ValueError("config.json: needs `layers_block_type` or `hybrid_override_pattern`")
        if d.get("mtp_layers_block_type") is not None:
            mtp_kinds = _kinds_from_hf_types(d["mtp_layers_block_type"], "mtp_layers_block_type")
        elif d.get("mtp_hybrid_override_pattern") is not None:
            mtp_kinds = parse_pattern(d["mtp_hybrid_override_pattern"], "mtp_hybrid_override_pattern")
        else:
            mtp_kinds = ("attention", "moe")
        n = d.get("num_hidden_layers")
        if n is not None and n != len(kinds):
            raise ValueError(f"config.json: num_hidden_layers={n} but the layer pattern has {len(kinds)} layers")
        if d.get("tie_word_embeddings"):
            raise ValueError("config.json: tie_word_embeddings=true is not a Nemotron-H checkpoint (lm_head is never tied)")
        names = {f.name for f in dataclasses.fields(cls)} - {"layer_kinds", "mtp_layer_kinds", "extra", "clamp_dt", "vision"}
        kw: dict[str, Any] = {}
        extra = []
        for k, v in d.items():
            if k in names:
                kw[k] = v
            elif k not in _IGNORED_HF_KEYS:
                extra.append((k, v))
        tsl = kw.get("time_step_limit")
        if tsl is not None:
            kw["time_step_limit"] = tuple(_decode_float(x) for x in tsl)
        if kw.get("num_key_value_heads") is None:
            kw["num_key_value_heads"] = kw.get("num_attention_heads", cls.num_attention_heads)
        if kw.get("head_dim") is None:
            kw["head_dim"] = kw.get("hidden_size", cls.hidden_size) // kw.get("num_attention_heads", cls.num_attention_heads)
        kw.update(overrides)
        return cls(layer_kinds=kinds, mtp_layer_kinds=mtp_kinds, extra=tuple(extra), **kw)

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json: `nemotron_h`, or `nemotron_h_omni` (this as its `text_config`) with a vision tower."""
        d: dict[str, Any] = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h"}
        if self.vision is not None:
            text = self.replace(vision=None).to_hf_dict()
            del text["architectures"]
            return {"architectures": ["NemotronH_Omni_Reasoning_V3"], "model_type": "nemotron_h_omni",
                    **self.vision.to_hf_dict(), "text_config": text}
        for f in dataclasses.fields(self):
            if f.name in ("layer_kinds", "mtp_layer_kinds", "extra", "clamp_dt", "vision"):
                continue
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        d["time_step_limit"] = [_encode_float(x) for x in self.time_step_limit]
        d["layers_block_type"] = [HF_TYPE_BY_KIND[k] for k in self.layer_kinds]
        d["mtp_layers_block_type"] = [HF_TYPE_BY_KIND[k] for k in self.mtp_layer_kinds]
        d["num_hidden_layers"] = self.num_hidden_layers
        d["mlp_hidden_act"] = "relu2"
        d["mamba_hidden_act"] = "silu"
        d["tie_word_embeddings"] = False
        d["expand"] = max(1, self.d_inner // self.hidden_size)
        for k, v in self.extra:
            d.setdefault(k, v)
        return d

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides) -> "NemotronHConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        d = read_json(path, "no such config file")
        processor = None
        pre = os.path.join(os.path.dirname(path), "preprocessor_config.json")
        if d.get("model_type") == "nemotron_h_omni" and os.path.exists(pre):
            with open(pre) as f:
                processor = json.load(f)
        try:
            return cls.from_hf_dict(d, processor, **overrides)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None


def write_config(cfg: NemotronHConfig, directory: str) -> None:
    """config.json (and, for a vision-language model, the image processor's preprocessor_config.json)."""
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    if cfg.vision is not None:
        with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
            json.dump(cfg.vision.processor_dict(), f, indent=2)



def _decode_float(x):
    if isinstance(x, dict) and "__float__" in x:
        return float(x["__float__"])
    return float(x)


def _encode_float(x: float):
    if math.isinf(x):
        return {"__float__": "Infinity" if x > 0 else "-Infinity"}
    return x
