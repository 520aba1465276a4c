"""Carry vLLM to a GPU machine that has no package index: ``python tools/carry_vllm.py [--dir .vw] [--part-mib 46]``.

Why: the GPU machine of docs/vllm.md's "Checks on the GPU" (one H200, x86-64, Python 3.12, torch and transformers
preinstalled) has no package index and no internet. It gets other packages only as files carried in a remote call's
working tree, at most 64 MiB per call with the repository's tree included, while vLLM's wheel alone is about 300 MB.
Ignored files carried by one call stay on the machine while it is warm (it goes back after about 30 s idle), so the
wheels travel in parts, one per call, in calls that follow each other.

The procedure (run from a checkout; standard library only, plus ``python -m pip download``):

1. download, for CPython 3.12 on manylinux x86-64 and without dependencies, vLLM and the packages it needs that the
   machine lacks, at the versions of ``PINNED``, into ``DIR/download`` (a wheel already there is not downloaded
   again);
2. prune vLLM's wheel of compiled files the checks ran without (``DROPPED``: FlashAttention 2, the MoE kernels, the
   vllm-rs binary, DeepGEMM for Pythons other than 3.12; about 304 MB to 116 MB) into ``DIR/pruned``, its RECORD
   rewritten without them so that it stays a valid wheel;
3. build loopkv's own wheel from the checkout into ``DIR/loopkv`` (installed beside vLLM, it gives vLLM's processes
   loopkv's ``vllm.general_plugins`` entry point; the tree's ``loopkv`` stays first on ``PYTHONPATH``, so the code that
   runs is the checkout's);
4. write one tar of the pruned wheel and the others, split into ``DIR/part1``, ``DIR/part2``, ... of at most
   ``--part-mib`` MiB each (the rest of a call's 64 MiB is the repository's tree);
5. print the device calls: one per part, each naming its part in ``carry``; the last one joins the parts, checks the
   tar's SHA-256, extracts it, installs every wheel to /tmp/site and exports the environment, and the benchmark's
   command follows in the same call.

``DIR`` must lie inside the repository and be ignored by git (``/.vw/`` is), since ``carry`` names ignored paths
and nothing of it may be committed.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Sequence

REPO = pathlib.Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
CARRY_LIMIT_MIB = 64  # what one remote call carries in all, the repository's tree included

# The one place for versions: vLLM, then what it needs that the machine's torch 2.11 / transformers 5.17 lack.
PINNED = {
    "vllm": "0.26.0",
    "annotated-types": "0.8.0",
    "apache-tvm-ffi": "0.1.10",
    "astor": "0.8.1",
    "cachetools": "8.0.2",
    "cbor2": "6.3.0",
    "depyf": "0.20.0",
    "dill": "0.4.1",
    "fastapi": "0.136.3",
    "httpcore2": "2.16.2",
    "httpx2": "2.16.2",
    "jiter": "0.19.0",
    "llguidance": "1.7.6",
    "msgspec": "0.23.0",
    "openai": "3.57.0",
    "openai-harmony": "0.0.8",
    "partial-json-parser": "0.2.1.1.post7",
    "pybase64": "1.5.1",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "pyzmq": "27.3.0",
    "sniffio": "1.3.1",
    "starlette": "1.10.0",
    "truststore": "0.10.5",
    "typing-extensions": "4.16.0",
    "typing-inspection": "0.4.5",
    "xgrammar": "0.2.7",
    # `vllm serve`'s OpenAI server and what it imports at start (vllm/entrypoints/launcher.py, serve/utils/ssl.py,
    # serve/sagemaker and serve/lora's routers, serve/instrumentator), for `vllm bench serve` against it
    "uvicorn": "0.55.0",
    "watchfiles": "1.3.0",
    "model-hosting-container-standards": "0.1.16",
    "jmespath": "1.1.0",
    "prometheus-fastapi-instrumentator": "8.1.0",
}
PRUNED_PACKAGE = "vllm"
PYTHON_VERSION = "3.12"
PLATFORMS = (  # the machine's torch is manylinux_2_28, so its glibc is at least 2.28
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# Wheels published only for a newer glibc. llguidance 1.7.6 has x86-64 wheels for manylinux_2_31 alone; the
# machine's pip installed it, which it does only for a tag its glibc supports.
EXTRA_PLATFORMS = {"llguidance": ("manylinux_2_31_x86_64",)}
# Files of vLLM's wheel that vLLM ran without in the checks on the H200 (FlashAttention 3 stays). Each pattern must
# match a file: one that matches none means the pinned wheel is not the one pruned before.
DROPPED = {
    "FlashAttention 2": re.compile(r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so"),
    "MoE kernels": re.compile(r"vllm/_moe_C_stable_libtorch\.abi3\.so"),
    "vllm-rs": re.compile(r"vllm/vllm-rs(/.*)?"),
    "DeepGEMM for Python 3.10, 3.11, 3.13, 3.14": re.compile(r"(.*/)?deep_gemm/_C\.cpython-31[0134]-[^/]*\.so"),
}
TAR_NAME = "/tmp/vw.tar"  # on the device
# The tree first: its loopkv is what runs, and loopkv's wheel in /tmp/site adds the entry point vLLM's processes find
EXPORTS = "PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1"
COMMAND_LIMIT = 2000  # characters of one remote command


class CarryError(Exception):
    """A step cannot go on; the message says what to do."""


# ----------------------------------------------------------------------------- download


def normalize(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 503 runs of ``-_.`` to ``_``, lower case)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(folder: pathlib.Path, name: str, version: str) -> pathlib.Path | None:
    """The wheel of ``name==version`` in ``folder``, or None."""
    for path in sorted(folder.glob("*.whl")):
        dist, wheel_version = path.name.split("-")[:2]
        if normalize(dist) == normalize(name) and wheel_version == version:
            return path
    return None


def pip_download(folder: pathlib.Path, name: str, version: str, platforms: Sequence[str]) -> None:
    """``pip download`` one wheel for the machine's Python and platforms into ``folder``."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", PYTHON_VERSION, "--implementation", "cp",
        *(flag for platform in platforms for flag in ("--platform", platform)),
        "-d", str(folder), f"{name}=={version}",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        said = "\n".join((result.stdout + result.stderr).strip().splitlines()[-6:])
        raise CarryError(
            f"pip could not download {name}=={version} for CPython {PYTHON_VERSION} on {', '.join(platforms)}.\n"
            "If it found no wheel and the index has one only for a newer glibc, add e.g. --platform "
            "manylinux_2_31_x86_64 (or 2_24, 2_34, 2_35); a tag newer than the machine's glibc will not install "
            f"there.\npip said:\n{said}"
        )


def download_all(folder: pathlib.Path, platforms: Sequence[str]) -> dict[str, pathlib.Path]:
    """Every wheel of ``PINNED`` in ``folder`` by package name, downloading those not already there."""
    folder.mkdir(parents=True, exist_ok=True)
    wheels = {}
    for name, version in PINNED.items():
        wheel = find_wheel(folder, name, version)
        if wheel is None:
            print(f"downloading {name}=={version}", flush=True)
            pip_download(folder, name, version, [*platforms, *EXTRA_PLATFORMS.get(name, ())])
            wheel = find_wheel(folder, name, version)
            if wheel is None:  # pip succeeded, yet under a name this tool does not recognize
                raise CarryError(f"pip downloaded {name}=={version} but no wheel of that name is in {folder}")
        wheels[name] = wheel
    return wheels


def loopkv_wheel(folder: pathlib.Path) -> pathlib.Path:
    """loopkv's own wheel, built from this checkout into ``folder`` (replacing an older one): installed beside vLLM
    it gives vLLM's processes the ``vllm.general_plugins`` entry point, as ``pip install loopkv`` does."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("loopkv-*.whl"):
        old.unlink()
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(folder), str(REPO)]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(folder.glob("loopkv-*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        said = "\n".join((result.stdout + result.stderr).strip().splitlines()[-6:])
        raise CarryError(f"pip could not build loopkv's wheel from {REPO} (it needs setuptools>=77 here).\n"
                         f"pip said:\n{said}")
    return wheels[0]


# ----------------------------------------------------------------------------- pruning vLLM's wheel


def dropped_by(name: str) -> str | None:
    """Which entry of ``DROPPED`` removes the wheel member ``name``, or None."""
    return next((what for what, pattern in DROPPED.items() if pattern.fullmatch(name)), None)


def is_record(name: str) -> bool:
    """Whether ``name`` is the wheel's RECORD (the list of its files with their hashes)."""
    return re.fullmatch(r"[^/]+\.dist-info/RECORD", name) is not None


def rewritten_record(text: str) -> str:
    """RECORD without the rows of dropped files."""
    rows = [row for row in csv.reader(io.StringIO(text)) if row and dropped_by(row[0]) is None]
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


def check_pruned(wheel: pathlib.Path) -> None:
    """Raise unless ``wheel`` is a sound zip whose RECORD lists exactly its files and none of ``DROPPED``."""
    with zipfile.ZipFile(wheel) as archive:
        bad = archive.testzip()
        if bad is not None:
            raise CarryError(f"{wheel}: member {bad} fails its CRC check")
        names = set(archive.namelist())
        records = [name for name in names if is_record(name)]
        if len(records) != 1:
            raise CarryError(f"{wheel}: expected one RECORD, found {records}")
        listed = {row[0] for row in csv.reader(io.StringIO(archive.read(records[0]).decode())) if row}
    left = sorted(name for name in names | listed if dropped_by(name) is not None)
    if left:
        raise CarryError(f"{wheel}: dropped files still present or listed: {left[:5]}")
    if listed != names:
        raise CarryError(f"{wheel}: RECORD and the zip differ: {sorted(listed ^ names)[:5]}")


def prune(source: pathlib.Path, target: pathlib.Path) -> None:
    """Copy the wheel ``source`` to ``target`` without the members of ``DROPPED``, RECORD rewritten."""
    partial = target.with_name(target.name + ".partial")  # a stopped run never leaves a wheel that looks done
    matched = dict.fromkeys(DROPPED, 0)
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(partial, "w") as out:
        for info in archive.infolist():
            what = dropped_by(info.filename)
            if what is not None:
                matched[what] += 1
            elif is_record(info.filename):
                out.writestr(info, rewritten_record(archive.read(info).decode()))
            else:
                with archive.open(info) as src, out.open(info, "w", force_zip64=info.file_size >= 2**31) as dst:
                    shutil.copyfileobj(src, dst, 16 * MIB)
    missing = [what for what, count in matched.items() if count == 0]
    if missing:
        partial.unlink()
        raise CarryError(f"{source.name} holds no file of {missing}: has the pinned vLLM changed? See DROPPED")
    partial.replace(target)


def pruned_wheel(source: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """The pruned copy of ``source`` in ``folder`` (same file name), made unless a sound one is there."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / source.name
    if not target.exists():
        print(f"pruning {source.name} ({source.stat().st_size / 1e6:.0f} MB)", flush=True)
        prune(source, target)
    check_pruned(target)
    return target


# ----------------------------------------------------------------------------- parts


class PartWriter:
    """A write-only stream that fills ``folder/part1``, ``folder/part2``, ... up to ``size`` bytes each."""

    def __init__(self, folder: pathlib.Path, size: int):
        self.folder, self.size = folder, size
        self.parts: list[pathlib.Path] = []
        self.sha256 = hashlib.sha256()
        self.file = None
        self.room = 0

    def write(self, data: bytes) -> int:
        """Write ``data``, opening the next part whenever the current one is full."""
        view = memoryview(data)
        while view:
            if self.room == 0:
                self.next_part()
            chunk = view[: self.room]
            self.file.write(chunk)
            self.sha256.update(chunk)
            self.room -= len(chunk)
            view = view[len(chunk) :]
        return len(data)

    def next_part(self) -> None:
        """Close the current part and open the next."""
        self.close()
        path = self.folder / f"part{len(self.parts) + 1}"
        self.parts.append(path)
        self.file = path.open("wb")
        self.room = self.size

    def close(self) -> None:
        """Close the current part."""
        if self.file is not None:
            self.file.close()
            self.file = None


def write_parts(
    wheels: Sequence[pathlib.Path], folder: pathlib.Path, part_bytes: int
) -> tuple[list[pathlib.Path], str]:
    """One tar of ``wheels`` (flat, fixed metadata: the same wheels give the same bytes), split into parts.

    Returns the parts and the tar's SHA-256."""
    for old in folder.glob("part*"):  # a part left by an earlier, longer split would be carried by mistake
        if re.fullmatch(r"part\d+", old.name):
            old.unlink()
    writer = PartWriter(folder, part_bytes)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for wheel in sorted(wheels, key=lambda path: path.name):
            info = tar.gettarinfo(wheel, arcname=wheel.name)
            info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
            with wheel.open("rb") as source:
                tar.addfile(info, source)
    writer.close()
    return writer.parts, writer.sha256.hexdigest()


# ----------------------------------------------------------------------------- the device calls


def install_prefix(parts: Sequence[str], sha256: str) -> str:
    """The last call's command up to the benchmark: join, check, extract, install, export."""
    return (
        f"cat {' '.join(parts)} > {TAR_NAME} && echo '{sha256}  {TAR_NAME}' | sha256sum -c --quiet && "
        f"rm -rf /tmp/vw && mkdir /tmp/vw && tar -xf {TAR_NAME} -C /tmp/vw && "
        "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
        f"/tmp/vw/*.whl && export {EXPORTS} && "
    )


def print_calls(parts: Sequence[str], sha256: str, part_mib: float) -> None:
    """The ``run`` calls that carry the parts and install vLLM, for the user to make on the device."""
    prefix = install_prefix(parts, sha256)
    print(
        f"\nDevice calls, {len(parts)} in all, back to back: the machine keeps carried files only while warm "
        f"(about 30 s idle).\nEach carries one part (at most {part_mib:g} MiB) and the repository's tree, "
        f"which must stay under {CARRY_LIMIT_MIB - part_mib:g} MiB.\n"
    )
    for index, part in enumerate(parts[:-1], start=1):
        print(f'call {index}: carry ["{part}"], command: ls -la {pathlib.PurePosixPath(part).parent}')
    print(f'call {len(parts)}: carry ["{parts[-1]}"], command (then your benchmark command, e.g. '
          "python benchmarks/bench_vllm.py ...):\n")
    print(prefix)
    print(f"\n(the prefix is {len(prefix)} characters of the command's {COMMAND_LIMIT})")


# ----------------------------------------------------------------------------- main


def carry_folder(text: str) -> pathlib.Path:
    """``--dir`` resolved against the repository root; it must lie inside it, since ``carry`` names repo paths."""
    folder = (REPO / text).resolve()
    if folder == REPO or REPO not in folder.parents:
        raise CarryError(f"--dir {text} must be a folder inside the repository {REPO}")
    return folder


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".vw", help="output folder, relative to the repository root and "
                        "ignored by git (default .vw)")
    parser.add_argument("--part-mib", type=float, default=46.0, help="largest part in MiB (default 46)")
    parser.add_argument("--platform", action="append", default=[], metavar="TAG",
                        help="another platform tag to accept, e.g. manylinux_2_31_x86_64 (repeatable)")
    return parser


def carry(args: argparse.Namespace) -> None:
    """Download, prune, split, then print the device calls."""
    if not 0 < args.part_mib < CARRY_LIMIT_MIB:
        raise CarryError(f"--part-mib must be in (0, {CARRY_LIMIT_MIB}), got {args.part_mib}")
    folder = carry_folder(args.dir)
    wheels = download_all(folder / "download", [*PLATFORMS, *args.platform])
    wheels[PRUNED_PACKAGE] = pruned = pruned_wheel(wheels[PRUNED_PACKAGE], folder / "pruned")
    wheels["loopkv"] = loopkv_wheel(folder / "loopkv")
    parts, sha256 = write_parts(list(wheels.values()), folder, int(args.part_mib * MIB))
    print(f"\n{len(wheels)} wheels, {sum(w.stat().st_size for w in wheels.values()) / 1e6:.1f} MB "
          f"({pruned.name}: {pruned.stat().st_size / 1e6:.1f} MB), in {len(parts)} parts:")
    for part in parts:
        print(f"  {part.relative_to(REPO)}  {part.stat().st_size / MIB:.2f} MiB")
    print_calls([part.relative_to(REPO).as_posix() for part in parts], sha256, args.part_mib)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        carry(args)
    except CarryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
