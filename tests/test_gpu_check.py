"""The device check, prepared on a CPU machine (inference/tools/gpu_check/, run.sh; docs/cli.md §4.3): the
CPU rehearsal of every phase, the budget table, the one-line answers without CUDA, and the wheels for an
offline GPU host: packed in parts and installed from them (a fake wheel set, offline), and the real set
downloaded by `bash run.sh wheels` (network to PyPI needed), installed into a private folder, imported in a
fresh venv. The costly steps happen once, in module fixtures: one pack, one download, one install of the real
wheels. Only a test that needs CUDA may be skipped, and none here does."""
import contextlib
import glob
import importlib.metadata
import importlib.util
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile
from site import getsitepackages, getusersitepackages

import pytest

from conftest import ROOT
from inference.tools import gpu_check
from inference.tools.gpu_check import wheels as gpu_wheels     # its helpers, and where wheels_main looks

RUN_SH = os.path.join(ROOT, "run.sh")
CUDA_LINE = "gpu-check needs CUDA: no CUDA device is visible\n"
# The pin the wheels must follow (requirements.txt), and the wheels tilelang cannot import without.
TILELANG_PIN = next(ln.split("==")[1].strip() for ln in open(os.path.join(ROOT, "requirements.txt"))
                    if ln.startswith("tilelang=="))
TILELANG_NEEDS = {"tilelang", "apache-tvm-ffi", "torch-c-dlpack-ext", "z3-solver"}


def run(cmd, env=None, timeout=600, drop=()):
    # One torch thread (the rehearsal and the processes it starts): beside the suite's other worker, two
    # threads per process fight for two cores and the rehearsal takes 1.7 times as long.
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update({"PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full,
                          stdin=subprocess.DEVNULL)


def one_error_line(proc, start: str):
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), proc.stderr


# ---- the rehearsal and the phase table ----

def test_rehearsal_walks_every_phase_on_cpu():
    proc = run([sys.executable, "-m", "inference.tools.gpu_check", "--rehearse"],
               env={"CUDA_VISIBLE_DEVICES": ""})
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    for p in gpu_check.PHASES:
        assert f"== {p.name} (rehearsal). The real check: {p.checks}" in out
        assert f"== {p.name}: PASS" in out
    summary = rf"^rehearsal: PASS, {len(gpu_check.PHASES)} phase\(s\) in [\d.]+ s$"
    assert re.search(summary, out, re.M), out[-400:]
    # the pieces the GPU run relies on were exercised: kernel lists, wrappers' argument checks, comparisons
    assert re.search(r"^kernels: would compile \d+ kernels at the released shapes", out, re.M)
    with open(os.path.join(gpu_check.FIXTURE, "config.json"), encoding="utf-8") as f:
        cases = gpu_check.kernel_cases(json.load(f), ops=object())
    section = out.split("== kernels (rehearsal)")[1].split("== kernels: PASS")[0]
    rows = re.findall(r" (ok {5}|FAIL {3})\S", section)
    assert len(rows) == len(cases) and set(rows) == {"ok     "}, section
    assert "fixture, torch vs reference logits: ok" in out
    assert "fixture, tilelang vs reference logits: ok" in out
    assert re.search(r"speed 2 layers torch +batch  2: decode +[\d.]+ ms eager, +[\d.]+ ms as the captured "
                     r"step run eagerly, \d+ launches a step", out)
    assert re.search(r"speed host-expert kernel \(\w+\)  2 threads: decode +[\d.]+ GB/s", out)
    assert "tp, W = 2 vs W = 1 (torch kernels, gloo): ok" in out
    assert "experts on the host vs reference logits: ok" in out
    assert "experts on the host vs on the device: ok" in out
    for where in ("device", "host"):
        assert re.search(rf"--experts-on {where}: ok \(decode [\d.]+ ms per token, ", out), out[-2000:]


def test_rehearsal_fails_when_a_phase_setup_raises(monkeypatch, capsys):
    def typo(ctx):
        return undefined_name   # noqa: F821 - the point: a typo in a phase's setup

    phases = (gpu_check.Phase("broken", 10, typo, typo, "nothing"),
              gpu_check.Phase("failing", 10, lambda c: False, lambda c: False, "nothing"),
              gpu_check.Phase("fine", 10, lambda c: True, lambda c: c.rehearse and c.device == "cpu",
                              "nothing"))
    monkeypatch.setattr(gpu_check, "PHASES", phases)
    assert gpu_check.main(["--rehearse"]) == 1
    out = capsys.readouterr().out
    assert "broken: setup raised NameError: name 'undefined_name' is not defined" in out
    assert "== broken: FAIL" in out and "== failing: FAIL" in out and "== fine: PASS" in out
    assert "rehearsal: FAIL (broken, failing), 3 phase(s)" in out
    assert gpu_check.main(["--rehearse", "--phases", "fine"]) == 0


def test_phase_budgets_fit_eight_minutes_and_match_the_docstring(capsys):
    budgets = {p.name: p.budget for p in gpu_check.PHASES}
    assert not set(budgets) & set(gpu_check.RESERVED)
    total = sum(budgets.values()) + sum(gpu_check.RESERVED.values()) + gpu_check.START_UP_SECONDS
    assert total <= gpu_check.TOTAL_SECONDS == 540
    table = gpu_check.__doc__.split("  phase       budget")[1].split("\n--budget")[0]
    rows = dict(re.findall(r"^  \(?([\w-]+)\)?\s+(\d+)(?:  |$)", table, re.M))
    assert {k: int(v) for k, v in rows.items()} == {**budgets, **gpu_check.RESERVED,
                                                    "start-up": gpu_check.START_UP_SECONDS, "total": total}
    with pytest.raises(SystemExit) as done:
        gpu_check.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"(default {sum(budgets.values())}, the phases' budgets summed)" in " ".join(out.split())


# ---- without CUDA ----

def test_run_sh_gpu_check_without_cuda_prints_one_line_and_exits_2():
    proc = run(["bash", RUN_SH, "gpu-check"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and proc.stdout == CUDA_LINE and proc.stderr == "", proc.stdout + proc.stderr


@pytest.mark.parametrize("args,start", [
    (["--wheels", "/nonexistent/w"], "run.sh: error: gpu-check --wheels /nonexistent/w: no such folder"),
    (["--wheels=/nonexistent/w.tar.xz"], "run.sh: error: gpu-check --wheels /nonexistent/w.tar.xz: no such"),
    (["--wheels", "/nonexistent/w.tar.xz.part0"], "run.sh: error: gpu-check --wheels /nonexistent/w.tar.x"),
    (["--wheels"], "run.sh: error: gpu-check --wheels needs a folder, a .tar.xz or its .part0"),
])
def test_gpu_check_wheels_option_errors(args, start):
    one_error_line(run(["bash", RUN_SH, "gpu-check", *args], env={"CUDA_VISIBLE_DEVICES": ""}), start)


def test_gpu_check_wheels_folder_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"CUDA_VISIBLE_DEVICES": "", "GPU_CHECK_SITE": str(tmp_path / "site")}
    one_error_line(run(["bash", RUN_SH, "gpu-check", "--wheels", str(empty)], env=env),
                   f"run.sh: error: gpu-check --wheels: no wheels in {empty}")
    other = tmp_path / "other"
    other.mkdir()
    (other / gpu_check.MANIFEST).write_text(json.dumps({"python_version": "3.1", "wheels": []}))
    one_error_line(run(["bash", RUN_SH, "gpu-check", "--wheels", str(other)], env=env),
                   f"run.sh: error: gpu-check --wheels: the wheels in {other} are for Python 3.1, this is "
                   f"Python {sys.version_info[0]}.{sys.version_info[1]}")


def test_wheels_errors_are_one_line(tmp_path):
    one_error_line(run(["bash", RUN_SH, "wheels", str(tmp_path / "w"), "--python-version", "3.x"]),
                   "run.sh: error: wheels: unknown --python-version '3.x' (expected 3.N, e.g. 3.12)")
    offline = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple/"}
    drop = ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_CONSTRAINT")
    one_error_line(run(["bash", RUN_SH, "wheels", str(tmp_path / "w")], env=offline, drop=drop, timeout=300),
                   "run.sh: error: wheels: no network: pip could not reach the package index")


# ---- the wheel set, offline ----

TILELANG_REQUIRES = [      # tilelang 0.1.15's Requires-Dist lines (a selection)
    "apache-tvm-ffi<0.1.13,>=0.1.11", 'torch-c-dlpack-ext; python_version < "3.14"', "cloudpickle",
    "ml-dtypes", "numpy>=1.23.5", "psutil", "torch", 'torch>=2.4; platform_system == "Darwin"',
    'setuptools; platform_system == "Darwin"', "tqdm>=4.62.3", "typing-extensions>=4.10.0",
    "z3-solver<4.15.5,>=4.13.0", 'ml-dtypes>=0.5.1; extra == "fp4"',
    'nvidia-cuda-nvcc>=13.0.48; extra == "nvcc"']


def test_dependencies_read_from_metadata_for_the_hosts_python():
    need = gpu_wheels._needed(TILELANG_REQUIRES, gpu_check.target_environment("3.12"), "tilelang")
    assert [n for n, _, _ in need] == ["apache-tvm-ffi", "torch-c-dlpack-ext", "cloudpickle", "ml-dtypes",
                                       "psutil", "tqdm", "z3-solver"]
    assert ("apache-tvm-ffi", "<0.1.13,>=0.1.11", "tilelang") in need
    need = gpu_wheels._needed(TILELANG_REQUIRES, gpu_check.target_environment("3.14"), "tilelang")
    assert "torch-c-dlpack-ext" not in [n for n, _, _ in need]
    roots = gpu_wheels._needed(gpu_check.project_requirements(), gpu_check.target_environment("3.12"), "r")
    names = [n for n, _, _ in roots]
    assert names[0] == "tilelang" and ("tilelang", f"=={TILELANG_PIN}", "r") in roots
    assert not {"torch", "numpy", "pytest", "hypothesis", "pytest-xdist"} & set(names)


def _fake_wheel(folder, name: str, version: str, body: str, blob: bytes = b"") -> str:
    """A minimal pure-Python wheel: module `name` with `body` (and `blob` as name/blob.bin), its dist-info."""
    fname = f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": body, f"{name}/blob.bin": blob,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(os.path.join(folder, fname), "w", zipfile.ZIP_DEFLATED) as z:
        for f, data in files.items():
            z.writestr(f, data)
    return fname


PART = 64 * 1024


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The one pack: `wheels DIR --pack --part-size 64K` with the download replaced by a fake wheel set (a
    probe carrying 200 kB of random bytes, and a `torch` that must be left out): (DIR, the output)."""
    folder = tmp_path_factory.mktemp("packed") / "w"

    def download(dest, python_version):
        os.makedirs(dest)
        records = []
        for name, version, blob in (("gpucheck_probe", "1.0", random.Random(0).randbytes(200_000)),
                                    ("torch", "0.0.1", b"")):
            f = _fake_wheel(dest, name, version, "VALUE = 42\n", blob)
            records.append({"file": f, "name": gpu_check.canonical(name), "version": version,
                            "requirement": f"{gpu_check.canonical(name)}=={version}", "needed_by": "test",
                            "bytes": os.path.getsize(os.path.join(dest, f))})
        with open(os.path.join(dest, gpu_check.MANIFEST), "w", encoding="utf-8") as f:
            json.dump({"python_version": python_version, "wheels": records}, f)
        return records

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(gpu_wheels, "download_wheels", download)      # where wheels_main reads it
        rc = gpu_check.main(["wheels", str(folder), "--pack", "--part-size", "64K"])
    assert rc == 0, out.getvalue()
    return folder, out.getvalue()


def _parts(folder) -> list:
    archive = f"{folder}.tar.xz"
    return [f"{archive}.part{i}" for i in range(len(glob.glob(glob.escape(archive) + ".part*")))]


def test_pack_writes_parts_and_says_which_call_carries_which(packed, tmp_path):
    """DIR.tar.xz, and its parts of at most --part-size (as few as fit, equal but the last) that join into
    it; the output names each call's part and what the last call runs. A pack that fits in one part leaves
    no parts, not even an earlier pack's."""
    folder, out = packed
    archive, parts = f"{folder}.tar.xz", _parts(folder)
    size = os.path.getsize(archive)
    assert f"packed into {archive}: " in out
    assert len(parts) == -(-size // PART) >= 3, out
    sizes = [os.path.getsize(p) for p in parts]
    assert max(sizes) <= PART and len(set(sizes[:-1])) == 1 and sizes[-1] <= sizes[0]
    joined = b"".join(open(p, "rb").read() for p in parts)
    assert joined == open(archive, "rb").read()
    lines = out.splitlines()
    calls = [f"  call {i + 1}: carry {p} ({n / 2 ** 20:.1f} MiB)" for i, (p, n) in
             enumerate(zip(parts, sizes))]
    calls[-1] += f", run: bash run.sh gpu-check --wheels {parts[0]}"
    assert [ln for ln in lines if ln.startswith("  call ")] == calls, out
    assert lines[-1] == f"on the GPU host: bash run.sh gpu-check --wheels {archive}"
    copy = tmp_path / "w.tar.xz"
    shutil.copy(archive, copy)
    assert gpu_check.split_archive(str(copy), PART) == [f"{copy}.part{i}" for i in range(len(parts))]
    assert gpu_check.split_archive(str(copy), size) == [] and os.listdir(tmp_path) == ["w.tar.xz"]


def test_packed_parts_install_into_a_private_folder(packed, tmp_path):
    """The parts, carried into a folder of their own (as on the device machine), go through `run.sh gpu-check
    --wheels PART0`: joined and unpacked (each wheel stored uncompressed inside, so that xz compresses the
    raw files), installed offline into the private folder, torch left out, then the check runs. A second
    install, given the folder holding the parts, installs nothing. The whole archive unpacks to the same
    files."""
    folder, _ = packed
    carried = tmp_path / "carried"
    carried.mkdir()
    for p in _parts(folder):
        shutil.copy(p, carried)
    site = tmp_path / "site"
    env = {"CUDA_VISIBLE_DEVICES": "", "GPU_CHECK_SITE": str(site)}
    proc = run(["bash", RUN_SH, "gpu-check", "--wheels", str(carried / "w.tar.xz.part0")], env=env)
    assert proc.returncode == 2 and proc.stdout.endswith(CUDA_LINE), proc.stdout + proc.stderr
    assert "torch-0.0.1-py3-none-any.whl left out" in proc.stdout
    assert f"wheels: installed into {site}: gpucheck-probe 1.0" in proc.stdout
    assert "wheels: tilelang " in proc.stdout
    unpacked = tmp_path / "wheels" / "w"
    probe = unpacked / "gpucheck_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(probe) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
        assert z.read("gpucheck_probe/blob.bin") == random.Random(0).randbytes(200_000)
    code = "import gpucheck_probe as p; print(p.VALUE, p.__file__)"
    imported = run([sys.executable, "-c", code], env={"PYTHONPATH": str(site)})
    assert imported.stdout.split()[0] == "42" and imported.stdout.split()[1].startswith(str(site)), \
        imported.stderr
    assert not (site / "torch").exists()
    again = run([sys.executable, "-m", "inference.tools.gpu_check", "install-wheels", str(carried),
                 "--target", str(site)])
    assert again.returncode == 0 and f"wheels: {site} already holds 1 of them" in again.stdout, \
        again.stdout + again.stderr
    whole = gpu_check.archive_sources(f"{folder}.tar.xz")
    assert whole == ("w.tar.xz", [f"{folder}.tar.xz"])
    gpu_wheels._unpack(whole[1], "test", str(tmp_path / "whole"))
    for f in (gpu_check.MANIFEST, probe.name, "torch-0.0.1-py3-none-any.whl"):
        assert (tmp_path / "whole" / f).read_bytes() == (unpacked / f).read_bytes()


def test_a_missing_part_is_a_one_line_error(packed, tmp_path):
    folder, _ = packed
    parts = _parts(folder)
    n = len(parts)
    env = {"CUDA_VISIBLE_DEVICES": "", "GPU_CHECK_SITE": str(tmp_path / "site")}
    for case, left_out in (("gap", 1), ("end", n - 1)):
        (tmp_path / case).mkdir()
        for i, p in enumerate(parts):
            if i != left_out:
                shutil.copy(p, tmp_path / case)
        base = tmp_path / case / "w.tar.xz"
        found = ", ".join(f"part{i}" for i in range(n) if i != left_out)
        why = f"(found {found}; " if case == "gap" else f"(the archive goes on after w.tar.xz.part{n - 2})"
        for given in (f"{base}.part0", str(tmp_path / case)):
            one_error_line(run(["bash", RUN_SH, "gpu-check", "--wheels", given], env=env),
                           f"run.sh: error: gpu-check --wheels: {base}.part{left_out} is missing {why}")
    shutil.copy(parts[0], tmp_path / "end" / "v.tar.xz.part0")
    one_error_line(run(["bash", RUN_SH, "gpu-check", "--wheels", str(tmp_path / "end")], env=env),
                   f"run.sh: error: gpu-check --wheels: {tmp_path / 'end'} holds the parts of 2 archives "
                   f"(v.tar.xz, w.tar.xz): give the first part of one")


def test_wheels_commands_run_without_torch(tmp_path):
    """`wheels` and `install-wheels` never import torch: the machine with network may lack it."""
    code = ("import sys; from inference.tools import gpu_check as g; rc = g.main(sys.argv[1:]); "
            "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    for args in (["wheels", str(tmp_path / "w"), "--python-version", "3.x"],
                 ["install-wheels", str(tmp_path)]):
        proc = run([sys.executable, "-c", code, *args])
        assert proc.returncode == 1 and proc.stdout == "no torch\n", proc.stdout + proc.stderr


# ---- the real wheels (downloaded from PyPI: CI has network) ----

@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-wheels") / "w"
    proc = run(["bash", RUN_SH, "wheels", str(folder)], timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    with open(folder / gpu_check.MANIFEST, encoding="utf-8") as f:
        return folder, json.load(f)


@pytest.fixture(scope="module")
def private_site(wheels, tmp_path_factory):
    """The one install of the real wheels: every one of them, the host's own too (--all), into a private
    folder, as `gpu-check --wheels` does: (the folder, the output)."""
    folder, _ = wheels
    site = tmp_path_factory.mktemp("private") / "site"
    proc = run([sys.executable, "-m", "inference.tools.gpu_check", "install-wheels", str(folder), "--target",
                str(site), "--all"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site, proc.stdout


def test_wheels_are_tilelang_and_what_it_needs_never_torch(wheels):
    folder, manifest = wheels
    assert manifest["python_version"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    got = {r["name"]: r for r in manifest["wheels"]}
    assert TILELANG_NEEDS <= set(got) and got["tilelang"]["version"] == TILELANG_PIN
    assert not [n for n in got if n in ("torch", "numpy", "triton") or n.startswith("nvidia-")]
    env = gpu_check.target_environment(manifest["python_version"])
    for r in manifest["wheels"]:        # closed: whatever a wheel requires is in the set or on every GPU host
        assert r["file"].endswith(".whl") and (folder / r["file"]).is_file()
        _, _, requires = gpu_check.wheel_metadata(str(folder / r["file"]))
        requires += gpu_check.UNDECLARED.get(r["name"], [])
        missing = {n for n, _, _ in gpu_wheels._needed(requires, env, r["name"])} - set(got)
        assert not missing, f"{r['name']} needs {missing}"


# Run in a fresh venv that sees the packages of the Python running the suite (host_site_dirs), with every one
# of them other than torch, numpy and torch's own requirements (gpu_check.HOST_HAS) hidden: the GPU host the
# wheels are for, with the private folder on PYTHONPATH as `gpu-check --wheels` puts it.
HOST_ONLY = """
import importlib.abc, importlib.machinery, importlib.metadata as md, os, re, sys
venv, site = {venv!r}, {site!r}
hidden = set()
for d in md.distributions(path={host_dirs!r}):
    name = re.sub(r"[-_.]+", "-", (d.metadata["Name"] or "")).lower()
    if name in {host!r} or name.startswith("nvidia-"):
        continue
    for f in d.files or []:
        top = f.parts[0]
        if not top.endswith((".dist-info", ".data", ".pth")) and top != "..":
            hidden.add(top.split(".")[0])
hidden -= set(sys.stdlib_module_names)
own = [p for p in sys.path if p.startswith((venv, site))]
class HideSystem(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if "." not in name and top in hidden and importlib.machinery.PathFinder.find_spec(top, own) is None:
            raise ImportError("hidden: " + name)
sys.meta_path.insert(0, HideSystem())
import json, tilelang, tvm_ffi, z3, torch_c_dlpack_ext, generate, convert
import inference.tools.parity, inference.tools.synthetic, inference.tools.bench
from inference.kernels import tilelang_ops as ops
tilelang.disable_cache()   # compile for real (the compile-time imports too), write nothing to ~/.tilelang
build = next(b for b in ops.builds(json.load(open("config.json"))) if b.name == "hc_split_sinkhorn")
jit = ops.compile_kernel(build.prim_func(), {{"kind": "cuda", "arch": "sm_90a"}})
assert "__global__" in jit.get_kernel_source()
print(sys.modules["torch"].__file__, tilelang.__version__, tilelang.__file__)
"""


def host_site_dirs() -> list:
    """The site-packages folders of the Python running the suite, in its sys.path order: a venv's own (and
    its base's with --system-site-packages), the user's when enabled."""
    dirs = set(getsitepackages()) | {getusersitepackages()}
    return [p for p in sys.path if p in dirs]


def test_wheels_install_offline_into_a_fresh_venv(private_site, tmp_path):
    """With only the host's packages (those of the Python running the suite, its torch among them) and the
    private folder visible, tilelang and the check's modules import and a kernel compiles: the wheel set is
    complete."""
    site, _ = private_site
    venv = tmp_path / "venv"
    proc = run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert proc.returncode == 0, proc.stderr
    python = str(venv / "bin" / "python")
    # The host's folders, their .pth files included, through a .pth of the venv's own: --system-site-packages
    # would give it the base interpreter's, without the torch of a suite run from a venv.
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    host_dirs = host_site_dirs()
    with open(os.path.join(purelib, "host-site.pth"), "w", encoding="utf-8") as f:
        f.writelines(f"import site; site.addsitedir({d!r})\n" for d in host_dirs)
    code = HOST_ONLY.format(venv=str(venv), site=str(site), host=sorted(gpu_check.HOST_HAS),
                            host_dirs=host_dirs)
    proc = run([python, "-c", code], env={"PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    torch_file, version, where = proc.stdout.split()[-3:]
    assert torch_file == importlib.util.find_spec("torch").origin
    assert version == TILELANG_PIN and where.startswith(str(site))


def test_gpu_check_wheels_installs_into_the_private_folder(wheels, private_site):
    """Every wheel installs offline into the private folder and tilelang imports from there; torch and numpy
    are never installed, the host's own packages are untouched. Without --all the choice is what the host
    lacks, or has at a version the requirement excludes."""
    _, manifest = wheels
    site, out = private_site
    assert f"wheels: installed into {site}: " in out and (site / ".wheels").is_file()
    assert f"wheels: tilelang {TILELANG_PIN} imports from {site}" in out
    assert not (site / "torch").exists() and not (site / "numpy").exists()
    assert importlib.metadata.version("tilelang")       # the host's own install is untouched
    host = gpu_wheels._host_versions(str(site))
    chosen, kept = gpu_check.choose_wheels(manifest["wheels"], host)
    chosen = {r["name"] for r in chosen}
    for r in manifest["wheels"]:
        spec = r["requirement"][len(r["name"]):]
        allowed = r["name"] in host and gpu_wheels._satisfies(host[r["name"]], spec)
        assert (r["name"] in chosen) != allowed and (f"{r['name']} {host.get(r['name'])}" in kept) == allowed
