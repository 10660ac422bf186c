"""Train the demo model: a small Llama on the docstrings of Python's standard library, on the CPU, once.

    python -m stoker.engine.train_demo [--out DIR] [--steps N]   (ops/demo runs it; prints the folder)

The text is what every machine with Python has: each docstring of the stdlib's modules, classes and functions
(found with `ast`, never imported), one file in 20 held out for evaluation. The tokenizer is make_model's
byte-level BPE trained on that text; the model is LlamaForCausalLM-shaped and saved as an ordinary Hugging Face
folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json), so the
engine's loader reads it like any checkpoint; training.json beside them records the run (time, held-out loss,
a unigram model's loss on the same tokens). The folder is cached under $STOKER_CACHE/models (default
~/.cache/stoker), keyed by the Python version (its stdlib is the corpus) and a hash of this file and
make_model.py (the code that decides the result), so it is trained once per machine and code.

The forward below is a plain-torch training forward (whole sequences, causal SDPA); the engine's own is
inference only (paged KV cache, Triton). Both compute the same function: the tests check that the engine's
greedy tokens on this folder are the ones this forward predicts.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from stoker.engine import make_model
from torch import nn

# Trees of the stdlib that are tests, demos or vendored copies: their docstrings are not prose.
SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "lib2to3", "ensurepip", "__pycache__"}
HELD_OUT_EVERY = 20  # every 20th source file (sorted by path) is held out


@dataclass(frozen=True, slots=True)
class TrainConfig:
    # Sized for about 2 minutes on 2 CPU cores (the numbers in the README): smaller learns words but not
    # phrases, larger does not converge in time.
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 64
    batch_size: int = 32
    steps: int = 300
    lr: float = 3e-3
    warmup_steps: int = 30
    seed: int = 0


# ------------------------------------------------------------------------------------------------
# The corpus.


def stdlib_sources(stdlib: str | None = None) -> list[str]:
    """The stdlib's .py files, sorted by path relative to the stdlib (the same list on every machine with
    this Python version)."""
    root = stdlib or sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(paths, key=lambda p: os.path.relpath(p, root))


def docstrings(path: str) -> list[str]:
    """The module's, classes' and functions' docstrings of one file, dedented; none if it does not parse."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
    return [d.strip() for d in found if d and len(d.strip()) >= 20]


def corpus(stdlib: str | None = None) -> tuple[list[str], list[str]]:
    """(training docstrings, held-out docstrings): whole files are held out, so no docstring is in both."""
    train: list[str] = []
    held_out: list[str] = []
    for i, path in enumerate(stdlib_sources(stdlib)):
        (held_out if i % HELD_OUT_EVERY == 0 else train).extend(docstrings(path))
    return train, held_out


# ------------------------------------------------------------------------------------------------
# The model, named as HF Llama checkpoints name it, so that state_dict() is the checkpoint.


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotate_half rotary on x [B, heads, S, D] with cos, sin [S, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # GQA as HF does it: kv head j serves query heads j*group ... (j+1)*group-1
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: TrainConfig, vocab: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)


class TrainLlama(nn.Module):
    """input_ids [B, S] -> logits [B, S, vocab]; the LM head is tied to the embedding (saved without
    lm_head.weight, tie_word_embeddings in config.json)."""

    def __init__(self, cfg: TrainConfig, vocab: int, rope_theta: float = 10000.0):
        super().__init__()
        self.model = Backbone(cfg, vocab)
        head_dim = cfg.hidden_size // cfg.num_heads
        self.inv_freq: torch.Tensor
        self.register_buffer(
            "inv_freq", 1.0 / rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim), persistent=False
        )
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's init: N(0, 0.02), output projections scaled down by depth
                std = 0.02 / math.sqrt(2 * cfg.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        freqs = torch.arange(input_ids.shape[1]).float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x) @ self.model.embed_tokens.weight.T


# ------------------------------------------------------------------------------------------------
# Training.


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:  # tokenizer: tokenizers.Tokenizer
    """All texts as one int64 stream: <s> text </s> <s> text </s> ... (a prompt is encoded as <s> text)."""
    eos = tokenizer.token_to_id("</s>")
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids += enc.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def held_out_loss(model: TrainLlama, stream: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of the held-out stream."""
    windows = stream[: (len(stream) - 1) // seq_len * seq_len + 1]
    starts = list(range(0, len(windows) - 1, seq_len))[:max_windows]
    inputs = torch.stack([windows[s : s + seq_len] for s in starts])
    targets = torch.stack([windows[s + 1 : s + seq_len + 1] for s in starts])
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def unigram_loss(train: torch.Tensor, stream: torch.Tensor, vocab: int, seq_len: int, max_windows: int = 64) -> float:
    """The same held-out tokens' cross-entropy under token frequencies of the training stream (add-one)."""
    counts = torch.bincount(train, minlength=vocab).double() + 1
    log_probs = (counts / counts.sum()).log()
    targets = stream[1 : 1 + min(len(stream) - 1, max_windows * seq_len)]
    return -log_probs[targets].mean().item()


def train(out_dir: str, cfg: TrainConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Trains and writes the model folder to out_dir; returns what training.json records."""
    from safetensors.torch import save_file

    started = time.monotonic()
    # On a loaded machine (CI, a shared box) two intra-op threads wait on each other at every op: a step took
    # 2.1-3.7 s with 2 threads and 0.4 s with 1 at load average 6 on 2 cores. Spare cores: use up to 2.
    cores = os.cpu_count() or 1
    torch.set_num_threads(1 if os.getloadavg()[0] > cores - 1 else min(2, cores))
    torch.manual_seed(cfg.seed)
    train_texts, held_texts = corpus()
    os.makedirs(out_dir, exist_ok=True)
    tok_vocab = make_model.write_tokenizer(out_dir, cfg.vocab_size, train_texts)
    vocab = -(-tok_vocab // 64) * 64
    make_model.write_llama_config(
        out_dir, vocab=vocab, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, layers=cfg.num_layers,
        heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, tie_word_embeddings=True,
    )
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    stream, held = token_stream(tokenizer, train_texts), token_stream(tokenizer, held_texts)
    model = TrainLlama(cfg, vocab)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    offsets = torch.arange(cfg.seq_len + 1)
    loss_ema = float("nan")
    for step in range(cfg.steps):
        starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        batch = stream[starts[:, None] + offsets]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_ema = loss.item() if step == 0 else 0.95 * loss_ema + 0.05 * loss.item()
        if progress and (step % 10 == 0 or step == cfg.steps - 1):
            progress(f"step {step + 1}/{cfg.steps} loss {loss_ema:.2f} ({time.monotonic() - started:.0f} s)")
    model.eval()
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    record = {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "train_docstrings": len(train_texts),
        "held_out_docstrings": len(held_texts),
        "train_tokens": len(stream),
        "held_out_tokens": len(held),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "held_out_loss": held_out_loss(model, held, cfg.seq_len),
        "unigram_loss": unigram_loss(stream, held, vocab, cfg.seq_len),
        "train_seconds": round(time.monotonic() - started, 1),
        "torch_threads": torch.get_num_threads(),
        "config": asdict(cfg),
    }
    with open(os.path.join(out_dir, "training.json"), "w") as f:
        json.dump(record, f, indent=2)
    return record


# ------------------------------------------------------------------------------------------------
# The cache.


def cache_key(cfg: TrainConfig) -> str:
    digest = hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode())
    for module_file in (__file__, make_model.__file__):
        with open(module_file, "rb") as f:
            digest.update(f.read())
    return f"py{sys.version_info.major}{sys.version_info.minor}-{digest.hexdigest()[:12]}"


def default_dir(cfg: TrainConfig) -> str:
    cache = os.environ.get("STOKER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "stoker")
    return os.path.join(cache, "models", f"stoker-demo-{cache_key(cfg)}")


def ensure_demo_model(
    out_dir: str | None = None, cfg: TrainConfig | None = None, progress: Callable[[str], None] | None = None
) -> str:
    """The trained demo model's folder: the cached one, or trained now (into a temporary folder renamed into
    place, so two processes training at once both end with a whole folder)."""
    cfg = cfg or TrainConfig()
    out_dir = out_dir or default_dir(cfg)
    if os.path.isfile(os.path.join(out_dir, "training.json")):
        return out_dir
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".training-", dir=parent)
    try:
        train(tmp, cfg, progress)
        try:
            os.rename(tmp, out_dir)
        except OSError:  # another process finished first (or a stale half folder): keep a whole one
            if not os.path.isfile(os.path.join(out_dir, "training.json")):
                shutil.rmtree(out_dir, ignore_errors=True)
                os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stoker.engine.train_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="model folder (default: the cache folder for this Python and code)")
    parser.add_argument("--steps", type=int, default=TrainConfig().steps, help="optimizer steps (default %(default)s)")
    args = parser.parse_args(argv)

    trained = False

    def progress(line: str) -> None:  # one line on stderr, rewritten in place
        nonlocal trained
        trained = True
        print(f"\r[train_demo] training the demo model on the stdlib's docstrings: {line}   ", end="",
              file=sys.stderr, flush=True)

    out = ensure_demo_model(args.out, TrainConfig(steps=args.steps), progress)
    if trained:
        print(file=sys.stderr)  # end the progress line
    print(out)


if __name__ == "__main__":
    main()
