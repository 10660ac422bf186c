"""How many distinct masks the rows inside one bounded string have at each character count (issue 15's tail).

    PYTHONPATH=. python ops/llg_share_probe.py          # the carried recording (ops/data/), ~1 min on the dev VM

On the H200 every constrained round has five steps of 107-206 ms (BENCHMARKS.md, call 2 at 21:32 UTC) in which all
1,024 rows are inside the schema's `name` (maxLength 40) near its end, where llguidance's mask costs ~1.7 ms of CPU
a row. This replays ops/bench_guided.py --record's rows (ops/data/guided_rows.json.gz, the 66,144-token tokenizer)
through one matcher each and, for every token position inside a string value of --key with at least --min-chars
characters written, groups the mask by the characters written so far: if a group's rows share a handful of masks,
computing each distinct mask once a step would remove most of that work (it needs a state-equality signal from
llguidance: the character count is not one, an escape or a split UTF-8 character changes the mask). Prints one line.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

from stoker.ops.llg_fill_probe import DEFAULT_RECORD, DEFAULT_TOKENIZER, read_text, state_kind


def masks_by_chars(record: dict[str, object], tokenizer_json: str, key: str, min_chars: int) -> dict[int, list[bytes]]:
    """-> characters written inside key's string -> the masks of every row position there."""
    from stoker.engine.grammar import GrammarCompiler
    from stoker.engine.sampling_params import GuidedDecoding
    from tokenizers import Tokenizer

    decoder = Tokenizer.from_str(tokenizer_json)
    compiler = GrammarCompiler(tokenizer_json, int(record["vocab_size"]), [1], mask_threads=1, families=1)  # type: ignore[call-overload]
    guided = GuidedDecoding("json_schema", str(record["schema"]))
    opening = f'"{key}":"'
    groups: dict[int, list[bytes]] = collections.defaultdict(list)
    for row in next(iter(record["cases"].values())):  # type: ignore[attr-defined]
        matcher = compiler.matcher(guided)
        for position, token in enumerate(row):
            text = decoder.decode(row[:position])
            if state_kind(text) == f"str:{key}":
                written = len(text) - text.rindex(opening) - len(opening)
                if written >= min_chars:
                    groups[written].append(bytes(matcher.compute_bitmask()))
            if not matcher.consume_token(token):
                raise RuntimeError(f"the recording's token {token} breaks the schema at {position}")
    return groups


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", default=DEFAULT_RECORD)
    ap.add_argument("--tokenizer-json", default=DEFAULT_TOKENIZER)
    ap.add_argument("--key", default="name")
    ap.add_argument("--min-chars", type=int, default=8)
    args = ap.parse_args(argv)
    groups = masks_by_chars(json.loads(read_text(args.record)), read_text(args.tokenizer_json), args.key, args.min_chars)
    positions = sum(len(v) for v in groups.values())
    distinct = sum(len(set(v)) for v in groups.values())
    cells = " ".join(f"{chars}:{len(v)}/{len(set(v))}" for chars, v in sorted(groups.items()))
    print(f"# inside {args.key!r}, >= {args.min_chars} characters written: {positions} row positions, {distinct} "
          f"distinct masks by character count (chars:rows/distinct) {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
