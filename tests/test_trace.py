"""The trace format: round trips, and clear errors for every kind of bad input."""

from __future__ import annotations

import json

import msgspec
import pytest

from bunshin_async import (
    TRACE_VERSION,
    ContextMessage,
    MemoryProfile,
    Rollout,
    Step,
    Task,
    ToolCall,
    Trace,
    TraceError,
    call_key,
    check_trace,
    decode_trace,
    dump_trace,
    encode_trace,
    load_trace,
    observation_digest,
)
from bunshin_async._cli import main


def make_trace(n_rollouts: int = 2) -> Trace:
    task = Task("t0", MemoryProfile(image_bytes=1 << 30, runtime_bytes=2 << 30, boot_time=30.0))
    steps = [
        Step(2.0, ToolCall("shell", {"command": "ls"}), 0.5, observation_digest("a"), 10, 4096),
        Step(1.0, ToolCall("click", {"x": 1, "y": 2}), 1.5, observation_digest("b"), 20, 8192),
    ]
    rollouts = [Rollout(0, "t0", 0, i, 1.0, steps, final_think_time=3.0) for i in range(n_rollouts)]
    return Trace(TRACE_VERSION, "unit", [task], rollouts, {"source": "test"})


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_round_trip(fmt: str, tmp_path) -> None:
    trace = make_trace()
    path = tmp_path / f"t.{fmt}"
    dump_trace(trace, path)
    assert load_trace(path) == trace
    assert decode_trace(encode_trace(trace, fmt), fmt=fmt) == trace
    assert not list(tmp_path.glob("*.tmp-*"))


def with_context(trace: Trace) -> Trace:
    r = trace.rollouts[0]
    said = (ContextMessage("user", "cancel AB12CD please"), ContextMessage("assistant", "Sure, one moment."))
    steps = [msgspec.structs.replace(r.steps[0], context=said), *r.steps[1:]]
    return msgspec.structs.replace(trace, rollouts=[msgspec.structs.replace(r, steps=steps), *trace.rollouts[1:]])


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_round_trip_with_conversation_context(fmt: str, tmp_path) -> None:
    trace = with_context(make_trace())
    assert trace.rollouts[0].steps[0].context[0].text == "cancel AB12CD please"
    path = tmp_path / f"t.{fmt}"
    dump_trace(trace, path)
    again = load_trace(path)
    assert again == trace
    assert again.rollouts[0].steps[0].context == trace.rollouts[0].steps[0].context
    assert again.rollouts[0].steps[1].context == ()


def test_context_is_optional_and_only_written_when_present() -> None:
    """A step without context encodes as before the field existed (defaults left out), so a
    reader of version 1 that predates it accepts the file; old files load with no context."""
    plain = _json(make_trace())
    assert plain["version"] == TRACE_VERSION == 1
    assert all("context" not in s for r in plain["rollouts"] for s in r["steps"])

    class OldStep(msgspec.Struct, forbid_unknown_fields=True):  # the schema before `context`
        think_time: float
        call: dict
        exec_time: float
        observation_digest: str
        observation_size: int
        dirtied_bytes: int
        cacheable: bool = True
        modelled: tuple[str, ...] = ()

    old = msgspec.json.decode(msgspec.json.encode(plain["rollouts"][0]["steps"]), type=list[OldStep])
    assert [s.observation_size for s in old] == [10, 20]
    with pytest.raises(msgspec.ValidationError, match="context"):  # what an old reader says
        msgspec.json.decode(msgspec.json.encode(_json(with_context(make_trace()))["rollouts"][0]["steps"]),
                            type=list[OldStep])
    # and a document written before the field existed (defaults spelled out) still loads
    for r in plain["rollouts"]:
        for s in r["steps"]:
            s.update(cacheable=True, modelled=[])
    trace = decode_trace(json.dumps(plain).encode(), fmt="json")
    assert trace == make_trace() and trace.rollouts[0].steps[0].context == ()


def test_bad_context_names_the_path(tmp_path) -> None:
    doc = _json(with_context(make_trace()))
    doc["rollouts"][0]["steps"][0]["context"][1]["role"] = ""
    with pytest.raises(TraceError, match=r"\$\.rollouts\[0\]\.steps\[0\]\.context\[1\]\.role"):
        load_trace(_write(tmp_path, doc))
    doc = _json(with_context(make_trace()))
    doc["rollouts"][0]["steps"][0]["context"][0]["speaker"] = "user"
    with pytest.raises(TraceError, match=r"unknown field `speaker`"):
        load_trace(_write(tmp_path, doc))


def test_call_key_is_canonical() -> None:
    a = ToolCall("f", {"b": 1, "a": [1, {"y": 2, "x": 1}]})
    b = ToolCall("f", {"a": [1, {"x": 1, "y": 2}], "b": 1})
    assert call_key(a) == call_key(b)
    assert call_key(a) != call_key(ToolCall("g", a.arguments))


def _json(trace: Trace) -> dict:
    return json.loads(encode_trace(trace))


def _write(tmp_path, doc) -> str:
    p = tmp_path / "bad.json"
    p.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    return str(p)


def test_wrong_type_names_file_path_and_expectation(tmp_path) -> None:
    doc = _json(make_trace())
    doc["rollouts"][1]["steps"][0]["exec_time"] = "fast"
    path = _write(tmp_path, doc)
    with pytest.raises(TraceError) as e:
        load_trace(path)
    msg = str(e.value)
    assert path in msg
    assert "$.rollouts[1].steps[0].exec_time" in msg
    assert "Expected `float`" in msg


def test_negative_time_rejected(tmp_path) -> None:
    doc = _json(make_trace())
    doc["rollouts"][0]["steps"][1]["think_time"] = -1
    with pytest.raises(TraceError, match=r"\$\.rollouts\[0\]\.steps\[1\]\.think_time"):
        load_trace(_write(tmp_path, doc))


def test_missing_field_rejected(tmp_path) -> None:
    doc = _json(make_trace())
    del doc["rollouts"][0]["steps"][0]["call"]
    with pytest.raises(TraceError, match=r"missing required field `call`.*\$\.rollouts\[0\]\.steps\[0\]"):
        load_trace(_write(tmp_path, doc))


def test_unknown_field_rejected(tmp_path) -> None:
    doc = _json(make_trace())
    doc["tasks"][0]["memroy"] = {}
    with pytest.raises(TraceError, match=r"unknown field `memroy`"):
        load_trace(_write(tmp_path, doc))


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_truncated_file_is_an_error(fmt: str, tmp_path) -> None:
    data = encode_trace(make_trace(5), fmt)
    for cut in (len(data) // 3, len(data) - 1):
        p = tmp_path / f"cut.{fmt}"
        p.write_bytes(data[:cut])
        with pytest.raises(TraceError, match="truncated") as e:
            load_trace(p)
        assert str(p) in str(e.value)


def test_unknown_and_missing_version(tmp_path) -> None:
    doc = _json(make_trace())
    doc["version"] = 99
    with pytest.raises(TraceError, match=r"unknown trace version 99.*reads version 1"):
        load_trace(_write(tmp_path, doc))
    del doc["version"]
    with pytest.raises(TraceError, match=r"missing field `version`"):
        load_trace(_write(tmp_path, doc))


def test_not_a_trace(tmp_path) -> None:
    with pytest.raises(TraceError, match="empty"):
        load_trace(_write(tmp_path, b""))
    with pytest.raises(TraceError, match="a trace is an object"):
        load_trace(_write(tmp_path, [1, 2]))
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.json")


def test_cross_references(tmp_path) -> None:
    doc = _json(make_trace())
    doc["rollouts"][0]["task"] = "nope"
    with pytest.raises(TraceError, match=r"unknown task 'nope' at `\$\.rollouts\[0\]\.task`"):
        load_trace(_write(tmp_path, doc))
    doc = _json(make_trace())
    doc["rollouts"][1]["sample"] = 0
    with pytest.raises(TraceError, match=r"appears twice: `\$\.rollouts\[0\]` and `\$\.rollouts\[1\]`"):
        load_trace(_write(tmp_path, doc))
    doc = _json(make_trace())
    doc["tasks"].append(doc["tasks"][0])
    with pytest.raises(TraceError, match=r"duplicate task id 't0' at `\$\.tasks\[1\]\.id`"):
        load_trace(_write(tmp_path, doc))


def test_nondeterministic_cacheable_call_is_a_warning() -> None:
    trace = make_trace()
    r1 = trace.rollouts[1]
    steps = list(r1.steps)
    steps[1] = msgspec.structs.replace(steps[1], observation_digest=observation_digest("other"))
    trace = msgspec.structs.replace(trace, rollouts=[trace.rollouts[0], msgspec.structs.replace(r1, steps=steps)])
    warnings = check_trace(trace)
    assert len(warnings) == 1 and "steps[1]" in warnings[0] and "non-cacheable" in warnings[0]
    assert check_trace(trace, strict=True) == []


def test_cli_validate(tmp_path, capsys) -> None:
    good = tmp_path / "good.msgpack"
    dump_trace(make_trace(), good)
    assert main(["trace", "validate", str(good)]) == 0
    assert "ok, version 1" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_bytes(encode_trace(make_trace())[:-10])
    assert main(["trace", "validate", str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert "bad.json" in out and "truncated" in out
