"""Many sandboxed runs at once, for parallel episodes.

``SandboxPool(sandbox, max_workers)`` runs ``Sandbox.run`` calls on a thread pool: each run's
work happens in its own child processes (the threads only wait on pipes), and each concurrent
run on the host gets its own uid (``Sandbox``'s slots).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Mapping, Sequence

from agentrl_jax.envs.sandbox import Result, Sandbox


class SandboxPool:
    """Runs many sandboxed programs at once (one thread per concurrent run).

    Args:
      sandbox: the sandbox to run in (default ``Sandbox()``).
      max_workers: concurrent runs, 1..256.

    Raises:
      ValueError: ``max_workers`` out of range.
    """

    def __init__(self, sandbox: Sandbox | None = None, max_workers: int = 8):
        if not 1 <= max_workers <= 256:
            raise ValueError(f"max_workers={max_workers} must be in [1, 256]")
        self.sandbox = sandbox or Sandbox()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="sandbox"
        )

    def submit(
        self, files: Mapping[str, str], argv: Sequence[str], timeout_s: float
    ) -> concurrent.futures.Future[Result]:
        """Starts ``Sandbox.run(files, argv, timeout_s)``; returns its future."""
        return self._executor.submit(self.sandbox.run, files, argv, timeout_s)

    def map(self, jobs: Iterable[tuple[Mapping[str, str], Sequence[str], float]]) -> list[Result]:
        """Runs ``(files, argv, timeout_s)`` jobs concurrently; results in job order.

        Raises:
          ValueError, SandboxUnavailable: as ``Sandbox.run`` (the first job's error).
        """
        futures = [self.submit(*job) for job in jobs]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Waits for running jobs and stops the threads."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
