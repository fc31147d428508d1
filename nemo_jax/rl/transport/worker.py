"""`nemo-jax rollout-worker`: samples the groups a GRPO run requests (`rollout.spool: true`) on any OpenAI-compatible
server (vLLM, SGLang, `nemo-jax serve`) and writes the rollouts to the run's spool.

    nemo-jax rollout-worker --run /shared/runs/expert-gui --server http://inference-0:8000 --concurrency 8

The loop (docs/serving.md has the layout and the server flags):

  1. The newest published adapter (RUN/policy/LATEST) is loaded into the server by name, `<run>-<hash>-v<version>`
     (vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"}; SGLang's /load_lora_adapter), when LATEST
     moves; an older one this worker loaded is unloaded once no request of its own samples with it.
  2. Requests are claimed (`board.claim_request`) while the worker holds fewer than `--concurrency` groups. A
     heartbeat thread renews every lease (each lease_s / 3) and looks for cancellations twice a second.
  3. Each group's episodes run through `EpisodeDriver`, the loop the in-process producer runs, on a
     `ServerSampler` in place of the Engine: every assistant turn is one request with the group's sampling
     parameters. The token record is the learner's: the opening and the environment's turns are rendered by the
     learner's chat template (`Conversation`), each sampled turn is spliced in as the server returned it (token
     ids and behaviour logprobs, never re-tokenised text), with the policy version of its adapter. By default
     (`--api auto`) a turn is a completion whose prompt IS those token ids (/v1/completions, token-in token-out:
     the server samples from exactly the context the learner scores); conversations with pictures (or
     `--api chat`) go through /v1/chat/completions with the messages, and the prompt ids the server reports are
     checked against the worker's (a different first prompt means a different chat template: an error).
  4. Rollouts are written to RUN/spool as they finish (`write_rollouts`); a failed episode is reported
     (`report_failure`) and replaced by a new one; a group with all its rollouts ends its lease (`complete`); a
     lease that is lost (expired and reposted, or the group cancelled) abandons its episodes at once.
  5. SIGTERM / SIGINT: every held request is given back asking for what it still needs (`release`) and every
     episode is closed.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import queue
import re
import signal
import socket
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass

from nemo_jax.data.chat import IMAGE_END, IMAGE_START, IMAGE_TOKEN
from nemo_jax.extras import require
from nemo_jax.fields import Fields
from nemo_jax.generate import SamplingParams, TurnEnd
from nemo_jax.generate.sampling import request_sampling as translate
from nemo_jax.rl.transport import board, policy, rollouts
from nemo_jax.rl.transport.producer import EpisodeDriver, stop_ids
from nemo_jax.rl.rollout import ImageStore


class WorkerError(ValueError):
    """A setup the worker cannot sample with (server flags, a different chat template or environment): one error
    line from the CLI."""


class TurnFailed(RuntimeError):
    """A turn the server could not sample: its episode is reported failed."""


def request_sampling(req: dict, stop_token_ids, vocab: int) -> SamplingParams:
    """A posted request's `sampling` {temperature, top_p, top_k, max_tokens, stop} -> its SamplingParams (the
    translation the servers use, `nemo_jax.generate.sampling.request_sampling`)."""
    f = Fields(req.get("sampling") or {}, lambda message, key: WorkerError(f"request {req.get('group_id')!r}: "
                                                                          f"{message}"), "sampling.")
    return translate(f, vocab=vocab, stop_ids=stop_token_ids, default_max=256)[0][0]


# ----------------------------------------------------------------------------- the inference server's client
class InferenceClient:
    """A client of an OpenAI-compatible inference server: the server's kind (`vllm`, `sglang`, `nemo-jax`, from /v1/models `owned_by`), base
    model name and context length, and LoRA adapters loaded and unloaded by name."""

    LORA_PATHS = {"sglang": "/{}_lora_adapter"}  # vLLM and nemo-jax serve: /v1/{}_lora_adapter
    QUIET_S = 10.0  # the longest a worker waits for a server without saying so
    CLIENT_RETRIES = 2  # the openai client's own retries of a turn (then the sampler's backoff takes over)

    def __init__(self, url: str, *, model: str | None = None, api_key: str | None = None, timeout_s: float = 900.0,
                 wait_s: float = 600.0, transport=None, async_transport=None):
        require("openai", "worker", "nemo-jax rollout-worker")
        import httpx

        root = url.rstrip("/")
        self.root = root[: -len("/v1")] if root.endswith("/v1") else root
        self.key = api_key or os.environ.get("NEMO_JAX_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"
        self.timeout_s, self.wait_s = timeout_s, wait_s
        self.async_transport = async_transport  # (tests: an httpx transport for the sampler's requests)
        self.http = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {self.key}"},
                                 transport=transport)
        cards = self._models(wait_s)
        ids = [c.get("id") for c in cards]
        if model is None:
            model = next((c["id"] for c in cards if not c.get("parent")), ids[0])
        elif model not in ids:
            raise WorkerError(f"--model {model!r}: the server at {self.root} serves {ids}")
        card = next(c for c in cards if c.get("id") == model)
        owner = str(card.get("owned_by", "")).lower()
        self.model = model
        self.kind = next((k for k in ("sglang", "vllm", "nemo-jax") if k in owner), "openai")
        self.max_len = card.get("max_model_len")

    def _call(self, method: str, path: str, wait_s: float | None = None, **kw):
        """An HTTP call that outlasts a server restart: refused connections, resets and 502 / 503 / 504 are retried
        with backoff (1 s, doubling to 10 s) for up to `wait_s` seconds (default: --wait-s), saying so at least every
        10 s -> the response (WorkerError once the time is up)."""
        import httpx

        wait_s = self.wait_s if wait_s is None else wait_s
        t0 = time.monotonic()
        said, delay, why = None, 1.0, ""
        while True:
            try:
                r = self.http.request(method, self.root + path, **kw)
                if r.status_code not in (502, 503, 504):
                    if said is not None:
                        print(f"rollout-worker: {self.root} answers again", flush=True)
                    return r
                why = f"HTTP {r.status_code}"
            except httpx.TransportError as e:  # (refused, reset, timed out: the server is down or restarting)
                why = f"{type(e).__name__}: {e}"
            now = time.monotonic()
            if now - t0 >= wait_s:
                raise WorkerError(f"{self.root}{path}: no answer within {wait_s:.0f} s ({why})")
            if said is None or now - said >= self.QUIET_S:
                print(f"rollout-worker: {self.root}{path}: {why}; retrying for up to {wait_s - (now - t0):.0f} s",
                      flush=True)
                said = now
            time.sleep(min(delay, self.QUIET_S, max(wait_s - (now - t0), 0.0)))
            delay = min(2 * delay, self.QUIET_S)

    def _models(self, wait_s: float) -> list[dict]:
        deadline = time.monotonic() + wait_s
        while True:
            r = self._call("GET", "/v1/models", wait_s=max(deadline - time.monotonic(), 0.0), timeout=10)
            if r.status_code in (401, 403):
                raise WorkerError(f"--server {self.root}: {r.status_code} from /v1/models (give --api-key, or set "
                                  "NEMO_JAX_API_KEY)")
            try:
                if r.status_code == 200 and r.json().get("data"):
                    return r.json()["data"]
            except (ValueError, AttributeError):
                pass
            if time.monotonic() > deadline:
                raise WorkerError(f"--server {self.root}: /v1/models did not answer within {wait_s:.0f} s "
                                  f"(HTTP {r.status_code})")
            time.sleep(1.0)

    def async_client(self):
        """An openai.AsyncOpenAI on the server (make it on the event loop that will use it)."""
        import openai

        kw = {}
        if self.async_transport is not None:
            import httpx

            kw["http_client"] = httpx.AsyncClient(transport=self.async_transport, timeout=self.timeout_s)
        return openai.AsyncOpenAI(base_url=self.root + "/v1", api_key=self.key, timeout=self.timeout_s,
                                  max_retries=self.CLIENT_RETRIES, **kw)

    def select(self, adapter: str | None) -> tuple[str, dict]:
        """-> (`model`, extra body fields) of a request sampled with `adapter` (None: the base model)."""
        if adapter is None:
            return self.model, {}
        if self.kind == "sglang":  # (SGLang picks an adapter by `lora_path`, the name it was loaded under)
            return self.model, {"lora_path": adapter}
        return adapter, {}

    def _lora(self, what: str, body: dict, wait_s: float | None = None):
        path = self.LORA_PATHS.get(self.kind, "/v1/{}_lora_adapter").format(what)
        r = self._call("POST", path, wait_s=wait_s, json=body)
        try:
            failed = r.status_code == 200 and r.json().get("success") is False  # (SGLang's way of saying no)
        except (ValueError, AttributeError):
            failed = False
        return (r.status_code if not failed else 400), r.text, path

    def load_adapter(self, name: str, path: str) -> bool:
        """Load the adapter dir `path` (as the server's machine sees it) as `name` -> True, or False when the server
        cannot read the dir (e.g. pruned meanwhile). Loaded already, or being loaded by another worker on this server
        (waited for): True."""
        deadline = time.monotonic() + self.wait_s
        while True:
            code, text, where = self._lora("load", {"lora_name": name, "lora_path": path})
            if code == 200 or "already" in text.lower():
                return True
            if "being loaded" not in text.lower() or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # another worker on this server is loading the same version: wait for its answer
        if code in (404, 405) and ("lora" not in text.lower() and "adapter" not in text.lower()
                                   or "runtime lora updating is off" in text.lower()):
            raise WorkerError(f"{self.root}{where}: {code}: the server does not load adapters at run time (vLLM: "
                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora; SGLang: --enable-lora; "
                              "nemo-jax serve: --enable-runtime-lora-updating --adapter-root RUN_DIRS)")
        if code in (400, 404, 500):
            return False
        raise WorkerError(f"{self.root}{where}: loading adapter {name} from {path} failed ({code}): {text[:300]}")

    def unload_adapter(self, name: str) -> bool:
        """One try, no waiting -> whether the server answered (unloaded, or unknown to it: e.g. unloaded by another
        worker, or lost in a restart). A server that is down is not waited for: the caller tries again later."""
        try:
            self._lora("unload", {"lora_name": name}, wait_s=0.0)
        except WorkerError:
            return False
        return True


Server = InferenceClient  # (its name before: it is the client of a server)


# ----------------------------------------------------------------------------- the sampler EpisodeDriver drives
@dataclass(eq=False)
class _Turn:
    """A conversation whose next turn the server samples (the request in flight, its retries)."""
    id: int
    tokens: list[int]  # the whole conversation so far: the prompt of its next turn
    sp: SamplingParams
    tag: object
    pictures: bool
    turns: int = 0
    future: object = None  # the request in flight
    adapter: tuple = (None, 0)  # (name, version) it was sent with
    retries: int = 0  # times its turn was sent again because the server was away (backoff)
    reloads: int = 0  # times its turn was sent again because the server did not know its adapter
    down: float | None = None  # when its turn first failed to reach the server (sent again until --wait-s)
    retry_at: float = 0.0


def _token_ids(strings: list) -> list[int] | None:
    """Logprob entries spelled `token_id:<id>` (vLLM's --return-tokens-as-token-ids) -> the ids, else None."""
    out = []
    for s in strings:
        m = re.fullmatch(r"token_id:(\d+)", s or "")
        if m is None:
            return None
        out.append(int(m.group(1)))
    return out


def parse_turn(kind: str, resp, sp: SamplingParams) -> tuple[list[int], list[float], str, list[int] | None]:
    """A chat or completion response -> (token ids and behaviour logprobs of the sampled turn as returned, finish
    reason "stop" | "length", the prompt ids the server reports or None)."""
    if not resp.choices:
        raise TurnFailed("the response has no choices")
    c = resp.choices[0]
    if kind == "chat":
        entries = (c.logprobs.content if c.logprobs is not None else None) or []
        lps, strs = [e.logprob for e in entries], [e.token for e in entries]
        prompt = getattr(resp, "prompt_token_ids", None) or getattr(c, "prompt_token_ids", None)
    else:
        lp = c.logprobs
        lps, strs = (list(lp.token_logprobs or []), list(lp.tokens or [])) if lp is not None else ([], [])
        prompt = getattr(c, "prompt_token_ids", None)
    ids = getattr(c, "token_ids", None)
    ids = list(ids) if ids is not None else _token_ids(strs)
    if ids is None:
        raise WorkerError("the server returned neither token ids nor logprob entries spelled token_id:<id> (vLLM "
                          ">= 0.10.2 answers return_token_ids; older vLLM needs --return-tokens-as-token-ids; "
                          "SGLang needs a version with return_token_ids)")
    if len(ids) != len(lps) or any(not isinstance(x, (int, float)) for x in lps):
        raise TurnFailed(f"{len(ids)} token ids but {len(lps)} logprobs in the response")
    reason = {"tool_calls": "stop"}.get(c.finish_reason, c.finish_reason)
    if reason not in ("stop", "length"):
        raise TurnFailed(f"finish_reason {c.finish_reason!r}")
    if reason == "stop" and not sp.stop and (not ids or ids[-1] not in sp.stop_token_ids):
        raise WorkerError(f"the server ended a turn (finish_reason stop) without an end-of-turn token in its token "
                          f"ids (last: {ids[-1:]}, expected one of {list(sp.stop_token_ids)}): the rollout would miss "
                          "it; use a server that returns the stop token")
    return [int(t) for t in ids], [float(x) for x in lps], reason, (list(prompt) if prompt is not None else None)


class ServerSampler:
    """A `nemo_jax.generate.Sampler` (what `EpisodeDriver` drives, as it drives the in-process Engine) over an
    OpenAI-compatible server: each turn is one HTTP request (the official `openai`
    client, on an event loop thread), many in flight at once; `step` returns the turns that came back.

    api "auto": a turn of a conversation without pictures is a completion of its token ids (exact); with pictures,
    or api "chat", a chat completion of `chat(tag)` -> (messages, tools), whose prompt ids (when the server reports
    them) must equal the worker's on the first turn (else WorkerError: another chat template) and are counted
    (`counts["prompt_mismatch_turns"]`) when a later turn's differ (text re-tokenised differently). A turn that fails
    goes to `failed` as (tag, reason). Turns sample with the adapter of the last `set_adapter`."""

    RETRY_S = (1.0, 10.0)  # a turn the server could not take is sent again after 1 s, doubling up to 10 s

    def __init__(self, server: InferenceClient, *, api: str = "auto", chat=None, poll_s: float = 0.02):
        if api not in ("auto", "chat"):
            raise ValueError(f"--api {api!r}: expected auto or chat")
        self.server, self.api, self.chat, self.poll_s = server, api, chat, poll_s
        self.adapter: tuple = (None, 0, None)  # (name, version, path on the server)
        self.queued = 0  # (the server queues; nothing waits here)
        self.failed: list[tuple[object, str]] = []
        self.counts = Counter()
        self.in_use = Counter()  # adapter name -> its requests in flight
        self._seqs: dict[int, _Turn] = {}
        self._next = 0
        self._done: queue.Queue = queue.Queue()
        self._retry: list[_Turn] = []  # turns to send again: the server was unreachable or overloaded
        self._said = 0.0
        self._warned = False
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="server-requests", daemon=True).start()
        self._client = asyncio.run_coroutine_threadsafe(self._make_client(), self._loop).result()

    async def _make_client(self):
        return self.server.async_client()

    @property
    def version(self) -> int:
        return self.adapter[1]

    def set_adapter(self, name: str | None, version: int, path: str | None = None) -> None:
        """Sample the next turns with adapter `name` (loaded on the server) of policy `version`."""
        self.adapter = (name, int(version), path)

    @property
    def busy(self) -> int:
        return sum(s.future is not None for s in self._seqs.values()) + len(self._retry)

    def submit(self, tokens: list[int], sp: SamplingParams, *, images=None, tag=None) -> int:
        sid, self._next = self._next, self._next + 1
        self._seqs[sid] = seq = _Turn(sid, list(tokens), sp, tag, bool(images))
        self._launch(seq)
        return sid

    def feed(self, seq_id: int, tokens: list[int], *, images=None) -> None:
        seq = self._seqs[seq_id]
        seq.tokens += tokens
        seq.pictures |= bool(images)
        self._launch(seq)

    def room(self, seq_id: int) -> int:
        s = self._seqs[seq_id]
        return (self.server.max_len or 1 << 40) - len(s.tokens) - s.sp.max_new_tokens

    def release(self, seq_id: int) -> None:
        s = self._seqs.pop(seq_id, None)
        if s in self._retry:
            self._retry.remove(s)
        if s is not None and s.future is not None:
            s.future.cancel()  # (the HTTP request is dropped; vLLM and SGLang abort it)

    def _launch(self, seq: _Turn) -> None:
        name, version, _ = self.adapter
        model, extra = self.server.select(name)
        sp = seq.sp
        extra.update(top_k=sp.top_k if sp.top_k > 0 else -1, stop_token_ids=list(sp.stop_token_ids),
                     return_token_ids=True)
        if self.server.kind != "sglang":
            extra["return_tokens_as_token_ids"] = True  # (older vLLM: the ids from the logprob entries)
        kw = dict(model=model, max_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p)
        if sp.stop:
            kw["stop"] = list(sp.stop)
        if sp.seed is not None:
            kw["seed"] = sp.seed
        if self.api == "chat" or seq.pictures:
            messages, tools = self.chat(seq.tag)
            kind = "chat"
            kw.update(messages=messages, logprobs=True, extra_body=dict(extra, return_prompt_token_ids=True)
                      if self.server.kind == "sglang" else extra)
            if tools:  # rendered by the server's template as by the learner's; the environment parses the calls
                kw.update(tools=tools, tool_choice="none")
        else:
            kind = "completions"
            kw.update(prompt=list(seq.tokens), logprobs=0, extra_body=extra)
        seq.adapter = (name, version)
        self.in_use[name] += 1
        self.counts["requests"] += 1
        seq.future = asyncio.run_coroutine_threadsafe(self._request(kind, kw), self._loop)
        seq.future.add_done_callback(lambda f, s=seq: self._done.put((s, f)))

    async def _request(self, kind: str, kw: dict):
        api = self._client.chat.completions if kind == "chat" else self._client.completions
        return kind, await api.create(**kw)

    def step(self) -> list[TurnEnd]:
        """The turns that came back (waiting up to poll_s for the first)."""
        import openai

        now = time.monotonic()
        for seq in [x for x in self._retry if x.retry_at <= now]:
            self._retry.remove(seq)
            if self._seqs.get(seq.id) is seq:
                self._launch(seq)
        try:
            items = [self._done.get(timeout=self.poll_s)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._done.get_nowait())
            except queue.Empty:
                break
        out, unknown = [], []
        for seq, fut in items:
            self.in_use[seq.adapter[0]] -= 1
            if self._seqs.get(seq.id) is not seq or fut.cancelled():  # released meanwhile
                continue
            seq.future = None
            try:
                kind, resp = fut.result()
                tokens, lps, reason, prompt = parse_turn(kind, resp, seq.sp)
            except openai.NotFoundError as e:
                # its adapter is unknown to the server: unloaded by another worker on it, or lost when the server
                # restarted. The current adapter is loaded again (once for all such turns) and the turn sent again.
                if seq.reloads < 2 and seq.adapter[0] is not None:
                    seq.reloads += 1
                    unknown.append(seq)
                else:
                    self.failed.append((seq.tag, f"the server: {e}"))
                continue
            except (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError) as e:
                # down, restarting or overloaded: the turn is sent again with backoff for up to --wait-s
                now = time.monotonic()
                seq.down = seq.down or now
                if now - seq.down < self.server.wait_s:
                    seq.retry_at = now + min(self.RETRY_S[0] * 2.0 ** seq.retries, self.RETRY_S[1])
                    seq.retries += 1
                    self._retry.append(seq)
                    self.counts["turns_resent"] += 1
                    if now - self._said >= 10.0:
                        self._said = now
                        print(f"rollout-worker: the server could not take a turn ({type(e).__name__}: {e}); "
                              f"sending it again for up to {self.server.wait_s - (now - seq.down):.0f} s", flush=True)
                else:
                    self.failed.append((seq.tag, f"the server could not sample a turn for {now - seq.down:.0f} s: "
                                                 f"{type(e).__name__}: {e}"))
                continue
            except (openai.OpenAIError, TurnFailed) as e:
                self.failed.append((seq.tag, f"the server could not sample a turn: {type(e).__name__}: {e}"))
                continue
            seq.down = None
            if prompt is not None and prompt != seq.tokens:
                self._mismatch(seq, prompt)
            seq.tokens += tokens
            seq.turns += 1
            seq.retries = seq.reloads = 0
            self.counts["turns"] += 1
            self.counts["tokens"] += len(tokens)
            v = seq.adapter[1]
            out.append(TurnEnd(seq.id, tokens, lps, reason, v, seq.tag, (v,)))
        if unknown:
            name, _, path = self.adapter
            if name is not None and path is not None:
                self.server.load_adapter(name, path)
            self.counts["adapter_reloads"] += 1
            for seq in unknown:
                self._launch(seq)
        return out

    def _mismatch(self, seq: _Turn, prompt: list[int]) -> None:
        at = next((i for i, (a, b) in enumerate(zip(prompt, seq.tokens)) if a != b), min(len(prompt), len(seq.tokens)))
        where = (f"the server's prompt ({len(prompt)} tokens) differs from the worker's ({len(seq.tokens)}) from "
                 f"token {at} on (server {prompt[at:at + 8]}, worker {seq.tokens[at:at + 8]})")
        if seq.turns == 0:
            raise WorkerError(f"{where}: the server renders the chat template differently from the learner's "
                              "tokenizer (start it with the learner's template, e.g. vLLM --chat-template)")
        self.counts["prompt_mismatch_turns"] += 1
        if not self._warned:
            self._warned = True
            print(f"rollout-worker: warning: a later turn re-tokenised differently: {where}; its logprobs are of "
                  "the server's context (counted as prompt_mismatch_turns; --api auto avoids this for text)",
                  flush=True)

    def take_failed(self) -> list[tuple[object, str]]:
        out, self.failed = self.failed, []
        return out

    def close(self) -> None:
        for s in list(self._seqs):
            self.release(s)
        asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def chat_messages(r, store: ImageStore | None) -> tuple[list[dict], list | None]:
    """A running rollout's conversation (`producer._Live`: its text with image markers, its stored pictures) as
    OpenAI chat messages, each picture an `image_url` part with the stored PNG as a data URL -> (messages, tools)."""
    marker = IMAGE_START + IMAGE_TOKEN + IMAGE_END
    pics = iter(r.images)
    out = []
    for m in r.text:
        c = m.get("content")
        if isinstance(c, str) and marker in c:
            parts = []
            for i, piece in enumerate(c.split(marker)):
                if i:
                    with open(store.path(next(pics)), "rb") as f:
                        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
                    parts.append({"type": "image_url", "image_url": {"url": url}})
                if piece:
                    parts.append({"type": "text", "text": piece})
            m = dict(m, content=parts)
        out.append(m)
    return out, r.tools


# ----------------------------------------------------------------------------- the worker
@dataclass(eq=False)
class _Group:
    lease: board.Lease
    task: object
    sp: SamplingParams
    want: int  # rollouts the request asks for
    lease_s: float  # renew at least every lease_s / 3
    written: int = 0
    failed: int = 0
    rewards: float = 0.0
    versions: tuple = ()
    renewed: float = 0.0  # time.monotonic() of the last renewal
    lost: str = ""  # why the lease was lost ("" while held)


LOST = "lost (its claim is gone: expired and reposted, or the group needs nothing more)"


def default_worker_id() -> str:
    return re.sub(r"[^A-Za-z0-9_.@+-]", "_", f"{socket.gethostname()}-{os.getpid()}")


class RolloutWorker:
    """The loop of `nemo-jax rollout-worker` (the module docstring): `run()` until stopped (SIGTERM / SIGINT,
    `stop()`, or `max_groups` groups completed)."""

    def __init__(self, run_dir: str, server: InferenceClient, tok, cfg, env, *, worker_id: str | None = None,
                 concurrency: int = 4, lease_s: float | None = None, api: str = "auto", timeout_s: float = 0.0,
                 env_workers: int = 16, server_run_dir: str | None = None, quiet: bool = False):
        if concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
        if lease_s is not None and lease_s <= 0:
            raise ValueError(f"--lease-s must be > 0, got {lease_s}")
        self.run_dir, self.server, self.tok, self.env = os.path.abspath(run_dir), server, tok, env
        self.worker_id = worker_id or default_worker_id()
        if not re.fullmatch(r"[A-Za-z0-9_.@+-]+", self.worker_id):
            raise ValueError(f"--worker-id {self.worker_id!r}: use letters, digits and _.@+- only")
        self.concurrency, self.lease_s, self.quiet = concurrency, lease_s, quiet
        self.server_run_dir = server_run_dir or self.run_dir
        # adapters are named <run dir name>-<hash of its path on the server>-v<version>: workers of one run share
        # them on an engine, two runs never mix them up
        where = hashlib.sha1(os.path.normpath(self.server_run_dir).encode()).hexdigest()[:8]
        self.run_name = f"{os.path.basename(os.path.normpath(self.run_dir))}-{where}"
        self.store = ImageStore(os.path.join(self.run_dir, "images")) if cfg.vision is not None else None
        self.stop_token_ids, self.vocab = stop_ids(cfg, tok), cfg.vocab_size
        self.sampler = ServerSampler(server, api=api, chat=lambda r: chat_messages(r, self.store))
        self.driver = EpisodeDriver(self.sampler, tok, cfg, env, SamplingParams(stop_token_ids=self.stop_token_ids),
                                    images=self.store, timeout_s=timeout_s, workers=env_workers, report_failures=True)
        self.tasks = {t.id: t for t in env.tasks("train")}
        self.groups: dict[str, _Group] = {}
        self.loaded: dict[str, int] = {}  # adapters this worker loaded: name -> version
        self.counts = Counter()
        self.stopping = threading.Event()
        self.finished = None  # what RUN/requests/CLOSED says, once the learner has finished the run
        self._lock = threading.Lock()
        self._files = 0
        self._last_claim = self._last_policy = 0.0

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(f"rollout-worker {self.worker_id}: {msg}", flush=True)

    def stop(self, *_):
        self.stopping.set()

    # ------------------------------------------------------------------ the policy
    def _policy(self, force: bool = False) -> None:
        """Load LATEST when it moved (at most twice a second; waits for a server that is away, up to --wait-s);
        unload this worker's idle older adapters (never waiting: a server that is away is asked again later)."""
        now = time.monotonic()
        if not force and now - self._last_policy < 0.5:
            return
        self._last_policy = now
        latest = policy.latest_policy(self.run_dir)
        if latest is not None and (self.sampler.adapter[0] is None or latest[0] != self.sampler.version):
            v = latest[0]
            name = f"{self.run_name}-v{v}"
            path = os.path.join(self.server_run_dir, "policy", str(v))
            if self.server.load_adapter(name, path):
                self.sampler.set_adapter(name, v, path)
                self.loaded[name] = v
                self.counts["adapters_loaded"] += 1
                self.log(f"policy {v} loaded into the server as {name}")
            elif os.path.isdir(latest[1]) and policy.latest_policy(self.run_dir) == latest:
                raise WorkerError(f"the server cannot load {path} (it exists here: give --server-run-dir, the run dir "
                                  "as the server's machine sees it, and check --max-lora-rank and the adapter's "
                                  "targets against the server's LoRA flags)")
        for name in [n for n in self.loaded if n != self.sampler.adapter[0] and self.sampler.in_use[n] <= 0]:
            if self.server.unload_adapter(name):  # (a server that is away is asked again at the next call)
                del self.loaded[name]

    def _run_closed(self) -> bool:
        """Has the learner finished the run? (Then the worker stops: nothing more will be requested.)"""
        got = board.closed(self.run_dir)
        if got is not None and self.finished is None:
            self.finished = got
            self.log(f"the learner finished the run{' at step ' + str(got['step']) if 'step' in got else ''} "
                     f"({self.run_dir}/requests/CLOSED): stopping")
        return got is not None

    def _wait_for_policy(self) -> bool:
        said = False
        while not self.stopping.is_set() and not self._run_closed():
            self._policy(force=True)
            if self.sampler.adapter[0] is not None:
                return True
            if not said:
                self.log(f"waiting for the learner's first policy ({self.run_dir}/policy/LATEST)")
                said = True
            self.stopping.wait(1.0)
        return False

    # ------------------------------------------------------------------ leases
    def _heartbeat(self) -> None:
        """Renew each held lease every lease_s / 3; notice cancelled groups twice a second."""
        while not self._hb_stop.wait(0.5):
            now = time.monotonic()
            with self._lock:
                held = [g for g in self.groups.values() if not g.lost]
            for g in held:
                if board.cancelled(self.run_dir, g.lease.group_id):
                    g.lost = "cancelled by the learner"  # (stale, or too many failed episodes)
                elif now - g.renewed >= g.lease_s / 3:
                    if board.renew(g.lease):
                        g.renewed = now
                    else:
                        g.lost = LOST

    def _claim(self) -> None:
        now = time.monotonic()
        if len(self.groups) >= self.concurrency or now - self._last_claim < 0.2:
            return
        self._last_claim = now
        while len(self.groups) < self.concurrency and not self.stopping.is_set():
            lease = board.claim_request(self.run_dir, self.worker_id)
            if lease is None:
                return
            self._start(lease)

    def _start(self, lease: board.Lease) -> None:
        req, gid = lease.request, lease.group_id
        task = self.tasks.get(req.get("task_id"))
        posted = req.get("messages")
        if task is None or (posted is not None and json.loads(json.dumps(list(task.messages), default=str)) != posted):
            board.release(lease)
            what = "is not among" if task is None else "has other messages than the task of that id in"
            raise WorkerError(f"request {gid}: task {req.get('task_id')!r} {what} the worker's environment "
                              f"({getattr(self.env, 'name', '?')}): give the learner's rollout.env and env_args")
        g = _Group(lease, task, request_sampling(req, self.stop_token_ids, self.vocab),
                   int(req.get("rollouts", req["group_size"])),
                   min(float(req.get("lease_s", 120.0)), self.lease_s or float("inf")), renewed=time.monotonic())
        with self._lock:
            self.groups[gid] = g
        for _ in range(g.want):
            self._episode(g)
        self.counts["groups_claimed"] += 1

    def _episode(self, g: _Group) -> None:
        self.driver.add(g.task, g.lease.group_id, f"{g.lease.group_id}/{uuid.uuid4().hex[:12]}", sp=g.sp)

    def _drop(self, gid: str, release: bool) -> None:
        """Stop working on a group: its episodes abandoned; `release`: its request given back for what it needs."""
        with self._lock:
            g = self.groups.pop(gid)
        self.driver.abandon(gid)
        if release:
            board.release(g.lease, rollouts=g.want - g.written)

    # ------------------------------------------------------------------ the loop
    def _deliver(self, finished) -> None:
        """Write the `finished` rollouts of groups still held (one file), count them."""
        keep, by = [], defaultdict(list)
        for x in finished:
            by[x.group_id].append(x)
        for gid, xs in by.items():
            g = self.groups.get(gid)
            if g is None or g.lost or not board.renew(g.lease):  # (a lost lease: the learner no longer wants them)
                self.counts["rollouts_dropped"] += len(xs)
                if g is not None and not g.lost:
                    g.lost = LOST
                continue
            g.renewed = time.monotonic()
            keep += xs
        if keep:
            rollouts.write_rollouts(os.path.join(self.run_dir, "spool"), keep, f"{self.worker_id}-{self._files:06d}")
            self._files += 1
            self.counts["rollouts_written"] += len(keep)
            for x in keep:
                g = self.groups[x.group_id]
                g.written += 1
                g.rewards += x.reward
                g.versions = tuple(sorted(set(g.versions) | set(x.policy_versions)))

    def _failures(self) -> None:
        """Report failed episodes; start a new one in their place (a group failing more than its size is given
        back: the learner cancels groups past rollout.max_failed_episodes)."""
        for tag, reason in self.sampler.take_failed():
            self.driver.fail(tag.rollout_id, reason)
        failures, self.driver.failures = self.driver.failures, []
        for gid, rid, reason in failures:
            g = self.groups.get(gid)
            if g is None or g.lost:
                continue
            rollouts.report_failure(g.lease, reason, f"{self.worker_id}-failed-{uuid.uuid4().hex[:12]}")
            g.failed += 1
            self.counts["episodes_failed"] += 1
            self.log(f"group {gid}: episode {rid} failed: {reason}")
            if g.failed <= g.want:
                self._episode(g)
            else:
                self.log(f"group {gid}: {g.failed} failed episodes: given back")
                self._drop(gid, release=True)

    def _settle(self) -> None:
        """Complete groups with all their rollouts; abandon those whose lease was lost."""
        for gid, g in list(self.groups.items()):
            if g.lost:
                n = self.driver.abandon(gid)
                with self._lock:
                    del self.groups[gid]
                self.counts["groups_lost"] += 1
                self.log(f"group {gid}: lease {g.lost}: {n} running episodes abandoned")
            elif g.written >= g.want:
                board.complete(g.lease)
                with self._lock:
                    del self.groups[gid]
                self.counts["groups_completed"] += 1
                self.log(f"group {gid} ({g.task.id}): {g.written} rollouts, reward mean {g.rewards / g.written:.3f}, "
                         f"policy {', '.join(map(str, g.versions))}")

    def run(self, max_groups: int = 0) -> dict:
        """Work until stopped (or `max_groups` groups completed) -> the counts."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        self.log(f"server {self.server.root} ({self.server.kind}, model {self.server.model}), run {self.run_dir}, "
                 f"environment {getattr(self.env, 'name', '?')}, {self.concurrency} groups at a time")
        self._hb_stop = threading.Event()
        hb = threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True)
        try:
            if not self._wait_for_policy():
                return self.summary()
            hb.start()
            last_check = 0.0
            while not self.stopping.is_set():
                if time.monotonic() - last_check >= 0.5:
                    last_check = time.monotonic()
                    if self._run_closed():
                        break
                self._policy()
                self._claim()
                self._deliver(self.driver.pump(wait_s=0.05))
                self._failures()
                self._settle()
                if max_groups and self.counts["groups_completed"] >= max_groups:
                    break
                if not self.groups:
                    self.stopping.wait(0.1)
        finally:
            self._hb_stop.set()
            for gid, g in list(self.groups.items()):  # (a finished run takes nothing back)
                back = not g.lost and self.finished is None
                self._drop(gid, release=back)
                self.counts["groups_released"] += back
            self.driver.close()
            self.sampler.close()
        self.log("stopped: " + ", ".join(f"{k} {v}" for k, v in sorted(self.summary().items())))
        return self.summary()

    def summary(self) -> dict:
        return {**self.counts, **{k: v for k, v in self.sampler.counts.items()},
                **{f"episodes_{k}": v for k, v in self.driver.counts.items() if k in ("timed_out", "context_full")}}


# ----------------------------------------------------------------------------- the command
def _run_config(run_dir: str):
    """The learner's resolved config (RUN/config.yaml), or None when there is none."""
    from nemo_jax.config.load import load_config
    from nemo_jax.config.train import GRPOConfig

    path = os.path.join(run_dir, "config.yaml")
    return load_config(GRPOConfig, path) if os.path.exists(path) else None


def cli_worker(a) -> dict:
    from nemo_jax.config.model import NemotronHConfig
    from nemo_jax.data.chat import ChatTokenizer
    from nemo_jax.rl.envs import make_env

    if a.concurrency < 1 or (a.lease_s is not None and a.lease_s <= 0) or a.max_groups < 0:
        raise ValueError("--concurrency must be >= 1, --lease-s > 0 and --max-groups >= 0")
    env_args = json.loads(a.env_args) if a.env_args else None
    if env_args is not None and not isinstance(env_args, dict):
        raise ValueError(f"--env-args {a.env_args!r}: expected a JSON object")
    if board.closed(a.run) is not None:
        print(f"rollout-worker: the learner finished the run ({a.run}/requests/CLOSED): nothing to sample",
              flush=True)
        return {}
    server = InferenceClient(a.server, model=a.model, api_key=a.api_key, timeout_s=a.request_timeout, wait_s=a.wait_s)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # (the worker takes the signals over when it runs)
        signal.signal(sig, lambda *_: stopping.set())
    model, said = os.path.join(a.run, "model", "config.json"), False
    while not os.path.exists(model):  # the learner writes config.yaml, then model/ when it starts
        if board.closed(a.run) is not None:
            print(f"rollout-worker: the learner finished the run ({a.run}/requests/CLOSED): nothing to sample",
                  flush=True)
            return {}
        if not said:
            print(f"rollout-worker: waiting for the learner to start ({model})", flush=True)
            said = True
        if stopping.wait(1.0):
            return {}
    c = _run_config(a.run)
    if c is None and (a.env is None or a.tokenizer is None):
        raise FileNotFoundError(f"{a.run}/config.yaml: not found (the learner writes it); or give --env and "
                                "--tokenizer")
    if env_args is None:
        env_args = c.rollout.env_args if a.env is None else {}
    tok = ChatTokenizer.load(a.tokenizer or c.tokenizer)
    env = make_env(a.env or c.rollout.env, **env_args)
    cfg = NemotronHConfig.from_file(os.path.dirname(model))
    w = RolloutWorker(a.run, server, tok, cfg, env, worker_id=a.worker_id, concurrency=a.concurrency,
                      lease_s=a.lease_s, api=a.api, timeout_s=c.rollout.episode_timeout_s if c else 0.0,
                      env_workers=c.rollout.env_workers if c else 16, server_run_dir=a.server_run_dir)
    if stopping.is_set():
        w.driver.close()
        w.sampler.close()
        return w.summary()
    return w.run(max_groups=a.max_groups)
