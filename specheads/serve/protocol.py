"""OpenAI request parsing and response shapes (completions, chat completions, SSE chunks)."""

from __future__ import annotations

import time
import uuid

from specheads.serve.engine import Completion, Params, RequestError

# fields whose non-default values we cannot honour: refused rather than silently ignored
_UNSUPPORTED = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0,
                "logprobs": None, "top_logprobs": None, "echo": False, "suffix": None,
                "logit_bias": None, "response_format": None}


def _number(body: dict, key: str, default, kind=float, lo=None, hi=None):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise RequestError(f"'{key}' must be a{'n integer' if kind is int else ' number'}, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"'{key}' must lie in [{lo}, {hi}], got {value!r}")
    return kind(value)


def parse_params(body: dict) -> Params:
    """max_tokens / max_completion_tokens, temperature, top_p, seed, stop -> Params."""
    for key, default in _UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and value is not False and value != default:
            raise RequestError(f"'{key}' = {value!r} is not supported by this server")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", None, int, lo=1)
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop' must be a string or a list of strings")
    return Params(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, lo=0, hi=2),
                  top_p=_number(body, "top_p", 1.0, lo=1e-9, hi=1),
                  seed=_number(body, "seed", None, int), stop=tuple(s for s in stop if s))


def _text_content(content, where: str) -> str:
    """A message's content: a string, null, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "\n".join(str(p.get("text", "")) for p in content)
    raise RequestError(f"{where}.content must be a string or a list of text parts")


def parse_messages(body: dict) -> list[dict]:
    """`messages` checked and normalised (text parts joined); other message keys kept."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'")
        out.append({**m, "content": _text_content(m.get("content"), f"messages[{i}]")})
    return out


def parse_prompt(body: dict):
    """`prompt`: a string, a list of token ids, or a one-element list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise RequestError("'prompt' must be a non-empty string or list of token ids (one prompt per request)")


def include_usage(body: dict) -> bool:
    opts = body.get("stream_options") or {}
    return bool(isinstance(opts, dict) and opts.get("include_usage"))


def usage(done: Completion) -> dict:
    n = len(done.tokens)
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": n,
            "total_tokens": done.prompt_tokens + n}


class Responder:
    """Builds the response objects of one request (one id, one creation time)."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _base(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, done: Completion) -> dict:
        """The non-streaming response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": done.text},
                      "logprobs": None, "finish_reason": done.finish_reason}
            return {**self._base("chat.completion", [choice]), "usage": usage(done)}
        choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason}
        return {**self._base("text_completion", [choice]), "usage": usage(done)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None,
              role: bool = False) -> dict:
        """One streamed chunk: a text delta, the opening role (chat) or the finish reason."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else (
                {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._base("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._base("text_completion", [choice])

    def usage_chunk(self, done: Completion) -> dict:
        """The last chunk under stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj, []), "usage": usage(done)}


def error_body(message: str, status: int) -> dict:
    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
