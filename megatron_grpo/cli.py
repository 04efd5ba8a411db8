"""`megatron-grpo` command line: one registry of sub-commands, each a module with `main(argv)`.

Sub-commands are imported lazily so `megatron-grpo validate-config` does not pay for
importing megatron-core. Every sub-command's ``main`` returns a process exit code: 0 on
success, 2 for bad user input (one-line error on stderr), 1 for failures.
"""

from __future__ import annotations

import importlib
import sys

from megatron_grpo.runtime.library_warnings import quiet_library_warnings
from megatron_grpo.runtime.process import exit_now

# name -> (module with a `main(argv) -> int`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megatron_grpo.launcher.cli", "run a GRPO experiment from a YAML config"),
    "eval": ("megatron_grpo.evaluation.cli", "evaluate a checkpoint or HF model on the config's eval sets"),
    "validate-config": ("megatron_grpo.config.cli", "validate a YAML config and print it resolved"),
    "config-reference": ("megatron_grpo.config.reference", "print the generated config reference"),
    "serve": ("megatron_grpo.inference.serve", "run the embedded rollout engine as an HTTP server"),
    "convert-hf-to-megatron": ("megatron_grpo.models.convert_cli", "HF directory -> Megatron checkpoint"),
    "convert-megatron-to-hf": ("megatron_grpo.models.convert_cli", "Megatron checkpoint -> HF directory"),
}


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: megatron-grpo COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"megatron-grpo: unknown command '{name}'{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    quiet_library_warnings()  # before the import: megatron-core warns while it is imported
    module = importlib.import_module(COMMANDS[name][0])
    if hasattr(module, "run_command"):  # modules serving several sub-commands
        return int(module.run_command(name, rest) or 0)
    return int(module.main(rest) or 0)


def run() -> None:
    """The ``megatron-grpo`` console script: ``main`` as a process, ended without the
    interpreter's teardown (``runtime.process.exit_now``: a sub-command that imported torch
    otherwise spends most of a second exiting). ``main`` itself returns, for callers in-process."""
    exit_now(main())


if __name__ == "__main__":
    run()
