"""Checkpoint merging (docs/merging.md): tensor operations (`ops`), YAML recipes (`recipe`) and the
rule-driven engine streaming over checkpoint directories or working on in-memory params (`engine`).

The recipe layer loads without JAX (`nemo-jax merge` checks a recipe before JAX starts); the engine and the
operations are imported on first use."""

import importlib

from nemo_jax.merge.recipe import Recipe, RecipeError, Rule, load_recipe, parse_recipe

_LAZY = {**dict.fromkeys(("merge_params", "open_recipe", "run_recipe", "stats_table", "summary"), "engine"),
         **dict.fromkeys(("dare", "finish", "linear", "lora", "slerp", "task_arithmetic", "ties", "tree_dare",
                          "tree_linear", "tree_slerp", "tree_task_arithmetic", "tree_ties"), "ops")}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"nemo_jax.merge.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'nemo_jax.merge' has no attribute {name!r}")


__all__ = ["Recipe", "RecipeError", "Rule", "dare", "finish", "linear", "load_recipe", "lora", "merge_params",
           "open_recipe", "parse_recipe", "run_recipe", "slerp", "stats_table", "summary", "task_arithmetic", "ties",
           "tree_dare", "tree_linear", "tree_slerp", "tree_task_arithmetic", "tree_ties"]
