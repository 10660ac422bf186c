"""Tokenizer from a model folder: tokenizer.json (via `tokenizers`), tokenizer_config.json special tokens,
BOS handling and the jinja2 chat template rendered the way transformers renders it."""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict with 'content'."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"model folder {path!r} has no tokenizer.json (only fast tokenizers are supported)"
            )
        self._tok = HFTokenizer.from_file(file)
        self._file = file
        self._byte_table: list[bytes] | None | bool = False  # False: not built yet
        cfg: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                cfg = json.load(f)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        # add_bos_token: True/False forces it; absent leaves it to tokenizer.json's post-processor.
        self.add_bos_token: bool | None = cfg.get("add_bos_token")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        self.chat_template: str | None = template
        self._special_tokens = {k: _token_text(v) for k, v in cfg.items() if k.endswith("_token")}
        self._compiled: Any = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_token_id is not None:
            if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
                ids = [self.bos_token_id, *ids]
            elif self.add_bos_token is False and ids and ids[0] == self.bos_token_id:
                ids = ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def byte_table(self) -> list[bytes] | None:
        """For a byte-level BPE tokenizer (GPT-2/Llama-3 style: ByteLevel decoder), each id's bytes as decode
        with skip_special_tokens produces them (special tokens and unknown ids: b""), so a detokenizer can
        decode a stream by concatenating bytes. None for any other decoder. Built once, on first use."""
        if self._byte_table is False:
            self._byte_table = self._build_byte_table()
        return self._byte_table  # type: ignore[return-value]

    def _build_byte_table(self) -> list[bytes] | None:
        with open(self._file, encoding="utf-8") as f:
            spec = json.load(f)
        decoder = spec.get("decoder") or {}
        if decoder.get("type") != "ByteLevel" or (spec.get("model") or {}).get("type") != "BPE":
            return None
        # GPT-2's reversible byte <-> printable character map (what ByteLevel decoding undoes).
        keep = [
            *range(ord("!"), ord("~") + 1),
            *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1),
        ]
        chars = {chr(b): b for b in keep}
        extra = 0
        for b in range(256):
            if b not in keep:
                chars[chr(256 + extra)] = b
                extra += 1
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        table: list[bytes] = []
        for i in range(self._tok.get_vocab_size(with_added_tokens=True)):
            token = self._tok.id_to_token(i)
            if token is None or i in special:
                table.append(b"")
            elif all(c in chars for c in token):
                table.append(bytes(chars[c] for c in token))
            else:  # as the ByteLevel decoder does for a token outside the map (an added token's text)
                table.append(token.encode("utf-8"))
        return table

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render like transformers: sandboxed jinja2, trim_blocks/lstrip_blocks, raise_exception, tojson."""
        if not self.chat_template:
            raise ValueError(
                "this model has no chat_template (tokenizer_config.json): send a prompt instead of messages"
            )
        if self._compiled is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ValueError(f"chat template: {message}")

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii
            )
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled = env.from_string(self.chat_template)
        context = {**{k: v for k, v in self._special_tokens.items() if v is not None}}
        return self._compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template writes BOS itself, so no special tokens are added here (as transformers does).
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)
