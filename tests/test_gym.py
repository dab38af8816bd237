"""The gymnasium environment over ``bunshin serve`` (bunshin_async._gym)."""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator

import pytest
from anyio.from_thread import start_blocking_portal
from gymnasium.utils.env_checker import check_env

from bunshin_async import BunshinEnv, ServeConfig, SkyRLTextEnv, create_app, open_env_group, open_http_server, open_service
from sim import SimBackend, ToolModel

from test_serve import CALLS, RECORDED, TRACE


@contextlib.contextmanager
def service(config: ServeConfig | None = None) -> Iterator[tuple[str, SimBackend]]:
    """The service on the simulator's backend, in a thread of its own (gymnasium is synchronous)."""
    backend = SimBackend("bunshin", ToolModel(TRACE))
    with start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(open_service(backend, config, tasks=TRACE.task_map(), cacheable=["shell"])) as svc:
            with portal.wrap_async_context_manager(open_http_server(create_app(svc))) as server:
                url = server.url + "/v1"
                import httpx

                httpx.post(url + "/tasks", json={"id": "t", "description": "count the files"}, trust_env=False).raise_for_status()
                yield url, backend
    assert backend.live_handles() == 0


def action(c) -> str:
    return json.dumps({"name": c.name, "arguments": c.arguments})


def test_an_episode_steps_through_the_service() -> None:
    with service() as (url, backend):
        env = BunshinEnv(url, "t", max_steps=10)
        obs, info = env.reset(seed=0)
        assert obs == "count the files" and info["session"]
        served = []
        for j, c in enumerate(CALLS[0]):
            obs, reward, terminated, truncated, info = env.step(action(c))
            assert (reward, terminated, truncated) == (0.0, False, False)
            assert RECORDED[(0, j)] in obs  # the simulator keeps no output: the digest stands in
            served.append(info["served_by"])
        assert served == ["executed"] * 4
        obs, reward, terminated, truncated, info = env.step(json.dumps({"name": "finish", "arguments": {"reward": 1.0}}))
        assert (reward, terminated) == (1.0, True)
        with pytest.raises(Exception, match="reset"):
            env.step(action(CALLS[0][0]))
        # a second episode of the task: the shared opening calls come from the prefix tree
        env.reset()
        assert env.step(action(CALLS[1][0]))[4]["served_by"] == "cache"
        env.close()


def test_invalid_actions_are_explained_not_sent() -> None:
    with service() as (url, _):
        env = BunshinEnv(url, "t")
        env.reset()
        for bad, why in [("ls -l", "not JSON"), ('{"tool": "ls"}', "expected"),
                         ('{"name": "finish", "arguments": {}}', "reward")]:
            obs, reward, terminated, truncated, info = env.step(bad)
            assert why in obs and why in info["error"]
            assert (reward, terminated, truncated) == (0.0, False, False)
        env.close()


def test_a_group_of_environments_shares_one_fork() -> None:
    with service() as (url, _):
        sessions = open_env_group(url, "t", 3)
        envs = [BunshinEnv(url, "t") for _ in sessions]
        for env, sid in zip(envs, sessions):
            assert env.reset(options={"session": sid})[1]["session"] == sid
        assert envs[0].step(action(CALLS[0][0]))[4]["served_by"] == "executed"
        assert envs[1].step(action(CALLS[1][0]))[4]["served_by"] == "cache"
        for env in envs:
            env.close()


def test_max_steps_truncates_and_service_errors_end_the_episode() -> None:
    with service() as (url, _):
        env = BunshinEnv(url, "t", max_steps=2)
        env.reset()
        assert env.step(action(CALLS[0][0]))[3] is False
        assert env.step(action(CALLS[0][1]))[3] is True
        _, info = env.reset()
        import httpx

        # the session ends behind the environment's back: the next step ends the episode
        httpx.post(f"{url}/sessions/{info['session']}/close", json={}, trust_env=False).raise_for_status()
        obs, reward, terminated, truncated, info = env.step(action(CALLS[0][0]))
        assert (reward, terminated, truncated) == (0.0, True, False)
        assert "409" in info["error"] and "409" in obs
        env.close()
        with BunshinEnv(url, "nope") as nope, pytest.raises(Exception, match="404"):
            nope.reset()


def test_gymnasium_check_env_passes() -> None:
    with service() as (url, _):
        env = BunshinEnv(url, "t", max_text=4096)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # check_env warns about text spaces it cannot sample deterministically
            check_env(env, skip_render_check=True)
        env.close()


def test_skyrl_shaped_environment() -> None:
    with service() as (url, _):
        seen = []

        def verifier(answer, history):
            seen.append((answer, [c["name"] for c, _ in history]))
            return 1.0 if "42" in answer else 0.0

        env = SkyRLTextEnv(url, "t", verifier)
        prompt = [{"role": "user", "content": "count the files"}]
        messages, meta = env.init(prompt)
        assert messages == prompt and meta["session"]
        c = CALLS[0][0]
        out = env.step(f'Let me look.\n<tool_call>{action(c)}</tool_call>')
        assert out["done"] is False and out["reward"] == 0.0 and out["metadata"]["served_by"] == "executed"
        assert out["observations"] == [{"role": "user", "content": out["observations"][0]["content"]}]
        assert RECORDED[(0, 0)] in out["observations"][0]["content"]
        out = env.step(action(CALLS[0][1]))  # a bare JSON call works too
        assert out["done"] is False
        out = env.step("There are 42 files.")
        assert (out["done"], out["reward"]) == (True, 1.0)
        assert seen == [("There are 42 files.", [c.name, CALLS[0][1].name])]
        env.close()
        # a second episode attached to a session of a group the trainer opened
        (sid,) = open_env_group(url, "t", 1)
        env = SkyRLTextEnv(url, "t", verifier, session=sid)
        assert env.init(prompt)[1]["session"] == sid
        assert env.step(f"<tool_call>{action(CALLS[1][0])}</tool_call>")["metadata"]["served_by"] == "cache"
        env.close()
