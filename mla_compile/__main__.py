"""`python -m mla_compile <command>`: `demo` runs the main job."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "run the end-to-end demo",
                "export-mlir": "print the torch-dialect MLIR of a decode step (needs torch-mlir)"}
    if not argv or argv[0] not in commands:
        print("usage: python -m mla_compile {" + ",".join(commands) + "} [options]\n" +
              "\n".join(f"  {k:11} {v}" for k, v in commands.items()))
        return 2
    if argv[0] == "export-mlir":
        from . import mlir

        return mlir.main(argv[1:])
    from . import demo

    return demo.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
