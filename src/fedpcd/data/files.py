"""Where dataset files are found, how they are downloaded, and the checksums of the official ones.

Files are looked up in the configured root, then ``$FEDPCD_DATA``, then system locations, then the download
cache; when nothing is found they are downloaded from the official source (if allowed), otherwise a UserError
says where to put them. Downloads land by rename, so an interrupted one never leaves a partial file.

A file whose shape (or sample count) is that of an official file must also have its content (MD5, checked by
the format's reader: ``idx``, ``cifar``, ``svhn``); files of other shapes (subsets, test fixtures, other data
in the same format) are not checked.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from fedpcd.errors import UserError
from fedpcd.utils import current_umask

DOWNLOAD_TIMEOUT_S = 10.0
ENV_VAR = "FEDPCD_DATA"
SKIP_CHECKSUMS_VAR = "FEDPCD_SKIP_CHECKSUMS"  # set to 1 to use a modified copy of an official file


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "fedpcd"


def _search_bases(root: Path | None) -> list[Path]:
    """Top-level folders to search, in order: root, $FEDPCD_DATA, then the download cache."""
    bases = []
    if root is not None:
        bases.append(root)
    env = os.environ.get(ENV_VAR)
    if env:
        bases.append(Path(env).expanduser())
    bases.append(_cache_dir())
    return bases


def _download_base(root: Path | None) -> Path:
    env = os.environ.get(ENV_VAR)
    if root is not None:
        return root
    return Path(env).expanduser() if env else _cache_dir()


def _candidates(name: str, subdirs: Sequence[str], root: Path | None, system: Sequence[str]) -> list[Path]:
    """Folders to try: each base, base/<name>, base/<usual sub-folders>; system folders after $FEDPCD_DATA."""
    bases = _search_bases(root)
    out: list[Path] = []
    for i, base in enumerate(bases):
        if i == len(bases) - 1:  # the cache comes after the system locations
            out.extend(Path(s) for s in system)
        for sub in ("", name, *subdirs):
            p = base / sub if sub else base
            if p not in out:
                out.append(p)
    return out


def find_or_download(
    name: str,
    root: Path | None,
    download: bool,
    subdirs: Sequence[str],
    system: Sequence[str],
    probe: Callable[[Path], Path | None],
    fetch: Callable[[Path], None],
    what: str,
) -> Path:
    """The data folder ``probe`` finds in the first candidate that has one; else download, or fail clearly.

    ``probe(candidate)`` returns the folder holding the files (the candidate or a fixed sub-folder of it)
    or None. Downloads go to ``<root | $FEDPCD_DATA | ~/.cache/fedpcd>/<name>``.
    """
    looked = _candidates(name, subdirs, root, system)
    for folder in looked:
        found = probe(folder)
        if found is not None:
            return found
    places = ", ".join(str(p) for p in looked)
    if not download:
        raise UserError(
            f"{name} files not found in {places}; download disabled; put {what} under one of those folders "
            f"or set {ENV_VAR}"
        )
    dest = _download_base(root) / name
    new_dirs = [d for d in (dest, *dest.parents) if not d.exists()]  # innermost first
    try:
        dest.mkdir(parents=True, exist_ok=True)
        fetch(dest)
    except Exception as exc:  # network, HTTP, disk: all end in the same advice
        for d in new_dirs:  # leave no empty folders behind
            with contextlib.suppress(OSError):
                d.rmdir()
        if isinstance(exc, UserError):
            raise
        reason = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        raise UserError(
            f"{name} files not found in {places}; download failed ({reason}); put {what} under one of those "
            f"folders or set {ENV_VAR}"
        ) from None
    found = probe(dest)
    if found is None:
        raise UserError(f"{name}: downloaded into {dest} but the expected files are not there")
    return found


def download_file(urls: Sequence[str], target: Path) -> None:
    """Fetch the first URL that works into ``target`` atomically (temp file beside it, then rename)."""
    errors = []
    for url in urls:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
        os.fchmod(fd, 0o666 & ~current_umask())  # a normal file, not mkstemp's 0600
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:
                shutil.copyfileobj(resp, out, length=1 << 20)
            os.replace(tmp, target)
            return
        except Exception as exc:
            errors.append(f"{url}: {exc}")
        finally:
            Path(tmp).unlink(missing_ok=True)
    raise OSError("; ".join(errors))


def download_and_extract(url: str, dest: Path, folder: str) -> None:
    """Download a .tar.gz, extract it into a staging folder, then move ``folder`` (or its missing files) in.

    Every file lands by rename, so an interrupted download or extraction never leaves a partial file.
    """
    archive = dest / url.rsplit("/", 1)[-1]
    download_file([url], archive)
    staging = Path(tempfile.mkdtemp(prefix=".extract.", dir=dest))
    try:
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(staging, filter="data")
            else:  # pragma: no cover - Python without extraction filters
                for member in tar.getmembers():
                    if member.name.startswith(("/", "..")) or ".." in Path(member.name).parts:
                        raise OSError(f"unsafe path {member.name!r} in {archive.name}")
                tar.extractall(staging)
        if not (staging / folder).is_dir():
            raise OSError(f"{archive.name} does not contain {folder}/")
        if not (dest / folder).exists():
            os.replace(staging / folder, dest / folder)
        else:  # an incomplete earlier copy: keep what is there, add what is missing
            for f in (staging / folder).iterdir():
                if not (dest / folder / f.name).exists():
                    os.replace(f, dest / folder / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        archive.unlink(missing_ok=True)


# ----- checksums of the official files (sources: the publishers' pages as mirrored by torchvision)


def md5(data: bytes | bytearray | Path) -> str:
    """The hex MD5 of bytes, or of a file's content (read in chunks)."""
    digest = hashlib.md5(usedforsecurity=False)
    if isinstance(data, Path):
        with data.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    else:
        digest.update(data)
    return digest.hexdigest()


def verify_md5(path: Path, data: bytes | bytearray | Path, expected: str) -> None:
    """UserError naming ``path`` if the MD5 of ``data`` is not ``expected`` ($FEDPCD_SKIP_CHECKSUMS: skip)."""
    if os.environ.get(SKIP_CHECKSUMS_VAR, "").strip() not in ("", "0"):
        return
    got = md5(data)
    if got != expected:
        raise UserError(
            f"{path} is corrupt: it has the official file's shape but not its content (MD5 {got}, expected "
            f"{expected}); delete it so that it is downloaded again, or set {SKIP_CHECKSUMS_VAR}=1 to use a "
            "modified copy"
        )


def files_probe(folder_name: str, files: Sequence[str]) -> Callable[[Path], Path | None]:
    """Looks for ``files`` in ``<candidate>/<folder_name>/``, then in the candidate itself."""

    def probe(base: Path) -> Path | None:
        for folder in (base / folder_name, base):
            if all((folder / f).is_file() for f in files):
                return folder
        return None

    return probe
