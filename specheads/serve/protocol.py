"""OpenAI request parsing and response shapes (completions, chat completions, SSE chunks)."""

from __future__ import annotations

import math
import time
import uuid

from specheads.data.messages import FieldError, check_message, check_strings, check_text
from specheads.serve.engine import Completion, Params, RequestError

# fields whose non-default values we cannot honour: refused rather than silently ignored
_UNSUPPORTED = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0,
                "logprobs": None, "top_logprobs": None, "echo": False, "suffix": None,
                "logit_bias": None, "response_format": None}


_INT64 = (-(2**63), 2**63 - 1)
MAX_TOKENS_LIMIT = 2**31 - 1


def _number(body: dict, key: str, default, kind=float, lo=None, hi=None):
    """body[key] as a finite number (an integer for `kind` int) in [lo, hi], or `default`."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (kind is int and value != int(value)):
        raise RequestError(f"'{key}' must be a{'n integer' if kind is int else ' finite number'}, "
                           f"got {value!r}", key)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"'{key}' must lie in [{lo}, {hi}], got {value!r}", key)
    return kind(value)


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"'{key}' must be true or false, got {value!r}", key)
    return bool(value)


def parse_params(body: dict) -> Params:
    """max_tokens / max_completion_tokens, temperature, top_p, seed, stop -> Params."""
    for key, default in _UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and value is not False and value != default:
            raise RequestError(f"'{key}' = {value!r} is not supported by this server", key)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, None, int, lo=1, hi=MAX_TOKENS_LIMIT)
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop' must be a string or a list of strings", "stop")
    _flag(body, "stream")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    return Params(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, lo=0, hi=2),
                  top_p=_number(body, "top_p", 1.0, lo=1e-9, hi=1),
                  seed=_number(body, "seed", None, int, *_INT64), stop=tuple(s for s in stop if s))


def _text_content(content, where: str) -> str:
    """A message's content: a string, null, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise RequestError(f"'{where}.content' must be a string or a list of text parts "
                       f"({{\"type\": \"text\", \"text\": \"...\"}}), got {_short(content)}",
                       f"{where}.content")


def _checked(check, value, field: str) -> None:
    """Run a message check (data/messages.py) on a request field: its FieldError becomes a 400
    that names the field, in the style of this module's other refusals."""
    try:
        check(value, field)
    except FieldError as err:
        raise RequestError(f"'{err.field}': {err.problem}", err.field) from None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_messages(body: dict) -> list[dict]:
    """`messages` checked (shape here, roles and text by `check_message`) and normalised (text
    parts joined); other message keys kept."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"'messages[{i}]' must be an object with a string 'role'",
                               f"messages[{i}]")
        content = _text_content(m.get("content"), f"messages[{i}]")
        _checked(check_message, m, f"messages[{i}]")
        out.append({**m, "content": content})
    return out


def parse_tools(body: dict) -> list[dict] | None:
    """`tools`: null or a list of {"type": "function", "function": {"name": str, ...}}."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError(f"'tools' must be a list of function tools, got {_short(tools)}", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": "
                               f"{{\"name\": \"...\", ...}}}}, got {_short(tool)}", f"tools[{i}]")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise RequestError(f"'tools[{i}].function.parameters' must be a JSON schema object",
                               f"tools[{i}].function.parameters")
    _checked(check_strings, tools, "tools")
    return tools


def parse_tool_choice(body: dict, tools: list[dict] | None) -> None:
    """`tool_choice`: null, "none" or (with `tools`) "auto"; what would force a tool call is refused,
    since this server does not constrain decoding to a call (as it refuses logprobs, n, ...)."""
    choice = body.get("tool_choice")
    if choice is None or choice == "none":
        return
    names = [t["function"]["name"] for t in tools or []]
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise RequestError(f"'tool_choice' names the function {_short(name)}, which is not in 'tools' "
                               f"({', '.join(names) or 'none given'})", "tool_choice")
        raise RequestError(f"'tool_choice' forcing the function '{name}' is not supported by this server (it "
                           "does not constrain decoding to a call): use \"auto\" or \"none\"", "tool_choice")
    if choice == "auto":
        if not tools:
            raise RequestError("'tool_choice' \"auto\" needs 'tools': pass the tools, or drop tool_choice",
                               "tool_choice")
        return
    if choice == "required":
        raise RequestError("'tool_choice' \"required\" is not supported by this server (it does not constrain "
                           "decoding to a call): use \"auto\" or \"none\"", "tool_choice")
    raise RequestError(f"'tool_choice' must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {_short(choice)}", "tool_choice")


def parse_template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    _checked(check_strings, kwargs, "chat_template_kwargs")
    return kwargs


def parse_prompt(body: dict):
    """`prompt`: a string, a list of token ids, or a one-element list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        _checked(check_text, prompt, "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise RequestError("'prompt' must be a non-empty string or list of token ids (one prompt per "
                       "request)", "prompt")


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


_KINDS = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed",
          408: "RequestTimeout", 413: "RequestTooLarge", 431: "RequestHeadersTooLarge",
          503: "ServiceUnavailable"}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error shape; `param` names the offending field when there is one."""
    kind = _KINDS.get(status, "BadRequestError" if 400 <= status < 500 else "InternalServerError")
    # a lone surrogate echoed from the request (a model name) is written \udXXX: UTF-8 cannot hold it
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
