"""Incremental detokenization with stop strings.

Text deltas never split a UTF-8 character: byte-level BPE tokens may end mid-character, which decodes to a
trailing U+FFFD, so such a span is held back until a later token completes it. Deltas never carry a
partial stop string that may still match: the longest suffix of the text that is a prefix of some stop
string is held back. `flush()` releases what is held when the request ends for another reason.

Each step decodes only a short window (a few tokens of context before the new ones, as vLLM does): the
context keeps decoders that strip a leading space (sentencepiece "Metaspace") from eating real spaces.
"""

from __future__ import annotations

import codecs
from typing import Protocol

_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])  # context, then the output tokens
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.ids)  # tokens before this are already in self.text
        self.text = ""  # the completion so far (only whole characters; truncated at a stop string)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False
        # Byte-level BPE: per-token bytes through an incremental UTF-8 decoder (it holds an unfinished
        # character back by itself) instead of two tokenizer calls per token. Same text, a fraction of the CPU.
        table = getattr(tokenizer, "byte_table", None)
        bytes_table: list[bytes] | None = table() if callable(table) else None
        self._bytes: list[bytes] = bytes_table or []
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if bytes_table is not None else None

    def _decode_pending(self, allow_partial: bool) -> None:
        if self._utf8 is not None:
            bytes_of, n = self._bytes, len(self._bytes)
            new = self.ids[self.read_offset :]
            data = b"".join([bytes_of[t] if 0 <= t < n else b"" for t in new])
            self.text += self._utf8.decode(data, final=allow_partial)
            del self.ids[self.read_offset :]  # decoded: only the slow path needs ids kept
            return
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not allow_partial):
            return  # nothing new, or an unfinished UTF-8 character: wait for the next token
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def add_token(self, token: int, check_stop: bool = True) -> str:
        """add([token]), with a short path for the common case (byte table, no stop strings)."""
        utf8 = self._utf8
        if utf8 is None or self.stop or self.stopped:
            return self.add([token], check_stop)
        table = self._bytes
        data = table[token] if 0 <= token < len(table) else b""
        # ASCII with no unfinished character held (the decoder's .buffer): the decoder's work without its frame
        piece = data.decode("ascii") if data.isascii() and not utf8.buffer else utf8.decode(data)
        if piece:
            self.text += piece
            self.emitted = len(self.text)
        return piece

    def add(self, token_ids: list[int], check_stop: bool = True) -> str:
        """Feed new tokens; returns the text that may be sent now. Sets `stopped` when a stop string matched
        (the text is then final: cut before the stop string, or after it with include_stop_str_in_output).
        check_stop=False (before min_tokens) ignores stop strings completed by these tokens."""
        if self.stopped:
            return ""
        old_len = len(self.text)
        if self._utf8 is not None:  # the byte path decodes just these tokens: no id history to keep
            self.read_offset = len(self.ids)
        self.ids.extend(token_ids)
        self._decode_pending(allow_partial=False)
        if check_stop and self.stop and len(self.text) > old_len:
            search_from = max(0, old_len - self.max_stop_len + 1)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                index, stop = min(hits)
                self.text = self.text[: index + (len(stop) if self.include_stop else 0)]
                self.stopped = True
                return self._take(len(self.text))
        return self._take(len(self.text) - self._partial_stop_len())

    def flush(self) -> str:
        """The request ended (not by a stop string): release everything held back, replacement chars too."""
        if not self.stopped:
            self._decode_pending(allow_partial=True)
        return self._take(len(self.text))

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        for length in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-length:]
            if any(s.startswith(tail) for s in self.stop):
                return length
        return 0

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted : end], end
        return delta
