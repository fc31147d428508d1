"""The Tinker API's wire formats, as the official SDK (tinker 0.38) speaks them: pure functions, no HTTP, no JAX.

`forward_backward` requests and the `ForwardBackwardOutput` / `SampleResponse` results travel as protobuf, in the
SDK's own schema (`tinker.proto.tinker_public_pb2`, Apache-2.0, from the pinned `tinker` package: one schema, never
a copy); everything else is JSON. Decoding checks every shape, dtype and byte count and raises `UserError` naming
the datum and the field, so that a malformed request fails alone.

    decode_forward_backward(body)           protobuf ForwardBackwardRequest -> FwdBwdRequest (numpy)
    model_input(obj)                        a JSON ModelInput (asample's prompt) -> chunks
    encode_forward_backward_output(...)     per-datum arrays + `name:reduction` metrics -> protobuf bytes
    encode_sample_response(...)             sampled sequences (+ prompt logprobs) -> protobuf bytes
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field

import numpy as np

from nemo_jax.extras import require

SDK_VERSION = "0.38.0"  # the SDK this server speaks (constraints.txt pins it; `pip install 'nemo_jax[tinker]'`)
PROTO = "application/x-protobuf"


class UserError(ValueError):
    """A request's own fault: it fails alone (category "user"; HTTP 400 where it is answered at once)."""


def pb():
    """The SDK's protobuf module."""
    return require("tinker.proto.tinker_public_pb2", "tinker", "the Tinker API (nemo-jax serve --tinker-root)")


def same_minor(version: str | None) -> bool:
    """Is `version` an SDK this server speaks (0.38.x)?"""
    return bool(version) and version.split(".")[:2] == SDK_VERSION.split(".")[:2]


def version_hint(version: str | None) -> str:
    """A sentence for errors of clients of another SDK version ('' for ours)."""
    if same_minor(version):
        return ""
    return (f" (this server speaks the Tinker API of SDK {SDK_VERSION}; your client is tinker "
            f"{version or 'of an unknown version'}: pip install tinker=={SDK_VERSION})")


# ----------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class Image:
    """An image chunk: encoded bytes, their format (png | jpeg) and the token count the client expects (or None)."""
    data: bytes
    format: str
    expected_tokens: int | None = None


@dataclass
class Datum:
    """One datum: its model input as chunks (token arrays and `Image`s, in order) and its loss inputs (1-D numpy
    arrays, int64 `target_tokens`, float32 others; each as long as the model input)."""
    chunks: list
    inputs: dict = field(default_factory=dict)


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict  # loss_fn_config: name -> float | str
    forward_only: bool
    data: list  # [Datum]


_NP = {1: np.float32, 2: np.int64, 3: np.int32}  # DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32
MAX_ELEMENTS = 1 << 26  # one tensor's element count (a bound on what a shape may claim before any allocation)


def _buffer(raw: bytes, dtype, what: str) -> np.ndarray:
    item = np.dtype(dtype).itemsize
    if len(raw) % item:
        raise UserError(f"{what}: {len(raw)} bytes is not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(raw, dtype)


def tensor(msg, what: str) -> np.ndarray:
    """A protobuf `Tensor` (dense, or sparse CSR) -> numpy array of its shape (int64 or float32)."""
    dt = _NP.get(msg.dtype)
    if dt is None:
        raise UserError(f"{what}: unsupported dtype {msg.dtype} (float32 or int64)")
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape) or math.prod(shape) > MAX_ELEMENTS:
        raise UserError(f"{what}: shape {list(shape)} is not a tensor this server takes")
    if msg.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise UserError(f"{what}: a sparse CSR tensor must be 2-D, got shape {list(shape)}")
        csr = msg.sparse_csr
        values = _buffer(csr.values, dt, what)
        crow = _buffer(csr.crow_indices, np.int64, what + " (crow_indices)")
        col = _buffer(csr.col_indices, np.int64, what + " (col_indices)")
        rows, cols = shape
        if (len(crow) != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != len(values)
                or len(col) != len(values) or (len(col) and (col.min() < 0 or col.max() >= cols))):
            raise UserError(f"{what}: inconsistent sparse CSR indices for shape {list(shape)}")
        out = np.zeros(shape, dt)
        out[np.repeat(np.arange(rows), np.diff(crow)), col] = values
        return out.astype(np.int64 if dt != np.float32 else np.float32)
    flat = _buffer(msg.dense, dt, what)
    if not shape:
        shape = (len(flat),)
    if len(flat) != math.prod(shape):
        raise UserError(f"{what}: {len(flat)} values for shape {list(shape)}")
    return flat.reshape(shape).astype(np.int64 if dt != np.float32 else np.float32)


def _chunk(c, what: str):
    kind = c.WhichOneof("chunk")
    if kind == "encoded_text":
        return _buffer(c.encoded_text.tokens, np.int32, what).astype(np.int64)
    if kind == "image":
        im = c.image
        return Image(bytes(im.data), im.format, im.expected_tokens if im.HasField("expected_tokens") else None)
    if kind == "dmel":
        raise UserError(f"{what}: audio (dmel) chunks are not supported by nemo-jax serve: send text "
                        "(encoded_text) and image chunks")
    raise UserError(f"{what}: an empty chunk")


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    """A protobuf ForwardBackwardRequest -> FwdBwdRequest. Provenance spans (StableReinforce) are ignored."""
    from google.protobuf.message import DecodeError

    msg = pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise UserError(f"the forward_backward body is not a protobuf ForwardBackwardRequest ({e})") from None
    config: dict = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # (v2 wins where both are set, as the SDK's dual write expects)
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        chunks = [_chunk(c, f"datum {i}: model_input chunk {j}") for j, c in enumerate(d.model_input)]
        inputs = {k: tensor(t, f"datum {i}: loss_fn_inputs[{k!r}]") for k, t in d.loss_fn_inputs.items()}
        data.append(Datum(chunks, inputs))
    return FwdBwdRequest(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data)


def model_input(obj, what: str = "prompt") -> list:
    """A JSON ModelInput {chunks: [{type, ...}]} -> chunks (token arrays and `Image`s)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("chunks"), list):
        raise UserError(f"{what}: expected a ModelInput {{'chunks': [...]}}")
    out = []
    for j, c in enumerate(obj["chunks"]):
        w = f"{what} chunk {j}"
        kind = c.get("type") if isinstance(c, dict) else None
        if kind == "encoded_text":
            toks = c.get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
                raise UserError(f"{w}: 'tokens' must be a list of integers")
            out.append(np.asarray(toks, np.int64))
        elif kind == "image":
            try:
                data = base64.b64decode(c.get("data") or "", validate=True)
            except (binascii.Error, TypeError, ValueError):
                raise UserError(f"{w}: 'data' is not base64") from None
            exp = c.get("expected_tokens")
            if exp is not None and (not isinstance(exp, int) or isinstance(exp, bool) or exp < 0):
                raise UserError(f"{w}: 'expected_tokens' must be a non-negative integer")
            out.append(Image(data, str(c.get("format")), exp))
        elif kind == "image_asset_pointer":
            raise UserError(f"{w}: image asset pointers are not supported by nemo-jax serve: send the image bytes "
                            "(an ImageChunk)")
        elif kind == "dmel":
            raise UserError(f"{w}: audio (dmel) chunks are not supported by nemo-jax serve: send text "
                            "(encoded_text) and image chunks")
        else:
            raise UserError(f"{w}: unknown chunk type {kind!r}")
    return out


# ----------------------------------------------------------------------------- results
def _batched(arrays: list[np.ndarray], dtype, pbm):
    """Per-datum 1-D arrays -> a BatchedTensor (concatenated bytes, N + 1 int64 byte offsets)."""
    bt = pbm.BatchedTensor()
    parts = [np.ascontiguousarray(a, dtype) for a in arrays]
    bt.data = b"".join(p.tobytes() for p in parts)
    bt.offsets = np.concatenate([[0], np.cumsum([p.nbytes for p in parts])]).astype(np.int64).tobytes()
    bt.dtype = pbm.DTYPE_FLOAT32 if np.dtype(dtype) == np.float32 else pbm.DTYPE_INT64
    return bt


def encode_forward_backward_output(outputs: list[dict], metrics: dict) -> bytes:
    """outputs: per datum {field: 1-D float32 array} (the same fields for every datum); metrics: {"name:reduction":
    float} -> a protobuf ForwardBackwardOutput holding one ArrayRecord."""
    for k in metrics:
        if k.count(":") != 1:
            raise ValueError(f"metric {k!r}: the SDK needs exactly one ':' (name:reduction)")
    pbm = pb()
    out = pbm.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    rec = out.loss_fn_outputs.add()
    rec.type_tag = "ArrayRecord"
    rec.num_datums = len(outputs)
    for name in (outputs[0] if outputs else {}):
        rec.fields[name].CopyFrom(_batched([o[name] for o in outputs], np.float32, pbm))
    return out.SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop: bool  # ended at a stop token / string (else: max_tokens)
    top: list | None = None  # per token [(id, logprob), ...] (topk_sample_logprobs)


def _topk(rows: list, k: int, pbm):
    t = pbm.TopkLogprobs(k=k, length=len(rows))
    ids = np.zeros((len(rows), k), np.int32)
    lps = np.full((len(rows), k), -np.inf, np.float32)
    for i, row in enumerate(rows):
        for j, (tid, lp) in enumerate(row[:k]):
            ids[i, j], lps[i, j] = tid, lp
    t.token_ids, t.logprobs = ids.tobytes(), lps.tobytes()
    return t


def encode_sample_response(sequences: list[Sequence], prompt_logprobs: np.ndarray | None = None,
                           topk: int = 0) -> bytes:
    """Sampled sequences (tokens include the stop token) and optional prompt logprobs (NaN where none) -> a protobuf
    SampleResponse."""
    pbm = pb()
    out = pbm.SampleResponse()
    for s in sequences:
        q = out.sequences.add()
        q.stop_reason = pbm.STOP_REASON_STOP if s.stop else pbm.STOP_REASON_LENGTH
        q.tokens = np.asarray(s.tokens, np.int32).tobytes()
        q.logprobs = np.asarray(s.logprobs, np.float32).tobytes()
        if topk and s.top is not None:
            q.topk_sampled_logprobs.CopyFrom(_topk(s.top, topk, pbm))
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return out.SerializeToString()
