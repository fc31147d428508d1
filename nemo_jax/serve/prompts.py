"""Requests -> prompts: text and chat messages through the tokenizer and the chat template, pictures read (data
URLs, or local files under `--allowed-local-media-path` within a time limit), token ids checked, and each prompt's
sampling parameters (`openai.sampling`); `/tokenize` and `/detokenize`."""

from __future__ import annotations

import concurrent.futures

from nemo_jax.serve.openai import REASONING_EFFORTS, APIError, Prompt, local_image, sampling, template_messages
from nemo_jax.threads import DaemonPool

MEDIA_READ_TIMEOUT_S = 30.0  # one local image file read, at most (a slow or stuck file: 503, its thread replaced)


class PromptBuilder:
    """`media_roots`: folders local images may be read from; `vocab_bytes`: each token's bytes (bounds the text a
    prompt of `max_len` tokens can spell)."""

    def __init__(self, cfg, tok, *, max_len: int, bucket: int, media_roots=(), max_media_bytes: int = 32 << 20,
                 vocab_bytes=None):
        import os

        self.cfg, self.tok, self.max_len, self.bucket = cfg, tok, max_len, bucket
        self.media_roots = [os.path.realpath(r) for r in media_roots]
        self.max_media_bytes = max_media_bytes
        # local image reads on daemon threads (nemo_jax.threads): a read past MEDIA_READ_TIMEOUT_S is given up and
        # its thread replaced, so stuck files never take the request threads
        self.media_io = DaemonPool(4, "media-io")
        self.stop_ids = tuple(sorted({*cfg.eos_ids, *tok.eos_ids()}))
        longest = max((len(b) for b in vocab_bytes), default=1) if vocab_bytes else 64
        self.max_prompt_bytes = max_len * max(longest, 1) + 4096  # more text than this cannot fit max_len tokens

    def encode(self, text: str, what: str = "prompt") -> list[int]:
        if len(text) > self.max_prompt_bytes or len(text.encode()) > self.max_prompt_bytes:
            raise APIError(f"This model's maximum context length is {self.max_len} tokens; the {what} text is longer "
                           f"than any {self.max_len} tokens can spell", param=what)
        return self.tok.tokenizer.encode(text, add_special_tokens=False).ids

    def chat_tokens(self, body: dict) -> tuple[list[int], list]:
        """A chat request's messages (and tools) through the chat template -> (token ids, pictures)."""
        from nemo_jax.data.chat import DataError
        from nemo_jax.generate import widen_images

        msgs, refs = template_messages(body.get("messages"), self.cfg.vision is not None)
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise APIError("'tools' must be a list of tool definitions", param="tools")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
            raise APIError("'chat_template_kwargs' must be an object of names", param="chat_template_kwargs")
        effort = body.get("reasoning_effort")
        if effort is not None:  # (as vLLM: handed to the template, which may read it; the bundled ones do not)
            if effort not in REASONING_EFFORTS:
                raise APIError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}",
                               param="reasoning_effort")
            kwargs = {"reasoning_effort": effort, **kwargs}
        cont = bool(body.get("continue_final_message"))
        text_len = sum(len(m["content"]) for m in msgs if isinstance(m.get("content"), str))
        if text_len > self.max_prompt_bytes:
            raise APIError(f"This model's maximum context length is {self.max_len} tokens; the messages are longer "
                           f"than any {self.max_len} tokens can spell", param="messages")
        try:
            text = self.tok.render(msgs, tools=tools or None,
                                   add_generation_prompt=bool(body.get("add_generation_prompt", True)) and not cont,
                                   **kwargs)
        except (DataError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise APIError(f"chat template: {e}", param="messages") from None
        eos = self.tok.eos_token
        if cont and eos and eos in text:  # the last message stays open: the model continues it
            text = text[: text.rfind(eos)]
        ids = self.encode(text, "messages")
        if not refs:
            return ids, []
        pics = [self.picture(r) for r in refs]
        try:
            return widen_images(self.cfg, ids, pics)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None

    def picture(self, ref: str):
        """An image part's reference -> RGB PIL image. A local file: only under --allowed-local-media-path, a
        regular file (a FIFO is refused, never opened), at most --max-request-mb, read within
        MEDIA_READ_TIMEOUT_S; any picture of more than `MAX_IMAGE_PIXELS` is refused from its header."""
        from nemo_jax.data.images import ImageError, load_image, open_image, read_image_file

        try:
            if ref.startswith("data:"):
                return load_image(ref)
            real = local_image(ref, self.media_roots)
            fut = self.media_io.submit(read_image_file, real, self.max_media_bytes)
            try:
                data = fut.result(timeout=MEDIA_READ_TIMEOUT_S)
            except concurrent.futures.TimeoutError:
                if not fut.cancel():
                    self.media_io.add_thread()  # (the stuck read keeps its thread)
                raise APIError(f"{ref[:120]}: reading the image did not finish within {MEDIA_READ_TIMEOUT_S:g} s",
                               status=503, param="messages") from None
            return open_image(data, ref[:120])
        except ImageError as e:
            raise APIError(str(e)[:500], param="messages") from None

    def completion_prompts(self, body: dict) -> list[list[int]]:
        p = body.get("prompt")
        if isinstance(p, str):
            out = [self.encode(p)]
        elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            out = [list(p)]
        elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            out = [self.encode(x) for x in p]
        elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
            out = [list(x) for x in p]
        else:
            raise APIError("'prompt' must be a string, a list of token ids, or a list of either", param="prompt")
        for x in out:
            if not x:
                raise APIError("a prompt is empty", param="prompt")
            self.check_ids(x, "prompt")
        return out

    def check_ids(self, ids: list, field: str) -> None:
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise APIError(f"{field} token {bad[0]!r:.40} is not a token id of this model "
                           f"(vocabulary {self.cfg.vocab_size})", param=field)

    def prompt(self, tokens: list[int], images: list, body: dict, top_logprobs: int) -> Prompt:
        samples, stop = sampling(body, len(tokens), self.max_len, self.bucket, self.stop_ids, self.cfg.vocab_size,
                                 top_logprobs)
        return Prompt(tokens, images, samples, stop)

    def token_prompt(self, ids, sampling_params: dict, top_logprobs: int) -> Prompt:
        """A token-in request's prompt (`/inference/v1/generate`): its ids checked, its `sampling_params` read."""
        self.check_ids(ids, "token_ids")
        samples, stop = sampling(sampling_params, len(ids), self.max_len, self.bucket, self.stop_ids,
                                 self.cfg.vocab_size, top_logprobs, prefix="sampling_params.",
                                 prompt_field="token_ids")
        return Prompt(list(ids), [], samples, stop)

    def prompts(self, body: dict, *, chat: bool, top_logprobs: int) -> list[Prompt]:
        """A chat request's one prompt, or a completion request's prompts, each with its sampling parameters."""
        if chat:
            ids, pics = self.chat_tokens(body)
            return [self.prompt(ids, pics, body, top_logprobs)]
        return [self.prompt(ids, [], body, top_logprobs) for ids in self.completion_prompts(body)]

    def tokenize(self, body: dict) -> dict:
        if "messages" in body:
            ids, _ = self.chat_tokens(body)
        else:
            ids = self.completion_prompts({"prompt": body.get("prompt")})[0]
        return {"count": len(ids), "max_model_len": self.max_len, "tokens": ids}

    def detokenize(self, body: dict) -> dict:
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < self.cfg.vocab_size for t in ids):
            raise APIError(f"'tokens' must be a list of token ids in [0, {self.cfg.vocab_size})", param="tokens")
        return {"prompt": self.tok.tokenizer.decode(ids, skip_special_tokens=False)}

    def close(self) -> None:
        self.media_io.shutdown()
