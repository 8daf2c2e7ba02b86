"""`python -m mla_compile <command>`: `demo` runs the main job."""

from __future__ import annotations

import sys

COMMANDS = {"demo": "run the end-to-end demo",
            "export-mlir": "print the torch-dialect MLIR of a decode step (needs torch-mlir)"}


def usage() -> str:
    return ("usage: python -m mla_compile {" + ",".join(COMMANDS) + "} [options]\n\ncommands:\n" +
            "\n".join(f"  {k:11} {v}" for k, v in COMMANDS.items()) +
            "\n\n`python -m mla_compile <command> --help` lists a command's options.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = "a command is required" if not argv else f"unknown command {argv[0]!r}"
        print(f"{usage()}\n\npython -m mla_compile: error: {problem} (choose from {', '.join(COMMANDS)})",
              file=sys.stderr)
        return 2
    if argv[0] == "export-mlir":
        from . import mlir

        return mlir.main(argv[1:])
    from . import demo

    return demo.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
