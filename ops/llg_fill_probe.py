"""llguidance's mask fill on recorded constrained rows: per row, by executor thread count, by lexer families
(issue 15), and by the kind of state a row is in.

    PYTHONPATH=. python ops/llg_fill_probe.py                    # the carried states (ops/data/), H200: ~20 s
    PYTHONPATH=. python ops/llg_fill_probe.py --rows 64 --threads 1,2 --steps 8,40 --families 1,2   # dry run

Input: ops/bench_guided.py --record's file (the schema, the model's vocabulary, the greedy constrained rows'
output token ids) and the guided tokenizer those ids belong to (gzip or plain tokenizer.json), so that the
states are the ones the bench walked into whatever Python's standard library builds into a tokenizer here.

For each step s of --steps: --rows matchers (recorded row i % len(rows)) that consumed their row's first s
tokens, from a GrammarCompiler with families F (F = 1: every matcher a deep copy of one template, what the engine
did before; F > 1: the fix, engine/grammar.py FAMILY_COMPILE_BUDGET_S), then one fill per thread count T, each on
fresh matchers (a matcher caches its last mask). Before the timed fills one untimed fill of the same states
derives the lexer states they need (the "cold" column), so that the first thread count is not charged for it.
Then, per state kind (JSON context of the row's text: inside which key's string, a number, between tokens), the
fill per row of those rows alone at the largest T. Prints tables; writes $OUT/llg_fill_probe.json when OUT is
set.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_RECORD = os.path.join(HERE, "data", "guided_rows.json.gz")
DEFAULT_TOKENIZER = os.path.join(HERE, "data", "guided_tokenizer66k.json.gz")


def read_text(path: str) -> str:
    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return str(f.read())


def state_kind(text: str) -> str:
    """The JSON context at the end of text (a prefix of compact JSON): 'str:<key>' inside a value string,
    'key' inside a key, 'number' inside a number, 'literal' in true/false, else 'between'."""
    in_string = escaped = False
    string_start = 0
    last_key = ""
    is_key = False
    stack: list[str] = []
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if is_key:
                    last_key = text[string_start:i]
            continue
        if ch == '"':
            in_string, string_start = True, i + 1
            is_key = bool(stack) and stack[-1] == "{" and text[:i].rstrip()[-1:] in "{,"
        elif ch in "{[":
            stack.append(ch)
        elif ch in "}]" and stack:
            stack.pop()
    if in_string:
        return "key" if is_key else f"str:{last_key}"
    tail = text[-1:] if text else ""
    if tail.isdigit() or tail in "-.eE+":
        return "number"
    if tail.isalpha():
        return "literal"
    return "between"


class Probe:
    """The recorded rows, the tokenizer and one GrammarCompiler per family count."""

    def __init__(self, record: dict[str, Any], tokenizer_json: str, case: str | None):
        import llguidance
        from stoker.engine.sampling_params import GuidedDecoding

        cases = record["cases"]
        self.case = case or next(iter(cases))
        self.rows: list[list[int]] = cases[self.case]
        self.vocab_size = int(record["vocab_size"])
        self.guided = GuidedDecoding("json_schema", record["schema"])
        self.tokenizer_json = tokenizer_json
        self.decoder = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.vocab_size, eos_token=[1])
        self.words = (self.vocab_size + 31) // 32
        self.tokenizer_tokens = len(json.loads(tokenizer_json)["model"]["vocab"])

    def compiler(self, families: int, threads: int) -> Any:
        from stoker.engine.grammar import GrammarCompiler

        return GrammarCompiler(self.tokenizer_json, self.vocab_size, [1], mask_threads=threads, families=families)

    def kind(self, row: list[int], step: int) -> str:
        return state_kind(self.decoder.decode_str(row[:step]))


class Parents:
    """count GrammarStates of one compiler, row i % len(rows) having consumed its first step - 1 tokens (one
    more is consumed by each fresh copy, so that its mask is not the cached one); advanced step by step."""

    def __init__(self, probe: Probe, compiler: Any, count: int):
        self.probe, self.step = probe, 1
        self.states = [compiler.new_state(probe.guided) for _ in range(count)]

    def at(self, step: int) -> list[Any]:
        for i, state in enumerate(self.states):
            row = self.probe.rows[i % len(self.probe.rows)]
            tokens = row[self.step - 1 : step - 1]
            if tokens and not state.matcher.consume_tokens(tokens):
                raise RuntimeError(f"recorded row {i % len(self.probe.rows)} breaks the grammar before step "
                                   f"{step}: {state.matcher.get_error()} (a tokenizer other than the recording's?)")
        self.step = step
        return self.states


def fresh(probe: Probe, parents: list[Any], step: int) -> tuple[list[Any], list[int]]:
    """Copies of parents (each keeps its parent's lexer, so its family) advanced by their step-th token."""
    matchers = []
    for i, parent in enumerate(parents):
        matcher = parent.matcher.deep_copy()
        if not matcher.consume_token(probe.rows[i % len(probe.rows)][step - 1]):
            raise RuntimeError(f"row {i % len(probe.rows)} step {step}: {matcher.get_error()}")
        matchers.append(matcher)
    return matchers, [p.family for p in parents]


def timed_fill(compiler: Any, matchers: list[Any], families: list[int] | None, bitmask: torch.Tensor
               ) -> tuple[float, float]:
    """-> (wall us, process CPU us) per row of one fill."""
    wall, cpu = time.perf_counter(), time.process_time()
    compiler.fill_bitmasks(matchers, bitmask[: len(matchers)], families)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall / len(matchers) * 1e6, cpu / len(matchers) * 1e6


def fills_at(probe: Probe, compiler: Any, parents: list[Any], step: int, args: argparse.Namespace,
             bitmask: torch.Tensor, labels: dict[str, Any]) -> list[dict[str, Any]]:
    """The cold fill of fresh copies of parents, then per order the median of --repeat fills."""
    cold = timed_fill(compiler, *fresh(probe, parents, step), bitmask)
    rows = []
    for order in args.orders.split(",") if labels["families"] > 1 else ["batch order"]:
        samples = []
        for _ in range(args.repeat):
            matchers, families = fresh(probe, parents, step)
            samples.append(timed_fill(compiler, matchers, families if order == "grouped" else None, bitmask))
        wall, cpu = statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)
        rows.append(dict(labels, order=order, cold_wall_us=cold[0], wall_us=wall, cpu_us=cpu, cores=cpu / wall))
        print(f"families {labels['families']:2d} ({labels['built']:2d} built) step {step:3d} threads "
              f"{labels['threads']:2d} {order:11s} cold {cold[0]:8.1f}  wall {wall:8.1f}  cpu {cpu:8.1f} us/row  "
              f"cores {cpu / wall:5.2f}", flush=True)
    return rows


def run(args: argparse.Namespace, save: Any) -> dict[str, Any]:
    """save(partial result) after each step, so that a run cut by its time bound keeps what it has."""
    record = json.loads(read_text(args.record))
    probe = Probe(record, read_text(args.tokenizer_json), args.case)
    threads = [int(t) for t in args.threads.split(",")]
    steps = [s for s in (int(x) for x in args.steps.split(",")) if 1 <= s <= min(map(len, probe.rows))]
    bitmask = torch.empty(args.rows, probe.words, dtype=torch.int32)
    results: list[dict[str, Any]] = []
    kinds: list[dict[str, Any]] = []
    out = {"case": probe.case, "rows": args.rows, "recorded_rows": len(probe.rows), "vocab_size": probe.vocab_size,
           "tokenizer_tokens": probe.tokenizer_tokens, "host_cpus": os.cpu_count(),
           "affinity": len(os.sched_getaffinity(0)), "results": results, "kinds": kinds}
    began = time.perf_counter()
    family_counts = [int(f) for f in args.families.split(",")]
    # one compiler per (families, threads): an executor's size is fixed at its creation, and each compiler's
    # templates derive their own lexer states
    compilers = {(f, t): probe.compiler(f, t) for f in family_counts for t in threads}
    built = {f: compilers[f, threads[0]].num_families(probe.guided) for f in family_counts}
    lineage = {key: Parents(probe, compiler, args.rows) for key, compiler in compilers.items()}
    for step in steps:  # step-major, saved after each: a run cut by its time bound keeps whole steps
        row_kinds = [probe.kind(probe.rows[i % len(probe.rows)], step) for i in range(args.rows)]
        for families in family_counts:
            for t in threads:
                results += fills_at(probe, compilers[families, t], lineage[families, t].at(step), step, args,
                                    bitmask, dict(families=families, built=built[families], step=step, threads=t))
            t = threads[-1]
            every, families_of = fresh(probe, lineage[families, t].at(step), step)  # the rows of each kind alone
            for kind in sorted(set(row_kinds)):
                index = [i for i, k in enumerate(row_kinds) if k == kind]
                wall, cpu = timed_fill(compilers[families, t], [every[i] for i in index],
                                       [families_of[i] for i in index], bitmask)
                kinds.append(dict(families=families, step=step, threads=t, kind=kind, rows=len(index),
                                  wall_us=wall, cpu_us=cpu))
        print(f"# step {step} done at {time.perf_counter() - began:.1f} s", flush=True)
        save(out)
    return out


def string_sweep(tokenizer_json: str, vocab_size: int, max_lengths: list[int]) -> list[dict[str, Any]]:
    """One matcher of {"type": "string", "maxLength": N} per N, walked one single-byte token at a time: the
    mask's thread CPU (best of 3 fresh copies) at every other position, to show where in a bounded string the
    masks get dear."""
    from stoker.engine.grammar import GrammarCompiler
    from stoker.engine.sampling_params import GuidedDecoding

    compiler = GrammarCompiler(tokenizer_json, vocab_size, [1], mask_threads=1, families=1)
    quote, byte = (compiler.tokenizer.tokenize_str(t)[0] for t in ('"', "q"))
    rows = []
    for max_length in max_lengths:
        walker = compiler.matcher(GuidedDecoding("json_schema", json.dumps({"type": "string", "maxLength": max_length})))
        assert walker.consume_token(quote)
        for position in range(1, max_length + 1):  # position: bytes of the string once the copy's token is in
            if position % 2 or position == max_length:
                best = float("inf")
                for _ in range(3):
                    copy = walker.deep_copy()
                    assert copy.consume_token(byte)
                    started = time.thread_time()
                    copy.compute_bitmask()
                    best = min(best, time.thread_time() - started)
                rows.append(dict(max_length=max_length, position=position, mask_us=best * 1e6))
            assert walker.consume_token(byte)
    for max_length in max_lengths:
        cells = [f"{x['position']}:{x['mask_us']:.0f}" for x in rows if x["max_length"] == max_length]
        print(f"# string sweep maxLength {max_length} (position:us) " + " ".join(cells), flush=True)
    return rows


def print_tables(r: dict[str, Any]) -> None:
    print(f"# {r['rows']} rows ({r['recorded_rows']} recorded, case {r['case']}); tokenizer {r['tokenizer_tokens']:,} "
          f"of vocabulary {r['vocab_size']:,}; {r['host_cpus']} CPUs ({r['affinity']} usable); us per row")
    print("| families (built) | order | threads | fill wall us/row (median over steps) | cpu us/row | cores |"
          " cold wall us/row |")
    print("|---|---|---|---|---|---|---|")
    groups: dict[tuple[int, int, str, int], list[dict[str, Any]]] = {}
    for x in r["results"]:
        groups.setdefault((x["families"], x["built"], x["order"], x["threads"]), []).append(x)
    for (families, built, order, threads), xs in groups.items():
        med = {k: statistics.median(x[k] for x in xs) for k in ("wall_us", "cpu_us", "cores", "cold_wall_us")}
        print(f"| {families} ({built}) | {order} | {threads} | {med['wall_us']:.1f} | {med['cpu_us']:.1f} | "
              f"{med['cores']:.2f} | {med['cold_wall_us']:.1f} |")
    print("| families | threads | state kind | rows (all steps) | fill wall us/row | cpu us/row |")
    print("|---|---|---|---|---|---|")
    by_kind: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for x in r["kinds"]:
        by_kind.setdefault((x["families"], x["threads"], x["kind"]), []).append(x)
    for (families, threads, kind), xs in sorted(by_kind.items()):
        rows = sum(x["rows"] for x in xs)
        wall = sum(x["wall_us"] * x["rows"] for x in xs) / rows
        cpu = sum(x["cpu_us"] * x["rows"] for x in xs) / rows
        print(f"| {families} | {threads} | {kind} | {rows} | {wall:.1f} | {cpu:.1f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", default=DEFAULT_RECORD, help="ops/bench_guided.py --record's file (.gz or not)")
    ap.add_argument("--tokenizer-json", default=DEFAULT_TOKENIZER, help="the recording's tokenizer (.gz or not)")
    ap.add_argument("--case", default=None, help="the recorded case (default: the first)")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--threads", default="1,4,12,16")
    ap.add_argument("--steps", default="8,24,40,56,72")
    ap.add_argument("--families", default="1,12,48",
                    help="1: one template (before the fix); N: at most N (the engine's default: 4 per mask thread)")
    ap.add_argument("--orders", default="grouped,interleaved",
                    help="rows to the executor grouped by family (the fix) or in batch order")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--string-sweep", default="",
                    help="instead: the mask's cost along strings of these maxLengths (e.g. 40,60,400)")
    args = ap.parse_args(argv)
    if args.string_sweep:
        rows = string_sweep(read_text(args.tokenizer_json), int(json.loads(read_text(args.record))["vocab_size"]),
                            [int(n) for n in args.string_sweep.split(",")])
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "string_sweep.json"), "w") as f:
                json.dump(rows, f, indent=2)
        return 0
    def save(result: dict[str, Any]) -> None:
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "llg_fill_probe.json"), "w") as f:
                json.dump(result, f, indent=2)

    print_tables(run(args, save))
    return 0


if __name__ == "__main__":
    sys.exit(main())
