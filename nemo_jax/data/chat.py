"""Chat SFT data: JSONL -> chat template (jinja2) -> tokens + assistant loss mask -> packed rows.

* Each line is `{"messages": [{"role", "content"}, ...], "tools": [...]?}`.
* The tokenizer's own chat template (from `tokenizer_config.json`) renders the conversation. The text of
  each assistant turn is found by rendering the conversation up to that turn with and without it, so the
  loss covers exactly what the model must generate (including its end-of-turn token).
* Rows of `seq_len` hold documents with segment ids 1, 2, ... (0 = padding; `pack`); the model sees each
  document as if alone. Which documents share a row, and in which order they come: `loader.PackedIterator`.
* Large inputs are prepared once into ArrayRecord shards (`prepared.prepare`) and read lazily from there.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets")


def resolve(path: str) -> str:
    """`builtin:NAME` -> a file or directory shipped inside the package."""
    if path.startswith("builtin:"):
        return os.path.join(ASSETS, path[len("builtin:"):])
    return path


class DataError(ValueError):
    pass


# --------------------------------------------------------------------------- tokenizer + template
@dataclass
class ChatTokenizer:
    tokenizer: Tokenizer
    template: jinja2.Template
    eos_token: str | None
    special: dict
    path: str

    @classmethod
    def load(cls, path: str) -> "ChatTokenizer":
        path = resolve(path)
        tj, tc = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer_config.json")
        if not os.path.exists(tj):
            raise FileNotFoundError(f"{tj}: no tokenizer.json in the tokenizer directory")
        tok = Tokenizer.from_file(tj)
        conf = {}
        if os.path.exists(tc):
            with open(tc) as f:
                conf = json.load(f)
        src = conf.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if src is None and os.path.exists(jinja_file):
            with open(jinja_file) as f:
                src = f.read()
        if isinstance(src, list):  # [{"name": "default", "template": ...}, ...]
            src = next((t["template"] for t in src if t.get("name") == "default"), src[0]["template"])
        if not src:
            raise DataError(f"{tc}: no chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        special = {k: _tok_str(conf.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        return cls(tok, env.from_string(src), special.get("eos_token"), special, path)

    def render(self, messages, tools=None, add_generation_prompt=False, **kwargs) -> str:
        """`kwargs`: extra template variables (e.g. `enable_thinking` of the Nemotron 3 templates)."""
        return self.template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    **{**{k: v for k, v in self.special.items() if v}, **kwargs})

    def encode_chat(self, messages, tools=None) -> tuple[np.ndarray, np.ndarray]:
        """-> token ids [n] int32, loss mask [n] bool (True on assistant tokens)."""
        text = self.render(messages, tools)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.render(messages[:i], tools, add_generation_prompt=True)
            upto = self.render(messages[: i + 1], tools)
            if not text.startswith(upto) or not upto.startswith(before):
                raise DataError("the chat template does not render conversations prefix-consistently")
            spans.append((len(before), len(upto)))
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, np.int32)
        mask = np.zeros(len(ids), bool)
        for j, (s, e) in enumerate(enc.offsets):
            mask[j] = any(a <= s and e <= b and e > s for a, b in spans)
        return ids, mask

    def eos_ids(self) -> list[int]:
        out = []
        for t in (self.eos_token,):
            if t is not None and self.tokenizer.token_to_id(t) is not None:
                out.append(self.tokenizer.token_to_id(t))
        return out


def _tok_str(x):
    if isinstance(x, dict):
        return x.get("content")
    return x


def _raise(msg):
    raise DataError(f"chat template: {msg}")


# --------------------------------------------------------------------------- tool calls
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def tool_calls(text: str, tools=None) -> list[dict]:
    """The tool calls in an assistant's text, in order -> [{"name", "arguments" (dict)}]. Two forms:
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (JSON, as Hermes / Qwen templates write it) and
    `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>` (Nemotron 3, what vLLM's
    `qwen3_coder` parser reads; a value that parses as JSON is taken as such, else as a string, and a parameter the
    call's tool definition in `tools` types `string` stays a string). A call that parses as neither is
    {"name": "<malformed>", "arguments": {}, "text": ...} (the environment answers it with an error)."""
    types = _parameter_types(tools)
    return [_parse_call(m.group(1), types) for m in _TOOL_CALL.finditer(text)]


def split_tool_calls(text: str, tools=None) -> tuple[str | None, list[dict]]:
    """An assistant's text -> (the text outside its well-formed tool calls, stripped: None when that is empty and
    there are calls; the well-formed calls, as `tool_calls` reads them). Malformed blocks stay in the text."""
    types = _parameter_types(tools)
    calls, kept, at = [], [], 0
    for m in _TOOL_CALL.finditer(text):
        c = _parse_call(m.group(1), types)
        if c["name"] != "<malformed>":
            calls.append(c)
            kept.append(text[at:m.start()])
            at = m.end()
    if not calls:
        return text, []
    rest = ("".join(kept) + text[at:]).strip()
    return rest or None, calls


def _parameter_types(tools) -> dict[str, dict]:
    """OpenAI tool definitions -> {function name: {parameter: its JSON schema type}}."""
    out = {}
    for t in tools or ():
        f = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            props = (f.get("parameters") or {}).get("properties") or {}
            out[f["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return out


def _parse_call(body: str, types: dict) -> dict:
    f = _FUNCTION.search(body)
    if f:
        kinds, args = types.get(f.group(1), {}), {}
        for k, v in _PARAMETER.findall(f.group(2)):
            if kinds.get(k) == "string":
                args[k] = v
                continue
            try:
                args[k] = json.loads(v)
            except json.JSONDecodeError:
                args[k] = v
        return {"name": f.group(1), "arguments": args}
    try:
        c = json.loads(body)
    except json.JSONDecodeError:
        c = None
    if isinstance(c, dict) and isinstance(c.get("name"), str):
        a = c.get("arguments", c.get("parameters", {}))
        if isinstance(a, str):
            try:
                a = json.loads(a)
            except json.JSONDecodeError:
                a = None
        return {"name": c["name"], "arguments": a if isinstance(a, dict) else {}}
    return {"name": "<malformed>", "arguments": {}, "text": body[:200]}


# --------------------------------------------------------------------------- reading
@dataclass
class Document:
    ids: np.ndarray
    mask: np.ndarray
    source: int = 0  # index of the mixture source it came from (data.sources)
    images: list = field(default_factory=list)  # image references: the image parts (or a record's "images" list)
    image_hw: list = field(default_factory=list)  # [height, width] in pixels of each image part, in token order


def read_chat_jsonl(path: str, tok: ChatTokenizer, vocab_size: int, on_error: str = "raise"):
    """-> (documents, skipped count). Malformed lines raise naming file:line, or are skipped and counted.
    Relative image paths are relative to the file's directory."""
    path = resolve(path)
    if on_error not in ("raise", "skip"):
        raise ValueError(f"data.on_error: {on_error!r} (expected raise or skip)")
    docs, skipped = [], 0
    try:
        f = open(path, "rb")  # lines end at b"\n" only; each decoded strictly (`parse_record`)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such data file") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = parse_record(line, tok, vocab_size, base_dir=os.path.dirname(os.path.abspath(path)))
            except DataError as e:
                if on_error == "raise":
                    raise DataError(f"{path}:{lineno}: {e}") from None
                skipped += 1
                continue
            docs.append(doc)
    if not docs:
        raise DataError(f"{path}: no usable conversations")
    return docs, skipped


ROLES = ("system", "user", "assistant", "tool")  # a message of any other role is refused, not trained on


def utf8(line: bytes) -> str:
    """A line's bytes -> text; bytes that are not UTF-8 are a DataError naming the first (never replaced with
    U+FFFD and trained on)."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"not UTF-8: byte 0x{line[e.start]:02x} at column {e.start + 1} ({e.reason})") from None


def parse_record(raw, tok: ChatTokenizer, vocab_size: int, base_dir: str | None = None) -> Document:
    """A JSON line (text or bytes, which must be UTF-8) or an already parsed record (e.g. a Parquet row) ->
    Document; DataError says what is wrong."""
    if isinstance(raw, bytes):
        raw = utf8(raw)
    if isinstance(raw, str) and raw.startswith("\ufeff"):  # a UTF-8 BOM (a file saved by some editors): not data
        raw = raw[1:]
    try:
        return _parse(json.loads(raw) if isinstance(raw, str) else raw, tok, vocab_size, base_dir)
    except json.JSONDecodeError as e:
        raise DataError(f"not valid JSON ({e.msg})") from None
    except (ValueError, KeyError, TypeError, jinja2.TemplateError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{type(e).__name__}: {e}") from None


IMAGE_TOKEN, IMAGE_START, IMAGE_END = "<image>", "<img>", "</img>"  # as transformers' nemotron_h_omni processor


def _image_ref(part: dict, where: str):
    """The path or URL of an image content part: {"type": "image", "path"|"image"|"url": ...} or
    {"type": "image_url", "image_url": {"url": ...} or "..."}; an environment's message may also hold the picture
    itself (a PIL image or an [H, W, C] array) under "image"."""
    if part["type"] == "image":
        ref = next((part[k] for k in ("path", "image", "url") if k in part), None)
    else:
        ref = part.get("image_url")
        ref = ref.get("url") if isinstance(ref, dict) else ref
    if hasattr(ref, "getbbox") or (isinstance(ref, np.ndarray) and ref.ndim == 3):
        return ref
    if not isinstance(ref, str) or not ref:
        raise DataError(f"{where}: an image part needs a path or URL string")
    return ref


def content_text(content, where: str, refs: list) -> str:
    """A message's content (a string, or a list of text / image parts) -> its text, each image part as an
    `<img><image></img>` marker (the loader widens `<image>` to the image's tokens); image refs appended."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DataError(f'{where} needs string "content" or a list of content parts')
    out = []
    for j, part in enumerate(content):
        w = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind in ("image", "image_url"):
            refs.append(_image_ref(part, w))
            out.append(IMAGE_START + IMAGE_TOKEN + IMAGE_END)
        elif kind in ("audio", "input_audio", "audio_url", "video", "video_url"):
            raise DataError(f"{w}: {kind} parts are not supported (images and text only)")
        else:
            raise DataError(f'{w}: expected {{"type": "text", "text": ...}} or an image part, got {part!r:.80}')
    return "".join(out)


def _parse(obj, tok: ChatTokenizer, vocab_size: int, base_dir: str | None = None) -> Document:
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
        raise DataError('expected an object with a non-empty "messages" list')
    refs: list[str] = []
    messages = []
    for i, m in enumerate(obj["messages"]):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise DataError(f'messages[{i}] needs string "role" and "content"')
        if m["role"] not in ROLES:
            raise DataError(f"messages[{i}]: unknown role {m['role'][:40]!r} (expected one of {', '.join(ROLES)})")
        messages.append(dict(m, content=content_text(m["content"], f"messages[{i}]", refs)))
    ids, mask = tok.encode_chat(messages, obj.get("tools"))
    if len(ids) and (ids.max() >= vocab_size or ids.min() < 0):
        bad = int(ids[(ids >= vocab_size) | (ids < 0)][0])
        raise DataError(f"token id {bad} outside the model vocabulary ({vocab_size})")
    if not mask.any():
        raise DataError("no assistant tokens to train on")
    if refs:
        return Document(ids, mask, 0, *read_image_parts(refs, ids, tok, base_dir))
    images = obj.get("images") or []  # a record's own image list is carried as it is (not loaded here)
    if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
        raise DataError('"images" must be a list of image paths or URLs')
    return Document(ids, mask, 0, images)


def read_image_parts(refs: list[str], ids: np.ndarray, tok: ChatTokenizer, base_dir: str | None):
    """Each image opened and decoded once (a missing or corrupt file is an error naming it); -> (refs with
    paths made absolute, [height, width] of each)."""
    from nemo_jax.data.images import ImageError, load_image

    image_id = tok.tokenizer.token_to_id(IMAGE_TOKEN)
    if image_id is None:
        raise DataError(f"the tokenizer ({tok.path}) has no {IMAGE_TOKEN} token: it cannot hold images")
    if int(np.sum(ids == image_id)) != len(refs):
        raise DataError(f"{len(refs)} image parts but {int(np.sum(ids == image_id))} {IMAGE_TOKEN} tokens after the "
                        f"chat template (is {IMAGE_TOKEN} written in the text?)")
    out, hw = [], []
    for ref in refs:
        if not ref.startswith("data:") and "://" not in ref and not os.path.isabs(ref) and base_dir:
            ref = os.path.join(base_dir, ref)
        try:
            img = load_image(ref)
        except ImageError as e:
            raise DataError(str(e)) from None
        out.append(ref)
        hw.append([img.height, img.width])
    return out, hw


# --------------------------------------------------------------------------- packing
def pack(docs: list[Document], seq_len: int) -> dict[str, np.ndarray]:
    """Documents into one row, in order (each its own segment; one past the row is cut). Returns
    tokens/targets/loss_mask/segment_ids [seq_len]."""
    tokens = np.zeros(seq_len + 1, np.int32)
    mask = np.zeros(seq_len + 1, bool)
    seg = np.zeros(seq_len + 1, np.int32)
    off = 0
    for i, d in enumerate(docs):
        n = min(len(d.ids), seq_len + 1 - off)
        tokens[off:off + n] = d.ids[:n]
        mask[off:off + n] = d.mask[:n]
        seg[off:off + n] = i + 1
        off += n
    same = seg[1:] == seg[:-1]
    return {
        "tokens": tokens[:-1],
        "targets": tokens[1:],
        "loss_mask": mask[1:] & same & (seg[:-1] > 0),
        "segment_ids": seg[:-1],
    }


def split_long(doc: Document, seq_len: int) -> list[Document]:
    """A document longer than a row (seq_len + 1 tokens) as consecutive pieces of <= seq_len + 1 tokens that
    overlap by one token, so each of its targets is predicted exactly once (each piece its own segment)."""
    n = len(doc.ids)
    if n <= seq_len + 1:
        return [doc]
    return [Document(doc.ids[s:s + seq_len + 1], doc.mask[s:s + seq_len + 1], doc.source)
            for s in range(0, n - 1, seq_len)]


def first_fit_decreasing(lengths: list, capacity) -> list[list[int]]:
    """Bins of item indices: items taken longest first (ties in order), each into the first bin it fits.
    An item's size may be a tuple (tokens, then e.g. image patches and images) against a tuple capacity: it
    fits where every part fits; items are ordered by their first part."""
    sizes = [tuple(x) if isinstance(x, (tuple, list)) else (x,) for x in lengths]
    cap = tuple(capacity) if isinstance(capacity, (tuple, list)) else (capacity,)
    bins: list[list[int]] = []
    room: list[list[int]] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i][0]):
        s = sizes[i]
        if len(cap) == 1:
            j = next((j for j, r in enumerate(room) if r[0] >= s[0]), len(bins))
        else:
            j = next((j for j, r in enumerate(room) if all(a >= b for a, b in zip(r, s))), len(bins))
        if j == len(bins):
            bins.append([])
            room.append(list(cap))
        bins[j].append(i)
        room[j] = [a - b for a, b in zip(room[j], s)]
    return bins
