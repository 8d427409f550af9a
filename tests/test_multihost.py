"""Multi-process helpers in one process, start-up checks, and the kernel_impl config field."""

import numpy as np
import pytest

from agentrl_jax import multihost, sharding
from agentrl_jax.cli import parse_args
from agentrl_jax.experiment import base_config, build
from agentrl_jax.rollout.trajectory import Trajectory
from agentrl_jax.train.placement import _concat, play_sharded


@pytest.mark.parametrize("n,count", [(0, 2), (5, 2), (8, 4), (3, 5)])
def test_shard_range_blocks_are_disjoint_and_cover(n, count):
    blocks = [multihost.shard_range(n, i, count) for i in range(count)]
    assert [i for lo, hi in blocks for i in range(lo, hi)] == list(range(n))
    assert max(hi - lo for lo, hi in blocks) - min(hi - lo for lo, hi in blocks) <= 1
    with pytest.raises(ValueError, match="index"):
        multihost.shard_range(n, count, count)


def test_one_process_helpers_are_identities():
    assert multihost.is_primary()
    assert multihost.allgather_objects({"a": 1}) == [{"a": 1}]
    assert multihost.broadcast_object("x") == "x"
    multihost.barrier("nothing")


def _traj(rows: int, length: int, start: int) -> Trajectory:
    ints = np.arange(start, start + rows * length, dtype=np.int32).reshape(rows, length)
    flags = np.ones((rows, length), bool)
    per_row = np.arange(rows, dtype=np.float32)
    logs = tuple({"episode": start + i} for i in range(rows))
    return Trajectory(
        ints, flags, flags, ints, per_row[:, None] + 0 * ints, None, per_row, 0 * ints,
        per_row > 0, per_row > 0, per_row > 0, per_row.astype(np.int32), logs=logs,
    )  # fmt: skip


def test_play_sharded_in_one_process_and_concat():
    calls = []

    def play(lo, hi):
        calls.append((lo, hi))
        return _traj(hi - lo, 4, lo)

    assert play_sharded(play, 3).batch == 3 and calls == [(0, 3)]
    merged = _concat([_traj(2, 4, 0), _traj(1, 6, 10)])
    assert merged.tokens.shape == (3, 6) and merged.routes is None
    np.testing.assert_array_equal(merged.turn_ids[0], [0, 1, 2, 3, -1, -1])  # padding is -1
    assert [r["episode"] for r in merged.logs] == [0, 1, 10]


def test_distributed_start_up_arguments(monkeypatch):
    for var in sharding.CLUSTER_MARKERS + ("JAX_NUM_PROCESSES",):
        monkeypatch.delenv(var, raising=False)
    assert sharding.maybe_initialize_distributed() is False  # no launcher, no flags
    assert sharding.maybe_initialize_distributed("h:1", 1, 0) is False  # one process
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert sharding.maybe_initialize_distributed() is False
    with pytest.raises(ValueError, match="go together"):
        sharding.maybe_initialize_distributed("h:1", 2, None)
    with pytest.raises(ValueError, match="process-id=2"):
        sharding.maybe_initialize_distributed("h:1", 2, 2)
    args = parse_args(
        ["train", "e.py", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "1"]
    )
    assert (args.coordinator, args.num_processes, args.process_id) == ("h:1", 2, 1)
    assert parse_args(["train", "e.py", "--distributed"]).distributed


def test_kernel_impl_is_a_config_field():
    cfg = base_config()
    assert build(cfg).policy.kernel_impl == "auto"
    cfg.kernel_impl = "xla"
    assert build(cfg).policy.kernel_impl == "xla"
    cfg.kernel_impl = "triton"
    with pytest.raises(ValueError, match="kernel_impl='triton'"):
        build(cfg)
