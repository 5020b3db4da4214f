"""Run ``python ...`` commands one after another in this one interpreter, so that the imports of
torch, transformers and DeepSpeed (~5 s a process on 2 CPU cores) are paid once (tests/test_readme.py).

    python tests/scripts/python_commands.py < commands

Reads one JSON list per line: a command's arguments after ``python`` (``SCRIPT args...`` or
``-m MODULE args...``). Runs it as ``python`` would: as ``__main__``, with ``sys.argv`` and
``sys.path[0]`` set the same way, its output (file descriptors 1 and 2, so C-level writes too) in
a file. Answers one JSON line per command on its own stdout: ``{"rc": exit status, "output": ...}``;
an uncaught exception is exit 1 with its traceback, as in a fresh process; a launched script's
exit (``engine.run.launch.exit_without_teardown``) is its ``SystemExit``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback

from engine.run import launch

# A launched script ends its process without the interpreter's teardown (engine/run/launch.py); this
# interpreter outlives each command, so the script's exit is a SystemExit here, as any other command's.
launch.exit_without_teardown = sys.exit


def run(argv: list[str]) -> int:
    """``python argv...`` in this process; its exit status."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as stop:
        code = stop.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        with tempfile.TemporaryFile("w+") as output:
            saved = os.dup(1), os.dup(2)
            os.dup2(output.fileno(), 1)
            os.dup2(output.fileno(), 2)
            try:
                rc = run(json.loads(line))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
            output.seek(0)
            answers.write(json.dumps({"rc": rc, "output": output.read()}) + "\n")
            answers.flush()


if __name__ == "__main__":
    main()
