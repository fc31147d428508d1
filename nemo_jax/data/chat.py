"""Chat SFT data: JSONL -> chat template (jinja2) -> tokens + assistant loss mask -> packed rows.

* Each line is `{"messages": [{"role", "content"}, ...], "tools": [...]?}`.
* The tokenizer's own chat template (from `tokenizer_config.json`) renders the conversation. The text of
  each assistant turn is found by rendering the conversation up to that turn with and without it, so the
  loss covers exactly what the model must generate (including its end-of-turn token).
* Rows of `seq_len` are packed greedily with segment ids 1, 2, ... (0 = padding); documents longer than a
  row are truncated and counted. The model sees each document as if alone.
* Order: a grain `MapDataset` shuffle by (seed, epoch); each process reads its own share of every epoch.
  The iterator state (epoch, position) is a small dict saved in checkpoints, so a resumed run continues
  with exactly the rows it would have seen.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import grain
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

    def render(self, messages, tools=None, add_generation_prompt=False) -> str:
        return self.template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    **{k: v for k, v in self.special.items() if v})

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


# --------------------------------------------------------------------------- reading
@dataclass
class Document:
    ids: np.ndarray
    mask: np.ndarray


def read_chat_jsonl(path: str, tok: ChatTokenizer, vocab_size: int, on_error: str = "raise"):
    """-> (documents, skipped count). Malformed lines raise naming file:line, or are skipped and counted."""
    path = resolve(path)
    if on_error not in ("raise", "skip"):
        raise ValueError(f"data.on_error: {on_error!r} (expected raise or skip)")
    docs, skipped = [], 0
    try:
        f = open(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such data file") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = _parse_line(line, tok, vocab_size)
            except (DataError, ValueError, KeyError, TypeError, jinja2.TemplateError) as e:
                if on_error == "raise":
                    raise DataError(f"{path}:{lineno}: {e}") from None
                skipped += 1
                continue
            docs.append(doc)
    if not docs:
        raise DataError(f"{path}: no usable conversations")
    return docs, skipped


def _parse_line(line: str, tok: ChatTokenizer, vocab_size: int) -> Document:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
        raise DataError('expected an object with a non-empty "messages" list')
    for i, m in enumerate(obj["messages"]):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f'messages[{i}] needs string "role" and "content"')
    ids, mask = tok.encode_chat(obj["messages"], obj.get("tools"))
    if len(ids) and (ids.max() >= vocab_size or ids.min() < 0):
        bad = int(ids[(ids >= vocab_size) | (ids < 0)][0])
        raise DataError(f"token id {bad} outside the model vocabulary ({vocab_size})")
    if not mask.any():
        raise DataError("no assistant tokens to train on")
    return Document(ids, mask)


# --------------------------------------------------------------------------- packing
def pack(docs: list[Document], seq_len: int) -> dict[str, np.ndarray]:
    """Greedy packing of whole documents into one row. Returns tokens/targets/loss_mask/segment_ids [seq_len]."""
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


class PackedIterator:
    """Deterministic, resumable iterator of packed batches [rows, seq_len] for this process.

    state = {"epoch", "pos"}: the next document of this process's share of the epoch's shuffled order.
    """

    def __init__(self, docs: list[Document], seq_len: int, rows: int, seed: int, *, process_index: int = 0,
                 process_count: int = 1, shuffle: bool = True, repeat: bool = True):
        self.docs, self.seq_len, self.rows, self.seed = docs, seq_len, rows, seed
        self.pi, self.pc, self.shuffle, self.repeat = process_index, process_count, shuffle, repeat
        self.epoch, self.pos = 0, 0
        self.truncated = 0
        self._order_epoch, self._order = None, None

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            ds = grain.MapDataset.range(len(self.docs))
            if self.shuffle:
                ds = ds.shuffle(seed=self.seed + 1_000_003 * self.epoch)
            ds = ds[self.pi::self.pc]
            self._order = np.fromiter((ds[i] for i in range(len(ds))), np.int64, len(ds))
            self._order_epoch = self.epoch
        return self._order

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def set_state(self, state: dict):
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])

    def _next_doc(self) -> Document | None:
        order = self._epoch_order()
        if self.pos >= len(order):
            if not self.repeat:
                return None
            self.epoch += 1
            self.pos = 0
            order = self._epoch_order()
        d = self.docs[order[self.pos]]
        self.pos += 1
        return d

    def _peek(self) -> Document | None:
        e, p = self.epoch, self.pos
        d = self._next_doc()
        self.epoch, self.pos = e, p
        return d

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rows = []
        for _ in range(self.rows):
            docs, used = [], 0
            while True:
                d = self._peek()
                if d is None:
                    break
                n = len(d.ids)
                if docs and used + n > self.seq_len + 1:
                    break
                self._next_doc()
                if n > self.seq_len + 1:
                    self.truncated += 1
                docs.append(d)
                used += n
            if not docs:
                break
            rows.append(pack(docs, self.seq_len))
        if not rows:
            raise StopIteration
        while len(rows) < self.rows:  # final partial batch (no repeat): pad with empty rows
            rows.append(pack([], self.seq_len))
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
