"""The second benchmark corpus (experiment=linux_corpus): Linux 6.1's documentation and C sources, as
Debian's package linux-source-6.1 ships them: 160 MB of UTF-8 text, 70.9M GPT-2 tokens.

    python -m scripts.prepare_corpus pack --out bench/corpus/linux-6.1.tar.xz      # needs apt (Debian) and a network
    python -m scripts.prepare_corpus pack --deb linux-source-6.1_*.deb --out ...   # from a .deb already here
    python -m scripts.prepare_corpus unpack bench/corpus/linux-6.1.tar.xz          # -> bench/corpus/linux-6.1/

``pack`` downloads the package (``apt-get download``; or takes ``--deb``), reads the kernel tarball
inside it and writes the chosen files (``selected``) to one xz-compressed tar of about 27 MB, small
enough to carry to a machine without a network; ``unpack`` turns it into the folder of .txt files
that ``data.source=text`` reads, one document per source file (then train.py tokenizes it, with
data.num_proc threads). Each file is named by a hash of its path first, so the folder's sorted order,
and with it the validation split (the last data.val_fraction of the documents), is a random sample
of the files rather than the last directories. Nothing here is committed: bench/ is git-ignored.

Why this corpus (docs/RECIPE.md): no Debian or PyPI package ships English prose large enough not to
be memorised by GPT-2 in a few minutes (the largest, linux-doc's reStructuredText and dict-gcide's
dictionary, hold 6M and 10M tokens; a GPT-2 run on the H100 reads about 30M tokens a minute). The
kernel's sources, documentation included, are the largest body of text Debian ships in one package.
"""
import argparse
import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "linux-source-6.1"
# The documentation, and the C files of the core subsystems (no drivers, no architectures).
DOC_SUFFIXES = (".rst", ".txt")
C_DIRS = ("fs", "net", "kernel", "lib", "mm", "security", "crypto", "block", "io_uring", "ipc", "init", "virt", "sound")


def fail(message: str) -> None:
    """A user's mistake: one line, exit status 2 (as train.py; this script imports nothing of nanoflash)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors (training/exits.py has the same for the other scripts)."""

    def error(self, message: str):
        fail(f"{self.prog}: {message} ({self.prog} --help lists the options)")


def selected(path: str) -> bool:
    """Whether a path inside the kernel tree (linux-source-6.1/<path>) joins the corpus."""
    top = path.split("/", 1)[0]
    if top == "Documentation":
        return path.endswith(DOC_SUFFIXES)
    return top in C_DIRS and path.endswith(".c")


def document_name(path: str) -> str:
    """fs/ext4/inode.c -> <8 hex digits of its hash>-fs__ext4__inode.c.txt (a .txt that sorts at random)."""
    return f"{hashlib.sha256(path.encode()).hexdigest()[:8]}-{path.replace('/', '__')}.txt"


def download(folder: Path) -> Path:
    """The package's .deb, fetched into ``folder`` with apt."""
    proc = subprocess.run(["apt-get", "download", PACKAGE], cwd=folder, capture_output=True, text=True)
    debs = sorted(folder.glob(f"{PACKAGE}_*.deb"))
    if proc.returncode != 0 or not debs:
        fail(f"apt-get download {PACKAGE} failed ({proc.stderr.strip().splitlines()[-1:] or proc.returncode}); run it on "
             "a Debian machine with a network (after apt-get update), or give the .deb with --deb")
    return debs[0]


def kernel_tarball(deb: Path, folder: Path) -> Path:
    """The linux-source-*.tar.xz inside ``deb``, extracted into ``folder`` by dpkg-deb."""
    proc = subprocess.run(["dpkg-deb", "-x", str(deb), str(folder)], capture_output=True, text=True)
    found = sorted(folder.glob("usr/src/linux-source-*.tar.xz"))
    if proc.returncode != 0 or not found:
        fail(f"{deb} holds no usr/src/linux-source-*.tar.xz (dpkg-deb: {proc.stderr.strip() or proc.returncode})")
    return found[0]


def pack(deb: Path, out: Path) -> None:
    """Write the selected files of ``deb``'s kernel tree to ``out`` (a .tar.xz of .txt documents)."""
    with tempfile.TemporaryDirectory() as tmp:
        tarball = kernel_tarball(deb, Path(tmp))
        out.parent.mkdir(parents=True, exist_ok=True)
        n = size = 0
        with tarfile.open(tarball, "r|xz") as source, tarfile.open(out, "w:xz", preset=6) as corpus:
            for member in source:
                path = member.name.split("/", 1)[1] if "/" in member.name else ""
                if not (member.isfile() and selected(path)):
                    continue
                text = source.extractfile(member).read()
                text.decode("utf-8")  # every chosen file is UTF-8 (checked on 6.1.192); fail loudly otherwise
                info = tarfile.TarInfo(document_name(path))
                info.size = len(text)
                corpus.addfile(info, io.BytesIO(text))
                n, size = n + 1, size + len(text)
    print(f"wrote {out}: {n} documents, {size / 1e6:.1f} MB of text, {out.stat().st_size / 1e6:.1f} MB compressed")


def unpack(archive: Path, out: Path) -> None:
    """Extract ``archive`` (written by pack) into the folder ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as corpus:
        names = corpus.getnames()
        if not names or any("/" in name or not name.endswith(".txt") for name in names):
            fail(f"{archive} is not a corpus written by `prepare_corpus.py pack` (its members are not plain .txt names)")
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: say that these are plain files
            corpus.extractall(out, filter="data")
        else:
            corpus.extractall(out)
    print(f"unpacked {len(names)} documents into {out}: python train.py experiment=linux_corpus data.path={out}")


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("pack", help="the package's chosen files as one .tar.xz")
    a.add_argument("--out", required=True, help="the .tar.xz to write (e.g. bench/corpus/linux-6.1.tar.xz)")
    a.add_argument("--deb", help=f"a {PACKAGE} .deb already downloaded (default: apt-get download it)")
    b = sub.add_parser("unpack", help="the .tar.xz as a folder of .txt documents")
    b.add_argument("archive")
    b.add_argument("--out", help="the folder (default: the archive's path without .tar.xz)")
    args = p.parse_args(argv)
    if args.command == "unpack":
        archive = Path(args.archive)
        if not archive.is_file():
            fail(f"{archive}: no such file; write it with `python -m scripts.prepare_corpus pack --out {archive}`")
        unpack(archive, Path(args.out) if args.out else archive.with_name(archive.name.removesuffix(".tar.xz")))
        return
    if args.deb is None:
        with tempfile.TemporaryDirectory() as tmp:
            pack(download(Path(tmp)), Path(args.out))
    elif not Path(args.deb).is_file():
        fail(f"--deb {args.deb}: no such file")
    else:
        pack(Path(args.deb), Path(args.out))


if __name__ == "__main__":
    main()
