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
    source: int = 0  # index of the mixture source it came from (data.sources)


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


def read_sources(data, tok, vocab_size: int):
    """-> (documents, skipped lines, mixture weights or None, source names) of a data config section's
    `sources` (each document tagged with its source) or of its `train` file alone."""
    if not data.sources:
        docs, skipped = read_chat_jsonl(data.train, tok, vocab_size, data.on_error)
        return docs, skipped, None, ["train"]
    docs, skipped, weights, names = [], 0, [], []
    for i, src in enumerate(data.sources):
        where = f"data.sources[{i}]"
        if not isinstance(src.get("path"), str) or set(src) - {"path", "weight"}:
            raise ValueError(f"{where}: expected {{path: FILE, weight: NUMBER}}, got {src!r}")
        w = src.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w <= 0:
            raise ValueError(f"{where}.weight must be a positive number, got {w!r}")
        d, sk = read_chat_jsonl(src["path"], tok, vocab_size, data.on_error)
        if not d:
            raise ValueError(f"{where}: {src['path']} holds no documents")
        docs += [Document(x.ids, x.mask, i) for x in d]
        skipped += sk
        weights.append(float(w))
        stem = os.path.splitext(os.path.basename(src["path"]))[0]
        names.append(stem if stem not in names else f"{stem}_{i}")
    return docs, skipped, weights, names


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


PACKINGS = ("ffd", "greedy")
LONG_DOCUMENTS = ("split", "drop")


def split_long(doc: Document, seq_len: int) -> list[Document]:
    """A document longer than a row (seq_len + 1 tokens) as consecutive pieces of <= seq_len + 1 tokens that
    overlap by one token, so each of its targets is predicted exactly once (each piece its own segment)."""
    n = len(doc.ids)
    if n <= seq_len + 1:
        return [doc]
    return [Document(doc.ids[s:s + seq_len + 1], doc.mask[s:s + seq_len + 1], doc.source)
            for s in range(0, n - 1, seq_len)]


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices: items taken longest first (ties in order), each into the first bin it fits."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = next((j for j, r in enumerate(room) if r >= lengths[i]), len(bins))
        if j == len(bins):
            bins.append([])
            room.append(capacity)
        bins[j].append(i)
        room[j] -= lengths[i]
    return bins


class PackedIterator:
    """Deterministic, resumable iterator of packed batches [rows, seq_len] for this process.

    packing "ffd" (default): the epoch's shuffled order is taken in windows of `window` documents; documents
    longer than a row are split into consecutive pieces (`split_long`) or dropped and counted
    (`long_documents`), and each window's pieces are packed first-fit decreasing. state = {"epoch", "pos",
    "row"}: the first document of the current window and the rows of it already emitted (a window re-packs
    to the same rows, so resume is exact). packing "greedy" (the reference): documents in order, a row
    filled until the next one does not fit (next-fit); documents longer than a row are truncated and counted.
    """

    def __init__(self, docs: list[Document], seq_len: int, rows: int, seed: int, *, process_index: int = 0,
                 process_count: int = 1, shuffle: bool = True, repeat: bool = True, packing: str = "ffd",
                 long_documents: str = "split", window: int = 1024, weights: list[float] | None = None):
        if packing not in PACKINGS:
            raise ValueError(f"data.packing: {packing!r} not in {PACKINGS}")
        if long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"data.long_documents: {long_documents!r} not in {LONG_DOCUMENTS}")
        if window < 1:
            raise ValueError(f"data.pack_window must be >= 1, got {window}")
        self.docs, self.seq_len, self.rows, self.seed = docs, seq_len, rows, seed
        self.pi, self.pc, self.shuffle, self.repeat = process_index, process_count, shuffle, repeat
        self.packing, self.long_documents, self.window = packing, long_documents, window
        self.epoch, self.pos, self.row = 0, 0, 0
        self.truncated = self.split = self.dropped = 0  # documents truncated (greedy), split, dropped (ffd)
        self._order_epoch, self._order = None, None
        self._bins_at, self._bins = None, None
        self.weights = None if weights is None else np.asarray(weights, np.float64)
        self._sources = np.fromiter((d.source for d in docs), np.int64, len(docs))
        n_sources = 1 + int(self._sources.max(initial=0))
        if self.weights is not None and (len(self.weights) != n_sources or not (self.weights > 0).all()):
            raise ValueError(f"data.sources: {n_sources} sources need as many positive weights, got {weights}")
        self.source_tokens = np.zeros(n_sources, np.int64)  # tokens of each source emitted since the start

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            if self.weights is None:
                ds = grain.MapDataset.range(len(self.docs))
                if self.shuffle:
                    ds = ds.shuffle(seed=self.seed + 1_000_003 * self.epoch)
                order = np.fromiter((ds[i] for i in range(len(ds))), np.int64, len(ds))
            else:
                order = self._mixture_order()
            self._order = order[self.pi::self.pc]
            self._order_epoch = self.epoch
        return self._order

    def _mixture_order(self) -> np.ndarray:
        """An epoch of len(docs) draws: each draw picks a source with probability weight / sum(weights) and
        takes that source's next document (its own shuffled order, reshuffled each time it runs out), all
        from (seed, epoch)."""
        rng = np.random.default_rng([self.seed, self.epoch])
        draws = rng.choice(len(self.weights), size=len(self.docs), p=self.weights / self.weights.sum())
        members = [np.flatnonzero(self._sources == s) for s in range(len(self.weights))]
        order = np.empty(len(draws), np.int64)
        for s, m in enumerate(members):
            at = np.flatnonzero(draws == s)
            if len(at) and not len(m):
                raise ValueError(f"data.sources[{s}] holds no documents")
            cycles = -(-len(at) // max(len(m), 1))
            order[at] = np.concatenate([rng.permutation(m) if self.shuffle else m for _ in range(cycles)]
                                       or [np.zeros(0, np.int64)])[:len(at)]
        return order

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "row": self.row}

    def set_state(self, state: dict):
        self.epoch, self.pos, self.row = int(state["epoch"]), int(state["pos"]), int(state.get("row", 0))

    def _window(self):
        """(pieces, bins, documents in the window) at (epoch, pos), moving to the next epoch at the end of
        one (None at the end without repeat)."""
        order = self._epoch_order()
        if self.pos >= len(order):
            if not self.repeat or not len(order):
                return None
            self.epoch, self.pos, self.row = self.epoch + 1, 0, 0
            order = self._epoch_order()
        if self._bins_at != (self.epoch, self.pos):
            docs = [self.docs[i] for i in order[self.pos:self.pos + self.window]]
            pieces = []
            for d in docs:
                if len(d.ids) > self.seq_len + 1:
                    if self.long_documents == "drop":
                        self.dropped += 1
                        continue
                    self.split += 1
                pieces += split_long(d, self.seq_len)
            bins = first_fit_decreasing([len(p.ids) for p in pieces], self.seq_len + 1)
            self._bins_at, self._bins = (self.epoch, self.pos), (pieces, bins, len(docs))
        return self._bins

    def _next_ffd(self) -> list[dict]:
        rows, empty = [], 0
        while len(rows) < self.rows:
            w = self._window()
            if w is None:
                break
            pieces, bins, n_docs = w
            empty = 0 if bins else empty + 1
            if empty > len(self._epoch_order()) // self.window + 1:  # a whole epoch without a row
                raise ValueError(f"data: every document is longer than a row ({self.seq_len + 1} tokens) and "
                                 "data.long_documents is drop")
            take = bins[self.row:self.row + self.rows - len(rows)]
            rows += [pack([pieces[i] for i in b], self.seq_len) for b in take]
            for b in take:
                for i in b:
                    self.source_tokens[pieces[i].source] += len(pieces[i].ids)
            self.row += len(take)
            if self.row >= len(bins):
                self.pos, self.row = self.pos + n_docs, 0
        return rows

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
        rows = self._next_ffd() if self.packing == "ffd" else self._next_greedy()
        if not rows:
            raise StopIteration
        while len(rows) < self.rows:  # final partial batch (no repeat): pad with empty rows
            rows.append(pack([], self.seq_len))
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def _next_greedy(self) -> list[dict]:
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
                self.source_tokens[d.source] += min(len(d.ids), self.seq_len + 1)
                used += n
            if not docs:
                break
            rows.append(pack(docs, self.seq_len))
        return rows
