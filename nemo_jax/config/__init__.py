from nemo_jax.config.model import NemotronHConfig

__all__ = ["NemotronHConfig"]
