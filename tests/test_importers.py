"""Importers: mappings, round trips, and clear errors on bad input."""

from __future__ import annotations

import json
import pathlib

import pytest

from bunshin_async import (
    ContextMessage,
    ImportModel,
    TraceError,
    check_trace,
    dump_trace,
    import_asciinema,
    import_openai,
    import_swe_agent,
    import_trace,
    load_trace,
    observation_digest,
    observation_index,
    observation_values,
)
from bunshin_async._cli import main

SAMPLE = pathlib.Path("/work/shared/traces/tau-bench-airline-sample.json")
needs_sample = pytest.mark.skipif(not SAMPLE.exists(), reason="the bundled tau-bench sample is not present")


def roundtrip(trace, tmp_path: pathlib.Path) -> None:
    for name in ("t.json", "t.msgpack"):
        dump_trace(trace, tmp_path / name)
        assert load_trace(tmp_path / name) == trace


# -- openai ------------------------------------------------------------------------------------

def tc(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def small_openai() -> list[dict]:
    user = {"user_id": "u_1", "reservations": ["AB12CD", "EF34GH"]}
    traj = [
        {"role": "system", "content": "policy"},
        {"role": "user", "content": "hi, I am u_1"},
        {"role": "assistant", "content": None, "tool_calls": [tc("c1", "get_user_details", {"user_id": "u_1"})]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_user_details", "content": json.dumps(user)},
        {"role": "assistant", "content": "x" * 400, "tool_calls": [
            tc("c2", "get_reservation_details", {"reservation_id": "AB12CD"}),
            tc("c3", "cancel_reservation", {"reservation_id": "AB12CD"})]},
        {"role": "tool", "tool_call_id": "c2", "content": "{\"reservation_id\": \"AB12CD\"}"},
        {"role": "tool", "tool_call_id": "c3", "content": "done"},
        {"role": "assistant", "content": "bye"},
    ]
    return [
        {"task_id": 7, "trial": 1, "reward": 1.0, "info": {"task": {"instruction": "cancel"}}, "traj": traj},
        {"task_id": 7, "trial": 0, "reward": 0, "traj": traj[:4] + [{"role": "assistant", "content": "ok"}]},
    ]


def test_openai_mapping(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "small.json"
    src.write_text(json.dumps(small_openai()))
    model = ImportModel(tokens_per_second=100.0, first_token_seconds=0.5, chars_per_token=4.0, default_exec_time=2.0)
    trace = import_openai(src, model=model)
    assert [t.id for t in trace.tasks] == ["7"] and trace.tasks[0].description == "cancel"
    # trials become samples of group 0, epoch 0, in trial order
    assert [(r.epoch, r.group, r.sample) for r in trace.rollouts] == [(0, 0, 0), (0, 0, 1)]
    r = trace.rollouts[1]
    assert r.reward == 1.0
    assert [s.call.name for s in r.steps] == ["get_user_details", "get_reservation_details", "cancel_reservation"]
    assert r.steps[1].call.arguments == {"reservation_id": "AB12CD"}
    assert r.steps[2].observation_digest == observation_digest("done") and r.steps[2].observation_size == 4
    for s in r.steps:
        assert s.modelled == ("think_time", "exec_time", "dirtied_bytes")
        assert s.exec_time == 2.0 and s.cacheable
    # think time: each model/user message since the last observation, plus the call's own text
    text = "x" * 400 + json.dumps({"reservation_id": "AB12CD"}) + json.dumps({"reservation_id": "AB12CD"})
    assert r.steps[1].think_time == pytest.approx(0.5 + round(len(text) / 4) / 100)
    assert r.steps[2].think_time == 0.0  # a parallel call of the same message
    assert r.final_think_time == pytest.approx(0.5 + 1 / 100)
    # read-only tools dirty less than writing ones
    assert r.steps[0].dirtied_bytes < r.steps[2].dirtied_bytes
    # the observation-values index holds the ids the user lookup returned
    idx = observation_index(trace)
    assert idx[r.steps[0].observation_digest][:2] == ("u_1", "AB12CD") or "AB12CD" in idx[r.steps[0].observation_digest]
    roundtrip(trace, tmp_path)


def test_openai_conversation_context(tmp_path: pathlib.Path) -> None:
    """Each step carries the user and assistant text that reached the policy since its
    previous call: not the system prompt, not tool output, and not the text that came with
    the call itself (that is the next step's)."""
    traj = [
        {"role": "system", "content": "policy"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Your user id?"},
        {"role": "user", "content": "It is u_1."},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [tc("c1", "get_user_details", {"user_id": "u_1"})]},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"reservations": ["AB12CD"]})},
        {"role": "assistant", "content": None, "tool_calls": [
            tc("c2", "get_reservation_details", {"reservation_id": "AB12CD"}),
            tc("c3", "get_reservation_details", {"reservation_id": "EF34GH"})]},
        {"role": "tool", "tool_call_id": "c2", "content": "{}"},
        {"role": "tool", "tool_call_id": "c3", "content": "{}"},
        {"role": "assistant", "content": "Which one?"},
        {"role": "user", "content": "Cancel AB12CD."},
        {"role": "assistant", "content": "", "tool_calls": [tc("c4", "cancel_reservation", {"reservation_id": "AB12CD"})]},
        {"role": "tool", "tool_call_id": "c4", "content": "ok"},
        {"role": "assistant", "content": "Done."},
    ]
    src = tmp_path / "talk.json"
    src.write_text(json.dumps([{"task_id": "t", "trial": 0, "reward": 1.0, "traj": traj}]))
    trace = import_openai(src)
    steps = trace.rollouts[0].steps
    u, a = "user", "assistant"
    assert [s.context for s in steps] == [
        (ContextMessage(u, "hi"), ContextMessage(a, "Your user id?"), ContextMessage(u, "It is u_1.")),
        (ContextMessage(a, "Let me look."),),  # written with call 1: known before call 2, not 1
        (),  # a parallel call of the same message
        (ContextMessage(a, "Which one?"), ContextMessage(u, "Cancel AB12CD.")),
    ]
    roundtrip(trace, tmp_path)


def test_openai_reused_call_ids_match_the_next_answer(tmp_path: pathlib.Path) -> None:
    traj = [
        {"role": "assistant", "tool_calls": [tc("same", "a", {})]},
        {"role": "tool", "tool_call_id": "same", "content": "first"},
        {"role": "assistant", "tool_calls": [tc("same", "b", {})]},
        {"role": "tool", "tool_call_id": "same", "content": "second"},
    ]
    src = tmp_path / "ids.json"
    src.write_text(json.dumps([{"task_id": "t", "trial": 0, "reward": 0.0, "traj": traj}]))
    steps = import_openai(src).rollouts[0].steps
    assert [s.observation_digest for s in steps] == [observation_digest("first"), observation_digest("second")]


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"not": "a list"}, r"`\$`: expected a list"),
        ([{"trial": 0, "traj": []}], r"record 0: missing field `task_id`"),
        ([{"task_id": 1, "trial": -1, "traj": []}], r"record 0 field `trial`"),
        ([{"task_id": 1, "trial": 0, "reward": "x", "traj": []}], r"record 0 field `reward`"),
        ([{"task_id": 1, "trial": 0, "traj": [{"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "{bad"}}]}]}],
         r"record 0 field `traj\[0\].tool_calls\[0\].function.arguments`: not valid JSON"),
        ([{"task_id": 1, "trial": 0, "traj": [{"role": "assistant", "tool_calls": [tc("c", "f", {})]}]}],
         r"record 0 field `traj\[0\].tool_calls\[0\].id`: no `tool` message"),
        ([{"task_id": 1, "trial": 0, "traj": []}, {"task_id": 1, "trial": 0, "traj": []}],
         r"record 1: task '1' trial 0 already appears in record 0"),
    ],
)
def test_openai_bad_input_names_record_and_field(tmp_path: pathlib.Path, doc, match: str) -> None:
    src = tmp_path / "bad.json"
    src.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=match) as info:
        import_openai(src)
    assert str(src) in str(info.value)


def test_openai_truncated_file(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "cut.json"
    src.write_text(json.dumps(small_openai())[:-40])
    with pytest.raises(TraceError, match="truncated"):
        import_openai(src)


@needs_sample
def test_openai_bundled_sample_roundtrips(tmp_path: pathlib.Path) -> None:
    trace = import_openai(SAMPLE)
    assert len(trace.tasks) == 6 and len(trace.rollouts) == 24
    assert sum(len(r.steps) for r in trace.rollouts) > 100
    assert {r.sample for r in trace.rollouts} == {0, 1, 2, 3}
    # every group is contiguous, in trial order
    groups = list(trace.groups())
    assert [len(g) for g in groups] == [4] * 6
    assert check_trace(trace) == []  # deterministic tools: same call after same prefix, same result
    # the conversation: every user message before a call is in the context of a step up to it
    doc = json.loads(SAMPLE.read_text())
    assert sum(bool(s.context) for r in trace.rollouts for s in r.steps) > 50
    for rec in doc:
        r = next(r for r in trace.rollouts if r.task == str(rec["task_id"]) and r.sample == rec["trial"])
        if not r.steps:
            continue
        first_call = next(j for j, m in enumerate(rec["traj"]) if m.get("tool_calls"))
        before = [m["content"] for m in rec["traj"][:first_call] if m["role"] == "user" and m.get("content")]
        assert [m.text for m in r.steps[0].context if m.role == "user"] == before
        heard = [m.text for s in r.steps for m in s.context if m.role == "user"]
        users = [m["content"] for m in rec["traj"] if m["role"] == "user" and m.get("content")]
        assert heard == users[: len(heard)]  # in order; the rest came after the last call
    roundtrip(trace, tmp_path)


# -- swe-agent ---------------------------------------------------------------------------------

def swe_doc(actions: list[tuple[str, str, float | None]]) -> dict:
    steps = []
    for action, obs, et in actions:
        e = {"action": action, "observation": obs, "response": f"I will run {action}", "thought": "t",
             "state": "{}", "messages": []}
        if et is not None:
            e["execution_time"] = et
        steps.append(e)
    return {"environment": "swe_main", "trajectory": steps, "history": [], "info": {"exit_status": "submitted"}}


def test_swe_agent_mapping_and_grouping(tmp_path: pathlib.Path) -> None:
    for run in ("run1", "run2"):
        d = tmp_path / "runs" / run / "astropy__astropy-1"
        d.mkdir(parents=True)
        (d / "astropy__astropy-1.traj").write_text(json.dumps(swe_doc([
            ("find_file setup.py", "Found 1 matches: /repo/setup.py", 0.25),
            ("python reproduce.py", "Traceback ...", 3.5),
            ("date", "Mon", None),
            ("submit", "diff --git", 0.1),
        ])))
    trace = import_swe_agent(tmp_path / "runs")
    assert [t.id for t in trace.tasks] == ["astropy__astropy-1"]
    assert [(r.task, r.sample) for r in trace.rollouts] == [("astropy__astropy-1", 0), ("astropy__astropy-1", 1)]
    steps = trace.rollouts[0].steps
    assert [s.call.name for s in steps] == ["find_file", "bash", "bash", "submit"]
    assert steps[1].call.arguments == {"command": "python reproduce.py"}
    assert [s.exec_time for s in steps] == [0.25, 3.5, 1.0, 0.1]
    assert steps[0].modelled == ("think_time", "dirtied_bytes")
    assert steps[2].modelled == ("think_time", "exec_time", "dirtied_bytes")
    assert [s.cacheable for s in steps] == [True, True, False, True]  # `date` reads the clock
    assert steps[0].observation_digest == observation_digest("Found 1 matches: /repo/setup.py")
    roundtrip(trace, tmp_path)
    # a single file: the task is its stem
    one = import_swe_agent(tmp_path / "runs" / "run1" / "astropy__astropy-1" / "astropy__astropy-1.traj")
    assert [r.task for r in one.rollouts] == ["astropy__astropy-1"]


def test_swe_agent_first_step_hears_the_issue(tmp_path: pathlib.Path) -> None:
    """The instance prompt (the user messages of ``history`` before the first action,
    demonstrations skipped) is the first step's context; later user messages are
    observations, which the steps hold already."""
    doc = swe_doc([("find_file setup.py", "Found", 0.1), ("submit", "diff", 0.1)])
    doc["history"] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "demo issue", "is_demo": True},
        {"role": "user", "content": [{"type": "text", "text": "Fix the crash in "}, {"type": "text", "text": "io/fits.py"}]},
        {"role": "assistant", "content": "I will look", "action": "find_file setup.py"},
        {"role": "user", "content": "Found"},
    ]
    (tmp_path / "x.traj").write_text(json.dumps(doc))
    steps = import_swe_agent(tmp_path / "x.traj").rollouts[0].steps
    assert steps[0].context == (ContextMessage("user", "Fix the crash in io/fits.py"),)
    assert steps[1].context == ()
    roundtrip(import_swe_agent(tmp_path / "x.traj"), tmp_path)


def test_swe_agent_history_only(tmp_path: pathlib.Path) -> None:
    doc = {"history": [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": "let me look", "action": "ls -la"},
        {"role": "user", "content": "a.py b.py"},
    ]}
    (tmp_path / "x.traj").write_text(json.dumps(doc))
    (s,) = import_swe_agent(tmp_path / "x.traj").rollouts[0].steps
    assert s.call.arguments == {"command": "ls -la"} and s.observation_size == len("a.py b.py")
    assert "exec_time" in s.modelled


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"info": {}}, "missing field `trajectory`"),
        ({"trajectory": [{"observation": "x"}]}, r"step 0 \(`trajectory\[0\]`\) field `action`"),
        ({"trajectory": [{"action": "ls", "execution_time": -1}]}, r"step 0 .* field `execution_time`"),
        ({"history": [{"role": "assistant", "action": "ls"}]}, r"message 0 .*no observation"),
    ],
)
def test_swe_agent_bad_input(tmp_path: pathlib.Path, doc, match: str) -> None:
    src = tmp_path / "bad.traj"
    src.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=match):
        import_swe_agent(src)


# -- asciinema ---------------------------------------------------------------------------------

HEADER = {"version": 2, "width": 80, "height": 24, "timestamp": 1700000000, "title": "demo"}


def cast(events: list[list]) -> str:
    return "\n".join([json.dumps(HEADER)] + [json.dumps(e) for e in events]) + "\n"


def test_asciinema_with_input_events(tmp_path: pathlib.Path) -> None:
    events = [
        [0.1, "o", "$ "],
        [1.0, "i", "l"], [1.1, "o", "l"], [1.2, "i", "x\x7fs"], [1.3, "o", "s"],
        [2.0, "i", "\r"], [2.0, "o", "\r\n"],
        [2.5, "o", "a.txt  b.txt\r\n"], [2.6, "o", "$ "],
        [4.0, "i", "date\r"], [4.1, "o", "date\r\nMon\r\n"], [4.3, "o", "$ "],
    ]
    src = tmp_path / "s.cast"
    src.write_text(cast(events))
    trace = import_asciinema(src)
    steps = trace.rollouts[0].steps
    assert [s.call.arguments["command"] for s in steps] == ["ls", "date"]
    assert {s.call.name for s in steps} == {"shell"}
    assert steps[0].think_time == pytest.approx(2.0 - 0.1)  # from the prompt to Enter
    assert steps[0].exec_time == pytest.approx(2.6 - 2.0)  # from Enter to the next prompt
    assert steps[0].observation_digest == observation_digest("\na.txt  b.txt\n")
    assert steps[1].think_time == pytest.approx(4.0 - 2.6)
    assert steps[1].exec_time == pytest.approx(0.3)
    assert [s.cacheable for s in steps] == [True, False]
    assert steps[0].modelled == ("dirtied_bytes",)
    assert trace.tasks[0].description == "demo"
    assert all(s.context == () for s in steps)  # a terminal recording has no conversation
    roundtrip(trace, tmp_path)


def test_asciinema_output_only_split_on_prompts(tmp_path: pathlib.Path) -> None:
    events = [
        [0.0, "o", "user@host:~$ "], [0.8, "o", "cat a.txt\r\n"], [1.5, "o", "hello\r\n"],
        [1.6, "o", "user@host:~$ "], [3.0, "o", "\x1b[1mpwd\x1b[0m\r\n/home\r\n"], [3.2, "o", "user@host:~$ "],
    ]
    src = tmp_path / "o.cast"
    src.write_text(cast(events))
    steps = import_asciinema(src).rollouts[0].steps
    assert [s.call.arguments["command"] for s in steps] == ["cat a.txt", "pwd"]
    assert steps[0].think_time == pytest.approx(0.8)
    assert steps[0].exec_time == pytest.approx(1.6 - 0.8)
    assert steps[0].observation_digest == observation_digest("hello\n")
    assert steps[1].observation_digest == observation_digest("/home\n")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", r"line 1: the file is empty"),
        (json.dumps({"version": 1}) + "\n", r"line 1 field `version`"),
        (json.dumps(HEADER) + "\n[0.1, \"o\", \"x\"]\n[0.2, \"o\"]\n", r"line 3: expected an event"),
        (json.dumps(HEADER) + "\n[0.5, \"o\", \"x\"]\n[0.2, \"o\", \"y\"]\n", r"line 3 field `time`"),
        (json.dumps(HEADER) + "\n[0.1, \"o\", \"x\"]\n[0.2, \"o\", \"y", r"line 3: the file is truncated"),
    ],
)
def test_asciinema_bad_input(tmp_path: pathlib.Path, text: str, match: str) -> None:
    src = tmp_path / "bad.cast"
    src.write_text(text)
    with pytest.raises(TraceError, match=match):
        import_asciinema(src)


# -- shared ------------------------------------------------------------------------------------

def test_observation_values_finds_ids() -> None:
    vals = observation_values(json.dumps({"payment_methods": {"credit_card_1": {"id": "credit_card_1"}},
                                          "reservations": ["JG7FMM", "LQ940Q"], "name": "Mia", "n": 1532}))
    assert vals == ("credit_card_1", "JG7FMM", "LQ940Q", "1532")
    assert "src/a_1.py" in observation_values("see src/a_1.py and README")


def test_import_trace_unknown_format() -> None:
    with pytest.raises(TraceError, match="unknown import format"):
        import_trace("csv", ["x"])


def test_cli_import(tmp_path: pathlib.Path, capsys) -> None:
    src = tmp_path / "small.json"
    src.write_text(json.dumps(small_openai()))
    out = tmp_path / "out.json"
    assert main(["trace", "import", "openai", str(src), str(out), "--default-exec-time", "3"]) == 0
    assert "2 rollouts" in capsys.readouterr().out
    assert load_trace(out).rollouts[1].steps[0].exec_time == 3.0
    assert main(["trace", "import", "openai", str(tmp_path / "missing.json"), str(out)]) == 2
    assert "missing.json" in capsys.readouterr().err
