"""Make a small random Llama model folder with our runtime deps only (no transformers).

    python -m stoker.engine.make_model OUT_DIR [--preset tiny|small] [--seed N]

Writes config.json, model.safetensors (safetensors.torch.save_file), a byte-level BPE tokenizer trained
with `tokenizers` on the built-in corpus below, tokenizer_config.json with a jinja2 chat template, and
generation_config.json. Output is random text, but every part of the serving path is real.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

CORPUS = """\
The stoker keeps the fire fed. Every few minutes he opens the door of the firebox, looks at the colour of \
the flames, and throws in another shovel of coal. When the fire is hot and even, the boiler makes steam, \
the pistons move, and the long train climbs the hill without complaint.

A message queue works much the same way. Producers drop jobs into a topic; workers pull them out when they \
have room, run them, and report what happened. Nobody waits at the door: the queue absorbs the bursts, and \
the workers set their own pace. If a worker falls over, another one picks up where it left off.

Language models read a prompt one token at a time and then write an answer the same way. The first pass \
over the prompt is called the prefill; every later step adds a single token and is called a decode. Keys \
and values from earlier tokens are kept in a cache so that each new token only needs to look back, not \
start over. Paging that cache into fixed blocks lets many requests share one pool of memory.

In the morning the market opens early. There are apples and pears, bread still warm from the oven, cheese \
from the hills, and fish that came in with the tide. People argue about prices, laugh, and carry their \
baskets home before the sun is high. By noon the square is quiet again, and the pigeons take it back.

Numbers are part of every story: 1, 2, 3, 10, 42, 100, 2024, 3.14159. Code is too: def main(): return 0; \
for i in range(10): print(i). JSON looks like {"key": "value", "list": [1, 2, 3]}.

Some text is not English at all. 東京は日本の首都です。今日は天気がいいですね。北京是中国的首都。\
你好，世界！Emoji travel well over the wire too: 🔥🚂✨🙂👍🏽 and the rocket 🚀 goes up.

Questions deserve answers. What time is it? It is time to write a good test. Why does the sky look blue? \
Because air scatters blue light more than red light. How many tokens fit in a block? Sixteen, by default.
"""

SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# Roles are checked so a bad message fails loudly; the generation prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role'] + ': use system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

PRESETS: dict[str, dict[str, int | float]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=384,
        init_std=0.25,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=512,
        init_std=0.1,
    ),
}


def train_tokenizer(vocab_size: int, texts: list[str] | None = None):  # -> tokenizers.Tokenizer
    """A byte-level BPE over `texts` (default: the paragraphs of CORPUS), the special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.split("\n\n") if texts is None else texts, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def write_tokenizer(out_dir: str, vocab_size: int, texts: list[str] | None = None) -> int:
    """Writes tokenizer.json + tokenizer_config.json; returns the tokenizer's vocabulary size."""
    tok = train_tokenizer(vocab_size, texts)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": None,
        "pad_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return tok.get_vocab_size(with_added_tokens=True)


def write_llama_config(
    out_dir: str, *, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
    init_std: float = 0.02, tie_word_embeddings: bool = False, max_position: int = 2048,
) -> None:
    """config.json and generation_config.json of a float32 LlamaForCausalLM over the tokenizer above."""
    head_dim = hidden // heads
    bos, eos, end = (
        SPECIAL_TOKENS.index(t) for t in ("<s>", "</s>", "<|end|>")
    )  # trainer puts specials first
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "initializer_range": init_std,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": [eos, end], "do_sample": False}, f, indent=2)


def make_model(out_dir: str, preset: str = "tiny", seed: int = 0) -> str:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    from safetensors.torch import save_file

    p = PRESETS[preset]
    os.makedirs(out_dir, exist_ok=True)
    tok_vocab = write_tokenizer(out_dir, int(p["vocab_size"]))
    vocab = -(-tok_vocab // 64) * 64  # embedding rows padded to a multiple of 64, as real models do
    hidden, inter, layers = int(p["hidden_size"]), int(p["intermediate_size"]), int(p["num_hidden_layers"])
    heads, kv_heads = int(p["num_attention_heads"]), int(p["num_key_value_heads"])
    head_dim = hidden // heads
    write_llama_config(out_dir, vocab=vocab, hidden=hidden, intermediate=inter, layers=layers, heads=heads,
                       kv_heads=kv_heads, init_std=float(p["init_std"]))
    gen = torch.Generator().manual_seed(seed)
    std = float(p["init_std"])

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {
        "model.embed_tokens.weight": rand(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(vocab, hidden),
    }
    for i in range(layers):
        pre = f"model.layers.{i}."
        weights |= {
            pre + "input_layernorm.weight": torch.ones(hidden),
            pre + "post_attention_layernorm.weight": torch.ones(hidden),
            pre + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            pre + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            pre + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            pre + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            pre + "mlp.gate_proj.weight": rand(inter, hidden),
            pre + "mlp.up_proj.weight": rand(inter, hidden),
            pre + "mlp.down_proj.weight": rand(hidden, inter),
        }
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stoker.engine.make_model", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_model(args.out_dir, args.preset, args.seed))


if __name__ == "__main__":
    main()
