"""The math tool: model-written Python (numpy and sympy allowed) run in its own short-lived
sandboxed process per call, with the worker's OS limits and a wall-clock timeout. No static check
applies to it: it is model output, not harness code."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from harness import sandbox

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[3]); "
    "from harness.sandbox import pyexec_main; pyexec_main()"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PythonToolConfig:
    timeout_s: float = 10.0
    limits: sandbox.Limits = sandbox.Limits(memory_bytes=2 << 30, cpu_s=10, output_bytes=8 << 10)
    max_parallel: int = 2  # processes at once, whatever the number of episodes


_slots: dict[int, threading.BoundedSemaphore] = {}


def _read(path: str, cap: int) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError:
        return ""
    text = data[:cap].decode("utf-8", errors="replace")
    return text + ("\n[output truncated]" if len(data) > cap else "")


def run_python(code: str, config: PythonToolConfig = PythonToolConfig()) -> dict[str, str]:
    """Returns {"status": ok | error | timeout | killed, "stdout", "stderr"}."""
    slot = _slots.setdefault(config.max_parallel, threading.BoundedSemaphore(config.max_parallel))
    workdir = tempfile.mkdtemp(prefix="whale-pytool-")
    try:
        with open(os.path.join(workdir, "code.py"), "w", encoding="utf-8") as f:
            f.write(code)
        out_path, err_path = os.path.join(workdir, "stdout"), os.path.join(workdir, "stderr")
        with slot, open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-c",
                    _BOOT,
                    workdir,
                    json.dumps(config.limits.to_dict()),
                    _ROOT,
                ],  # fmt: skip
                cwd=workdir,
                env=sandbox.scrubbed_env(workdir),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
            )
            try:
                rc = proc.wait(timeout=config.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        cap = config.limits.output_bytes
        stdout, stderr = _read(out_path, cap), _read(err_path, cap)
        if rc is None:
            status = "timeout"
        elif rc == 0:
            status = "ok"
        elif rc < 0:
            status = "killed"
            stderr += f"\n[killed by {signal.Signals(-rc).name}]"
        else:
            status = "error"
        return {"status": status, "stdout": stdout, "stderr": stderr}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
