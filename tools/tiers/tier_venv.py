"""What the tier scripts that keep a tool in a venv of its own share (nemo_gym.py, verifiers.py): the venv made
(never over a folder that is not one), its check run, the marker that says it was built whole, and the command line
(`venv` builds it; `tier` builds it when its marker is missing, then runs the tier's tests)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def make_venv(venv: str, python: str, script: str) -> str:
    """A venv at `venv` made with `python` unless there is one -> its Python; a folder there that is not a venv is
    refused (one line naming it), never reused or removed."""
    if os.path.exists(venv) and not os.path.exists(venv_python(venv)):
        raise SystemExit(f"{script} venv: {venv} exists and is not a venv; give another --venv")
    if not os.path.exists(venv_python(venv)):
        subprocess.run([python, "-m", "venv", venv], check=True)
    return venv_python(venv)


def seal(venv: str, marker: str, check: str, what: str) -> dict:
    """Run `check` (Python code printing a JSON object of versions last) in the venv, write the versions to its
    marker file (the venv is complete) and say so -> the versions."""
    out = subprocess.run([venv_python(venv), "-c", check], check=True, capture_output=True, text=True).stdout
    versions = json.loads(out.strip().splitlines()[-1])
    with open(os.path.join(venv, marker), "w") as f:
        json.dump(versions, f)
    print(f"{what} venv ready: {venv} ({json.dumps(versions)})", flush=True)
    return versions


def venv_and_tier(doc: str, venv_help: str) -> tuple[argparse.ArgumentParser, dict]:
    """The command line: subcommands `venv` and `tier`, each with --venv -> (the parser, {name: its subparser})
    for the script to add its own options to."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    subs = {name: sub.add_parser(name) for name in ("venv", "tier")}
    for s in subs.values():
        s.add_argument("--venv", help=venv_help)
    return ap, subs
