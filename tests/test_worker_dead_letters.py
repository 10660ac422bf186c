"""Dead-letter assembly (worker.dead_letters), without Kafka: the record forwarded whole with our headers,
then smaller forms whose message says what was left out."""

from __future__ import annotations

from stoker.schemas import (
    DLQ_ATTEMPTS,
    DLQ_ERROR_CODE,
    DLQ_ERROR_MESSAGE,
    DLQ_FAILED_AT,
    DLQ_HEADERS,
    DLQ_WORKER,
    dlq_headers,
)
from stoker.worker.dead_letters import DeadLetter, stub

ORIGINAL = [("content-type", b"application/json"), ("trace", b"t-1")]


def letter(key: bytes | None = b"rid-1", value: bytes | None = b"{bad json", message: str = "not JSON") -> DeadLetter:
    return DeadLetter.of(key, value, ORIGINAL, code="invalid_job", message=message, attempts=0, worker="w1",
                         now_ms=111)


def ours(headers: list[tuple[str, bytes]]) -> dict[str, str]:
    return {name: value.decode() for name, value in headers if name in DLQ_HEADERS}


def test_the_whole_record_goes_first_with_the_headers_stamped_at_rejection():
    dl = letter()
    form = dl.forms[0]
    key, value, headers = dl.record(form, now_ms=999)
    assert (key, value, form.dropped) == (b"rid-1", b"{bad json", "")
    assert headers[:2] == ORIGINAL  # the original headers first, ours after
    assert headers[2:] == dlq_headers("invalid_job", "not JSON", 111, "w1", 0)  # stamped once, at 111


def test_smaller_forms_drop_value_then_headers_then_key_and_say_so():
    dl = letter()
    forms = dl.forms
    assert [f.dropped for f in forms] == ["", "value", "value and headers", "key, value and headers"]
    small = stub(len(b"{bad json"))
    assert small == b"stoker: the dead-lettered record's value (9 bytes) is left out"
    assert [(f.key, f.value) for f in forms[1:]] == [(b"rid-1", small), (b"rid-1", small), (None, small)]
    assert [f.headers for f in forms[1:]] == [ORIGINAL, [], []]
    for form in forms[1:]:
        key, value, headers = dl.record(form, now_ms=222)
        mine = ours(headers)
        assert mine[DLQ_FAILED_AT] == "222"  # a fresh stamp per try of a smaller form
        assert mine[DLQ_ERROR_MESSAGE] == (
            f"not JSON; the record's {form.dropped} made the dead letter too large to send and are left out "
            "(value 9 bytes, key 5 bytes)")
        assert (mine[DLQ_ERROR_CODE], mine[DLQ_WORKER], mine[DLQ_ATTEMPTS]) == (
            "invalid_job", "w1", "0")


def test_messages_are_bounded():
    dl = letter(message="x" * 5000)
    whole = ours(dl.record(dl.forms[0], now_ms=1)[2])[DLQ_ERROR_MESSAGE]
    assert whole == "x" * 1000
    note = ours(dl.record(dl.forms[1], now_ms=1)[2])[DLQ_ERROR_MESSAGE]
    assert note.startswith("x" * 800 + "; the record's value") and "x" * 801 not in note


def test_a_record_without_a_value_keeps_what_came():
    keyed = letter(value=None)
    assert (keyed.forms[0].key, keyed.forms[0].value) == (b"rid-1", None)
    bare = letter(key=None, value=None)  # neither key nor value: the stub stands in so the letter has a body
    assert (bare.forms[0].key, bare.forms[0].value) == (None, stub(0))


def test_headers_are_copied_not_shared():
    dl = letter()
    key, value, headers = dl.record(dl.forms[0], now_ms=1)
    headers.append(("more", b"1"))
    assert dl.record(dl.forms[0], now_ms=1)[2] != headers and dl.headers == ORIGINAL
