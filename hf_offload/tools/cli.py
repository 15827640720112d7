"""The ``hf-offload`` command.

Examples::

    hf-offload demo                             # dense vs offloaded answer, KV bytes per tier, time
    hf-offload models list                      # the real models and whether they are installed / fetched
    hf-offload models fetch qwen05              # assemble, verify (sha256), convert once, print the folder
    hf-offload plan llama-3.1-8b --context 65536 --batch 8 --device-gib 139
    hf-offload bench --shape llama-3.1-8b --context 32768 --batch 8 --budget 2048
    hf-offload eval ruler_qwen05 --set samples=5 --set lengths=[4096]
"""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": ("hf_offload.tools.demo", "a needle prompt answered with a dense and an offloaded cache, side by side"),
    "models": ("hf_offload.tools.models", "list, fetch and check the real models (one optional extra each)"),
    "plan": ("hf_offload.tools.plan", "device / host bytes of a cache and the largest batch per method"),
    "bench": ("hf_offload.tools.bench",
              "decode speed and KV bytes of OffloadCache vs DynamicCache on a random-weight model"),
    "eval": ("eval_harness.cli", "run an evaluation recipe (RULER, LongBench): hf-offload eval RECIPE --set k=v"),
}


def _usage() -> str:
    lines = ["usage: hf-offload COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'hf-offload COMMAND --help' for a command's options and an example."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``hf-offload COMMAND ...`` to the command's own ``main``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"hf-offload: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = __import__(COMMANDS[command][0], fromlist=["main"])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
