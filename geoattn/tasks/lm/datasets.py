"""Named text datasets: a small registry, a download cache and the resolution of ``--data``.

Files are cached under ``$XDG_CACHE_HOME/geoattn`` (default ``~/.cache/geoattn``). A download is
checked against its sha256 and renamed into place only when complete, so an interrupted or corrupt
download never leaves a file that looks valid.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from geoattn.core.cache import cache_dir
from geoattn.core.errors import ConfigError, DataError


@dataclass(frozen=True)
class Dataset:
    """One downloadable text file."""

    name: str
    url: str
    sha256: str
    size: int  # bytes
    description: str

    @property
    def filename(self) -> str:
        return f"{self.name}.txt"


DATASETS: dict[str, Dataset] = {
    d.name: d
    for d in [
        Dataset(
            name="tinyshakespeare",
            url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
            sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
            size=1_115_394,
            description="40,000 lines of Shakespeare (karpathy/char-rnn), the nanoGPT character-level corpus",
        )
    ]
}


class DownloadError(DataError):
    """The file could not be fetched or did not match its checksum."""


def get_dataset(name: str) -> Dataset:
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")
    return DATASETS[name]


def cached_path(name: str) -> Path:
    return cache_dir() / get_dataset(name).filename


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(name: str, *, force: bool = False, timeout: float = 30.0) -> Path:
    """Fetch dataset ``name`` into the cache (unless already there) and return its path.

    Raises :class:`DownloadError` when offline, on an HTTP error, or on a checksum mismatch.
    """
    ds = get_dataset(name)
    target = cached_path(name)
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{ds.filename}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(ds.url, timeout=timeout) as response:
            for chunk in iter(lambda: response.read(1 << 16), b""):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != ds.sha256:
            raise DownloadError(
                f"{ds.url} has sha256 {digest.hexdigest()}, expected {ds.sha256}; "
                f"pass --data FILE with a trusted local copy"
            )
        os.replace(tmp, target)
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise DownloadError(
            f"could not download {name} from {ds.url} ({reason}); pass --data FILE with a local copy"
        ) from err
    finally:
        tmp.unlink(missing_ok=True)
    return target


def resolve_data(spec: str) -> Path:
    """``--data``: an existing file, or the name of a registered dataset (downloaded on first use)."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if spec in DATASETS:
        return download(spec)
    raise DataError(f"data file {spec} does not exist (nor is it a dataset name: {', '.join(DATASETS)})")


def default_corpus() -> Path:
    """The tinyshakespeare file read when none is named: ``$GEOATTN_CORPUS``, else
    ``../shared/data/tinyshakespeare.txt`` (``shared/`` beside the checkout, as the experiments name it)."""
    return Path(os.environ.get("GEOATTN_CORPUS", "../shared/data/tinyshakespeare.txt"))
