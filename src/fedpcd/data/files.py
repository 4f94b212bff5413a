"""How dataset files are downloaded when they are not found, and the checksums of the official ones.

Where files are looked for is ``fedpcd.data.sources``; when nothing is found they are downloaded from the
official source (if allowed), otherwise a UserError says where to put them. Downloads (pooch) land by
rename, so an interrupted one never leaves a partial file, and a download given its official MD5 lands only
if it has it.

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
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath

from fedpcd.data.sources import Source, candidates, download_base, find_local, missing_line
from fedpcd.errors import UserError
from fedpcd.utils import current_umask, quiet

DOWNLOAD_TIMEOUT_S = 10.0
SKIP_CHECKSUMS_VAR = "FEDPCD_SKIP_CHECKSUMS"  # set to 1 to use a modified copy of an official file


def find_or_download(
    source: Source, root: Path | None, download: bool, fetch: Callable[[Path], None] | None = None
) -> Path:
    """The folder holding ``source``'s files (``fedpcd.data.sources.locate``); else download them with
    ``fetch(dest)`` into ``<root | $FEDPCD_DATA | ~/.cache/fedpcd>/<name>``, or fail in one line.

    ``fetch`` is needed where ``source.downloadable`` and ``download`` are both true and no files are found.
    """
    found = find_local(source, root, download and fetch is not None)
    if found is not None:
        return found
    assert fetch is not None
    dest = download_base(root) / source.name
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
            missing_line(source, candidates(source, root), f"download failed ({reason})")
        ) from None
    found = source.probe(dest)
    if found is None:
        raise UserError(f"{source.name}: downloaded into {dest} but the expected files are not there")
    return found


def download_file(urls: Sequence[str], target: Path, md5: str | None = None) -> None:
    """Fetch ``target`` from the first of ``urls`` (http or https) that works, with pooch.

    Each attempt streams into a temporary file beside ``target``, renamed into place only when complete
    and, with ``md5``, of that MD5; otherwise OSError listing every URL's failure.
    """
    import pooch

    errors = []
    for url in urls:
        try:
            with quiet(pooch.get_logger()):  # it reports every download on stderr
                pooch.retrieve(
                    url,
                    known_hash=f"md5:{md5}" if md5 else None,
                    fname=target.name,
                    path=target.parent,
                    downloader=pooch.HTTPDownloader(timeout=DOWNLOAD_TIMEOUT_S),
                )
        except Exception as exc:  # requests' errors are OSErrors (some also ValueErrors); a wrong MD5 is not
            wrong_md5 = isinstance(exc, ValueError) and not isinstance(exc, OSError)
            reason = f"not the official file (its MD5 is not {md5})" if wrong_md5 else str(exc)
            errors.append(f"{url}: {reason}")
        else:
            target.chmod(0o666 & ~current_umask())  # a normal file, not the temporary file's 0600
            return
    raise OSError("; ".join(errors))


# tarfile's own "data" filter too where this Python has it (3.10.12, 3.11.4, 3.12 and later)
_TAR_FILTER = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def _plain_members(tar: tarfile.TarFile, archive: str) -> list[tarfile.TarInfo]:
    """The archive's members if all are files or folders inside it, made owner-writable only; else OSError.

    Links, devices, absolute and ``..`` paths are refused (tarfile's "data" filter, which pooch's Untar uses
    only on Python >= 3.12, would still allow links that stay inside).
    """
    members = tar.getmembers()
    for m in members:
        path = PurePosixPath(m.name)
        if not (m.isreg() or m.isdir()) or path.is_absolute() or ".." in path.parts:
            raise OSError(f"{archive} holds {m.name!r}, not a plain file or folder inside it; not extracted")
        m.mode &= 0o755  # no set-id bits, nothing writable by others
        m.uid, m.gid, m.uname, m.gname = os.getuid(), os.getgid(), "", ""
    return members


def _unzip(archive: Path, staging: Path) -> None:
    """Extract a .zip whose members are all plain files or folders inside it; else OSError (as for tars)."""
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            path = PurePosixPath(info.filename)
            link = (info.external_attr >> 16) & 0o170000 == 0o120000
            if link or path.is_absolute() or ".." in path.parts:
                raise OSError(f"{archive.name} holds {info.filename!r}, not a plain file or folder inside it")
        zf.extractall(staging)


def download_and_extract(url: str, dest: Path, folder: str, md5: str | None = None) -> None:
    """Download a .tar.gz or .zip (of MD5 ``md5`` if given), extract it into a staging folder, then move
    ``folder`` (or its missing files) in.

    Every file lands by rename, so an interrupted download or extraction never leaves a partial file;
    nothing is written outside ``dest``.
    """
    archive = dest / url.rsplit("/", 1)[-1]
    target = dest / folder
    if target.is_symlink():
        raise OSError(f"{target} is a symbolic link; not writing through it")
    download_file([url], archive, md5)
    staging = Path(tempfile.mkdtemp(prefix=".extract.", dir=dest))
    try:
        if archive.suffix == ".zip":
            _unzip(archive, staging)
        else:
            with tarfile.open(archive) as tar:
                members = _plain_members(tar, archive.name)
                tar.extractall(staging, members, **_TAR_FILTER)
        if not (staging / folder).is_dir():
            raise OSError(f"{archive.name} does not contain {folder}/")
        if not target.exists():
            os.replace(staging / folder, target)
        else:  # an incomplete earlier copy: keep what is there, add what is missing
            for f in (staging / folder).iterdir():
                if not (target / f.name).exists():
                    os.replace(f, target / f.name)
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
