"""Checkpoint merging (DESIGN section 6): tensor operations (`ops`), YAML recipes (`recipe`) and the
rule-driven engine streaming over checkpoint directories or working on in-memory params (`engine`)."""

from nemo_jax.merge.engine import merge_params, open_recipe, run_recipe, stats_table, summary
from nemo_jax.merge.ops import (dare, finish, linear, lora, slerp, task_arithmetic, ties, tree_dare, tree_linear,
                                tree_slerp, tree_task_arithmetic, tree_ties)
from nemo_jax.merge.recipe import Recipe, RecipeError, Rule, load_recipe, parse_recipe

__all__ = ["Recipe", "RecipeError", "Rule", "dare", "finish", "linear", "load_recipe", "lora", "merge_params",
           "open_recipe", "parse_recipe", "run_recipe", "slerp", "stats_table", "summary", "task_arithmetic", "ties",
           "tree_dare", "tree_linear", "tree_slerp", "tree_task_arithmetic", "tree_ties"]
