import json
import math
import os

import pytest

from nemo_jax.config.model import NemotronHConfig
from nemo_jax.model.spec import abstract_params, count_params

from helpers import tiny_cfg

ROOT = os.path.dirname(os.path.dirname(__file__))
MODEL_CONFIGS = sorted(os.listdir(os.path.join(ROOT, "configs", "model")))


def test_hf_dict_roundtrip_and_dialects():
    cfg = tiny_cfg(n_group=2, topk_group=1, moe_latent_size=8, num_nextn_predict_layers=1)
    d = cfg.to_hf_dict()
    assert d["layers_block_type"][:4] == ["linear_attention", "moe", "linear_attention", "full_attention"]
    assert NemotronHConfig.from_hf_dict(json.loads(json.dumps(d))) == cfg
    legacy = {k: v for k, v in d.items() if k not in ("layers_block_type", "mtp_layers_block_type", "n_groups",
                                                       "conv_kernel", "chunk_size", "time_step_min")}
    legacy.update(hybrid_override_pattern="MEM*E-", mtp_hybrid_override_pattern="*E", mamba_n_groups=2,
                  mamba_d_conv=4, mamba_chunk_size=8, mamba_dt_min=0.001)
    assert NemotronHConfig.from_hf_dict(legacy) == cfg
    assert math.isinf(NemotronHConfig.from_hf_dict(d).time_step_limit[1])


def test_derived_sizes():
    cfg = tiny_cfg()
    assert cfg.d_inner == 32 and cfg.conv_dim == 32 + 2 * 2 * 8 and cfg.in_proj_dim == 32 + cfg.conv_dim + 4
    assert cfg.pattern == "MEM*E-" and cfg.num_hidden_layers == 6


@pytest.mark.parametrize("bad, field", [
    (dict(num_attention_heads=5), "num_attention_heads"),
    (dict(mamba_num_heads=3), "mamba_num_heads"),
    (dict(n_routed_experts=6, n_group=4), "n_routed_experts"),
    (dict(moe_latent_size=8, pattern="M*-"), "moe_latent_size"),
    (dict(topk_group=3, n_group=2), "topk_group"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
])
def test_invalid_configs_name_the_field(bad, field):
    pattern = bad.pop("pattern", "MEM*E-")
    with pytest.raises(ValueError, match=field):
        tiny_cfg(pattern, **bad)


def test_unknown_layer_character():
    with pytest.raises(ValueError, match="hybrid_override_pattern.*'X'"):
        NemotronHConfig.from_hf_dict({"model_type": "nemotron_h", "hybrid_override_pattern": "MX"})
    with pytest.raises(ValueError, match=r"layers_block_type\[1\]"):
        NemotronHConfig.from_hf_dict({"model_type": "nemotron_h", "layers_block_type": ["mamba", "conv"]})


@pytest.mark.parametrize("name", MODEL_CONFIGS)
def test_shipped_configs_build_abstract_params(name):
    cfg = NemotronHConfig.from_file(os.path.join(ROOT, "configs", "model", name))
    tree = abstract_params(cfg)
    assert tree["lm_head"]["kernel"].shape == (cfg.hidden_size, cfg.vocab_size)
    assert count_params(cfg) > 0


def test_published_parameter_counts():
    nano = NemotronHConfig.from_file(os.path.join(ROOT, "configs", "model", "nano3-30b-a3b.json"))
    assert round(count_params(nano) / 1e9, 2) == 31.58
    sup = NemotronHConfig.from_file(os.path.join(ROOT, "configs", "model", "super-120b-a12b.json"))
    assert count_params(sup) == 123_611_033_088
    assert sup.num_nextn_predict_layers == 1 and sup.moe_latent_size == 1024


def test_init_sft_config_is_found_from_the_config_files_folder_whatever_the_working_directory(tmp_path,
                                                                                             monkeypatch):
    import os

    from nemo_jax.config.train import load_grpo_config, load_sft_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(tmp_path)
    g = load_grpo_config(os.path.join(root, "configs/grpo/tiny-cpu.yaml"))
    assert g.model.init_sft_config == os.path.join(root, "configs/sft/tiny-cpu.yaml")
    s = load_sft_config(os.path.join(root, "configs/sft/tiny-lora-cpu.yaml"))
    assert s.model.init_sft_config == os.path.join(root, "configs/sft/tiny-cpu.yaml")
    (tmp_path / "mine.yaml").write_text("x")
    g = load_grpo_config(os.path.join(root, "configs/grpo/tiny-cpu.yaml"), ["model.init_sft_config=mine.yaml"])
    assert g.model.init_sft_config == "mine.yaml"  # an override: the working directory's, as given
