"""Whether this venv's Triton interpreter (``TRITON_INTERPRET=1``) can run a kernel at all.

Some Triton/numpy pairs cannot: Triton 3.5's interpreter turns a loop bound into ``int(ndarray)``, which numpy 2.4
refuses ("only 0-dimensional arrays can be converted to Python scalars"). ``interpreter_env()`` puts
``triton_interpreter_shim/`` on the subprocess's path, whose sitecustomize mends that one conversion. The probe runs
a four-line kernel with a loop over a runtime bound, the construct every kernel of the pack uses, in that
environment; when it still fails, tests that run the pack's kernels under the interpreter skip with the probe's
error instead of failing on a tool bug.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_PROBE = textwrap.dedent("""
    import torch, triton, triton.language as tl

    @triton.jit
    def _sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, n, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr, tl.sum(acc, axis=0))

    x = torch.arange(10, dtype=torch.float32)
    out = torch.zeros(1)
    _sum[(1,)](x, out, 10, BLOCK=4)
    assert out.item() == 45.0, out
    print("OK")
""")


SHIM = Path(__file__).resolve().parent / "triton_interpreter_shim"


def interpreter_env() -> dict[str, str]:
    """This process's environment with TRITON_INTERPRET=1 and the shim first on PYTHONPATH, for a subprocess."""
    path = os.pathsep.join(p for p in (str(SHIM), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)


@functools.lru_cache(maxsize=1)
def interpreter_problem() -> str | None:
    """None when the interpreter runs the probe kernel; otherwise why not (versions and the error's last line)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed in this venv"
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=interpreter_env(), capture_output=True, text=True,
                          timeout=300)
    if proc.returncode == 0 and "OK" in proc.stdout:
        return None
    import numpy
    import triton

    last = (proc.stderr.strip().splitlines() or ["(no error text)"])[-1]
    return f"Triton {triton.__version__}'s interpreter cannot run a loop kernel with numpy {numpy.__version__}: {last}"
