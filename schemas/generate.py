"""Write the JSON Schemas of the wire contract next to this file: `python -m stoker.schemas.generate [--check]`.

The committed copies are what producers in other languages validate against; a test keeps them equal to a
fresh generation, so change the Structs and rerun this together.
"""

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
from stoker.schemas.messages import Cancel, Event, Job

SCHEMA_DIR = Path(__file__).parent
_DRAFT = "https://json-schema.org/draft/2020-12/schema"


def _document(kind: Any, title: str) -> dict[str, Any]:
    doc = msgspec.json.schema(kind)
    if "Job" in doc.get("$defs", {}):
        # The one cross-field rule JSON Schema can state: exactly one prompt form.
        doc["$defs"]["Job"]["oneOf"] = [{"required": [name]} for name in ("prompt", "messages", "prompt_token_ids")]
    return {"$schema": _DRAFT, "title": title,
            "description": "Stoker wire contract (CONTRACT.md). A field that is null means the same as absent; "
                           "unknown fields are ignored.", **doc}


def render() -> dict[str, str]:
    """File name -> text of every generated schema."""
    docs = {"job.schema.json": _document(Job, "Stoker job"),
            "cancel.schema.json": _document(Cancel, "Stoker cancel"),
            "event.schema.json": _document(Event, "Stoker event (chunk | done | error)")}
    return {name: json.dumps(doc, indent=2, sort_keys=True) + "\n" for name, doc in docs.items()}


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    stale = []
    for name, text in render().items():
        path = SCHEMA_DIR / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run `python -m stoker.schemas.generate`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
