"""`nemo-jax plan`: per-device memory, FLOPs, collectives and step time of a job, compiled ahead of time on
simulated devices (`plan.py`), with the loop-aware HLO counting in `hlo.py`."""

from __future__ import annotations

import json
import sys

from nemo_jax.plan.plan import (DEVICE_KINDS, ESTIMATES, TARGET_NOTE, default_target, format_plan,  # noqa: F401
                                format_search, format_tinker, plan_sampler, plan_sft, search, tinker_plan)

# the keys every `--json` plan carries at its top level (those of the training step)
PLAN_KEYS = ("fits", "per_device_bytes", "flops_per_step", "model_flops_per_step", "collective_bytes",
             "step_time_s", "mfu")


def cli_plan(a, overrides: list[str]) -> dict:
    from nemo_jax.plan.plan import load_plan_config

    c, sampler = load_plan_config(a.config, overrides)
    if getattr(a, "tinker_clients", None) and not c.lora.targets:
        raise ValueError("plan --tinker-clients plans the Tinker server's LoRA models: give the config lora.targets "
                         "(and lora.rank)")
    kind = DEVICE_KINDS[a.device_kind]
    target = a.target
    say = (lambda *x: print(*x, file=sys.stderr)) if a.json else print
    head = {"config": a.config or "embedded tiny CPU config", "devices": a.devices, "device_kind": a.device_kind,
            "target": target, "target_note": TARGET_NOTE[target], "estimate": target == "cpu",
            "headroom": a.headroom, "estimates": ESTIMATES}
    say(f"plan: {a.devices} x {kind.name}, target {target} ({TARGET_NOTE[target]})")
    if a.search:
        rows = search(c, a.devices, kind, a.max_candidates, a.headroom, progress=say, target=target, jobs=a.jobs)
        out = {**head, "candidates": rows, "best": rows[0] if rows and rows[0]["fits"] else None}
        if a.json:
            print(json.dumps(out, indent=1))
        else:
            print(format_search(rows))
            if out["best"] is None:
                print("no candidate fits: try more devices, a smaller data.batch_size or more optim.grad_accum")
        return out
    programs = [plan_sft(c, a.devices, kind, a.headroom, target)]
    if sampler["program"]:
        programs[0] = dict(programs[0], program=sampler["program"])
    if a.sampler:
        programs += plan_sampler(c, a.devices, kind, a.rollout_batch or sampler["rows"],
                                 a.context or sampler["context"], a.headroom, target, prefill=a.prefill)
    out = {**head, **{k: programs[0][k] for k in PLAN_KEYS}, "fits_all": all(p["fits"] for p in programs),
           "programs": programs}
    if getattr(a, "tinker_clients", None):
        out["tinker"] = tinker_plan(programs[0], programs[1:], a.tinker_clients, kind, a.headroom)
        out["fits_all"] = out["fits_all"] and out["tinker"]["fits"]
    if c.lora.targets and not getattr(a, "no_lora_ratio", False):
        out["lora_over_sft_flops"] = lora_ratio(c, a.devices, kind, a.headroom, target, programs[0])
        say(f"LoRA step HLO FLOPs: {out['lora_over_sft_flops']:.3f}x the same step's without LoRA (full SFT)")
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for p in programs:
            print(format_plan(p, kind) + "\n")
        if "tinker" in out:
            print(format_tinker(out["tinker"]) + "\n")
        print(f"estimates: {ESTIMATES}")
    return out


def lora_ratio(c, n_devices: int, kind, headroom: float, target: str, lora_plan: dict) -> float:
    """The LoRA step's HLO FLOPs over those of the same config's full SFT step (`lora.targets` cleared; compiled
    and cached like any plan)."""
    import dataclasses

    from nemo_jax.config.train import LoraSection

    full = plan_sft(dataclasses.replace(c, lora=LoraSection()), n_devices, kind, headroom, target)
    return lora_plan["flops_per_step"] / full["flops_per_step"]
