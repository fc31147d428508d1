"""VisionConfig: the RADIO vision tower, pixel shuffle and projector of a `nemotron_h_omni` checkpoint.

Field names follow transformers' `RadioConfig` (the `vision_config` block of `config.json`) and, for
`downsample_ratio`, `projector_hidden_size`, `image_token_id` and `vision_hidden_size`, the top level of
`NemotronH_Omni_Reasoning_V3_Config`. `min_num_patches` / `max_num_patches` are the image processor's
(`preprocessor_config.json`). The language model stays a `NemotronHConfig`, which holds this as `.vision`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "quick_gelu", "relu", "silu")

# vision_config keys we read into fields; the rest round-trips through `extra`
_RADIO_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "mlp_ratio", "hidden_act", "layer_norm_eps",
                 "use_swiglu_ffn", "qkv_bias", "layerscale_value", "num_channels", "patch_size", "max_img_size",
                 "num_cls_tokens", "num_registers", "video_temporal_patch_size", "summary_idxs", "norm_mean",
                 "norm_std")
_DERIVED = {"patch_dim", "video_patch_dim", "model_type"}
# legacy top-level names some released config.json files use
_LEGACY_TOP = {"img_context_token_id": "image_token_id", "vit_hidden_size": "vision_hidden_size",
               "video_context_token_id": "video_token_id", "sound_context_token_id": "audio_token_id"}


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int = 1280
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    mlp_ratio: float = 4.0
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-6
    use_swiglu_ffn: bool = False
    qkv_bias: bool = True
    layerscale_value: float = 1.0
    num_channels: int = 3
    patch_size: int = 16
    max_img_size: int = 2048
    num_cls_tokens: int = 3
    num_registers: int = 7
    video_temporal_patch_size: int | None = None  # weights carried (round trip); video inputs are refused
    summary_idxs: tuple[int, ...] = (0, 1)
    norm_mean: tuple[float, ...] = CLIP_MEAN
    norm_std: tuple[float, ...] = CLIP_STD
    # the omni model around the tower
    downsample_ratio: float = 0.5
    projector_hidden_size: int = 4096
    image_token_id: int = 18
    # the image processor (preprocessor_config.json)
    min_num_patches: int = 1024
    max_num_patches: int = 13312
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)  # other vision_config keys
    top_extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)  # other top-level keys

    def __post_init__(self):
        for name in ("summary_idxs", "norm_mean", "norm_std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, fld: str, msg: str):
            if not cond:
                raise ValueError(f"vision_config.{fld}: {msg}")

        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_channels", "patch_size",
                     "max_img_size", "projector_hidden_size", "min_num_patches"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, f"must be a positive int, got {v!r}")
        need(self.hidden_size % self.num_attention_heads == 0, "hidden_size",
             f"{self.hidden_size} not divisible by num_attention_heads={self.num_attention_heads}")
        need(self.hidden_act in ACTIVATIONS, "hidden_act", f"{self.hidden_act!r} not in {ACTIVATIONS}")
        need(self.max_img_size % self.patch_size == 0, "max_img_size", "must be a multiple of patch_size")
        need(len(self.norm_mean) == len(self.norm_std) == self.num_channels, "norm_mean",
             "norm_mean and norm_std need one value per channel")
        m = round(1 / self.downsample_ratio)
        need(0 < self.downsample_ratio <= 1 and abs(m * self.downsample_ratio - 1) < 1e-9, "downsample_ratio",
             f"must be 1/n for an integer n, got {self.downsample_ratio}")
        need(self.num_cls_tokens >= 0 and self.num_registers >= 0, "num_cls_tokens", "must be >= 0")

    # ----------------------------------------------------------------- derived sizes
    @property
    def merge(self) -> int:
        """Patches per side merged into one language token by the pixel shuffle (2 at ratio 0.5)."""
        return round(1 / self.downsample_ratio)

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size ** 2

    @property
    def n_prefix(self) -> int:
        """Class + register tokens before each image's patches."""
        return self.num_cls_tokens + self.num_registers

    @property
    def max_grid(self) -> int:
        """Rows (= columns) of the position-embedding table."""
        return self.max_img_size // self.patch_size

    @property
    def mlp_size(self) -> int:
        hidden = int(self.hidden_size * self.mlp_ratio)
        return (int(hidden * 2 / 3) + 7) // 8 * 8 if self.use_swiglu_ffn else hidden

    def replace(self, **kw) -> "VisionConfig":
        return dataclasses.replace(self, **kw)

    # ----------------------------------------------------------------- HF dialect
    @classmethod
    def from_hf_dict(cls, top: dict[str, Any], processor: dict[str, Any] | None = None) -> "VisionConfig":
        """From an omni `config.json` (its top level and `vision_config`) and `preprocessor_config.json`."""
        top = dict(top)
        for old, new in _LEGACY_TOP.items():
            if old in top:
                top.setdefault(new, top.pop(old))
        vc = dict(top.get("vision_config") or {})
        if vc.get("model_type", "radio") != "radio":
            raise ValueError(f"vision_config.model_type is {vc.get('model_type')!r}, expected 'radio'")
        kw = {k: vc.pop(k) for k in _RADIO_FIELDS if vc.get(k) is not None}
        extra = tuple((k, v) for k, v in vc.items() if k not in _DERIVED)
        hidden = top.get("vision_hidden_size")
        if hidden is not None and hidden != kw.get("hidden_size", cls.hidden_size):
            raise ValueError(f"vision_hidden_size={hidden} but vision_config.hidden_size="
                             f"{kw.get('hidden_size', cls.hidden_size)}")
        for k in ("downsample_ratio", "projector_hidden_size", "image_token_id"):
            if top.get(k) is not None:
                kw[k] = top[k]
        for k in ("min_num_patches", "max_num_patches"):  # ours at the top level; the processor's file wins
            for src in (top, processor or {}):
                if src.get(k) is not None:
                    kw[k] = src[k]
        skip = {"min_num_patches", "max_num_patches", "vision_config", "text_config", "llm_config", "model_type", "architectures", "vision_hidden_size",
                "downsample_ratio", "projector_hidden_size", "image_token_id", "audio_config", "sound_config",
                "transformers_version", "dtype", "torch_dtype", "_name_or_path"}
        top_extra = tuple((k, v) for k, v in top.items() if k not in skip)
        return cls(**kw, extra=extra, top_extra=top_extra)

    def to_hf_dict(self) -> dict[str, Any]:
        """The vision part of an omni config.json: {top-level keys..., "vision_config": {...}}."""
        vc: dict[str, Any] = {"model_type": "radio"}
        for k in _RADIO_FIELDS:
            v = getattr(self, k)
            vc[k] = list(v) if isinstance(v, tuple) else v
        vc["patch_dim"] = self.patch_dim
        if self.video_temporal_patch_size is not None:
            vc["video_patch_dim"] = self.video_temporal_patch_size * self.patch_dim
        for k, v in self.extra:
            vc.setdefault(k, v)
        top: dict[str, Any] = {"downsample_ratio": self.downsample_ratio,
                               "projector_hidden_size": self.projector_hidden_size,
                               "image_token_id": self.image_token_id, "vision_hidden_size": self.hidden_size,
                               "video_temporal_patch_size": self.video_temporal_patch_size or 2,
                               "audio_config": None, "min_num_patches": self.min_num_patches,
                               "max_num_patches": self.max_num_patches}
        for k, v in self.top_extra:
            top.setdefault(k, v)
        top["vision_config"] = vc
        return top

    def processor_dict(self) -> dict[str, Any]:
        """preprocessor_config.json for transformers' NemotronH_Omni_Reasoning_V3ImageProcessor."""
        return {"image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor", "patch_size": self.patch_size,
                "downsample_ratio": self.downsample_ratio, "min_num_patches": self.min_num_patches,
                "max_num_patches": self.max_num_patches, "image_mean": list(self.norm_mean),
                "image_std": list(self.norm_std), "do_rescale": True, "rescale_factor": 1 / 255,
                "do_normalize": True, "do_convert_rgb": True, "resample": 3}
