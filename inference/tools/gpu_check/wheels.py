"""Wheels for a GPU host without network (docs/cli.md §4.3): `bash run.sh wheels DIR` downloads them
(wheels_main, download_wheels, pack_wheels, split_archive), `bash run.sh gpu-check --wheels DIR` installs
them into a private folder (install_wheels_main, install_wheels) and runs the check with it on PYTHONPATH.
The package docstring says what each command does. Neither imports torch: the machine with network may lack
it.
"""
import argparse
import contextlib
import email.parser
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
import zlib

from .common import ROOT, note

# A GPU host has Python, torch (with the packages torch itself requires) and numpy: never downloaded.
HOST_HAS = {"torch", "numpy", "triton", "typing-extensions", "filelock", "sympy", "mpmath", "networkx",
            "jinja2", "markupsafe", "fsspec", "setuptools", "pip"}
NEVER = ("torch", "triton", "nvidia-")    # never installed from a wheel folder, whatever it holds
# In a package's metadata but never imported by the check: tokenizers imports huggingface-hub only in
# Tokenizer.from_pretrained; the project reads tokenizer.json files.
NOT_IMPORTED = {"huggingface-hub"}
TEST_ONLY = {"pytest", "hypothesis", "pytest-xdist", "openai"}     # requirements.txt's test tools
# Imported but missing from a package's metadata (found by tests/test_gpu_check.py, which imports the check's
# modules with only torch, numpy and the wheels visible): torch_c_dlpack_ext/core.py imports packaging.
UNDECLARED = {"torch-c-dlpack-ext": ["packaging"]}
# The manylinux levels of a host that runs torch's CUDA wheels (glibc >= 2.28), newest first.
PLATFORMS = ([f"manylinux_2_{n}_x86_64" for n in range(28, 4, -1)]
             + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"])
MANIFEST = "wheels.json"
PART_BYTES = 30 * 2 ** 20       # --pack also writes the archive in parts of at most this size (--part-size)
SITE = os.path.join(ROOT, ".device", "site")               # the default private folder (git-ignored)
NO_NETWORK = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name "
              "resolution", "Name or service not known", "Network is unreachable", "ConnectTimeoutError",
              "ProxyError", "Max retries exceeded", "ReadTimeoutError", "Connection refused")


class WheelError(Exception):
    """A problem with the wheels, reported as one line."""


def _packaging():
    """(Requirement, SpecifierSet, default_environment): packaging's, or the copy pip carries."""
    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
    except ImportError:
        from pip._vendor.packaging.markers import default_environment
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.specifiers import SpecifierSet
    return Requirement, SpecifierSet, default_environment


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _never(name: str) -> bool:
    return any(name == n or (n.endswith("-") and name.startswith(n)) for n in NEVER)


def _satisfies(version: str, spec: str) -> bool:
    _, SpecifierSet, _ = _packaging()
    try:
        return SpecifierSet(spec).contains(version, prereleases=True)
    except ValueError:      # a version string packaging cannot read
        return False


def target_environment(python_version: str) -> dict:
    """Marker values of CPython `python_version` on Linux x86_64 (no extras)."""
    _, _, default_environment = _packaging()
    env = dict(default_environment())
    env.update(python_version=python_version, python_full_version=python_version + ".0", sys_platform="linux",
               platform_system="Linux", os_name="posix", platform_machine="x86_64",
               implementation_name="cpython", platform_python_implementation="CPython", extra="")
    return env


def wheel_metadata(path: str):
    """(name, version, [Requires-Dist lines]) of a wheel file."""
    with zipfile.ZipFile(path) as z:
        meta = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(meta) != 1:
            raise WheelError(f"{os.path.basename(path)}: not a wheel (no single .dist-info/METADATA)")
        msg = email.parser.HeaderParser().parsestr(z.read(meta[0]).decode("utf-8"))
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def _needed(requirements, env, by: str):
    """(name, specifier, by) for requirement lines that apply to `env` and that a GPU host may lack."""
    Requirement, _, _ = _packaging()
    out = []
    for line in requirements:
        req = Requirement(line)
        name = canonical(req.name)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if name in HOST_HAS or name in NOT_IMPORTED or name in TEST_ONLY or _never(name):
            continue
        out.append((name, str(req.specifier), by))
    return out


def project_requirements(path: str = os.path.join(ROOT, "requirements.txt")) -> list:
    with open(path, encoding="utf-8") as f:
        lines = [ln.split("#", 1)[0].strip() for ln in f]
    reqs = [ln for ln in lines if ln and not ln.startswith("-")]
    return sorted(reqs, key=lambda r: not canonical(r).startswith("tilelang"))      # tilelang first


def _pip_download(requirements, dest: str, python_version: str) -> list:
    """pip download, one wheel per requirement, no dependencies; returns the paths pip reports."""
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps", "--python-version",
           python_version, "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)],
           "--dest", dest, "--retries", "1", "--timeout", "30", "--progress-bar", "off",
           "--disable-pip-version-check", *requirements]
    p = subprocess.run(cmd, capture_output=True, text=True)
    text = p.stdout + p.stderr
    if p.returncode != 0:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if any(s in text for s in NO_NETWORK):
            why = re.search(r"Failed to establish a new connection: [^'\"]*|Temporary failure in name "
                            r"resolution|Name or service not known|Network is unreachable|Connection refused|"
                            r"Read timed out|ProxyError|Max retries exceeded", text)
            where = re.search(r"Looking in indexes: (.*)", text)
            raise WheelError("no network: pip could not reach the package index"
                             + (" " + where.group(1).strip() if where else "")
                             + f" ({why.group(0).rstrip(')') if why else 'connection failed'})")
        missing = re.search(r"No matching distribution found for (\S+)", text)
        if missing:
            versions = re.search(r"\(from versions: ([^)]*)\)", text)
            found = versions.group(1) if versions else "none"
            raise WheelError(f"no wheel of {missing.group(1)} for Python {python_version} on manylinux "
                             f"x86_64 (versions with such a wheel: {found})")
        raise WheelError(f"pip download failed: {lines[-1] if lines else p.returncode}")
    found = re.findall(r"^\s*(?:Saved|File was already downloaded)\s+(.+\.whl)\s*$", text, re.M)
    return [os.path.abspath(f) for f in found]


def download_wheels(dest: str, python_version: str, requirements=None) -> list:
    """Download the wheels a GPU host with Python `python_version`, torch and numpy needs for the check:
    the project's requirements other than HOST_HAS and the test tools, and their dependencies from each
    wheel's metadata, recursively. Writes DEST/wheels.json; returns its records."""
    if not re.fullmatch(r"3\.\d{1,2}", python_version):
        raise WheelError(f"unknown --python-version {python_version!r} (expected 3.N, e.g. 3.12)")
    env = target_environment(python_version)
    os.makedirs(dest, exist_ok=True)
    specs, by_of, got = {}, {}, {}
    roots = requirements if requirements is not None else project_requirements()
    todo = _needed(roots, env, "requirements.txt")
    while todo:
        batch = []
        for name, spec, by in todo:
            specs.setdefault(name, [])
            if spec and spec not in specs[name]:
                specs[name].append(spec)
            by_of.setdefault(name, by)
            if name in got:
                if not _satisfies(got[name]["version"], ",".join(specs[name])):
                    raise WheelError(f"{by} needs {name}{spec}, but {got[name]['file']} was chosen for "
                                     f"{got[name]['requirement']}")
            elif name not in batch:
                batch.append(name)
        todo = []
        if not batch:
            break
        paths = _pip_download([name + ",".join(specs[name]) for name in batch], dest, python_version)
        for path in paths:
            dist, version, requires = wheel_metadata(path)
            name = canonical(dist)
            if name not in batch or name in got:
                continue
            got[name] = {"file": os.path.basename(path), "name": name, "version": version,
                         "requirement": name + ",".join(specs[name]), "needed_by": by_of[name],
                         "bytes": os.path.getsize(path)}
            todo += _needed(requires + UNDECLARED.get(name, []), env, name)
        lost = [n for n in batch if n not in got]
        if lost:
            raise WheelError(f"pip download reported no wheel for {', '.join(lost)}")
    records = list(got.values())
    with open(os.path.join(dest, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"python_version": python_version, "platforms": PLATFORMS[0] + " and older",
                   "wheels": records}, f, indent=1)
        f.write("\n")
    return records


def _stored(wheel: str, out: str):
    """Copy a wheel with every member stored uncompressed: the same files (so the same RECORD hashes), a
    valid wheel, and raw libraries for xz to compress (deflated ones it cannot shrink)."""
    with zipfile.ZipFile(wheel) as zi, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zo:
        for info in zi.infolist():
            zo.writestr(info, zi.read(info), compress_type=zipfile.ZIP_STORED)


def pack_wheels(dest: str, records) -> str:
    """DEST.tar.xz (xz preset 9, `xz -T0` when the xz program is there) holding the manifest and the wheels
    it lists, flat, each wheel stored uncompressed (_stored): half the size of the wheels as downloaded."""
    out = os.path.normpath(dest) + ".tar.xz"
    xz = shutil.which("xz")
    with tempfile.TemporaryDirectory() as scratch, open(out + ".tmp", "wb") as f:
        proc = subprocess.Popen([xz, "-9", "-T0", "-c"], stdin=subprocess.PIPE, stdout=f) if xz else None
        try:
            with (tarfile.open(fileobj=proc.stdin, mode="w|") if proc else
                  tarfile.open(fileobj=f, mode="w:xz", preset=9)) as tar:
                tar.add(os.path.join(dest, MANIFEST), arcname=MANIFEST)
                for r in records:
                    copy = os.path.join(scratch, r["file"])
                    _stored(os.path.join(dest, r["file"]), copy)
                    tar.add(copy, arcname=r["file"])
                    os.remove(copy)
        finally:
            if proc:
                proc.stdin.close()
                proc.wait()
        if proc and proc.returncode:
            raise WheelError(f"xz failed (exit status {proc.returncode}) writing {out}")
    os.replace(out + ".tmp", out)
    return out


def split_archive(archive: str, part_bytes: int = PART_BYTES) -> list:
    """When `archive` is larger than `part_bytes`: ARCHIVE.part0, .part1, ... (as few as fit, of equal size
    but the last), for hosts that take a limited size per transfer, the device machine for one (64 MiB a
    call, the repository's files included); [] otherwise. Parts of an earlier pack of that name are removed
    first. `cat ARCHIVE.part0 ARCHIVE.part1 > ARCHIVE` joins them; gpu-check --wheels joins them itself."""
    for old in _part_files(os.path.dirname(archive) or ".", os.path.basename(archive)).values():
        os.remove(old)
    size = os.path.getsize(archive)
    if size <= part_bytes:
        return []
    n = -(-size // part_bytes)
    each = -(-size // n)
    parts = []
    with open(archive, "rb") as f:
        for i in range(n):
            part = f"{archive}.part{i}"
            with open(part + ".tmp", "wb") as out:
                out.write(f.read(each))
            os.replace(part + ".tmp", part)
            parts.append(part)
    return parts


def _part_files(folder: str, name: str) -> dict:
    """{i: path} of the files NAME.part<i> in `folder`."""
    prefix = name + ".part"
    return {int(f[len(prefix):]): os.path.join(folder, f) for f in os.listdir(folder)
            if f.startswith(prefix) and f[len(prefix):].isdigit()}


def _xz_ends(path: str) -> bool:
    """Whether the file ends with an xz stream's footer: CRC32 of the next 6 bytes, backward size, flags,
    b"YZ" (a part cut from the middle of a stream does so by chance once in 2^48)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < 12:
            return False
        f.seek(-12, os.SEEK_END)
        footer = f.read(12)
    return footer[10:] == b"YZ" and zlib.crc32(footer[4:10]) == int.from_bytes(footer[:4], "little")


def archive_sources(src: str):
    """(name, [files]) of a packed wheel folder given as its archive, as one part of the archive split by
    `--pack` (NAME.part<i>), or as the folder holding those parts; None for a folder of wheels. A part
    missing (a gap, or a last part that does not end the xz stream) is a WheelError naming it."""
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, MANIFEST)) or any(f.endswith(".whl") for f in os.listdir(src)):
            return None
        names = set()
        for f in os.listdir(src):
            m = re.fullmatch(r"(.+)\.part\d+", f)
            if m and os.path.isfile(os.path.join(src, f)):
                names.add(m.group(1))
        names = sorted(names)
        if len(names) > 1:
            raise WheelError(f"{src} holds the parts of {len(names)} archives ({', '.join(names)}): give the "
                             f"first part of one, e.g. {os.path.join(src, names[0])}.part0")
        if not names:
            return None
        folder, name = src, names[0]
    else:
        m = re.fullmatch(r"(.+)\.part\d+", os.path.basename(src))
        if not m:
            return os.path.basename(src), [src]
        folder, name = os.path.dirname(src), m.group(1)
    have = _part_files(folder, name)
    base = os.path.join(folder, name)
    parts = []
    for i in range(max(have) + 1):
        if i not in have:
            found = ", ".join(f"part{j}" for j in sorted(have))
            raise WheelError(f"{base}.part{i} is missing (found {found}; "
                             f"the parts of one `bash run.sh wheels DIR --pack` join in order)")
        parts.append(have[i])
    if name.endswith((".xz", ".txz")) and not _xz_ends(parts[-1]):
        raise WheelError(f"{base}.part{len(parts)} is missing (the archive goes on after "
                         f"{os.path.basename(parts[-1])})")
    return name, parts


class _Joined(io.RawIOBase):
    """Files read one after the other as one stream (the parts of a split archive)."""

    def __init__(self, paths):
        self.files = [open(p, "rb") for p in paths]

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self.files:
            n = self.files[0].readinto(buf)
            if n:
                return n
            self.files.pop(0).close()
        return 0

    def close(self):
        for f in self.files:
            f.close()
        self.files = []
        super().close()


@contextlib.contextmanager
def _open_archive(files):
    """The tar stream of a packed wheel folder: one archive, or its parts joined ("r|*": read once, in
    order, any compression)."""
    with io.BufferedReader(_Joined(files), 1 << 20) as stream:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            yield tar


def _unpack(files, src: str, folder: str) -> str:
    """Extract a packed wheel folder (flat: wheels.json and *.whl) from its archive or parts `files` into
    `folder`, unless already there."""
    mark = "\n".join(f"{os.path.abspath(p)} {os.stat(p).st_size} {os.stat(p).st_mtime_ns}" for p in files)
    stamp = os.path.join(folder, ".from")
    if os.path.isfile(stamp) and open(stamp, encoding="utf-8").read() == mark:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    try:
        with _open_archive(files) as tar:
            for m in tar:
                if m.isfile() and "/" not in m.name and (m.name == MANIFEST or m.name.endswith(".whl")):
                    with tar.extractfile(m) as data, open(os.path.join(folder, m.name), "wb") as out:
                        shutil.copyfileobj(data, out)
    except (tarfile.TarError, EOFError, OSError, lzma.LZMAError) as e:
        raise WheelError(f"{src}: not a readable archive ({e})")
    with open(stamp, "w", encoding="utf-8") as f:
        f.write(mark)
    return folder


def _archive_manifest(files, src: str):
    """The manifest of a packed wheel folder (its first member: the first part is enough), or None."""
    try:
        with _open_archive(files) as tar:
            for m in tar:
                if m.name == MANIFEST and m.isfile():
                    return json.load(tar.extractfile(m))
    except (tarfile.TarError, EOFError, OSError, ValueError, lzma.LZMAError) as e:
        raise WheelError(f"{src}: not a readable archive ({e})")
    return None


def _python_of(spec, src: str, here: str):
    if spec is not None and spec.get("python_version") != here:
        raise WheelError(f"the wheels in {src} are for Python {spec.get('python_version')}, this is Python "
                         f"{here} (make them with: bash run.sh wheels DIR --python-version {here})")


def _host_versions(exclude: str) -> dict:
    """{name: version} of the distributions this Python sees, `exclude` (the private folder) left out."""
    import importlib.metadata as md
    exclude = os.path.abspath(exclude)
    path = [p for p in sys.path if os.path.abspath(p or ".") != exclude
            and not os.path.abspath(p or ".").startswith(exclude + os.sep)]
    out = {}
    for d in md.distributions(path=path):
        name = d.metadata["Name"]
        if name:
            out.setdefault(canonical(name), d.version)
    return out


def choose_wheels(records, host: dict, everything: bool = False):
    """(records to install, ["name version" of the host's own that meet the requirement]): torch, triton and
    nvidia-* never; a wheel the host {name: version} has at a version its requirement allows only with
    `everything`."""
    chosen, kept = [], []
    for r in records:
        if _never(r["name"]):
            note(f"wheels: {r['file']} left out (torch, triton and nvidia-* come with the host)")
            continue
        have = host.get(r["name"])
        if not everything and have is not None and _satisfies(have, r["requirement"][len(r["name"]):]):
            kept.append(f"{r['name']} {have}")
        else:
            chosen.append(r)
    return chosen, kept


def install_wheels(src: str, target: str = SITE, everything: bool = False) -> list:
    """Install the wheels of `src` (a folder from download_wheels, its .tar.xz, or that archive's parts, given
    as one of them or as their folder: archive_sources) that the host lacks into `target` with pip --no-index
    --no-deps, then check that tilelang imports with `target` on PYTHONPATH. `everything`: install every
    wheel, even those the host has. Returns the installed records."""
    src, target = os.path.abspath(src), os.path.abspath(target)
    if not os.path.exists(src):
        raise WheelError(f"{src}: no such folder or archive (make one with: bash run.sh wheels DIR [--pack])")
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    folder, packed = src, archive_sources(src)
    if packed:
        name, files = packed
        _python_of(_archive_manifest(files, src), src, here)     # before unpacking: its first member
        stem = re.sub(r"\.tar(\.xz|\.gz|\.bz2)?$|\.t[gx]z$", "", name)
        folder = _unpack(files, src, os.path.join(os.path.dirname(target), "wheels", stem))
    manifest = os.path.join(folder, MANIFEST)
    if os.path.isfile(manifest):
        with open(manifest, encoding="utf-8") as f:
            spec = json.load(f)
        _python_of(spec, src, here)
        records = spec["wheels"]
    else:       # a folder of wheels made by hand: each pinned to its own version
        records = []
        for f in sorted(os.listdir(folder)):
            if f.endswith(".whl"):
                name, version = canonical(f.split("-")[0]), f.split("-")[1]
                records.append({"file": f, "name": name, "version": version,
                                "requirement": f"{name}=={version}"})
    if not records:
        raise WheelError(f"no wheels in {src} (make them with: bash run.sh wheels DIR)")
    absent = [r["file"] for r in records if not os.path.isfile(os.path.join(folder, r["file"]))]
    if absent:
        raise WheelError(f"{src} lacks {', '.join(absent)} (listed in its {MANIFEST})")
    chosen, kept = choose_wheels(records, _host_versions(target), everything)
    stamp = os.path.join(target, ".wheels")
    want = "\n".join(sorted(r["file"] for r in chosen))
    if os.path.isfile(stamp) and open(stamp, encoding="utf-8").read() == want:
        note(f"wheels: {target} already holds {len(chosen)} of them")
    else:
        tmp = target + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        if chosen:
            cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--no-index", "--no-deps",
                   "--find-links", folder, "--target", tmp, "--no-cache-dir", "--no-warn-script-location",
                   "--disable-pip-version-check", "-q", *[os.path.join(folder, r["file"]) for r in chosen]]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
                raise WheelError(f"pip install --no-index into {target} failed: {lines[-1] if lines else ''}")
        with open(os.path.join(tmp, ".wheels"), "w", encoding="utf-8") as f:
            f.write(want)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        note(f"wheels: installed into {target}: "
             + (", ".join(f"{r['name']} {r['version']}" for r in chosen) or "nothing"))
    if kept:
        note(f"wheels: the host's own: {', '.join(kept)}")
    code = ("import os, tilelang, tilelang.env as e; n = os.path.join(e.CUDA_HOME or '', 'bin', 'nvcc'); "
            "print(tilelang.__version__, tilelang.__file__, n if os.path.isfile(n) else '-')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [target, os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        raise WheelError(f"tilelang does not import with {target} on PYTHONPATH: "
                         f"{lines[-1] if lines else p.returncode}")
    version, where, nvcc = (p.stdout.strip().splitlines() or [""])[-1].split(" ")
    note(f"wheels: tilelang {version} imports from {os.path.dirname(os.path.dirname(where))}; nvcc: "
         + (nvcc if nvcc != "-" else "none found, so no kernel can compile (TileLang looks at CUDA_HOME, "
                                     "PATH, /usr/local/cuda)"))
    return chosen


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB"


def _size(text: str) -> int:
    """Bytes of `30M`, `512K` or `1000000` (M and K: MiB and KiB)."""
    m = re.fullmatch(r"(\d+)([KkMm]?)", text.strip())
    if not m or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 30M or 512K, got {text!r}")
    return int(m.group(1)) * {"": 1, "k": 2 ** 10, "m": 2 ** 20}[m.group(2).lower()]


def _in_repo(path: str) -> str:
    """`path` relative to the repository root when it lies inside it (as `carry` names it), else as given."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return path if rel.startswith("..") else rel


def carry_plan(archive: str, parts) -> list:
    """Lines saying which file each call to a host with a size limit per transfer carries (one part a
    call) and what the last call runs."""
    run = f"bash run.sh gpu-check --wheels {_in_repo(parts[0])}"
    lines = [f"in {len(parts)} parts of {_mib(os.path.getsize(parts[0]))} at most, for a host that takes a "
             f"limited size per transfer (the device machine: docs/cli.md §4.3), one part a call:"]
    for i, part in enumerate(parts):
        lines.append(f"  call {i + 1}: carry {_in_repo(part)} ({_mib(os.path.getsize(part))})"
                     + (f", run: {run}" if i == len(parts) - 1 else ""))
    return lines


def wheels_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="bash run.sh wheels", description="Download the wheels an offline GPU "
                                 "host needs for the device check (docs/cli.md §4.3).")
    ap.add_argument("dir", help="folder to write the wheels and wheels.json into (created)")
    ap.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}",
                    help="the GPU host's Python, 3.N (default: this interpreter's)")
    ap.add_argument("--pack", action="store_true",
                    help="also write DIR.tar.xz (xz preset 9) and, when it is larger than --part-size, "
                         "DIR.tar.xz.part0, .part1, ...")
    ap.add_argument("--part-size", type=_size, default=PART_BYTES,
                    help=f"the largest part of a packed archive (default {PART_BYTES >> 20}M)")
    opts = ap.parse_args(argv)
    try:
        t0 = time.perf_counter()
        records = download_wheels(opts.dir, opts.python_version)
        for r in records:
            note(f"  {r['name']:20s} {r['version']:12s} {_mb(r['bytes']):>9s}  (for {r['needed_by']})")
        total = sum(r["bytes"] for r in records)
        note(f"wrote {len(records)} wheels, {_mb(total)}, for Python {opts.python_version} to {opts.dir} "
             f"in {time.perf_counter() - t0:.0f} s")
        out = opts.dir
        if opts.pack:
            t0 = time.perf_counter()
            out = pack_wheels(opts.dir, records)
            size = os.path.getsize(out)
            note(f"packed into {out}: {_mb(size)} ({_mib(size)}) in {time.perf_counter() - t0:.0f} s")
            parts = split_archive(out, opts.part_size)
            if parts:
                for line in carry_plan(out, parts):
                    note(line)
        note(f"on the GPU host: bash run.sh gpu-check --wheels {out}")
    except (WheelError, OSError) as e:
        print(f"run.sh: error: wheels: {e}", file=sys.stderr)
        return 1
    return 0


def install_wheels_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="bash run.sh gpu-check --wheels", description="Install the wheels of a "
                                 "folder or archive from `bash run.sh wheels` into a private folder.")
    ap.add_argument("src", help="the folder, its .tar.xz, a part of that (.part0) or the folder holding the "
                                "parts")
    ap.add_argument("--target", default=SITE,
                    help=f"the private folder (default {os.path.relpath(SITE, ROOT)})")
    ap.add_argument("--all", action="store_true", help="install every wheel, also those the host has")
    opts = ap.parse_args(argv)
    try:
        install_wheels(opts.src, opts.target, opts.all)
    except (WheelError, OSError, subprocess.SubprocessError) as e:
        print(f"run.sh: error: gpu-check --wheels: {e}", file=sys.stderr)
        return 1
    return 0
