"""Packed batches from a document sequence, as a grain pipeline (worker processes, prefetch, exact resume).

    windows (MapDataset over window index i = epoch * W + w: a pure function of (seed, i))
      -> the window's packed rows (FlatMap) -> batches of `rows` (in each worker) -> mp_prefetch(workers)

* Documents: any sequence of `chat.Document` (a list, or `prepared.PreparedDocuments`, which reads its
  ArrayRecord shards only when records are asked for). Mixture source s is the index range bounds[s]..bounds[s+1].
* Order (`DocumentOrder`): share k of `shares` (one per data-loading process) takes epoch positions k, k + shares,
  ...: the shares are disjoint and together cover the epoch. Unweighted: a Feistel index shuffle of the
  documents by (seed, epoch). Mixture: each block of BLOCK draws picks its sources multinomially by weight
  (from (seed, epoch, block)); the j-th draw of source s takes the source's documents in an index-shuffled
  order, reshuffled each time the source runs out. Every position is computed directly (nothing the size of
  the dataset is materialised), so start-up costs the same for 100 MB as for 100 GB.
* Windows of `window` positions are packed first-fit decreasing ("ffd", documents longer than a row split or
  dropped) or next-fit in order ("greedy", long documents truncated: the reference).
* The state is grain's iterator state (window, row within it, per worker): resume is exact for the same
  worker count; a different count is refused.
"""

from __future__ import annotations

import numpy as np

from nemo_jax.data.chat import Document, first_fit_decreasing, pack, split_long

PACKINGS = ("ffd", "greedy")
LONG_DOCUMENTS = ("split", "drop")
BLOCK = 1024  # mixture draws per multinomial block
STATS = ("source_tokens", "documents_split", "documents_dropped", "documents_truncated")


def _bounds(docs) -> np.ndarray:
    if hasattr(docs, "bounds"):
        return np.asarray(docs.bounds, np.int64)
    src = np.fromiter((d.source for d in docs), np.int64, len(docs))
    if len(src) and ((np.diff(src) < 0).any() or src[0] != 0):
        raise ValueError("documents of a mixture must be grouped by source, in source order")
    return np.searchsorted(src, np.arange(1 + int(src.max(initial=0)) + 1), side="left").astype(np.int64)


def _lengths(docs) -> tuple[int, int]:
    if hasattr(docs, "min_length"):
        return docs.min_length, docs.max_length
    n = [len(d.ids) for d in docs]
    return min(n, default=0), max(n, default=0)


def _read(docs, idx) -> list[Document]:
    return docs.read(idx) if hasattr(docs, "read") else [docs[int(i)] for i in idx]


class DocumentOrder:
    """Global document index of each position of share `share` of `shares` in an epoch (see the module doc)."""

    def __init__(self, n: int, seed: int, *, shuffle: bool = True, weights=None, bounds=None, share: int = 0,
                 shares: int = 1):
        self.n, self.seed, self.shuffle, self.share, self.shares = n, seed, shuffle, share, shares
        self.weights = None if weights is None else np.asarray(weights, np.float64)
        self.bounds = bounds
        if self.weights is not None:
            sizes = np.diff(bounds)
            if len(self.weights) != len(sizes) or not (self.weights > 0).all():
                raise ValueError(f"data.sources: {len(sizes)} sources need as many positive weights, got {weights}")
            if (sizes == 0).any():
                raise ValueError(f"data.sources[{int(np.flatnonzero(sizes == 0)[0])}] holds no documents")
        self.length = max(0, -(-(n - share) // shares))  # positions of this share per epoch
        self._cum_epoch, self._cum = None, None

    def _perm(self, i: np.ndarray, size: int, seed: int) -> np.ndarray:
        from grain.experimental import index_shuffle

        if not self.shuffle or size == 1:
            return i
        seed %= 2 ** 31
        return np.fromiter((index_shuffle(int(x), max_index=size - 1, seed=seed, rounds=4) for x in i), np.int64,
                           len(i))

    def _block(self, epoch: int, b: int) -> np.ndarray:
        """Source labels of the draws of block b."""
        rng = np.random.default_rng([self.seed, epoch, b])
        size = min(BLOCK, self.n - b * BLOCK)
        counts = rng.multinomial(size, self.weights / self.weights.sum())
        return rng.permutation(np.repeat(np.arange(len(counts)), counts))

    def _cumulative(self, epoch: int) -> np.ndarray:
        """[blocks + 1, sources]: draws of each source before each block (cached per epoch)."""
        if self._cum_epoch != epoch:
            blocks = -(-self.n // BLOCK)
            per = np.stack([np.bincount(self._block(epoch, b), minlength=len(self.weights)) for b in range(blocks)])
            self._cum = np.concatenate([np.zeros((1, len(self.weights)), np.int64), np.cumsum(per, 0)])
            self._cum_epoch = epoch
        return self._cum

    def indices(self, epoch: int, start: int, stop: int) -> np.ndarray:
        g = self.share + self.shares * np.arange(start, min(stop, self.length), dtype=np.int64)
        if self.weights is None:
            return self._perm(g, self.n, self.seed + 1_000_003 * epoch)
        cum = self._cumulative(epoch)
        out = np.empty(len(g), np.int64)
        for b in np.unique(g // BLOCK):
            labels = self._block(epoch, int(b))
            rank = np.zeros(len(labels), np.int64)  # draws of the same source earlier in the block
            for s in np.unique(labels):
                rank[labels == s] = np.arange(np.count_nonzero(labels == s))
            for j in np.flatnonzero(g // BLOCK == b):
                r = int(g[j] - b * BLOCK)
                s = int(labels[r])
                k = int(cum[b, s] + rank[r])  # this is the k-th draw of source s in the epoch
                size = int(self.bounds[s + 1] - self.bounds[s])
                seed = self.seed * 1_000_003 + epoch * 7_919 + s * 104_729 + k // size
                out[j] = self.bounds[s] + self._perm(np.asarray([k % size]), size, seed)[0]
        return out


class _Identity:
    """FlatMap of a window's row list into rows."""

    def __init__(self, max_fan_out: int):
        self.max_fan_out = max_fan_out

    def flat_map(self, rows):
        return rows


class _Window:
    """Window index -> its packed rows (each with the statistics of what it holds). Picklable for workers."""

    def __init__(self, docs, order: DocumentOrder, seq_len: int, window: int, packing: str, long_documents: str,
                 n_sources: int, images=None):
        self.docs, self.order, self.seq_len, self.window = docs, order, seq_len, window
        self.packing, self.long_documents, self.n_sources = packing, long_documents, n_sources
        self.images = images  # data.images.RowImages, or None: a text-only model
        self.per_epoch = max(1, -(-order.length // window))

    def __call__(self, i: int) -> list[dict]:
        epoch, w = divmod(int(i), self.per_epoch)
        docs = _read(self.docs, self.order.indices(epoch, w * self.window, (w + 1) * self.window))
        cap = self.seq_len + 1
        split = dropped = truncated = 0
        if self.images is not None:  # image documents are widened, never cut, and fit the row's image budget
            docs = [self.images.expand(d) for d in docs]
            keep = [not d.image_hw or (len(d.ids) <= cap and self.images.fits(d)) for d in docs]
            dropped += keep.count(False)
            docs = [d for d, k in zip(docs, keep) if k]
        sizes = lambda d: (len(d.ids),) + (self.images.size(d) if self.images is not None else ())
        caps = (cap,) + ((self.images.max_patches, self.images.max_images) if self.images is not None else ())
        if self.packing == "greedy":
            bins, pieces, used = [], docs, caps
            for j, d in enumerate(docs):
                if not bins or any(u + x > c for u, x, c in zip(used, sizes(d), caps)):
                    bins.append([])
                    used = (0,) * len(caps)
                bins[-1].append(j)
                used = tuple(u + x for u, x in zip(used, sizes(d)))
                truncated += len(d.ids) > cap
        else:
            pieces = []
            for d in docs:
                if len(d.ids) > cap:
                    if self.long_documents == "drop":
                        dropped += 1
                        continue
                    split += 1
                pieces += split_long(d, self.seq_len)
            bins = first_fit_decreasing([sizes(p) for p in pieces], caps)
        rows = []
        for b in bins:
            docs_b = [pieces[j] for j in b]
            if self.images is not None:  # each row's images are read here, in the process that packs it
                loaded = {k: self.images.load(d) for k, d in enumerate(docs_b) if d.image_hw}
                failed = {k for k, x in loaded.items() if x is None}
                dropped += len(failed)
                docs_b = [d for k, d in enumerate(docs_b) if k not in failed]
                if not docs_b:
                    continue
            row = pack(docs_b, self.seq_len)
            if self.images is not None:
                row.update(self.images.row([x for x in loaded.values() if x is not None]))
            row["source_tokens"] = np.bincount([d.source for d in docs_b], [min(len(d.ids), cap) for d in docs_b],
                                               minlength=self.n_sources).astype(np.int64)
            rows.append(row)
        if rows:
            rows[0].update(documents_split=np.int64(split), documents_dropped=np.int64(dropped),
                           documents_truncated=np.int64(truncated))
            for r in rows[1:]:
                r.update(documents_split=np.int64(0), documents_dropped=np.int64(0), documents_truncated=np.int64(0))
        return rows

    def empty_row(self) -> dict[str, np.ndarray]:
        row = pack([], self.seq_len)
        if self.images is not None:
            row.update(self.images.row([]))
        return row


class PackedIterator:
    """Deterministic, resumable iterator of packed batches [rows, seq_len] of share `process_index` of
    `process_count` (see the module docstring). Counters since construction: `split`, `dropped`, `truncated`
    (documents) and `source_tokens` (tokens of each mixture source)."""

    def __init__(self, docs, seq_len: int, rows: int, seed: int, *, process_index: int = 0, process_count: int = 1,
                 shuffle: bool = True, repeat: bool = True, packing: str = "ffd", long_documents: str = "split",
                 window: int = 1024, weights: list[float] | None = None, workers: int = 0, prefetch: int = 2,
                 images=None):
        import grain
        from grain import experimental as gx

        from nemo_jax.data.prepared import absl_flags_parsed

        if packing not in PACKINGS:
            raise ValueError(f"data.packing: {packing!r} not in {PACKINGS}")
        if long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"data.long_documents: {long_documents!r} not in {LONG_DOCUMENTS}")
        if window < 1:
            raise ValueError(f"data.pack_window must be >= 1, got {window}")
        if workers < 0:
            raise ValueError(f"data.workers must be >= 0, got {workers}")
        shortest, longest = _lengths(docs)
        if packing == "ffd" and long_documents == "drop" and shortest > seq_len + 1:
            raise ValueError(f"data: every document is longer than a row ({seq_len + 1} tokens) and "
                             "data.long_documents is drop")
        bounds = _bounds(docs)
        self.rows, self.seq_len, self.workers = rows, seq_len, workers
        order = DocumentOrder(len(docs), seed, shuffle=shuffle, weights=weights, bounds=bounds,
                              share=process_index, shares=process_count)
        win = self._window = _Window(docs, order, seq_len, window, packing, long_documents, len(bounds) - 1, images)
        total = win.per_epoch if not repeat else 2 ** 62  # windows (lazy: nothing per window is materialised)
        if not order.length:
            total = 0
        # one thread packs the next windows ahead (grain's default would start hundreds of windows at once)
        ds = grain.MapDataset.range(total).map(win).to_iter_dataset(grain.ReadOptions(num_threads=1,
                                                                                       prefetch_buffer_size=prefetch))
        fan_out = window * max(1, -(-longest // seq_len)) + 1
        ds = gx.FlatMapIterDataset(ds, _Identity(fan_out)).batch(rows)
        if workers:
            absl_flags_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=prefetch))
        self._ds, self._it = ds, None
        self.split = self.dropped = self.truncated = 0
        self.source_tokens = np.zeros(len(bounds) - 1, np.int64)

    @property
    def _iter(self):
        if self._it is None:
            self._it = iter(self._ds)
        return self._it

    def get_state(self) -> dict:
        return {"grain": self._iter.get_state(), "workers": self.workers}

    def set_state(self, state: dict):
        if "grain" not in state:
            raise ValueError(f"data position {state} is from an older nemo_jax data loader and cannot be resumed "
                             "(the order of documents changed); start the run afresh")
        if state.get("workers", 0) != self.workers:
            raise ValueError(f"the data position was saved with data.workers={state.get('workers', 0)}; resuming "
                             f"needs the same (this run has {self.workers})")
        self._iter.set_state(state["grain"])

    def close(self):
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        self._it = None

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        b = next(self._iter)
        self.source_tokens += b["source_tokens"].sum(0)
        self.split += int(b["documents_split"].sum())
        self.dropped += int(b["documents_dropped"].sum())
        self.truncated += int(b["documents_truncated"].sum())
        out = {k: v for k, v in b.items() if k not in STATS}
        short = self.rows - len(out["tokens"])
        if short:  # the final partial batch (no repeat): empty rows
            empty = self._window.empty_row()
            out = {k: np.concatenate([v, np.repeat(empty[k][None], short, 0)]) for k, v in out.items()}
        return out


class ShardedBatches:
    """Rows [lo, hi) of a global batch of `batch` rows made of `shards` data shards (shard k: rows
    k * batch / shards ...., packed from share k of the documents). A process reads only the shards its rows
    fall in, so the global batch depends on `shards`, not on how many processes read it."""

    def __init__(self, docs, seq_len: int, batch: int, shards: int, lo: int, hi: int, seed: int, **kw):
        if shards < 1 or batch % shards:
            raise ValueError(f"data.shards: {shards} does not divide data.batch_size {batch}")
        self.per, self.lo, self.hi = batch // shards, lo, hi
        self.first = lo // self.per
        self.mine = range(self.first, -(-hi // self.per))
        self.its = {k: PackedIterator(docs, seq_len, self.per, seed, process_index=k, process_count=shards, **kw)
                    for k in self.mine}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        got = [next(self.its[k]) for k in self.mine]
        a, b = self.lo - self.first * self.per, self.hi - self.first * self.per
        return {key: np.concatenate([g[key] for g in got])[a:b] for key in got[0]}

    def counts(self, shards) -> list[int]:
        """split, dropped, truncated, *source tokens summed over the given shards of this process."""
        its = [self.its[k] for k in shards]
        n_sources = len(next(iter(self.its.values())).source_tokens)
        per_source = np.sum([it.source_tokens for it in its] or [np.zeros(n_sources, np.int64)], axis=0)
        return [sum(it.split for it in its), sum(it.dropped for it in its), sum(it.truncated for it in its),
                *per_source.tolist()]

    def get_state(self) -> dict:
        return {str(k): it.get_state() for k, it in self.its.items()}

    def set_state(self, states: dict):
        for k, it in self.its.items():
            it.set_state(states[str(k)])

    def close(self):
        for it in self.its.values():
            it.close()
