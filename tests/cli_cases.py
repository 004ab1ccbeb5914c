"""Runs many command lines of ``flaxformer_lite.main`` cheaply, for the bad-input table.

  python -m tests.cli_cases CASES.json RESULTS.json

CASES.json holds ``[{"args": [...], "cwd": "...", "env": {...}, "stdin": "..."}]``.
This process imports the command line's modules once (JAX's backends stay
uninitialised), then forks one child per case, which parses its own arguments
into fresh flags and runs the command as ``python -m flaxformer_lite.main`` would.
RESULTS.json gets ``[{"code": exit status, "stdout": ..., "stderr": ...}]``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def _child(case: dict, out_path: str, err_path: str) -> None:
    os.chdir(case["cwd"])
    os.environ.update(case.get("env", {}))
    stdin = os.open(os.devnull, os.O_RDONLY)
    if case.get("stdin") is not None:
        read, write = os.pipe()
        os.write(write, case["stdin"].encode())
        os.close(write)
        stdin = read
    os.dup2(stdin, 0)
    os.dup2(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.argv = ["flaxformer_lite/main.py", *case["args"]]
    code = 0
    try:
        from flaxformer_lite import main

        main.run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # an uncaught error: print it as Python would, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    # What the commands import, once, before forking (no JAX computation here).
    import flaxformer_lite.inference.evaluation  # noqa: F401
    import flaxformer_lite.inference.streaming  # noqa: F401
    import flaxformer_lite.inference.translate  # noqa: F401
    import flaxformer_lite.main  # noqa: F401
    import flaxformer_lite.training.train  # noqa: F401

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(cases):
            out_path, err_path = f"{tmp}/{i}.out", f"{tmp}/{i}.err"
            start = time.monotonic()
            pid = os.fork()
            if pid == 0:
                _child(case, out_path, err_path)
            _, status = os.waitpid(pid, 0)
            results.append(
                {
                    "code": os.waitstatus_to_exitcode(status),
                    "stdout": open(out_path, errors="replace").read(),
                    "stderr": open(err_path, errors="replace").read(),
                    "seconds": time.monotonic() - start,
                }
            )
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
