"""Tool calls in model text, as Nemotron chat templates write them, parsed back into OpenAI-style calls.

Two spellings of a call are read, each inside `<tool_call>...</tool_call>`:

* Nemotron 3 / Qwen3-Coder XML (what the Nemotron 3 chat templates render and vLLM's `qwen3_coder` tool parser
  reads):

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

* Hermes JSON: `<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`.

A parameter's value is kept as text where the tool's JSON schema says `string` (or when it is not JSON), else it is
read as JSON (numbers, booleans, objects). A block that is not closed (the turn ran out of tokens) stays text.
"""

from __future__ import annotations

import json
import re

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _types(tools) -> dict[str, dict[str, str]]:
    """OpenAI tool definitions -> {function name: {parameter: JSON schema type}}."""
    out = {}
    for t in tools or ():
        f = t.get("function", t) if isinstance(t, dict) else {}
        props = ((f.get("parameters") or {}).get("properties") or {}) if isinstance(f, dict) else {}
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            out[f["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return out


def _value(text: str, kind):
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_tool_calls(text: str, tools=None) -> tuple[str | None, list[dict]]:
    """Model text -> (the text outside tool-call blocks, stripped; None when empty and calls were made,
    [{"name": ..., "arguments": {...}}, ...] in order). `tools`: the request's tool definitions (parameter types)."""
    types = _types(tools)
    calls, spans = [], []
    for block in _BLOCK.finditer(text):
        got = _block_calls(block.group(1).strip(), types)
        if got:
            calls += got
            spans.append(block.span())
    if not calls:
        return text, []
    rest = "".join(text[a:b] for a, b in zip([0] + [e for _, e in spans], [s for s, _ in spans] + [len(text)])).strip()
    return (rest or None), calls


def _block_calls(body: str, types: dict) -> list[dict]:
    """The calls of one block's body (none when it is not a call this parser understands)."""
    if body.startswith("{"):
        try:
            d = json.loads(body)
        except ValueError:
            return []
        if not isinstance(d, dict) or not isinstance(d.get("name"), str):
            return []
        args = d.get("arguments", d.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        return [{"name": d["name"], "arguments": args if isinstance(args, dict) else {}}]
    out = []
    for f in _FUNCTION.finditer(body):
        name = f.group(1).strip()
        kinds = types.get(name, {})
        out.append({"name": name, "arguments": {p.group(1).strip(): _value(p.group(2), kinds.get(p.group(1).strip()))
                                                for p in _PARAMETER.finditer(f.group(2))}})
    return out
