"""The ``agentrl`` console script: ``train | eval | sweep | plan | bench | report | convert |
export``.

Each subcommand lazily imports its implementation and calls ``run_from_cli(args)`` with the
parsed ``argparse.Namespace``, so a missing piece only disables its own subcommand::

    agentrl train experiments/toy.py:smoke=True --set model.n_layers=8
    agentrl eval runs/toy-20250101-120000 --split heldout --episodes 64
    agentrl sweep experiments/toy.py --set rl.lr=1e-5
    agentrl plan experiments/seed_moe_100l.py --devices 256 --accelerator h100
    agentrl train EXP --coordinator HOST:PORT --num-processes N --process-id I  (each process)
    agentrl bench rollout -- --fast      (runs benchmarks/rollout.py with this Python)
    agentrl report runs/toy-20250101-120000
    agentrl convert path/to/Qwen3-0.6B runs/qwen3      (an HF directory -> a run directory)
    agentrl convert model.gguf models/smollm2          (a GGUF file -> an HF directory)
    agentrl export runs/qwen3 path/to/exported         (a checkpoint -> an HF directory)

Exit codes: what ``run_from_cli`` returns (``None`` -> 0); 2 for usage errors, a subcommand that
is not available yet, and every error the input causes: ``ValueError`` (bad config, a run that
cannot be resumed, a checkpoint that does not fit the config, an error in an experiment file)
and ``OSError`` (a path that cannot be read or written, e.g. permission denied): one line on
stderr, no traceback (``--debug`` or ``AGENTRL_DEBUG=1`` keeps the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import subprocess
import sys
from collections.abc import Sequence

PROG = "agentrl"
DEBUG_ENV = "AGENTRL_DEBUG"

# subcommand -> module whose run_from_cli(args) implements it.
COMMANDS: dict[str, str] = {
    "train": "agentrl_jax.train.main",
    "eval": "agentrl_jax.train.eval_cli",
    "sweep": "agentrl_jax.train.sweep",
    "plan": "agentrl_jax.model.plan",
    "report": "agentrl_jax.report",
    "convert": "agentrl_jax.hf.convert",
    "export": "agentrl_jax.hf.convert",
}
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CommandError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def _add_spec(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="experiment module and variant, e.g. experiments/x.py:smoke=True")
    _add_set(p)


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. --set model.n_layers=8 (repeatable)",
    )


def _add_distributed(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "multi-process launch (one process per host or per GPU; default: from the cluster's "
        "variables, see README)"
    )
    g.add_argument("--coordinator", metavar="HOST:PORT", default=None, help="process 0's address")
    g.add_argument("--num-processes", type=_positive_int, default=None, metavar="N")
    g.add_argument("--process-id", type=int, default=None, metavar="I", help="in [0, N)")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="initialise jax.distributed from JAX's cluster detection (e.g. Cloud TPU VMs)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_train(sub) -> None:
    """The ``train`` subcommand and its arguments."""
    p = sub.add_parser("train", help="run the RL loop of an experiment")
    p.add_argument(
        "spec",
        nargs="?",
        default=None,
        help="experiment module and variant, e.g. experiments/x.py:smoke=True (optional with "
        "--resume: the run's own config)",
    )
    _add_set(p)
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default=None,
        help="continue this run (its own config; see docs/runs.md for what --set may change)",
    )
    _add_distributed(p)


def _add_eval(sub) -> None:
    """The ``eval`` subcommand and its arguments."""
    p = sub.add_parser("eval", help="evaluate a run directory or checkpoint")
    p.add_argument("run_dir_or_checkpoint")
    p.add_argument("--split", default=None, help="task split (default: the evaluator's)")
    p.add_argument("--difficulty", default=None, help="task difficulty filter")
    p.add_argument("--episodes", type=_positive_int, default=None, help="number of episodes")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="task-set and sampling seed (default: the run's eval.seed); another seed evaluates "
        "on other tasks of the split",
    )
    p.add_argument(
        "--pass-k",
        type=_positive_int,
        default=None,
        metavar="K",
        help="also sample K episodes per task and report pass@1, 2, 4, .., K (overall, per bug "
        "type and subtype)",
    )
    p.add_argument(
        "--transcripts",
        default=None,
        metavar="PATH",
        help="write every episode's bugs, outcome and tool calls to this new JSONL file",
    )
    p.add_argument(
        "--config", dest="spec", default=None, help="experiment spec (default: the run's config)"
    )
    _add_set(p)


def _add_sweep(sub) -> None:
    """The ``sweep`` subcommand and its arguments."""
    p = sub.add_parser("sweep", help="run the sweep(add) points of an experiment")
    _add_spec(p)
    p.add_argument(
        "--resume", default=None, help="sweep directory to continue (finished points are skipped)"
    )


def _add_plan(sub) -> None:
    """The ``plan`` subcommand and its arguments."""
    p = sub.add_parser("plan", help="parameter/FLOP/memory plan of a model (eval_shape only)")
    _add_spec(p)
    p.add_argument("--devices", type=_positive_int, default=None, help="number of devices")
    p.add_argument(
        "--accelerator",
        choices=("h100", "h200", "v5p", "v6e"),
        default=None,
        help="memory per device against this device's capacity (fits at <= 85%%?)",
    )
    p.add_argument(
        "--context", type=_positive_int, default=None, help="tokens per sequence (FLOPs, KV)"
    )


def _add_bench(sub) -> None:
    """The ``bench`` subcommand and its arguments."""
    p = sub.add_parser("bench", help="run benchmarks/<name>.py with this Python")
    p.add_argument("name", help="benchmark script name, e.g. rollout")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the script")


def _add_report(sub) -> None:
    """The ``report`` subcommand and its arguments."""
    p = sub.add_parser("report", help="summary table and PNG plots of a run's metrics")
    p.add_argument("run_dir")
    p.add_argument("--no-plots", action="store_true", help="print the table only")


def _add_convert(sub) -> None:
    """The ``convert`` subcommand and its arguments."""
    p = sub.add_parser(
        "convert",
        help="Hugging Face directory -> run directory (checkpoint); .gguf file -> HF directory",
    )
    p.add_argument("hf_dir", metavar="SOURCE", help="an HF directory or a .gguf file")
    p.add_argument(
        "run_dir",
        metavar="OUT_DIR",
        help="from an HF directory: the run directory to write; from a .gguf file: the HF "
        "directory it becomes (must not exist or be empty)",
    )
    p.add_argument(
        "--policy", default="fp32", help="dtype policy preset of the parameters (HF directory)"
    )


def _add_export(sub) -> None:
    """The ``export`` subcommand and its arguments."""
    p = sub.add_parser("export", help="checkpoint or run directory -> Hugging Face directory")
    p.add_argument("checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("--dtype", default=None, help="tensor dtype (default: the parameters')")


def build_parser() -> argparse.ArgumentParser:
    """The ``agentrl`` argument parser (subcommand in ``args.command``)."""
    from agentrl_jax import __version__

    parser = argparse.ArgumentParser(
        prog=PROG, description="agentic RL of LLMs: train, eval, sweep, plan, bench, report"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    parser.add_argument(
        "--debug", action="store_true", help=f"keep tracebacks of errors (as {DEBUG_ENV}=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_train(sub)
    _add_eval(sub)
    _add_sweep(sub)
    _add_plan(sub)
    _add_bench(sub)
    _add_report(sub)
    _add_convert(sub)
    _add_export(sub)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses ``argv``; ``--set`` values are in ``args.overrides`` and, as an alias, ``args.set``.

    Raises:
      SystemExit: usage errors (code 2), ``--help`` / ``--version`` (code 0).
    """
    args = build_parser().parse_args(argv)
    if hasattr(args, "overrides"):
        args.set = args.overrides
    return args


def _load_impl(command: str):
    module_name = COMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only a missing target (or its package) means "not available yet"; a missing third-party
        # dependency inside an existing module is a real error and keeps its traceback.
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise CommandError(
                f"'{PROG} {command}' is not available yet: module {module_name} does not exist"
            ) from None
        raise
    fn = getattr(module, "run_from_cli", None)
    if fn is None:
        raise CommandError(
            f"'{PROG} {command}' is not available yet: {module_name} has no run_from_cli(args)"
        )
    return fn


def find_benchmark(name: str) -> str:
    """Path of ``benchmarks/<name>.py`` (current directory first, then the source checkout).

    Raises:
      CommandError: no such script (message lists the available ones).
    """
    stem = name[:-3] if name.endswith(".py") else name
    if not stem or os.sep in stem:
        raise CommandError(f"benchmark name {name!r} must be a plain script name, e.g. rollout")
    dirs = [os.path.join(os.getcwd(), "benchmarks"), os.path.join(_REPO_ROOT, "benchmarks")]
    for d in dirs:
        path = os.path.join(d, stem + ".py")
        if os.path.isfile(path):
            return path
    known = sorted(
        {f[:-3] for d in dirs if os.path.isdir(d) for f in os.listdir(d) if f.endswith(".py")}
    )
    raise CommandError(f"no benchmark {stem!r}; available: {', '.join(known) or 'none'}")


def _run_bench(args: argparse.Namespace) -> int:
    path = find_benchmark(args.name)
    rest = list(args.bench_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    return subprocess.call([sys.executable, path, *rest])


def error_line(e: BaseException) -> str:
    """The one line a user-caused error prints (an OSError names its path)."""
    if isinstance(e, OSError) and e.strerror:
        paths = " -> ".join(repr(p) for p in (e.filename, e.filename2) if p is not None)
        text = f"{e.strerror}: {paths}" if paths else e.strerror
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())  # one line, whatever the exception text holds


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` (default ``sys.argv[1:]``), runs the subcommand, returns the exit code.

    Raises:
      SystemExit: from argparse on usage errors (code 2), ``--help`` and ``--version`` (0).
    """
    args = parse_args(argv)
    level = getattr(logging, args.log_level)
    # Other libraries (jax, absl, orbax) stay at WARNING unless DEBUG is asked for.
    logging.basicConfig(
        level=logging.DEBUG if level == logging.DEBUG else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    logging.getLogger("agentrl_jax").setLevel(level)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        if args.command == "bench":
            return _run_bench(args)
        rc = _load_impl(args.command)(args)
    except (CommandError, ValueError, OSError) as e:
        if debug and not isinstance(e, CommandError):
            raise
        where = PROG if isinstance(e, CommandError) else f"{PROG} {args.command}"
        print(f"{where}: error: {error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0 if rc is None else int(rc)


if __name__ == "__main__":
    sys.exit(main())
