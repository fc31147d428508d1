import json
import os

import numpy as np
import pytest

from nemo_jax.config.load import load_config
from nemo_jax.config.train import SFTConfig
from nemo_jax.data.chat import ASSETS, ChatTokenizer, DataError, Document, pack, read_chat_jsonl, split_long
from nemo_jax.data.loader import DocumentOrder, PackedIterator
from nemo_jax.data.prepared import PreparedDocuments, open_sources, prepare

CONV = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 2?"},
                     {"role": "assistant", "content": "2 plus 2 is 4."}, {"role": "user", "content": "And 3?"},
                     {"role": "assistant", "content": "3 plus 2 is 5."}]}


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.load("builtin:tiny")


def test_loss_mask_covers_exactly_the_assistant_turns(tok):
    ids, mask = tok.encode_chat(CONV["messages"])
    trained = tok.tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False)
    assert trained == "2 plus 2 is 4.<|im_end|>\n3 plus 2 is 5.<|im_end|>\n"
    untrained = tok.tokenizer.decode(ids[~mask].tolist(), skip_special_tokens=False)
    assert "What is 2 plus 2?" in untrained and "plus 2 is 4" not in untrained


def _write(tmp_path, lines):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def test_malformed_lines_error_or_skip(tok, tmp_path):
    good = json.dumps(CONV)
    path = _write(tmp_path, [good, "{not json", good, json.dumps({"messages": [{"role": "user"}]})])
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        read_chat_jsonl(path, tok, 512)
    docs, skipped = read_chat_jsonl(path, tok, 512, on_error="skip")
    assert len(docs) == 2 and skipped == 2


def test_token_ids_outside_vocabulary_are_an_error(tok, tmp_path):
    path = _write(tmp_path, [json.dumps(CONV)])
    with pytest.raises(DataError, match=r"d.jsonl:1: token id \d+ outside the model vocabulary \(100\)"):
        read_chat_jsonl(path, tok, 100)


def test_packing_masks_segment_boundaries(tok):
    docs, _ = read_chat_jsonl("builtin:tiny_chat/eval.jsonl", tok, 512)
    row = pack(docs[:3], 200)
    seg, m = row["segment_ids"], row["loss_mask"]
    assert set(np.unique(seg)) <= {0, 1, 2, 3}
    boundary = np.nonzero(seg[1:] != seg[:-1])[0]  # position t predicts a token of the next document
    assert not m[boundary].any()
    assert not m[seg == 0].any()


def test_iterator_is_deterministic_resumable_and_sharded(tok):
    docs, _ = read_chat_jsonl("builtin:tiny_chat/eval.jsonl", tok, 512)
    a = PackedIterator(docs, 128, 4, seed=3)
    batches = [next(a) for _ in range(30)]  # crosses an epoch
    assert sum(int(b["loss_mask"].sum()) for b in batches) > sum(int(d.mask[1:].sum()) for d in docs)
    b = PackedIterator(docs, 128, 4, seed=3)
    for _ in range(7):
        next(b)
    c = PackedIterator(docs, 128, 4, seed=3)
    c.set_state(b.get_state())
    for want in batches[7:]:
        np.testing.assert_array_equal(next(c)["tokens"], want["tokens"])
    for e in (0, 1):
        p0, p1 = (DocumentOrder(len(docs), 3, share=k, shares=2).indices(e, 0, len(docs)) for k in (0, 1))
        assert sorted(np.concatenate([p0, p1]).tolist()) == list(range(len(docs)))
    assert not (DocumentOrder(len(docs), 3).indices(0, 0, 99) == DocumentOrder(len(docs), 3).indices(1, 0, 99)).all()


def _long_tailed_docs(n=300, seed=0):
    """Documents with long-tailed lengths (lognormal, some longer than a 64-token row), every token trained."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(2 + rng.lognormal(3.0, 0.9, n).astype(int), 400)
    return [Document(rng.integers(1, 500, L).astype(np.int32), np.ones(L, bool)) for L in lengths]


def _trained(batches):
    """The multiset of trained targets (loss mask on) of some batches."""
    return sorted(t for b in batches for t in b["targets"][b["loss_mask"]].tolist())


def test_split_long_predicts_every_target_once_and_ffd_packs_tighter():
    doc = Document(np.arange(1, 131, dtype=np.int32), np.arange(130) % 3 > 0)
    pieces = split_long(doc, 64)
    assert [len(p.ids) for p in pieces] == [65, 65, 2]
    np.testing.assert_array_equal(np.concatenate([p.ids[1:] for p in pieces]), doc.ids[1:])
    np.testing.assert_array_equal(np.concatenate([p.mask[1:] for p in pieces]), doc.mask[1:])
    docs = _long_tailed_docs()

    def epoch(**kw):
        return list(PackedIterator(docs, 64, 8, seed=1, repeat=False, **kw))

    ffd, greedy = epoch(window=128), epoch(packing="greedy")
    # every target of every document exactly once (long documents split, not truncated as greedy does)
    want = sorted(t for d in docs for t in d.ids[1:].tolist())
    assert _trained(ffd) == want and len(_trained(greedy)) < len(want)
    eff = lambda bs: np.mean([(b["segment_ids"] > 0).mean() for b in bs[:-1]])  # noqa: E731
    assert eff(ffd) > eff(greedy) + 0.05 and eff(ffd) > 0.9, (eff(ffd), eff(greedy))
    assert len(ffd) < len(greedy)
    dropped = PackedIterator(docs, 64, 8, seed=1, repeat=False, long_documents="drop")
    list(dropped)
    assert dropped.dropped == sum(len(d.ids) > 65 for d in docs) > 0 and dropped.split == 0
    with pytest.raises(ValueError, match="data.packing"):
        PackedIterator(docs, 64, 8, seed=1, packing="best")
    too_long = [d for d in docs if len(d.ids) > 65]
    with pytest.raises(ValueError, match="every document is longer than a row"):  # not an endless loop
        next(PackedIterator(too_long, 64, 8, seed=1, long_documents="drop", window=4))


def test_ffd_resumes_mid_window_and_refuses_old_states():
    docs = _long_tailed_docs(120, seed=2)
    a = PackedIterator(docs, 64, 4, seed=5, window=32)
    batches = [next(a) for _ in range(40)]  # several windows and epochs (~24 rows per epoch)
    for k in (1, 3, 11, 25):
        b = PackedIterator(docs, 64, 4, seed=5, window=32)
        for _ in range(k):
            next(b)
        c = PackedIterator(docs, 64, 4, seed=5, window=32)
        c.set_state(b.get_state())
        for want in batches[k:k + 5]:
            np.testing.assert_array_equal(next(c)["tokens"], want["tokens"])
    with pytest.raises(ValueError, match="older nemo_jax data loader"):
        PackedIterator(docs, 64, 4, seed=5).set_state({"epoch": 0, "pos": 0})
    with pytest.raises(ValueError, match="data.workers=2"):
        PackedIterator(docs, 64, 4, seed=5).set_state({"grain": {}, "workers": 2})


def test_mixture_follows_the_weights_and_is_deterministic():
    rng = np.random.default_rng(3)
    sizes, weights = (50, 400, 120), (1.0, 2.0, 5.0)  # the smallest source must repeat, the largest not run out
    lengths = [(s, int(rng.integers(5, 40))) for s, n in enumerate(sizes) for _ in range(n)]
    docs = [Document(rng.integers(1, 99, L).astype(np.int32), np.ones(L, bool), s) for s, L in lengths]

    bounds = np.cumsum([0, *sizes])

    def epochs(seed, n=4):
        order = DocumentOrder(len(docs), seed, weights=list(weights), bounds=bounds)
        return [order.indices(e, 0, len(docs)) for e in range(n)]

    a, b, c = epochs(7), epochs(7), epochs(8)
    assert all((x == y).all() for x, y in zip(a, b)) and not all((x == y).all() for x, y in zip(a, c))
    draws = np.concatenate(a)
    counts = np.bincount(np.array([docs[i].source for i in draws]), minlength=3)
    expect = len(draws) * np.asarray(weights) / sum(weights)
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 13.8, (counts, expect)  # chi-square, 2 degrees of freedom, p = 0.001
    first = a[0][np.array([docs[i].source for i in a[0]]) == 0]
    assert set(first[:50]) == set(range(50))  # a source is drawn without repeats until it runs out
    it = PackedIterator(docs, 64, 4, seed=7, weights=list(weights))
    batches = [next(it) for _ in range(20)]
    assert it.source_tokens.sum() >= sum(int((b["segment_ids"] > 0).sum()) for b in batches)
    with pytest.raises(ValueError, match="data.sources"):
        PackedIterator(docs, 64, 4, seed=7, weights=[1.0, 2.0])


def test_sources_are_prepared_tagged_and_checked(tmp_path):
    data = load_config(SFTConfig, None, ["data.sources=[{path: 'builtin:tiny_chat/eval.jsonl', weight: 2}, "
                                         "{path: 'builtin:tiny_chat/eval.jsonl'}]"]).data
    docs, weights, names, rejected = open_sources(data, 512, str(tmp_path))
    assert weights == [2.0, 1.0] and names == ["eval", "eval_1"] and rejected == 0
    n = len(docs) // 2
    assert [docs[i].source for i in (0, n - 1, n, 2 * n - 1)] == [0, 0, 1, 1]
    assert sorted(os.listdir(tmp_path)) == ["eval", "eval_1"]
    again, *_ = open_sources(data, 512, str(tmp_path))  # a prepared directory is a source too
    np.testing.assert_array_equal(again[n + 3].ids, docs[n + 3].ids)
    for bad, msg in (("[{path: 'builtin:tiny_chat/eval.jsonl', weight: 0}]", r"data.sources\[0\].weight"),
                     ("[{file: x.jsonl}]", r"data.sources\[0\]: expected")):
        with pytest.raises(ValueError, match=msg):
            open_sources(load_config(SFTConfig, None, [f"data.sources={bad}"]).data, 512, str(tmp_path))
    with pytest.raises(DataError, match=r"eval: token id \d+ outside the model vocabulary \(100\)"):
        open_sources(data, 100, str(tmp_path))


def test_config_loader_errors_name_the_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("steps: 5\noptim:\n  lr: 0.1\n  lrr: 2\n")
    with pytest.raises(ValueError, match="unknown config key 'optim.lrr'"):
        load_config(SFTConfig, str(p))
    with pytest.raises(ValueError, match="'steps': expected int"):
        load_config(SFTConfig, None, ["steps=abc"])
    c = load_config(SFTConfig, None, ["optim.lr=1e-4", "mesh.fsdp=2", "data.eval=null"])
    assert c.optim.lr == 1e-4 and c.mesh.fsdp == 2 and c.data.eval is None


# --------------------------------------------------------------------------- prepared data
@pytest.fixture(scope="module")
def prepared(tok, tmp_path_factory):
    """The tiny train set (4000 conversations) prepared in ~20 shards by 2 worker processes."""
    out = str(tmp_path_factory.mktemp("prepared") / "train")
    manifest = prepare(["builtin:tiny_chat/train.jsonl"], "builtin:tiny", out, workers=2, chunk_bytes=40_000)
    return out, manifest


def test_prepare_round_trip_equals_direct_tokenisation(tok, prepared):
    out, m = prepared
    direct, _ = read_chat_jsonl("builtin:tiny_chat/train.jsonl", tok, 512)
    docs = PreparedDocuments([out])
    assert len(docs) == len(direct) == m["documents"] and len(m["shards"]) > 10
    assert m["tokens"] == sum(len(d.ids) for d in direct)
    assert m["assistant_tokens"] == sum(int(d.mask.sum()) for d in direct)
    assert sum(m["length_histogram"]["counts"]) == len(direct) and m["rejected_count"] == 0
    assert (m["min_length"], m["max_length"]) == (min(len(d.ids) for d in direct), max(len(d.ids) for d in direct))
    got = docs.read(range(len(docs)))
    for a, b in zip(got, direct):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.mask, b.mask)
    # re-running skips every finished shard (none is rewritten), and redoes one that was lost
    stamp = {f: os.stat(os.path.join(out, "shards", f)).st_mtime_ns for f in os.listdir(os.path.join(out, "shards"))}
    lost = m["shards"][3]["file"]
    os.remove(os.path.join(out, "shards", lost[:-12] + "json"))
    stamp.pop(lost[:-12] + "json")
    assert prepare(["builtin:tiny_chat/train.jsonl"], "builtin:tiny", out, workers=1, chunk_bytes=40_000) == m
    now = {f: os.stat(os.path.join(out, "shards", f)).st_mtime_ns for f in stamp}
    assert [f for f in stamp if now[f] != stamp[f]] == [lost] and os.path.exists(os.path.join(out, "shards",
                                                                                              lost[:-12] + "json"))


def test_prepare_names_bad_lines_and_records_skipped_ones(tmp_path):
    good = json.dumps(CONV)
    lines = [good] * 300 + ["{not json"] + [good] * 50 + [json.dumps({"messages": [{"role": "user"}]}),
                                                         json.dumps({**CONV, "images": ["a.png", "b.png"]})]
    path = _write(tmp_path, lines)
    with pytest.raises(DataError, match=r"d.jsonl:301: not valid JSON"):  # the file's line, in a later shard
        prepare([path], "builtin:tiny", str(tmp_path / "p"), chunk_bytes=20_000)
    assert not os.path.exists(tmp_path / "p" / "manifest.json")
    m = prepare([path], "builtin:tiny", str(tmp_path / "p"), chunk_bytes=20_000, on_error="skip")
    assert m["documents"] == 351 and m["rejected_count"] == 2
    assert [r["reason"][:14] for r in m["rejected"]] == ["not valid JSON", "messages[0] ne"]
    assert PreparedDocuments([str(tmp_path / "p")])[350].images == ["a.png", "b.png"]
    with pytest.raises(FileNotFoundError, match="no such data file"):
        prepare([str(tmp_path / "missing.jsonl")], "builtin:tiny", str(tmp_path / "q"))


def test_loader_reads_shards_only_when_asked_and_each_process_its_share(prepared, tmp_path):
    out, m = prepared
    moved = tmp_path / "away"
    os.rename(os.path.join(out, "shards"), moved)  # start-up must not need the token data
    try:
        docs = PreparedDocuments([out])
        its = [PackedIterator(docs, 128, 4, seed=1, repeat=False, process_index=k, process_count=2) for k in (0, 1)]
        with pytest.raises(DataError, match=r"train: reading the prepared shards failed: .*train-\d+.array_record"):
            next(its[0])
        for it in its:
            it.close()
    finally:
        os.rename(moved, os.path.join(out, "shards"))
    class Spy(PreparedDocuments):
        def read(self, idx):
            self.seen += list(idx)
            return super().read(idx)

    seen, targets = [], []
    for k in (0, 1):
        spy = Spy([out])
        spy.seen = []
        targets += _trained(list(PackedIterator(spy, 128, 4, seed=1, repeat=False, process_index=k, process_count=2)))
        seen.append(spy.seen)
    assert set(seen[0]).isdisjoint(seen[1]) and sorted(seen[0] + seen[1]) == list(range(m["documents"]))
    docs = PreparedDocuments([out])
    want = sorted(t for d in docs.read(range(len(docs))) for t in d.ids[1:][d.mask[1:]].tolist())
    assert sorted(targets) == want  # together: every target of the epoch once


@pytest.mark.slow
def test_loader_workers_resume_exactly(prepared):
    docs = PreparedDocuments([prepared[0]])
    a = PackedIterator(docs, 128, 4, seed=2, window=64, workers=2)
    first = [next(a) for _ in range(6)]
    state = a.get_state()
    rest = [next(a) for _ in range(4)]
    a.close()
    b = PackedIterator(docs, 128, 4, seed=2, window=64, workers=2)
    b.set_state(state)
    for want in rest:
        np.testing.assert_array_equal(next(b)["tokens"], want["tokens"])
    b.close()
    single = PackedIterator(docs, 128, 4, seed=2, window=64)  # the same windows, interleaved differently
    rows = lambda bs: sorted(r.tobytes() for x in bs for r in x["tokens"])  # noqa: E731
    assert set(rows(first)) <= set(rows([next(single) for _ in range(20)]))


def test_prepare_reads_parquet_row_groups_like_jsonl(tok, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")  # the `parquet` extra
    import pyarrow as pa

    rows = [json.loads(line) for line in open(os.path.join(ASSETS, "tiny_chat", "eval.jsonl"))][:60]
    rows[7]["messages"] = [{"role": "user", "content": "no answer"}]  # rejected with its row named
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "chat.parquet"), row_group_size=25)
    with pytest.raises(DataError, match=r"chat.parquet:row group 0 row 8: no assistant tokens"):
        prepare([str(tmp_path / "chat.parquet")], "builtin:tiny", str(tmp_path / "p"))
    m = prepare([str(tmp_path / "chat.parquet")], "builtin:tiny", str(tmp_path / "p"), on_error="skip")
    assert len(m["shards"]) == 3 and m["documents"] == 59 and m["rejected"][0]["line"] == "row group 0 row 8"
    docs = PreparedDocuments([str(tmp_path / "p")])
    want = [tok.encode_chat(r["messages"]) for i, r in enumerate(rows) if i != 7]
    for d, (ids, mask) in zip(docs.read(range(59)), want):
        np.testing.assert_array_equal(d.ids, ids)
        np.testing.assert_array_equal(d.mask, mask)


def test_prepare_refuses_a_fifo_image_at_once_and_a_bom_line_is_read(tmp_path):
    """An image path naming a FIFO (a file that never ends) is one error naming it, at once (it used to hang
    `nemo-jax data prepare` forever), as is a decompression bomb; a JSONL file starting with a UTF-8 BOM is read."""
    import base64
    import struct
    import subprocess
    import sys
    import zlib

    os.mkfifo(tmp_path / "pipe.png")

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    bomb = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 1, 0, 0, 0, 0))
            + chunk(b"IEND", b""))
    for name, ref, why in (("fifo", str(tmp_path / "pipe.png"), "not a regular file"),
                           ("bomb", "data:image/png;base64," + base64.b64encode(bomb).decode(), "more pixels")):
        conv = {"messages": [{"role": "user", "content": [{"type": "image", "path": ref},
                                                          {"type": "text", "text": "What?"}]},
                             {"role": "assistant", "content": "A shape."}]}
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(conv) + "\n")
        out = subprocess.run([sys.executable, "-m", "nemo_jax.cli", "data", "prepare", str(tmp_path / f"{name}.jsonl"),
                              "--tokenizer", "builtin:tiny_vl", "--out", str(tmp_path / f"out-{name}"), "--workers",
                              "1"], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
        assert out.returncode == 2 and why in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + (json.dumps(CONV) + "\n").encode() * 3)
    m = prepare([str(tmp_path / "bom.jsonl")], "builtin:tiny", str(tmp_path / "p"))
    assert m["documents"] == 3 and m["rejected_count"] == 0
