"""The embedded default target: a small Llama trained from scratch on the stdlib's train modules.

It is built deterministically (seeded, fixed step count) in a few CPU minutes and saved as an
ordinary Hugging Face folder, so every later stage treats it exactly like a hub model.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specheads.atomic import atomic_dir, remove_stale
from specheads.builtin import stdlib
from specheads.hf_compat import quiet_loading
from specheads.progress import Progress

BUILDER_VERSION = "stdlib-llama-v4"
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
BUILD_INFO = "specheads_build.json"
MANIFEST = "SHA256SUMS"
PREBUILT_DIR = Path(__file__).with_name("prebuilt")
# sha256 of each prebuilt build's SHA256SUMS (which lists every file's sha256): `make demo` starts
# from this copy instead of a ~15-minute build; `specheads tiny-target --out DIR` rebuilds it
PREBUILT_SHA256 = {"default": "567741679532656e5795a73b3dc4ea4c7e7e314ed8b2fb68207ed5a5d74818f6"}


@dataclass(frozen=True)
class Preset:
    """Everything that determines a build: data, tokenizer, model shape and optimisation."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    chat_fraction: float  # share of batch rows that start at a conversation
    max_position_embeddings: int = 1024
    module_limit: int | None = None  # first N stdlib modules only (quick builds)
    eval_windows: int = 64
    eval_conversations: int = 128
    weight_decay: float = 0.1
    seed: int = 0


PRESETS = {
    "default": Preset(vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=8,
                      num_heads=4, seq_len=256, batch_size=8, steps=1300, lr=5e-3, warmup=40,
                      chat_fraction=0.7),
    "test": Preset(vocab_size=512, hidden_size=48, intermediate_size=128, num_layers=8,
                   num_heads=2, seq_len=64, batch_size=8, steps=30, lr=3e-3, warmup=5,
                   chat_fraction=0.5, max_position_embeddings=256, module_limit=40,
                   eval_windows=8, eval_conversations=16),
}


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts`, wrapped with the specheads chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok: Tokenizer, model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """A transformers tokenizer: eos `<|end|>`, pad `<|pad|>`, the chat template, no auto-BOS."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|end|>",
        pad_token="<|pad|>", model_max_length=model_max_length)
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[2:5]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def render_chats(tokenizer: PreTrainedTokenizerFast, convs: list[dict]) -> list[str]:
    """Each conversation as the exact text the chat template produces."""
    return [tokenizer.apply_chat_template(c["messages"], tokenize=False) for c in convs]


# ---------------------------------------------------------------- data


@dataclass
class TokenData:
    """Tokenised training streams and documents' start offsets (1-D int64 tensors)."""

    raw: torch.Tensor  # [N_raw] module texts joined by <|endoftext|>
    chat: torch.Tensor  # [N_chat] rendered conversations back to back
    chat_starts: torch.Tensor  # [C] offset of each conversation in `chat`
    tokens: int  # total tokens available


def join_encoded(tokenizer: PreTrainedTokenizerFast, texts: list[str], sep: list[int]):
    """Encode `texts` and concatenate with `sep` after each; returns (stream [N], starts [D])."""
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    starts, flat = [], []
    for seq in ids:
        starts.append(len(flat))
        flat.extend(seq)
        flat.extend(sep)
    return torch.tensor(flat, dtype=torch.long), torch.tensor(starts, dtype=torch.long)


def build_token_data(tokenizer, train_sources, train_convs) -> TokenData:
    """Tokenise train module texts and rendered train conversations into two streams."""
    eot = [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    raw, _ = join_encoded(tokenizer, [s.text for s in train_sources], eot)
    chat, starts = join_encoded(tokenizer, render_chats(tokenizer, train_convs), [])
    return TokenData(raw, chat, starts, int(raw.numel() + chat.numel()))


def window(stream: torch.Tensor, start: int, length: int, pad_id: int) -> torch.Tensor:
    """`length` tokens of `stream` from `start`, right-padded with `pad_id` at the end."""
    piece = stream[start:start + length]
    if piece.numel() < length:
        piece = torch.cat([piece, piece.new_full((length - piece.numel(),), pad_id)])
    return piece


def sample_batch(data: TokenData, preset: Preset, gen: torch.Generator, pad_id: int):
    """A batch of windows: some start at a conversation, the rest anywhere in the raw stream."""
    n_chat = round(preset.batch_size * preset.chat_fraction)
    conv = torch.randint(len(data.chat_starts), (n_chat,), generator=gen)
    raw = torch.randint(max(1, data.raw.numel() - preset.seq_len), (preset.batch_size - n_chat,),
                        generator=gen)
    rows = [window(data.chat, int(data.chat_starts[i]), preset.seq_len, pad_id) for i in conv]
    rows += [window(data.raw, int(i), preset.seq_len, pad_id) for i in raw]
    input_ids = torch.stack(rows)  # [B, T]
    labels = input_ids.masked_fill(input_ids == pad_id, -100)  # [B, T]
    return input_ids, labels


# ---------------------------------------------------------------- model + training


def make_model(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A freshly initialised float32 Llama sized by `preset` (seed it before calling)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size, num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads, num_key_value_heads=preset.num_heads,
        max_position_embeddings=preset.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, attn_implementation="sdpa")
    config.dtype = "float32"
    return LlamaForCausalLM(config).to(torch.float32)


def lr_factor(step: int, preset: Preset) -> float:
    """Linear warmup then cosine decay to 10% of the peak learning rate."""
    if step < preset.warmup:
        return (step + 1) / preset.warmup
    progress = (step - preset.warmup) / max(1, preset.steps - preset.warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, preset: Preset) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": preset.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=preset.lr, betas=(0.9, 0.95), eps=1e-8)


def train_model(model, data: TokenData, preset: Preset, pad_id: int, progress: bool) -> float:
    """Fixed-step, seeded training; returns the mean loss of the last 10% of steps."""
    gen = torch.Generator().manual_seed(preset.seed)
    opt = make_optimizer(model, preset)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, preset))
    model.train()
    tail, bar = [], Progress(preset.steps, "tiny target", "steps", quiet=not progress)  # a log gets lines, not \r
    for step in range(preset.steps):
        input_ids, labels = sample_batch(data, preset, gen, pad_id)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step >= preset.steps * 0.9:
            tail.append(loss.item())
        bar.update()
    bar.close()
    model.eval()
    return sum(tail) / max(1, len(tail))


# ---------------------------------------------------------------- held-out evaluation


@torch.no_grad()
def heldout_text_loss(model, tokenizer, sources, preset: Preset) -> float | None:
    """Mean token cross-entropy on evenly spaced windows of the held-out modules' text."""
    eot = [tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    stream, _ = join_encoded(tokenizer, [s.text for s in sources], eot)
    n = min(preset.eval_windows, stream.numel() // preset.seq_len)
    if n == 0:
        return None
    stride = stream.numel() // n
    rows = torch.stack([stream[i * stride:i * stride + preset.seq_len] for i in range(n)])
    total = 0.0
    for chunk in rows.split(8):  # chunk: [b, T]
        total += model(input_ids=chunk, labels=chunk).loss.item() * len(chunk)
    return total / n


def assistant_labels(ids: list[int], assistant_id: int, end_id: int) -> list[int]:
    """Labels that keep only the assistant's content and its closing <|end|> (else -100)."""
    labels, inside = [], False
    for tok in ids:
        labels.append(tok if inside else -100)
        if tok == assistant_id:
            inside = True
        elif tok == end_id:
            inside = False
    return labels


@torch.no_grad()
def heldout_chat_loss(model, tokenizer, convs, preset: Preset) -> float | None:
    """Mean cross-entropy over the assistant tokens of held-out conversations."""
    convs = stdlib.choose_prompts(convs, preset.eval_conversations)
    a_id, e_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<|assistant|>", "<|end|>"))
    loss_sum, count = 0.0, 0
    for text in render_chats(tokenizer, convs):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:preset.seq_len]
        labels = torch.tensor([assistant_labels(ids, a_id, e_id)])  # [1, T]
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]  # [T-1, V]
        target = labels[0, 1:]  # [T-1]
        keep = target != -100
        if keep.any():
            loss_sum += torch.nn.functional.cross_entropy(
                logits[keep], target[keep], reduction="sum").item()
            count += int(keep.sum())
    return loss_sum / count if count else None


# ---------------------------------------------------------------- saving + cache


def save_folder(folder: Path, model, tokenizer, info: dict) -> None:
    """Write the HF folder: weights, config, tokenizer (template in its config), provenance."""
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, do_sample=False)
    quiet_loading()  # no 'Writing model shards' bar
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    (folder / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def load_corpus(preset: Preset):
    """(train sources, held-out sources, train conversations, held-out conversations)."""
    train, heldout = stdlib.split_sources(stdlib.read_sources(limit=preset.module_limit))
    return train, heldout, stdlib.conversations(train), stdlib.conversations(heldout)


def build_into(folder: Path, preset_name: str, progress: bool) -> dict:
    """Build the target into an existing empty `folder`; returns the provenance record."""
    preset, start = PRESETS[preset_name], time.time()
    train_src, held_src, train_convs, held_convs = load_corpus(preset)
    tokenizer = train_tokenizer([s.text for s in train_src], preset.vocab_size)
    tokenizer.model_max_length = preset.max_position_embeddings
    data = build_token_data(tokenizer, train_src, train_convs)
    torch.manual_seed(preset.seed)
    model = make_model(preset, tokenizer)
    final_loss = train_model(model, data, preset, tokenizer.pad_token_id, progress)
    info = {
        "builder_version": BUILDER_VERSION, "preset": preset_name, "seed": preset.seed,
        "hyperparameters": asdict(preset),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens_seen": preset.steps * preset.batch_size * preset.seq_len,
        "train_tokens_available": data.tokens,
        "train_modules": len(train_src), "heldout_modules": len(held_src),
        "train_conversations": len(train_convs), "heldout_conversations": len(held_convs),
        "final_train_loss": final_loss,
        "heldout_text_loss": heldout_text_loss(model, tokenizer, held_src, preset),
        "heldout_assistant_loss": heldout_chat_loss(model, tokenizer, held_convs, preset),
        "torch_threads": torch.get_num_threads(),
    }
    info["wall_seconds"] = round(time.time() - start, 1)  # saving adds well under a second
    save_folder(folder, model, tokenizer, info)
    return info


def build_tiny_target(out_dir: str | os.PathLike, preset: str = "default",
                      progress: bool = True) -> Path:
    """Build the tiny target into `out_dir` atomically (temp folder beside it, then rename); an
    earlier build there is replaced, any other non-empty folder refused before building."""
    return _build_atomic(Path(out_dir).absolute(), preset, progress, overwrite=True)


def is_tiny_target(folder: Path) -> bool:
    """A folder this builder wrote (what a new build may replace)."""
    return (folder / BUILD_INFO).is_file()


def _target_dir(dest: Path):
    """atomic_dir for a tiny target folder: replaces only an earlier build of ours."""
    return atomic_dir(dest, owned=is_tiny_target, what="a tiny target folder",
                      hint="choose another --out, or move or remove it yourself")


class _BuiltMeanwhile(Exception):
    """A concurrent builder finished `dest` first: keep its folder, drop ours."""


def _build_atomic(dest: Path, preset: str, progress: bool, overwrite: bool) -> Path:
    """Build in a hidden sibling folder, then rename it onto `dest` (kept if not `overwrite`)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    try:
        with _target_dir(dest) as tmp:
            build_into(tmp, preset, progress)
            if not overwrite and is_tiny_target(dest):
                raise _BuiltMeanwhile
    except _BuiltMeanwhile:
        pass
    return dest


def cache_dir() -> Path:
    """The specheads user cache: $SPECHEADS_CACHE, else $XDG_CACHE_HOME/specheads, else ~/.cache."""
    if os.environ.get("SPECHEADS_CACHE"):
        return Path(os.environ["SPECHEADS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specheads"


def cache_path(preset: str = "default") -> Path:
    """Where the build of `preset` for this builder version lives (built or not)."""
    return cache_dir() / f"tiny-target-{preset}-{BUILDER_VERSION}"


def cached_tiny_target(preset: str = "default", progress: bool = True) -> Path:
    """The cached build of `preset` for this builder version: on first use the prebuilt copy that ships
    with specheads (hash-verified) where there is one, else built here. Temporaries of killed builds
    are removed first."""
    dest = cache_path(preset)
    remove_stale(dest.parent, r"tiny-target-[A-Za-z0-9_.-]+?")
    prebuilt = prebuilt_path(preset)
    if (dest / BUILD_INFO).is_file() and (prebuilt is None or verified(dest, prebuilt)):
        return dest
    if prebuilt is not None:
        return _install_prebuilt(prebuilt, dest, preset)
    return _build_atomic(dest, preset, progress, overwrite=False)


# ---------------------------------------------------------------- the prebuilt copy


def prebuilt_path(preset: str) -> Path | None:
    """The build of `preset` by this builder version that ships in the package, if any."""
    folder = PREBUILT_DIR / f"tiny-target-{preset}-{BUILDER_VERSION}"
    return folder if preset in PREBUILT_SHA256 and (folder / MANIFEST).is_file() else None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest(folder: Path) -> dict[str, str]:
    """{file name: sha256} as MANIFEST lists them ('<sha256>  <name>' lines)."""
    lines = (folder / MANIFEST).read_text(encoding="utf-8").splitlines()
    return {name: sha for sha, name in (line.split("  ", 1) for line in lines if line.strip())}


def verified(folder: Path, prebuilt: Path) -> bool:
    """Every file of the prebuilt build is in `folder` with the hash its manifest records."""
    return all((folder / name).is_file() and file_sha256(folder / name) == sha
               for name, sha in manifest(prebuilt).items())


class PrebuiltCorrupt(RuntimeError):
    """The prebuilt tiny target in the package does not match its recorded hashes."""


def check_prebuilt(prebuilt: Path, preset: str) -> None:
    """The manifest is the one this code records and every file matches it."""
    if file_sha256(prebuilt / MANIFEST) != PREBUILT_SHA256[preset] or not verified(prebuilt, prebuilt):
        raise PrebuiltCorrupt(f"{prebuilt}: the prebuilt tiny target does not match its recorded sha256; "
                              "reinstall specheads, or build it here with `specheads tiny-target --out DIR`")


def _install_prebuilt(prebuilt: Path, dest: Path, preset: str) -> Path:
    """Copy the verified prebuilt build into the cache atomically (replacing a stale or damaged copy)."""
    check_prebuilt(prebuilt, preset)
    with _target_dir(dest) as tmp:
        for name in manifest(prebuilt):
            shutil.copyfile(prebuilt / name, tmp / name)
        if not verified(tmp, prebuilt):
            raise PrebuiltCorrupt(f"{dest}: the copy of the prebuilt tiny target does not match its sha256")
    return dest
