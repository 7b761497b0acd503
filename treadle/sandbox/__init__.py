"""The code sandbox: runs untrusted Python programs (model-written solutions) on this machine.

It is a security boundary of its own, kept apart from the recipes that use it (it imports nothing
else of treadle, `tests/test_import_boundaries.py`), with its own tests (`tests/test_sandbox.py`,
`tests/test_sandbox_escapes.py`) and its threat model in docs/security.md ("The code sandbox").

  protocol  `Sandbox` (run a program on a stdin), its `Execution`, and `run_all`
  local     `LocalSandbox`: namespaces, a private read-only root, rlimits, seccomp, per-run cgroups
  host      what the host kernel offers beyond namespaces: the seccomp filter, the runs' cgroups
"""

from treadle.sandbox.local import Limits, LocalSandbox
from treadle.sandbox.protocol import Execution, Sandbox, Status, run_all

__all__ = ["Execution", "Limits", "LocalSandbox", "Sandbox", "Status", "run_all"]
