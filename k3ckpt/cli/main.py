"""The ``k3ckpt`` command: a click group whose commands load lazily.

Each command lives in its own module (``k3ckpt/cli/<name>.py``) and is thin over
``k3ckpt.api``.  Importing a command module only when it runs keeps
``k3ckpt --help`` fast: numba and huggingface_hub never load for it.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from .. import __version__
from ..errors import Hint, K3ckptError

# name -> (module, one-line help).  The help text lives here so `--help` needs no imports.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("k3ckpt.cli.demo", "Build the tiny K3 fixture and run the main job on it."),
    "inspect": ("k3ckpt.cli.inspect", "Report what a checkpoint holds, from headers alone."),
    "dequant": ("k3ckpt.cli.dequant", "Decode quantized tensors to bf16/f16/f32 in a new checkpoint."),
    "fixture": ("k3ckpt.cli.fixture", "Generate a synthetic checkpoint with real names and layouts."),
    "formats": ("k3ckpt.cli.formats", "List the registered weight formats."),
    "gguf": ("k3ckpt.cli.gguf", "Write a K3, K2 or DeepSeek-V3 checkpoint as GGUF for llama.cpp (~2-bit experts)."),
    "requant": ("k3ckpt.cli.requant", "Requantize routed experts to a ~2.25-bpw format, with an error report."),
    "report": ("k3ckpt.cli.report", "Render an existing requant error report."),
    "plan": ("k3ckpt.cli.plan", "Place experts on a device set (GPUs, host RAM, NVMe) and write plan.json."),
    "shard": ("k3ckpt.cli.shard", "Write per-rank files and NVMe expert packs from a plan."),
    "verify": ("k3ckpt.cli.verify", "Re-check an output folder against its manifest (and the source)."),
}


class LazyGroup(click.Group):
    running: click.Command | None = None   # the subcommand being run, to word its errors

    def resolve_command(self, ctx, args):
        name, cmd, rest = super().resolve_command(ctx, args)
        LazyGroup.running = cmd
        return name, cmd, rest

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module = importlib.import_module(COMMANDS[name][0])
        return module.command

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="k3ckpt")
def cli():
    """Inspect, requantize and place the experts of very large MXFP4 MoE checkpoints.

    \b
    Examples:
      k3ckpt demo                                    # the main job on a tiny built-in K3
      k3ckpt inspect hf://moonshotai/Kimi-K3         # what a checkpoint holds, from headers
      k3ckpt requant SRC DST --format moet-w2        # routed experts to 2.25 bits per weight

    \b
    Exit status:
      0  success
      1  a check failed (verify found a difference)
      2  a mistake in the command or its input (one line on stderr: k3ckpt: error: ...)
      130, 143  stopped by Ctrl-C or SIGTERM (finished shards are kept for --resume)

    `k3ckpt COMMAND --help` gives each command's options and examples.
    """


def error_message(exc: BaseException, command: click.Command | None = None) -> str:
    """One line for a user's mistake: the message alone (the exception's class is for
    debugging; ``K3CKPT_DEBUG=1`` adds it, with the traceback).  A hint names the option of
    ``command`` that sets the hinted parameter (``--overwrite``, not ``overwrite=True``)."""
    if isinstance(exc, K3ckptError) and exc.hint is not None:
        flag = _option_for(command, exc.hint)
        text = exc.message(exc.hint.say(flag) if flag else None)
    else:
        text = str(exc)
    text = " ".join(text.split())
    if _debug():
        text += f" [{_kind(exc)}]"
    return f"k3ckpt: error: {text}"


def _option_for(command: click.Command | None, hint: Hint) -> str | None:
    """How ``command``'s options spell ``hint`` (``--overwrite``, ``--dtype f32``); None when
    it has no option for that parameter (then the hint is left out: it would not help)."""
    for p in getattr(command, "params", ()):
        if isinstance(p, click.Option) and p.name == hint.argument and not p.hidden:
            if p.is_flag and isinstance(hint.value, bool):
                opts = p.opts if hint.value else p.secondary_opts   # --x / --no-x
                return max(opts, key=len) if opts else None
            return f"{max(p.opts, key=len)} {hint.value}"
    return None


def usage_message(exc: click.UsageError) -> str:
    """Click's own usage errors (missing argument, unknown option or command, bad value) in
    the same one line, pointing at the help of the command that was given."""
    # Past the command's name the error is the command's, though click may not say so (an
    # option missing its value comes without a context).
    if LazyGroup.running is not None:
        path = f"k3ckpt {LazyGroup.running.name}"
    else:
        path = exc.ctx.command_path if exc.ctx is not None else "k3ckpt"
    text = " ".join(exc.format_message().split())
    return f"k3ckpt: error: {text} (see {path} --help)"


def _kind(exc: BaseException) -> str:
    return next((c.__name__ for c in type(exc).__mro__ if c.__module__ == "k3ckpt.errors"), type(exc).__name__)


def _debug() -> bool:
    return os.environ.get("K3CKPT_DEBUG", "") not in ("", "0")


def _echo_error(line: str) -> None:
    if _debug():
        import traceback

        traceback.print_exc()
    click.echo(line, err=True)


# click >= 8.2 raises this for a bare `k3ckpt` (8.1 prints the help and exits 0 itself)
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt, so that a run stops
    the same way: its pool shut down, its unfinished file removed, its finished shards kept
    for --resume."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _stopped(exc: BaseException | None, message: str) -> int:
    """A run stopped by a signal: one line and the shell's status for it (128 + the signal)."""
    import signal

    if isinstance(exc, Terminated):
        click.echo("k3ckpt: terminated", err=True)
        return 128 + signal.SIGTERM
    click.echo(message, err=True)
    return 128 + signal.SIGINT


def main(argv: list[str] | None = None) -> int:
    """Entry point: users' mistakes become one line on stderr and exit status 2."""
    import signal

    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:   # not the main thread: leave signals to whoever runs us
        previous = None
    LazyGroup.running = None
    try:
        cli.main(args=argv, prog_name="k3ckpt", standalone_mode=False)
    except K3ckptError as exc:
        _echo_error(error_message(exc, LazyGroup.running))
        return 2
    except click.exceptions.Abort as exc:   # click turns KeyboardInterrupt into Abort
        return _stopped(exc.__cause__, "k3ckpt: aborted")
    except _NO_ARGS_IS_HELP as exc:   # bare `k3ckpt`: a request for help
        click.echo(exc.format_message())
        return 0
    except click.UsageError as exc:
        _echo_error(usage_message(exc))
        return 2
    except click.ClickException as exc:
        # exit status 1 is a check that failed (`verify`); others are the user's mistakes
        text = " ".join(exc.format_message().split())
        _echo_error(f"k3ckpt: failed: {text}" if exc.exit_code == 1 else f"k3ckpt: error: {text}")
        return exc.exit_code
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt as exc:
        return _stopped(exc, "k3ckpt: interrupted")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
