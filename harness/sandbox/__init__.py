"""The sandbox: everything between untrusted code and the machine, one module per layer.

Layers, outermost first, each written to hold when the ones above it have been bypassed:

- ``static_check``: harness source is parsed and refused before any of it runs;
- ``python_layer``: the audit hook, resource limits and the scrubbed environment;
- ``worker``: what runs inside one jailed episode process (restricted builtins, module facades,
  proxies for the model and the tools);
- ``jail``: the operating-system wall (namespaces, read-only root, uids, seccomp, Landlock, rlimits);
- ``zygote``: the sandboxed process tree that forks one jailed child per episode or tool call;
- ``supervisor``: the trusted handle on that tree (start, hand work, watch, kill, clean up);
- ``ipc``: the frames between the two sides and the one table of message kinds;
- ``run_python``: the math tool, model-written Python in a fresh jailed process per call.

The names below are what the executor and the domains use. They are resolved on first use, so a
process that imports only one layer (the zygote's launcher) loads nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Policy": "jail",
    "JailError": "jail",
    "Limits": "python_layer",
    "SandboxViolation": "python_layer",
    "Zygote": "supervisor",
    "LoadError": "supervisor",
    "SandboxUnavailable": "supervisor",
    "check_source": "static_check",
    "validate": "static_check",
    "StaticCheckError": "static_check",
    "PythonToolConfig": "run_python",
    "run_python": "run_python",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'harness.sandbox' has no attribute {name!r}")
    return getattr(importlib.import_module(f"harness.sandbox.{module}"), name)
