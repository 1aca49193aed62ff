"""The serving engine: one frozen target (+ an optional exported draft) and what a request needs
to decode in the server's batch (serve/scheduler.py drives the batch).

Temperature 0 runs the lossless greedy speculative loop (token-equal to plain greedy decoding);
temperature > 0 runs lossless speculative sampling, seeded; both through the speculation session
(session.py), each request with a fresh proposer of its own. Without a draft the same loops run
with a proposer that never proposes, which is plain decoding. Stop strings are applied to the
decoded text: generation runs to eos or max_tokens, then the text (and the token count) is cut
at the first stop string; streamed text is held back while it could still be a stop's prefix.
A request's proposer and text stream are `Guarded`: their failure ends that request only.
"""

from __future__ import annotations

import copy
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specheads.data.prompts import NoChatTemplate, encode_chat, encode_text
from specheads.data.text_bound import max_token_chars, min_tokens
from specheads.protocols import GroupedProposer
from specheads.session import Session
from specheads.verify.loop import Request
from specheads.verify.settings import Sampling
from specheads.verify.steps import DecodeStats
from specheads.verify.text import StreamingProposer, TextStream, find_stop
from specheads.verify.trees import chain_tree


class RequestError(ValueError):
    """A request the engine cannot serve: returned to the client as a 4xx naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class Cancelled(Exception):
    """The client went away: its row leaves the batch at the next step boundary."""


class SerialTokenizer:
    """The target's tokenizer behind a lock: requests are tokenized on another thread than the
    decode's text streaming, and a fast tokenizer must not be used from two threads at once."""

    def __init__(self, tokenizer):
        self._tok, self._lock = tokenizer, threading.Lock()

    def __call__(self, *args, **kwargs):
        with self._lock:
            return self._tok(*args, **kwargs)

    def decode(self, *args, **kwargs):
        with self._lock:
            return self._tok.decode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        with self._lock:
            return self._tok.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def copy(self) -> SerialTokenizer:
        """An independent copy behind a lock of its own (one per thread that tokenises requests, so a
        long request never waits on, nor holds up, the decode thread's detokenising)."""
        with self._lock:
            try:
                return SerialTokenizer(copy.deepcopy(self._tok))
            except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared, behind this lock
                return self


@dataclass(frozen=True)
class Params:
    """Decoding settings of one request (OpenAI names)."""

    max_tokens: int | None = None  # None: up to the target's context
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Completion:
    """One finished request: text, tokens, why it stopped and the decode counts."""

    text: str
    tokens: list[int]  # generated ids (eos included when hit), cut after a stop string
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    stats: DecodeStats = field(default_factory=DecodeStats)


class Guarded:
    """A request's proposer (its text stream inside) whose failures stay in its own row: the first
    error is kept in `error` and from then on it drafts nothing and streams nothing, so the batch's
    step goes on; the scheduler drops the row at the next step boundary and reports the error."""

    def __init__(self, inner):
        self.inner, self.error = inner, None
        self.layers = inner.layers
        for hook, empty in _EMPTY.items():  # only the hooks the inner proposer has (protocol checks)
            if hasattr(inner, hook):
                setattr(self, hook, self._guard(getattr(inner, hook), empty))

    def __getattr__(self, name):  # max_nodes, ...
        return getattr(self.inner, name)

    def _call(self, hook, empty, *args):
        """hook(*args), or empty(*args) once anything has failed (this call included)."""
        if self.error is None:
            try:
                return hook(*args)
            except Exception as err:  # noqa: BLE001 - kept for this request's answer
                self.error = err
        return empty(*args)

    def _guard(self, hook, empty):
        return lambda *args: self._call(hook, empty, *args)

    def start(self, prompt_ids, first_token, out) -> None:
        self._call(self.inner.start, _nothing, prompt_ids, first_token, out)

    def accept(self, inputs, following, out, start) -> None:
        self._call(self.inner.accept, _nothing, inputs, following, out, start)

    def group_drafter(self):
        """The inner proposer's drafter for a draft group while nothing has failed (a failed
        proposer drafts nothing, alone)."""
        if self.error is not None or not isinstance(self.inner, GroupedProposer):
            return None
        return self.inner.group_drafter()

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            self._call(close, _nothing)


def _nothing(*_args) -> None:
    return None


_EMPTY = {  # what a failed proposer drafts: nothing, in each hook's shape
    "propose": lambda k: torch.empty(0, dtype=torch.long),  # [0]
    "propose_tree": lambda: (chain_tree(0), torch.empty(0, dtype=torch.long)),  # root only, [0]
    "propose_sampled": lambda k, warper, gen: (torch.empty(0, dtype=torch.long), torch.empty(0, 0)),  # [0], [0, V]
    "begin_step": lambda k, sampler: None,  # a split step (protocols.SplitProposer): nothing asked
    "end_step": lambda tokens, q: (torch.empty(0, dtype=torch.long), None),  # nothing verified
}


@dataclass
class Live:
    """One request in the batch: its settings and its loop Request, whose proposer is the
    request's own, streaming its text, `Guarded`."""

    ids: list[int]
    params: Params
    request: Request

    @property
    def guard(self) -> Guarded:
        return self.request.proposer

    @property
    def error(self) -> Exception | None:
        """What failed in this request's proposer or text stream (None: nothing)."""
        return self.guard.error


class Engine:
    """A speculation session (target + optional draft) and the request handling around it; the
    scheduler's decode thread alone runs the target."""

    def __init__(self, session: Session, model_name: str = "specheads"):
        self.session, self.model_name = session, model_name
        self.target, self.head, self.spec, self.eos = session.target, session.head, session.spec, session.eos
        self.tokenizer = SerialTokenizer(session.target.tokenizer)  # the decode thread's (text streaming)
        self.token_chars = max_token_chars(session.target.tokenizer)

    @property
    def context(self) -> int | None:
        return self.target.context

    def chat_ids(self, messages: list[dict], tools=None, template_kwargs: dict | None = None,
                 tokenizer=None) -> list[int]:
        """The conversation rendered with the target's chat template, ready for the answer (`tokenizer`:
        a copy of the target's, e.g. a request thread's own; default the decode thread's)."""
        try:
            return encode_chat(tokenizer or self.tokenizer, messages, tools, template_kwargs)
        except NoChatTemplate as err:
            raise RequestError(f"{err}: use /v1/completions", "messages") from None
        except Exception as err:  # noqa: BLE001 - jinja / template errors come from the request
            raise RequestError(f"the chat template cannot render these 'messages'"
                               f"{' and tools' if tools else ''}: {type(err).__name__}: {err}",
                               "messages") from None

    def text_ids(self, prompt, tokenizer=None) -> list[int]:
        """A completion prompt (text or a list of token ids) -> ids (`tokenizer`: as `chat_ids`)."""
        if isinstance(prompt, str):
            return encode_text(tokenizer or self.tokenizer, prompt)
        return [int(t) for t in prompt]

    def budget(self, ids: list[int], params: Params, field: str = "prompt", limit_field: str = "max_tokens") -> int:
        """New tokens this request may generate; refuses a prompt that leaves no room, or a limit past the
        context (`field` / `limit_field` name the request fields the prompt and the limit came from)."""
        if not ids:
            raise RequestError("the prompt is empty", field)
        ctx = self.context
        if ctx is not None and len(ids) >= ctx:
            raise RequestError(f"the prompt has {len(ids)} tokens but the model's context is {ctx}: "
                               "shorten it", field)
        room = (ctx - len(ids)) if ctx is not None else 1 << 30
        if params.max_tokens is not None and params.max_tokens > room:  # as vLLM: refused, not cut
            raise RequestError(f"'{limit_field}' is too large: {params.max_tokens}. This model's context is {ctx} "
                               f"tokens and the prompt has {len(ids)} ({params.max_tokens} > {ctx} - {len(ids)}): "
                               f"ask for at most {room}, or leave it out (up to the context)", limit_field)
        return room if params.max_tokens is None else params.max_tokens

    def check_chars(self, chars: int, field: str) -> None:
        """Refuse a prompt of `chars` characters that cannot fit the context, before tokenising it
        (data/text_bound.py: at least ceil(chars / token_chars) tokens)."""
        ctx = self.context
        least = min_tokens(chars, self.token_chars)
        if ctx is not None and least >= ctx:
            raise RequestError(f"the prompt ('{field}') has {chars} characters, so at least {least} tokens (no token of this "
                               f"model covers more than {self.token_chars} characters), but the model's context is "
                               f"{ctx}: shorten it", field)

    def _sampling(self, params: Params) -> Sampling:
        """Greedy at temperature 0, else seeded sampling (a random seed when none is given)."""
        if params.temperature == 0:
            return Sampling()
        seed = params.seed if params.seed is not None else secrets.randbelow(2**31)
        return Sampling(params.temperature, params.top_p, seed)

    def start(self, ids: list[int], params: Params, emit: Callable[[str], None] | None = None) -> Live:
        """A request ready to join the batch: a fresh proposer, guarded, whose verified tokens reach
        `emit` as text deltas (streaming; stop strings held back and cut)."""
        stream = TextStream(self.tokenizer, emit or (lambda _t: None), set(self.eos), params.stop)
        req = self.session.request(ids, self.budget(ids, params), self._sampling(params),
                                   wrap=lambda proposer: Guarded(StreamingProposer(proposer, stream)))
        return Live(ids, params, req)

    def finish(self, live: Live, result) -> Completion:
        """A finished row's result -> the request's Completion (the stream gets its last text)."""
        live.guard.inner.finish(result.tokens)  # the StreamingProposer
        if live.error is not None:
            raise live.error
        return self._finish(result, live.ids, live.params)

    def _finish(self, result, ids: list[int], params: Params) -> Completion:
        """Text cut at eos / the first stop string; tokens counted up to where the text ends."""
        tok, eos = self.tokenizer, set(self.eos)
        body = [t for t in result.tokens if t not in eos]
        text = tok.decode(body, skip_special_tokens=True)
        cut = find_stop(text, params.stop)
        tokens, reason = result.tokens, "stop" if result.stop_reason == "eos" else "length"
        if cut >= 0:
            text, reason = text[:cut], "stop"
            tokens = tokens[:_tokens_for(tok, body, params.stop)]
        return Completion(text, tokens, reason, len(ids), result.stats)


def _tokens_for(tok, body: list[int], stops: tuple[str, ...]) -> int:
    """The fewest leading tokens of `body` whose text contains a stop string (binary search)."""
    lo, hi = 1, len(body)
    while lo < hi:
        mid = (lo + hi) // 2
        if find_stop(tok.decode(body[:mid], skip_special_tokens=True), stops) >= 0:
            hi = mid
        else:
            lo = mid + 1
    return lo
