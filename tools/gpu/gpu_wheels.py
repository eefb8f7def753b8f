"""Wheels for a GPU machine without network: what pixelsac needs beside the machine's own torch
(and numpy, scipy, lxml, absl-py, PyYAML, pillow, tqdm, matplotlib, which such a machine has:
:data:`GPU_MACHINE_HAS`), lightning included: ``pixelsac.distributed.GradientAverage`` relies on
its strategy internals, so the version tested here travels and replaces another one.

On a machine with network (any platform), build the wheelhouse for the GPU machine's Python::

    python tools/gpu/gpu_wheels.py --python-version 3.12     # -> .whl/ (about 35 MB)
    python tools/gpu/gpu_wheels.py --print                   # the exact list and command, nothing downloaded

It runs ``pip download --only-binary=:all: --no-deps --python-version X.Y --platform ...`` of the
exact list :data:`WHEELS` (every package pinned: what travels is what was tested here;
``--no-deps`` keeps pip from resolving a CUDA torch), then cuts from dm_control's and mujoco's
wheels the folders that ``dm_control.suite`` never imports (:data:`STRIP`: the locomotion
models, test data and mujoco's GUI app, 60 MB of the 100), and refuses to write more than
``--max-mb`` (default 45: the wheels travel beside the repository, which has a size limit of its
own on most GPU loans). On the GPU machine ``tools/gpu/gpu_run.sh`` installs them itself; by hand::

    python tools/gpu/gpu_wheels.py --install .whl --target /tmp/site
    export PYTHONPATH=/tmp/site:$PWD MUJOCO_GL=egl

``--install`` installs the wheels whose package the machine lacks or has in another version
(``pip install --no-index --no-deps --target``, a folder that comes first on ``PYTHONPATH``): an
older kornia, omegaconf, mujoco or lightning already there would otherwise win over the pinned
wheel. It prints each replaced version. The machine's own torch and numpy stay as they are.
Exit codes: 0 done, 1 pip failed or the wheels are over ``--max-mb``, 2 a bad argument.

``tests/test_gpu_run.py`` checks the list against the requirements this checkout's installed
packages declare, so it cannot fall behind them silently.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: What pixelsac needs on a GPU machine that has torch, lightning and GPU_MACHINE_HAS, pinned.
WHEELS: tuple[str, ...] = (
    "dm-control==1.0.50",
    "mujoco==3.17.0",  # 4.x breaks dm_control 1.0.50 (MjModel has no flex_vertedge)
    "dm-env==1.6",
    "dm-tree==0.1.10",  # dm-env declares it; dm_control.composer imports it
    "wrapt==2.5.2",  # dm-tree's
    "pyopengl==3.1.10",  # EGL rendering
    "glfw==2.11.0",  # mujoco imports it when MUJOCO_GL is unset or glfw
    "etils==1.15.0",  # mujoco's
    "zipp==4.1.2",  # etils[epath]'s
    "kornia==0.9.0",
    "kornia-rs==0.2.0",
    "omegaconf==2.4.0",  # 2.4 vendors its antlr runtime
    "tensorboardx==2.6.5",  # Lightning's TensorBoard logger without tensorboard's gRPC wheels
    "protobuf==7.36.2",  # tensorboardX's
    "imageio==2.38.2",  # GIF videos (mp4 needs imageio-ffmpeg's 68 MB binary: not carried); tests import it
    "pytest==9.2.0",  # the GPU tests (tools/gpu/gpu_run.sh part 0)
    "iniconfig==2.3.1",
    "pluggy==1.7.0",
    "pygments==2.21.0",
    "lightning==2.6.6",  # GradientAverage relies on its strategy internals: the version tested here
    "lightning-utilities==0.15.3",  # lightning's
    "torchmetrics==1.9.0",  # lightning's
)

#: Packages a GPU machine of this kind has installed beside torch and lightning.
GPU_MACHINE_HAS: tuple[str, ...] = (
    "numpy",
    "scipy",
    "lxml",
    "absl-py",
    "pyyaml",
    "pillow",
    "tqdm",
    "matplotlib",
    "pyparsing",
    "requests",
    "certifi",
    "charset-normalizer",
    "idna",
    "urllib3",
)

#: Declared by dm_control or mujoco, and left out on purpose.
LEFT_OUT: dict[str, str] = {
    "labmaze": "dm_control.locomotion's mazes (cut out, see STRIP)",
    "websockets": "mujoco's remote viewer",
}

#: Folders cut out of the wheels: nothing in dm_control.suite imports them.
STRIP: tuple[str, ...] = (
    "dm_control/locomotion/",  # soccer, CMU humanoid, rodent, mazes (39 MB zipped)
    "dm_control/mujoco/testing/",  # test models and reference frames
    "mujoco/experimental/",  # the studio app and GUI bindings
)

#: The GPU machine's platform tags, newest first (pip picks the best wheel among them).
PLATFORMS: tuple[str, ...] = tuple(
    f"{tag}_x86_64"
    for tag in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_24", "manylinux_2_17", "manylinux2014", "manylinux1")
)


def normalize(name: str) -> str:
    """A project name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def download_command(python_version: str, dest: Path, platforms: tuple[str, ...] = PLATFORMS) -> list[str]:
    """``pip download`` of the exact list for the GPU machine's CPython and platform."""
    tags = [arg for platform in platforms for arg in ("--platform", platform)]
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--only-binary=:all:",
        "--no-deps",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *tags,
        "-d",
        str(dest),
        *WHEELS,
    ]


def strip_wheel(wheel: Path, folders: tuple[str, ...] = STRIP) -> int:
    """Rewrite ``wheel`` without the entries under ``folders`` (and their lines in the
    ``RECORD``, so that pip still accepts it); returns how many entries went."""
    with zipfile.ZipFile(wheel) as source:
        gone = [name for name in source.namelist() if name.startswith(folders)]
        if not gone:
            return 0
        rewritten = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as target:
            for info in source.infolist():
                if info.filename.startswith(folders):
                    continue
                data = source.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = csv.reader(io.StringIO(data.decode()))
                    rows = [row for row in lines if row and not row[0].startswith(folders)]
                    text = io.StringIO()
                    csv.writer(text, lineterminator="\n").writerows(rows)
                    data = text.getvalue().encode()
                target.writestr(info, data)
    os.replace(rewritten, wheel)
    return len(gone)


def wheel_project(path: Path) -> str:
    """The project name a wheel file installs (its file name's first field)."""
    return normalize(path.name.split("-", 1)[0])


def wheel_version(path: Path) -> str:
    """The version a wheel file installs (its file name's second field)."""
    return path.name.split("-")[1]


def _same_version(a: str, b: str) -> bool:
    try:
        from packaging.version import Version

        return Version(a) == Version(b)
    except Exception:  # noqa: BLE001 -- no packaging, or a version it cannot read: compare the text
        return a == b


def wheels_to_install(wheel_dir: Path) -> list[tuple[Path, str | None]]:
    """The wheels in ``wheel_dir`` whose project this Python lacks (None) or has in another
    version (that version), in file-name order."""
    have = {normalize(dist.metadata["Name"] or ""): dist.version for dist in importlib.metadata.distributions()}
    chosen = []
    for wheel in sorted(wheel_dir.glob("*.whl")):
        installed = have.get(wheel_project(wheel))
        if installed is None or not _same_version(installed, wheel_version(wheel)):
            chosen.append((wheel, installed))
    return chosen


def install(wheel_dir: Path, target: Path) -> int:
    chosen = wheels_to_install(wheel_dir)
    if not chosen:
        print(f"gpu_wheels: every wheel in {wheel_dir} is installed already, in its version")
        return 0
    wheels = [wheel for wheel, _ in chosen]
    names = ", ".join(f"{wheel_project(w)} {wheel_version(w)}" + (f" (over {old})" if old else "") for w, old in chosen)
    print(f"gpu_wheels: installing {len(wheels)} wheels into {target}: {names}", flush=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    command += ["--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)]
    return 0 if subprocess.run(command).returncode == 0 else 1


def build(python_version: str, dest: Path, max_mb: float) -> int:
    """Download, strip and size-check into a scratch folder; replace ``dest``'s wheels only
    when everything worked."""
    with tempfile.TemporaryDirectory() as scratch:
        scratch_dir = Path(scratch)
        if subprocess.run(download_command(python_version, scratch_dir)).returncode != 0:
            print("error: pip download failed (see above)", file=sys.stderr)
            return 1
        wheels = sorted(scratch_dir.glob("*.whl"))
        for wheel in wheels:
            gone = strip_wheel(wheel)
            if gone:
                print(f"gpu_wheels: cut {gone} unused entries from {wheel.name}")
        total = sum(w.stat().st_size for w in wheels)
        for wheel in wheels:
            print(f"{wheel.stat().st_size / 1e6:8.2f} MB  {wheel.name}")
        print(f"gpu_wheels: {len(wheels)} wheels, {total / 1e6:.1f} MB for CPython {python_version}")
        if total > max_mb * 1e6:
            print(f"error: the wheels add up to {total / 1e6:.1f} MB, over --max-mb {max_mb:g}", file=sys.stderr)
            return 1
        dest.mkdir(parents=True, exist_ok=True)
        for old in dest.glob("*.whl"):
            old.unlink()
        for wheel in wheels:
            shutil.move(str(wheel), dest / wheel.name)
    print(f"gpu_wheels: wrote {dest}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's CPython, MAJOR.MINOR")
    parser.add_argument("--dest", type=Path, default=Path(__file__).resolve().parent.parent.parent / ".whl")
    parser.add_argument("--max-mb", type=float, default=45.0, help="refuse wheels adding up to more (10^6 bytes)")
    parser.add_argument("--print", action="store_true", help="print the exact list and the command, download nothing")
    parser.add_argument("--install", type=Path, metavar="WHEEL_DIR", help="install the missing wheels of WHEEL_DIR")
    parser.add_argument("--target", type=Path, default=Path("/tmp/site"), help="where --install puts them")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        print(f"error: --python-version {args.python_version!r}: give MAJOR.MINOR, e.g. 3.12", file=sys.stderr)
        return 2
    if args.install is not None:
        if not args.install.is_dir():
            print(f"error: --install {args.install}: no such folder", file=sys.stderr)
            return 2
        return install(args.install, args.target)
    if args.print:
        print("\n".join(WHEELS))
        print("\n" + " ".join(["python", *download_command(args.python_version, args.dest)[1:]]))
        return 0
    return build(args.python_version, args.dest, args.max_mb)


if __name__ == "__main__":
    sys.exit(main())
