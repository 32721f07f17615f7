"""The ``command`` proposer: an external coding-agent CLI (for example ``claude -p {prompt}``) started
in a copy of the archive, with the skill text and the task as its prompt.

The agent works in ``<copy>/`` (the archive as it stands) and writes its candidates into
``<copy>/slots/`` per the output contract; only those files come back (``harness.py`` per slot and
``pending.json``), whatever else it writes stays in the copy, which is deleted. Its stdout and
stderr are kept in full in the iteration's slot directory (``command.log``). The command runs in its
own process group with a timeout; its environment holds PATH, HOME, LANG and only the variables
named in ``env_keys`` (its own API key), never another backend's.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile

from harness.search.archive import Proposal
from harness.search.proposers.base import MAX_SOURCE, ProposeRequest, Usage, collect

_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "TZ")


class CommandProposer:
    def __init__(
        self,
        template: str,
        *,
        timeout_s: float = 1800.0,
        env_keys: tuple[str, ...] = (),
        name: str = "command",
    ):
        if "{prompt}" not in template and "{prompt_file}" not in template:
            raise ValueError(
                f"command template {template!r} needs {{prompt}} or {{prompt_file}} where the "
                "task goes"
            )
        self.template, self.timeout_s, self.env_keys, self.name = (
            template,
            timeout_s,
            env_keys,
            name,
        )
        self.usage = Usage()  # the command's own model calls are not seen from here

    def propose(self, request: ProposeRequest) -> tuple[list[Proposal], list[str]]:
        work = tempfile.mkdtemp(prefix="whale-proposer-")
        try:
            copy = os.path.join(work, "archive")
            shutil.copytree(request.archive_dir, copy, symlinks=True,
                            ignore=shutil.ignore_patterns("proposals"))  # fmt: skip
            os.makedirs(os.path.join(copy, "slots"))
            rel_phase = os.path.relpath(request.phase_dir, request.archive_dir)
            prompt = (
                f"{request.skill}\n\n---\n\nImprove the {request.domain} harness (iteration "
                f"{request.iteration}). The archive of every earlier harness, its scores and "
                f"full traces is the current directory (current phase: {rel_phase}). Read the "
                f"failing traces end to end before proposing. Propose {request.slots} candidates, "
                f"one mechanism each.\n{request.contract}\nslot_dir = slots"
            )
            prompt_file = os.path.join(work, "prompt.md")
            with open(prompt_file, "w", encoding="utf-8") as f:
                f.write(prompt)
            argv = [a.replace("{prompt}", prompt).replace("{prompt_file}", prompt_file)
                    for a in shlex.split(self.template)]  # fmt: skip
            env = {k: os.environ[k] for k in (*_KEPT, *self.env_keys) if k in os.environ}
            log_path = os.path.join(request.slot_dir, "command.log")
            problems: list[str] = []
            with open(log_path, "wb") as log:
                try:
                    proc = subprocess.Popen(argv, cwd=copy, env=env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)  # fmt: skip
                except OSError as e:
                    return [], [f"command {argv[0]!r} did not start: {e}"]
                try:
                    rc = proc.wait(timeout=self.timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    rc = None
                    problems.append(f"command timed out after {self.timeout_s:.0f}s")
            if rc not in (0, None):
                problems.append(f"command exited with {rc} (log: {log_path})")
            self._bring_back(os.path.join(copy, "slots"), request.slot_dir)
            proposals, more = collect(request, self.name)
            return proposals, problems + more
        finally:
            shutil.rmtree(work, ignore_errors=True)

    @staticmethod
    def _bring_back(src: str, dst: str) -> None:
        """Copy pending.json and <name>/harness.py (plain files, capped) out of the copy."""

        def take(path: str, target: str) -> None:
            if (
                os.path.isfile(path)
                and not os.path.islink(path)
                and os.path.getsize(path) <= MAX_SOURCE
            ):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(path, target)

        take(os.path.join(src, "pending.json"), os.path.join(dst, "pending.json"))
        if os.path.isdir(src):
            for name in os.listdir(src):
                take(os.path.join(src, name, "harness.py"), os.path.join(dst, name, "harness.py"))
