"""Preemptible (Spot) TPU VMs for whale_jax runs: create, install, launch on every host, and a
watcher that brings a preempted run back on a new VM, where it resumes from its mirror.

Runs on your workstation (Python 3.11+, the standard library and the ``gcloud`` CLI, logged in).
The run directory lives on the VM's disk and is mirrored to ``--mirror`` (a ``gs://`` path) before
every checkpoint save; the checkpoints and the compiled programs live beside it in the bucket, so
a new VM resumes a preempted run with the same command (docs/loop.md, "The run directory's
mirror"). A whole run, from nothing to the end, through any number of preemptions:

    python tpu_setup/tpu.py watch --name=whale-math --zone=us-central2-b \\
        --accelerator=v4-8 --runtime=tpu-ubuntu2204-base --mirror=gs://my-bucket/runs/math-s1 \\
        -- --flagfile=experiments/math.flags --seed=1

Commands (each takes the same options): ``create`` (a Spot queued resource, waiting until it is
ACTIVE), ``install`` (this checkout's committed HEAD onto every host, with jax[tpu] and gcsfs),
``launch`` (the run on every host, in the background), ``status`` (the queued resource's state
and the run's), ``watch`` (all of the above, again after every preemption, until the run ends),
``delete``. tpu_setup/README.md has the details.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

WAITING = ("ACCEPTED", "CREATING", "WAITING_FOR_RESOURCES", "PROVISIONING", "SUSPENDING",
           "DELETING")  # fmt: skip
GONE = ("SUSPENDED", "FAILED")  # preempted (Spot) or never provisioned: delete and ask again
NOT_FOUND = "NOT_FOUND"
# Exit statuses of `python -m whale_jax.main` (whale_jax/main.py): 2 is bad input (flags, data, a
# foreign checkpoint), which a relaunch cannot mend; 143 is SIGTERM (a preemption or maintenance
# notice) after saving what it could; anything else is a crash, retried up to --max_restarts.
BAD_INPUT, PREEMPTED = 2, 143
REMOTE_DIR = "whale_jax"


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    zone: str
    accelerator: str = ""
    runtime: str = ""
    mirror: str = ""
    project: str = ""
    spot: bool = True
    flags: tuple[str, ...] = ()
    pass_env: tuple[str, ...] = ()
    gcloud: str = "gcloud"

    @property
    def run_dir(self) -> str:
        return f"runs/{self.name}"


class GcloudError(RuntimeError):
    pass


class Cloud:
    """The gcloud calls this tool makes, one place (tests substitute a fake gcloud binary)."""

    def __init__(self, target: Target, log: Callable[[str], None] = print):
        self.t, self.log = target, log

    def gcloud(
        self, *args: str, capture: bool = False, check: bool = True
    ) -> subprocess.CompletedProcess:
        cmd = [self.t.gcloud, *args, f"--zone={self.t.zone}"]
        if self.t.project:
            cmd.append(f"--project={self.t.project}")
        done = subprocess.run(cmd, text=True, capture_output=capture)
        if check and done.returncode != 0:
            detail = (done.stderr or "").strip()[-2000:] if capture else "(its output is above)"
            raise GcloudError(f"`{shlex.join(cmd[:6])} ...` failed with status {done.returncode}: "
                              f"{detail}")  # fmt: skip
        return done

    def state(self) -> str:
        done = self.gcloud("compute", "tpus", "queued-resources", "describe", self.t.name,
                           "--format=value(state.state)", capture=True, check=False)  # fmt: skip
        if done.returncode != 0:
            if "NOT_FOUND" in done.stderr or "not found" in done.stderr.lower():
                return NOT_FOUND
            raise GcloudError(f"describing queued resource {self.t.name}: {done.stderr.strip()}")
        return done.stdout.strip() or "UNKNOWN"

    def create(self) -> None:
        for name in ("accelerator", "runtime"):
            if not getattr(self.t, name):
                raise SystemExit(f"error: --{name} is needed to create {self.t.name}")
        args = ["compute", "tpus", "queued-resources", "create", self.t.name,
                f"--node-id={self.t.name}", f"--accelerator-type={self.t.accelerator}",
                f"--runtime-version={self.t.runtime}"]  # fmt: skip
        if self.t.spot:
            args.append("--spot")
        self.log(f"creating queued resource {self.t.name} ({self.t.accelerator}"
                 f"{', Spot' if self.t.spot else ''})")  # fmt: skip
        self.gcloud(*args)

    def delete(self) -> None:
        self.log(f"deleting queued resource {self.t.name} and its TPU VM")
        self.gcloud("compute", "tpus", "queued-resources", "delete", self.t.name, "--force",
                    "--quiet", "--async")  # fmt: skip

    def ssh(
        self, command: str, *, worker: str = "all", capture: bool = False
    ) -> subprocess.CompletedProcess:
        return self.gcloud("compute", "tpus", "tpu-vm", "ssh", self.t.name, f"--worker={worker}",
                           f"--command={command}", capture=capture)  # fmt: skip

    def scp(self, local: str, remote: str) -> None:
        self.gcloud("compute", "tpus", "tpu-vm", "scp", local, f"{self.t.name}:{remote}",
                    "--worker=all")  # fmt: skip


# ---- the steps -----------------------------------------------------------------------------------


def wait_active(cloud: Cloud, *, poll_s: float, timeout_s: float) -> None:
    t0, last = time.monotonic(), None
    while True:
        state = cloud.state()
        if state != last:
            cloud.log(f"{cloud.t.name}: {state} ({time.monotonic() - t0:.0f}s)")
            last = state
        if state == "ACTIVE":
            return
        if state in GONE or state == NOT_FOUND:
            raise GcloudError(f"{cloud.t.name}: {state} while waiting for it to become ACTIVE")
        if time.monotonic() - t0 > timeout_s:
            raise GcloudError(f"{cloud.t.name}: still {state} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def repo_archive(repo: str, out: str) -> None:
    """The checkout's committed HEAD as a .tar.gz (uncommitted changes are not sent: named)."""
    dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.split("\n")  # fmt: skip
    dirty = [x[3:] for x in dirty if x.strip()]
    if dirty:
        print(f"warning: uncommitted changes are not installed: {', '.join(dirty[:8])}",
              file=sys.stderr)  # fmt: skip
    subprocess.run(["git", "-C", repo, "archive", "--format=tar.gz", "-o", out, "HEAD"], check=True)


# A venv on Python >= 3.11: the one there if it is, else one made from the first such Python on
# the host, else (the TPU base images are Ubuntu 22.04, Python 3.10) from a standalone CPython
# 3.11 that uv installs for this user.
_NEW_ENOUGH = "-c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null"
MAKE_VENV = (
    f"if ! {{ [ -x .venv/bin/python ] && .venv/bin/python {_NEW_ENOUGH}; }}; then "
    "PY=; for p in python3.13 python3.12 python3.11 python3; do command -v $p >/dev/null && "
    f"$p {_NEW_ENOUGH} && {{ PY=$(command -v $p); break; }}; done; "
    'if [ -z "$PY" ]; then python3 -m pip install -q --user uv && '
    "~/.local/bin/uv python install 3.11 && PY=$(~/.local/bin/uv python find 3.11); fi; "
    'rm -rf .venv && "$PY" -m venv .venv; fi'
)


def install(cloud: Cloud, repo: str) -> None:
    """The project onto every host: a venv (Python 3.11 or newer: ``MAKE_VENV``) with the
    project, jax[tpu] and gcsfs (Orbax's gs:// path layer). Idempotent: a host already installed
    is installed again over it."""
    with tempfile.TemporaryDirectory() as tmp:
        tarball = os.path.join(tmp, "whale_jax.tar.gz")
        repo_archive(repo, tarball)
        cloud.log(f"installing on every host of {cloud.t.name}")
        cloud.scp(tarball, "whale_jax.tar.gz")
    d = REMOTE_DIR
    cloud.ssh(
        # The code is replaced whole (files deleted since are gone); runs, venv and .env stay.
        f"set -e; mkdir -p {d} && find {d} -mindepth 1 -maxdepth 1 ! -name runs ! -name .venv "
        f"! -name .env -exec rm -rf {{}} + && tar -xzf whale_jax.tar.gz -C {d} && cd {d} && "
        f"{MAKE_VENV} && .venv/bin/pip install -q --upgrade pip && "
        ".venv/bin/pip install -q -e . 'jax[tpu]' gcsfs && touch .installed"
    )


def launch_command(t: Target) -> str:
    """What every host runs: the run in the background, its exit status kept in a file."""
    if not t.mirror.startswith("gs://"):
        raise SystemExit("error: --mirror must be a gs:// path (the VM's disk goes with it)")
    flags = [*t.flags, f"--run_dir={t.run_dir}", f"--run_dir_mirror={t.mirror}",
             f"--compilation_cache_dir={t.mirror.rstrip('/')}/compile_cache"]  # fmt: skip
    if not any(f.split("=")[0] in ("--distributed", "--nodistributed", "--coordinator_address")
               for f in t.flags):  # fmt: skip
        # jax.distributed finds the slice's hosts from the TPU metadata (one host: a job of
        # one); Orbax's multi-host saves and the harness phase's key-value store need it.
        flags.append("--distributed")
    run = shlex.join([".venv/bin/python", "-m", "whale_jax.main", *flags])
    out, status, pid = f"{t.run_dir}.out", f"{t.run_dir}.exit", f"{t.run_dir}.pid"
    inner = f"{run} >> {out} 2>&1 & echo $! > {pid}; wait $!; echo $? > {status}"
    return (
        f"cd {REMOTE_DIR} && mkdir -p runs && "
        # A run left on this host (hung in a collective after another host's exited) would hold
        # the TPU: it goes first. Its pid is checked against its command line (pids are reused).
        f'{{ p=$(cat {pid} 2>/dev/null); if [ -n "$p" ] && grep -qa whale_jax /proc/$p/cmdline '
        f"2>/dev/null; then kill -9 $p; sleep 1; fi; }}; rm -f {status} {pid} && "
        "{ if [ -f .env ]; then . ./.env; fi; } && "
        f"nohup sh -c {shlex.quote(inner)} > /dev/null 2>&1 < /dev/null &"
    )


def launch(cloud: Cloud) -> None:
    t = cloud.t
    command = launch_command(t)  # checks --mirror before anything is sent
    if not t.pass_env:  # variables sent by an earlier launch do not linger
        cloud.ssh(f"rm -f {REMOTE_DIR}/.env")
    else:
        missing = [k for k in t.pass_env if k not in os.environ]
        if missing:
            raise SystemExit(f"error: --pass_env: {', '.join(missing)} not set here")
        # The values travel in a file readable by its owner only, never on a command line.
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "env")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.writelines(f"export {k}={shlex.quote(os.environ[k])}\n" for k in t.pass_env)
            cloud.scp(path, f"{REMOTE_DIR}/.env")
        cloud.ssh(f"chmod 600 {REMOTE_DIR}/.env")
    cloud.log(f"launching on every host of {t.name}: {' '.join(t.flags)}")
    cloud.ssh(command)


def job_status(cloud: Cloud) -> str | int:
    """The run over every host: "uninstalled", "running", "none" (installed, never started or
    the VM restarted), or an exit status (see ``combine``)."""
    t = cloud.t
    probe = (
        f"cd {REMOTE_DIR} 2>/dev/null && [ -f .installed ] || {{ echo uninstalled; exit 0; }}; "
        "if pgrep -f 'whale_jax[.]main' > /dev/null; then echo running; "
        f"elif [ -f {t.run_dir}.exit ]; then echo exit $(cat {t.run_dir}.exit); else echo none; fi"
    )
    out = cloud.ssh(probe, capture=True).stdout.splitlines()
    words = [x.strip() for x in out if x.strip().split(" ")[0] in HOST_STATES]
    if not words:
        raise GcloudError(f"unexpected status from {t.name}: {out[-3:]}")
    return combine(words)


HOST_STATES = ("uninstalled", "running", "none", "exit")


def combine(words: list[str]) -> str | int:
    """One status from each host's line. A host that exited with an error while others still
    run has stopped the job (the rest wait in a collective for it): its status is the job's, and
    the relaunch ends the leftovers. An exit file cut short reads as "none"."""
    codes: list[int] = []
    for word in words:
        try:
            codes.append(int(word.split()[1]) if word.startswith("exit ") else -1)
        except (IndexError, ValueError):
            codes.append(-1)
    if "uninstalled" in words:
        return "uninstalled"
    failed = [c for c in codes if c > 0]
    if failed:
        return failed[0]
    if "running" in words:
        return "running"
    if all(c == 0 for c in codes):
        return 0
    return "none"


def decide(state: str, job: str | int | None, restarts: int, max_restarts: int) -> str:
    """The watcher's next step from the queued resource's state and the run's: one of create,
    wait, recreate, install, launch, done, fail."""
    if state == NOT_FOUND:
        return "create"
    if state in GONE:
        return "recreate"
    if state != "ACTIVE":
        return "wait"  # WAITING, PROVISIONING, ... and states gcloud adds later
    if job == "uninstalled":
        return "install"
    if job == "running":
        return "wait"
    if job == "none":
        return "launch"
    if job == 0:
        return "done"
    if job == BAD_INPUT:
        return "fail"
    if job == PREEMPTED or restarts < max_restarts:
        return "launch"  # a SIGTERM is not the run's fault; a crash gets --max_restarts tries
    return "fail"


def watch(cloud: Cloud, repo: str, *, poll_s: float, max_restarts: int, delete_when_done: bool,
          status: Callable[[Cloud], str | int] = job_status, max_failures: int = 10) -> int:  # fmt: skip
    restarts, last, failures = 0, None, 0
    while True:
        try:
            state = cloud.state()
            job = status(cloud) if state == "ACTIVE" else None
        except GcloudError as e:  # a VM taken between two calls, ssh not up yet, the network
            failures += 1
            if failures > max_failures:
                cloud.log(f"gcloud failed {failures} times in a row; stopping: {e}")
                return 1
            cloud.log(f"gcloud failed ({failures} of {max_failures} in a row): {e}")
            time.sleep(poll_s)
            continue
        failures = 0
        action = decide(state, job, restarts, max_restarts)
        if (state, job, action) != last:
            cloud.log(f"{cloud.t.name}: {state}" + (f", run {job}" if job is not None else "")
                      + f" -> {action}")  # fmt: skip
            last = (state, job, action)
        if action == "create":
            cloud.create()
        elif action == "recreate":
            cloud.delete()
            while cloud.state() != NOT_FOUND:
                time.sleep(poll_s)
            cloud.create()
        elif action in ("install", "launch"):
            if action == "launch" and isinstance(job, int) and job != PREEMPTED:
                restarts += 1
                cloud.log(f"the run exited with status {job}: restart {restarts} of {max_restarts}")
            try:
                if action == "install":
                    install(cloud, repo)
                else:
                    launch(cloud)
            except GcloudError as e:  # looked at again next pass (the VM may be gone)
                cloud.log(f"{action} failed: {e}")
        elif action == "done":
            cloud.log(f"the run finished; its run directory is mirrored at {cloud.t.mirror}")
            if delete_when_done:
                cloud.delete()
            return 0
        elif action == "fail":
            cloud.log(f"the run exited with status {job}; not relaunched (see "
                      f"{REMOTE_DIR}/{cloud.t.run_dir}.out on host 0, or run.log in the mirror)")  # fmt: skip
            return 1
        if action in ("wait", "create", "recreate", "launch"):
            time.sleep(poll_s)


# ---- the command line ----------------------------------------------------------------------------


def parse(argv: list[str]) -> tuple[argparse.Namespace, Target]:
    main_flags: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, main_flags = argv[:cut], argv[cut + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Flags after -- go to whale_jax.main.")  # fmt: skip
    ap.add_argument("command", choices=("create", "install", "launch", "status", "watch", "delete"))
    ap.add_argument("--name", required=True, help="the queued resource and its TPU VM")
    ap.add_argument("--zone", required=True)
    ap.add_argument("--project", default="", help="(default: gcloud's configured project)")
    ap.add_argument("--accelerator", default="", help="e.g. v4-8, v5litepod-8, v6e-8")
    ap.add_argument("--runtime", default="", help="the TPU software version for it")
    ap.add_argument("--spot", action=argparse.BooleanOptionalAction, default=True,
                    help="Spot capacity (preemptible; the default)")  # fmt: skip
    ap.add_argument("--mirror", default="", help="gs:// path of the run directory's mirror")
    ap.add_argument("--pass_env", action="append", default=[],
                    help="an environment variable to set on the hosts (e.g. GEMINI_API_KEY); "
                         "repeatable; sent in a file, never on a command line")  # fmt: skip
    ap.add_argument("--poll_s", type=float, default=60.0, help="seconds between checks")
    ap.add_argument("--create_timeout_s", type=float, default=6 * 3600.0)
    ap.add_argument("--max_restarts", type=int, default=3, help="relaunches after crashes")
    ap.add_argument("--delete_when_done", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--gcloud", default="gcloud", help="the gcloud binary")
    ap.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", args.name):
        ap.error(f"--name={args.name!r}: lowercase letters, digits and '-', starting with a letter")
    bad = [k for k in args.pass_env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
    if bad:
        ap.error(f"--pass_env: {', '.join(map(repr, bad))} is not a variable name")
    target = Target(name=args.name, zone=args.zone, accelerator=args.accelerator,
                    runtime=args.runtime, mirror=args.mirror, project=args.project,
                    spot=args.spot, flags=tuple(main_flags), pass_env=tuple(args.pass_env),
                    gcloud=args.gcloud)  # fmt: skip
    if args.command in ("launch", "watch"):
        if not target.mirror:
            ap.error(f"{args.command} needs --mirror=gs://... (the run directory's mirror)")
        if any(f.split("=")[0] in ("--run_dir", "--run_dir_mirror") for f in main_flags):
            ap.error("--run_dir and --run_dir_mirror are set from --name and --mirror")
    return args, target


def main(argv: list[str] | None = None) -> int:
    args, target = parse(sys.argv[1:] if argv is None else argv)
    cloud = Cloud(target, log=lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", flush=True))
    try:
        if args.command == "create":
            cloud.create()
            wait_active(cloud, poll_s=args.poll_s, timeout_s=args.create_timeout_s)
        elif args.command == "install":
            install(cloud, args.repo)
        elif args.command == "launch":
            launch(cloud)
        elif args.command == "status":
            state = cloud.state()
            print(f"{target.name}: {state}"
                  + (f", run: {job_status(cloud)}" if state == "ACTIVE" else ""))  # fmt: skip
        elif args.command == "watch":
            return watch(cloud, args.repo, poll_s=args.poll_s, max_restarts=args.max_restarts,
                         delete_when_done=args.delete_when_done)  # fmt: skip
        elif args.command == "delete":
            cloud.delete()
    except GcloudError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
