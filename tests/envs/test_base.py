"""Tool registry and the never-raising dispatcher."""

import dataclasses
import time

import pytest

from agentrl_jax.envs.base import ToolError, ToolRegistry, ToolTimeout, call_tool


@dataclasses.dataclass(frozen=True)
class Echo:
    name: str = "echo"
    min_args: int = 1
    max_args: int = 2
    mutates: bool = False

    def __call__(self, ctx, args):
        if args[0] == "bad":
            raise ToolError("bad input")
        if args[0] == "crash":
            raise KeyError("boom")
        if args[0] == "slow":
            while time.monotonic() < ctx.deadline + 0.01:
                pass
            raise ToolTimeout("")
        return " ".join(args) + f" {ctx.state}"


def test_registry_refuses_duplicates_and_empty_names():
    reg = ToolRegistry([Echo()])
    assert reg.names == ("echo",)
    with pytest.raises(ValueError, match="unique"):
        reg.register(Echo())
    with pytest.raises(ValueError, match="non-empty"):
        reg.register(Echo(name=""))
    assert reg.get("nope") is None


@pytest.mark.parametrize(
    "words, output, error",
    [
        (["echo", "hi"], "hi 7", False),
        (["echo", "hi", "there"], "hi there 7", False),
        ([], "error empty call", True),
        (["nope"], "error unknown tool nope use echo", True),
        (["echo"], "error echo takes 1 to 2 args got 0", True),
        (["echo", "a", "b", "c"], "error echo takes 1 to 2 args got 3", True),
        (["echo", "bad"], "error bad input", True),
        (["echo", "crash"], "error tool echo failed", True),
    ],
)
def test_call_tool_turns_every_failure_into_an_error_observation(words, output, error):
    res = call_tool(ToolRegistry([Echo()]), words, 7, time_limit_s=1.0)
    assert (res.output, res.error) == (output, error)


def test_call_tool_reports_timeouts():
    res = call_tool(ToolRegistry([Echo()]), ["echo", "slow"], 0, time_limit_s=0.01)
    assert res.error and res.timed_out and res.output == "error timeout"
