"""`nemo-jax recipe FILE`: the whole post-training recipe, stage by stage, in one run directory.

    base        RUN/base         the starting model: `base.model` (a model dir), or trained by `base.sft_config`
    sft         RUN/sft          SFT from the base (`sft.config`; model.init = RUN/base)
    base-merge  RUN/base-merge   `base_merge.recipe` (QK-restore): models.base = RUN/base, models.sft = RUN/sft
    experts     RUN/expert-NAME  one GRPO run per expert (`experts[i].config`), all from RUN/base-merge
    final       RUN/final        `expert_merge.recipe`: RUN/base-merge + each expert's adapters at its weight,
                                 written as an HF safetensors checkpoint (the export inference engines serve;
                                 every merge streams HF or native inputs into HF output)
    report      RUN/report.md, report.json, report.png
                                 every stage (base, sft, base-merge, each expert = base merge + its adapters,
                                 final) scored on every `eval.envs` environment: mean reward, full-success rate

Every stage writes its output whole or not at all (temporary name, rename), so a rerun skips the stages whose
outputs exist and continues with the first missing one (a GRPO expert resumes from its own checkpoints). A
training stage that stops early (SIGTERM / SIGINT: it saves a checkpoint and returns) writes no output and stops
the recipe (`RecipeStopped`): nothing is built on a partial stage, and a rerun continues that stage's run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field

from nemo_jax.config.load import load_config
from nemo_jax.fsutil import atomic_dir


@dataclass(frozen=True)
class StageSection:
    config: str | None = None  # an SFT / GRPO YAML config
    overrides: list[str] = field(default_factory=list)  # its dotted key=value overrides


@dataclass(frozen=True)
class BaseSection:
    model: str | None = None  # an existing model dir (native or HF) ...
    sft_config: str | None = None  # ... or the SFT config that trains the base (from random init)
    overrides: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ExpertSection:
    name: str = "expert"
    config: str | None = None  # GRPO YAML config (model.init and run_dir are set by the recipe)
    overrides: list[str] = field(default_factory=list)
    weight: float = 1.0  # its weight in the expert merge


@dataclass(frozen=True)
class MergeStage:
    recipe: str | None = None  # merge YAML recipe (models / adapters / output are set by the recipe)
    overrides: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class EvalEnv:
    env: str = "arithmetic"
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EvalSection:
    SECTION = "eval"  # (named in setting errors)
    envs: list[EvalEnv] = field(default_factory=lambda: [EvalEnv()])
    attempts: int = 2  # per held-out task: pass@k and consistency use k = attempts
    max_new_tokens: int = 32  # per assistant turn
    temperature: float = 1.0
    seed: int = 0
    rows: int = 32  # decode rows of the eval sampler
    max_len: int = 1024  # positions per row (a whole conversation)

    def __post_init__(self):
        from nemo_jax.config.train import SettingError

        for key, v, lo in (("attempts", self.attempts, 1), ("max_new_tokens", self.max_new_tokens, 1),
                           ("temperature", self.temperature, 0)):
            if v < lo:
                raise SettingError(self, key, f"must be >= {lo}, got {v!r}")


@dataclass(frozen=True)
class RecipeConfig:
    name: str = "recipe"
    run_dir: str | None = None  # default runs/<name>
    base: BaseSection = field(default_factory=BaseSection)
    sft: StageSection = field(default_factory=StageSection)
    base_merge: MergeStage = field(default_factory=MergeStage)
    experts: list[ExpertSection] = field(default_factory=list)
    expert_merge: MergeStage = field(default_factory=MergeStage)
    eval: EvalSection = field(default_factory=EvalSection)


class RecipeStopped(Exception):
    """A training stage stopped early (a signal): its run keeps its checkpoints, nothing was built on it."""


def load_recipe_config(path: str, overrides=()) -> RecipeConfig:
    from nemo_jax.config.load import from_dict

    c = load_config(RecipeConfig, path, list(overrides))
    # lists of sections come in as dicts: make them dataclasses, naming the bad entry
    experts = [e if isinstance(e, ExpertSection) else from_dict(ExpertSection, e, f"experts.{i}")
               for i, e in enumerate(c.experts)]
    envs = [e if isinstance(e, EvalEnv) else from_dict(EvalEnv, e, f"eval.envs.{i}") for i, e in enumerate(c.eval.envs)]
    c = dataclasses.replace(c, experts=experts, eval=dataclasses.replace(c.eval, envs=envs))
    if c.name == "recipe":
        c = dataclasses.replace(c, name=os.path.splitext(os.path.basename(path))[0])
    if (c.base.model is None) == (c.base.sft_config is None):
        raise ValueError(f"{path}: base: give exactly one of model (a model dir) or sft_config")
    for key, v in (("sft.config", c.sft.config), ("base_merge.recipe", c.base_merge.recipe),
                   ("expert_merge.recipe", c.expert_merge.recipe)):
        if not v:
            raise ValueError(f"{path}: {key} is required")
    names = [e.name for e in c.experts]
    if not names or len(set(names)) != len(names) or any(not e.config for e in c.experts):
        raise ValueError(f"{path}: experts: at least one, unique names, each with a GRPO config")
    return c


def _rel(path: str, base: str) -> str:
    """A config path named in the recipe: as given when it exists from the working directory, else relative to
    the recipe file's directory."""
    return path if os.path.exists(path) else os.path.join(os.path.dirname(os.path.abspath(base)), path)


class Recipe:
    def __init__(self, c: RecipeConfig, path: str):
        self.c, self.path = c, path
        self.run_dir = os.path.abspath(c.run_dir or os.path.join("runs", c.name))
        self.out = lambda *p: os.path.join(self.run_dir, *p)  # noqa: E731
        self.ran_any = False  # a stage ran in this invocation: earlier scores are stale

    def _stage(self, name: str, output: str, fn) -> None:
        if os.path.exists(output):
            print(f"[recipe] {name}: done ({output})", flush=True)
            return
        print(f"[recipe] {name} -> {output}", flush=True)
        self.ran_any = True
        out = fn()
        if isinstance(out, dict) and out.get("stopped_early"):
            raise RecipeStopped(f"stopped at stage {name} (its training stopped at step {out.get('step')}, "
                                f"checkpoint saved); no later stage ran: rerun the same command to continue it")
        if not os.path.exists(output):
            raise RuntimeError(f"recipe stage {name} finished without writing {output}")

    def _sft(self, config: str, overrides: list[str], run_dir: str, dst: str, init: str | None):
        from nemo_jax.rl.warmstart import make_source
        from nemo_jax.train.sft import main as sft_main

        extra = [f"run_dir={run_dir}"] + ([f"model.init={init}", "model.init_sft_config=null"] if init else [])
        out = sft_main(_rel(config, self.path), list(overrides) + extra, make_source=make_source)
        if out.get("stopped_early"):
            return out  # a partial run: no stage output from it
        from nemo_jax.checkpoint import save_model
        from nemo_jax.sources import load_for_generation

        cfg, params, tok_dir = load_for_generation(run_dir)  # the run's latest good checkpoint (and tokenizer)
        save_model(dst, cfg, params, tokenizer_dir=tok_dir)
        return out

    def _merge(self, stage: MergeStage, sets: list[str]):
        from nemo_jax.merge import load_recipe, run_recipe, summary

        r = load_recipe(_rel(stage.recipe, self.path), list(stage.overrides) + sets)
        print(summary(run_recipe(r, progress=False).stats), flush=True)

    def preflight(self) -> list[str]:
        """Before any stage runs: every stage's config loads, and every environment a stage trains or the report
        scores can be built (its extra installed: an `mcp` expert without the mcp package stops here, not after
        the earlier stages' minutes) -> notes for what is missing but not needed (matplotlib: the report is
        written without its figure)."""
        from nemo_jax.config.train import load_grpo_config, load_sft_config
        from nemo_jax.merge.recipe import load_recipe
        from nemo_jax.plot import have_matplotlib
        from nemo_jax.rl.envs import make_env

        c = self.c
        for config, overrides in ([(c.base.sft_config, c.base.overrides)] if c.base.sft_config else []) + [
                (c.sft.config, c.sft.overrides)]:
            load_sft_config(_rel(config, self.path), list(overrides))
        for stage in (c.base_merge, c.expert_merge):
            load_recipe(_rel(stage.recipe, self.path), list(stage.overrides))
        envs = [(e.env, e.args, "eval.envs") for e in c.eval.envs]
        for e in c.experts:
            g = load_grpo_config(_rel(e.config, self.path), list(e.overrides))
            envs.append((g.rollout.env, g.rollout.env_args, f"expert {e.name}"))
        for name, args, where in envs:
            try:
                make_env(name, **args)
            except (ImportError, ValueError) as err:  # (a missing extra, bad arguments)
                raise ValueError(f"{where}: environment {name!r}: {err}") from None
        notes = []
        if not have_matplotlib():
            notes.append("matplotlib is not installed: report.md will be written without its figure report.png "
                         "(pip install 'nemo_jax[plot]' draws it; a rerun of the recipe then adds it)")
        return notes

    def run(self) -> dict:
        from nemo_jax.parallel.distributed import writer_lock

        for note in self.preflight():
            print(f"[recipe] note: {note}", flush=True)
        with writer_lock(self.run_dir, "nemo-jax recipe"):  # one writer per run dir (each stage's run: its own)
            return self._run()

    def _run(self) -> dict:
        c, out = self.c, self.out
        base = c.base.model or out("base")
        if c.base.model is None:
            self._stage("base", base, lambda: self._sft(c.base.sft_config, c.base.overrides, out("base-run"), base,
                                                        None))
        self._stage("sft", out("sft"), lambda: self._sft(c.sft.config, c.sft.overrides, out("sft-run"), out("sft"),
                                                         base))
        self._stage("base-merge", out("base-merge"), lambda: self._merge(
            c.base_merge, [f"models.base={base}", f"models.sft={out('sft')}", f"output={out('base-merge')}"]))
        for e in c.experts:
            self._stage(f"expert {e.name}", out(f"expert-{e.name}", "adapters"), lambda e=e: self._grpo(e))
        weights = {e.name: e.weight for e in c.experts}
        sets = [f"models={json.dumps({'base': out('base-merge')})}",
                f"adapters={json.dumps({e.name: out(f'expert-{e.name}', 'adapters') for e in c.experts})}",
                f"rules=[{json.dumps({'match': '.*', 'add_adapters': weights})}]", f"output={out('final')}"]
        self._stage("final (expert merge, HF export)", out("final"), lambda: self._merge(c.expert_merge, sets))
        return self.report()

    def _grpo(self, e: ExpertSection):
        from nemo_jax.config.train import load_grpo_config
        from nemo_jax.rl.grpo import main as grpo_main

        config = _rel(e.config, self.path)
        extra = [f"run_dir={self.out(f'expert-{e.name}')}", f"model.init={self.out('base-merge')}",
                 "model.init_sft_config=null", f"tokenizer={self.out('base-merge')}"]
        if load_grpo_config(config, list(e.overrides)).lora.init:  # its warm start: made in this run, from its base
            extra.append(f"lora.init={self.out(f'expert-{e.name}-warm')}")
        return grpo_main(config, list(e.overrides) + extra)

    # ------------------------------------------------------------------ report
    def stages(self) -> list[tuple[str, str, str | None]]:
        """(stage, model dir, adapters dir or None) of everything scored."""
        out = self.out
        rows = [("base", self.c.base.model or out("base"), None), ("sft", out("sft"), None),
                ("base-merge", out("base-merge"), None)]
        rows += [(f"expert-{e.name}", out("base-merge"), out(f"expert-{e.name}", "adapters")) for e in self.c.experts]
        return rows + [("final", out("final"), None)]

    def report(self) -> dict:
        import jax
        import jax.numpy as jnp

        from nemo_jax.data.chat import ChatTokenizer
        from nemo_jax.sources import load_adapters, load_any, tokenizer_dir
        from nemo_jax.rl.envs import make_env
        from nemo_jax.rl.grpo import eval_engine, evaluate_env

        ev = self.c.eval
        names = [e.env for e in ev.envs]
        names = [n if names.count(n) == 1 else f"{n}-{i}" for i, n in enumerate(names)]  # the same env twice
        envs = [(n, make_env(e.env, **e.args)) for n, e in zip(names, ev.envs)]
        path = self.out("report.json")
        # a rerun that only finishes the report (e.g. after a crash while scoring) keeps the scores it has
        table = json.load(open(path)) if os.path.exists(path) and not self.ran_any else {}
        for stage, model, adapters in self.stages():
            if stage in table and all("consistency" in table[stage].get(name, {}) for name, _ in envs):
                continue
            cfg, params = load_any(model, dtype=jnp.float32)
            ad = jax.tree.map(jnp.asarray, load_adapters(adapters, cfg)) if adapters else None
            tok = ChatTokenizer.load(tokenizer_dir(model))
            for name, env in envs:
                engine = eval_engine(params, cfg, ad, rows=ev.rows, max_len=ev.max_len, seed=ev.seed)
                r = evaluate_env(engine, tok, cfg, env, ev.attempts, ev.max_new_tokens, ev.temperature, seed=ev.seed)
                k = ev.attempts
                table.setdefault(stage, {})[name] = {"reward_mean": r["reward_mean"],
                                                     "success_rate": r["success_rate"], "pass@1": r["pass@1"],
                                                     f"pass@{k}": r[f"pass@{k}"], "consistency": r["consistency"],
                                                     "tasks": r["tasks"]}
                print(f"[recipe] eval {stage} on {name}: reward {r['reward_mean']:.3f}, "
                      f"success {r['success_rate']:.3f}, pass@{k} {r[f'pass@{k}']:.3f}, "
                      f"consistency {r['consistency']:.3f}", flush=True)
            with open(path + ".tmp", "w") as f:
                json.dump(table, f, indent=1)
            os.replace(path + ".tmp", path)
        names = [n for n, _ in envs]
        lines = [f"# {self.c.name}: every stage on every environment", "",
                 f"{ev.attempts} attempts per held-out task, temperature {ev.temperature}; cells: mean reward / "
                 f"full-success rate (pass@1) / pass@{ev.attempts} / consistency (solved in all {ev.attempts}).", "",
                 "| stage | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
        k = ev.attempts
        for stage, _, _ in self.stages():
            cells = [" / ".join(f"{table[stage][n][m]:.3f}" for m in ("reward_mean", "success_rate", f"pass@{k}",
                                                                       "consistency")) for n in names]
            lines.append(f"| {stage} | " + " | ".join(cells) + " |")
        self.write_report(lines, {s: {n: table[s][n]["reward_mean"] for n in names} for s, _, _ in self.stages()})
        print("\n".join(lines), flush=True)
        return table

    def write_report(self, lines: list[str], rewards: dict) -> None:
        """RUN/report.md (`lines`) and RUN/report.png (`rewards[stage][env]`, mean rewards), together; without
        matplotlib, report.md alone, saying so in a line (a finished run never loses its report for a picture)."""
        from nemo_jax.extras import MissingDependency
        from nemo_jax.plot import bar_chart

        with atomic_dir(self.out("report"), "recipe report", overwrite=True) as tmp:  # md + png together
            try:
                bar_chart(rewards, os.path.join(tmp, "report.png"), title=f"{self.c.name}: mean reward per stage",
                          ylabel="mean reward")
                made = ("report.md", "report.png")
            except MissingDependency:
                lines = lines + ["", "(No figure: matplotlib is not installed. `pip install 'nemo_jax[plot]'` and "
                                     "rerun the recipe to draw report.png.)"]
                print("[recipe] report.md written without its figure: matplotlib is not installed "
                      "(pip install 'nemo_jax[plot]', then rerun the recipe to draw report.png)", flush=True)
                made = ("report.md",)
            with open(os.path.join(tmp, "report.md"), "w") as f:
                f.write("\n".join(lines) + "\n")
        for f in made:
            os.replace(self.out("report", f), self.out(f))
        if "report.png" not in made and os.path.exists(self.out("report.png")):
            os.remove(self.out("report.png"))  # an earlier run's figure: no longer this report's
        shutil.rmtree(self.out("report"))  # made just above (what is left: its output marker)


def main(path: str, overrides=()) -> dict:
    return Recipe(load_recipe_config(path, overrides), path).run()
