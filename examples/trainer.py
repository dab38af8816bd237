"""A trainer's side of ``bunshin serve``, end to end: one group of G samples of one task.

    sudo bunshin serve &                    # live workspaces of the bundled spec, 127.0.0.1:8765
    python3 examples/trainer.py [--url http://127.0.0.1:8765/v1] [--group 8]

It registers a task (with a set-up call run once in the task's root workspace), opens a group
of G sessions forked from that root, steps every session concurrently until its "model" stops,
computes each trajectory's reward with a verifier that runs a call in the sample's own
workspace, and closes each session with its reward. It prints, per sample, its calls, how each
was served (``executed``, ``cache``: skipped thanks to the prefix tree, ``speculation``) and
its reward, and exits with status 0 only if every sample got a reward.

The model here is a stand-in: a scripted policy whose samples share their opening calls and
then diverge (each writes its own answer), which is what makes the prefix cache pay. Replace
``next_call`` with your model's sampling and ``verify`` with your task's checker.
"""

from __future__ import annotations

import argparse
import json
import sys

import anyio
import httpx

TASK = {
    "id": "count-conf",
    "description": "How many files directly under /etc end in .conf? Write the number to /root/answer.",
    "setup": [{"name": "shell", "arguments": {"command": "mkdir -p /root && cd /root"}}],
}


def next_call(sample: int, history: list[dict]) -> dict | None:
    """The stand-in model: the next tool call of sample *sample* given what it saw, or None
    when it is done. Every sample looks around the same way first (a shared prefix), then
    counts with its own method, and some of them get it wrong."""
    script = [
        {"name": "ls", "arguments": {"path": "/etc"}},
        {"name": "cat", "arguments": {"path": "/etc/os-release"}},
        {"name": "shell", "arguments": {"command": ["find /etc -maxdepth 1 -name '*.conf' | wc -l",
                                                    "find /etc -maxdepth 1 -name '*.conf' -printf . | wc -c",
                                                    "ls /etc | wc -l"][sample % 3]}},  # the last: wrong
    ]
    if len(history) < len(script):
        return script[len(history)]
    if len(history) == len(script):  # write the number the count printed
        count = history[-1]["observation"]["output"].strip()
        return {"name": "write_file", "arguments": {"path": "/root/answer", "content": count}}
    return None


async def verify(api: httpx.AsyncClient, session: str) -> float:
    """The reward: 1 if the answer the sample wrote is right, else 0. Checked in the sample's
    own workspace, through the same API (the check is one more step of the session)."""
    check = {"name": "shell", "arguments": {
        "command": "test \"$(cat /root/answer)\" = \"$(find /etc -maxdepth 1 -name '*.conf' | wc -l)\" && echo right || echo wrong"}}
    r = await api.post(f"/sessions/{session}/step", json={"call": check})
    r.raise_for_status()
    return 1.0 if r.json()["observation"]["output"].strip() == "right" else 0.0


async def sample(api: httpx.AsyncClient, i: int, session: str, out: dict[int, dict]) -> None:
    history: list[dict] = []
    while (call := next_call(i, history)) is not None:
        r = await api.post(f"/sessions/{session}/step", json={"call": call})
        r.raise_for_status()
        history.append(r.json())
    reward = await verify(api, session)
    r = await api.post(f"/sessions/{session}/close", json={"reward": reward})
    r.raise_for_status()
    out[i] = {"session": session, "calls": [s["call"]["name"] for s in history],
              "served_by": [s["served_by"] for s in history], "reward": reward}


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8765/v1", help="the service's API (default %(default)s)")
    ap.add_argument("--group", type=int, default=8, help="samples in the group, G (default 8)")
    args = ap.parse_args()
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as api:
        r = await api.post("/tasks", json=TASK)
        if r.status_code == 409:  # registered by an earlier run of this script: reuse it
            r = await api.get(f"/tasks/{TASK['id']}")
        r.raise_for_status()
        r = await api.post(f"/tasks/{TASK['id']}/groups", json={"size": args.group, "wait": 60})
        r.raise_for_status()
        group = r.json()
        out: dict[int, dict] = {}
        async with anyio.create_task_group() as tg:  # the samples step concurrently
            for i, session in enumerate(group["sessions"]):
                tg.start_soon(sample, api, i, session, out)
        stats = (await api.get("/stats")).json()
    for i in sorted(out):
        print(json.dumps({"sample": i, **out[i]}))
    rewards = [out[i]["reward"] for i in sorted(out)]
    print(f"group {group['id']}: {len(out)} samples, mean reward {sum(rewards) / len(rewards):.2f}; "
          f"service steps by source: {stats['steps']}")
    return 0 if len(out) == args.group else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))
