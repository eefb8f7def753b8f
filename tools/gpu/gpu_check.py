"""The GPU run's import check (``tools/gpu/gpu_run.sh`` calls it first, under a time limit).

    python tools/gpu/gpu_check.py DEVICE TRITON_FILE

Imports what pixelsac needs (torch, lightning, kornia, omegaconf, dm_control) and prints one
line: Python, torch, lightning, and on CUDA the GPU's name, memory and CUDA version; exit 1 when
``DEVICE`` is cuda and torch sees no GPU. That line is printed (and flushed) before anything
else is tried. Then, on CUDA, it compiles one trivial function with ``torch.compile`` -- inductor
writes a Triton kernel, and Triton builds its launcher with a C compiler and Python's headers,
which a bare machine may lack -- and writes to ``TRITON_FILE`` one line, ``ok: ...`` or
``failed: <the error's first line>``. Any failure there means the run drops its compiled cells
and the compiled optimizer; a compile that hangs is cut by the script's limit and leaves
``TRITON_FILE`` empty, which the script reads as a failure.
"""

from __future__ import annotations

import sys
from pathlib import Path


def smoke_compile() -> str:
    """One trivial kernel through torch.compile on the GPU: ``ok: ...`` or ``failed: ...``."""
    import torch

    try:
        x = torch.arange(8.0, device="cuda")
        y = torch.compile(lambda t: t * 2 + 1, fullgraph=True)(x)
        if not torch.equal(y, x * 2 + 1):
            return "failed: the compiled kernel computed wrong values"
        return "ok: torch.compile built and ran one kernel with triton"
    except Exception as exc:  # noqa: BLE001 -- any failure means: no compiled cells in this run
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"failed: {type(exc).__name__}: {first}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("cuda", "cpu"):
        print("usage: python tools/gpu/gpu_check.py cuda|cpu TRITON_FILE", file=sys.stderr)
        return 2
    device, triton_file = args[0], Path(args[1])
    import dm_control  # noqa: F401
    import kornia  # noqa: F401
    import lightning
    import omegaconf  # noqa: F401
    import torch

    line = f"- python {sys.version.split()[0]}, torch {torch.__version__}, lightning {lightning.__version__}"
    if device == "cuda":
        if not torch.cuda.is_available():
            print("error: DEVICE=cuda but torch sees no CUDA device", file=sys.stderr)
            return 1
        props = torch.cuda.get_device_properties(0)
        line += f", {props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"
    print(line, flush=True)
    verdict = smoke_compile() if device == "cuda" else "ok: not needed on a CPU"
    triton_file.write_text(verdict + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
