"""The device check, prepared on a CPU machine (inference/tools/gpu_check.py, run.sh; docs/cli.md §4.3): the
CPU rehearsal of every phase, the budget table, the one-line answers without CUDA, and the wheels for an
offline GPU host: downloaded by `bash run.sh wheels` (network to PyPI needed), packed, installed into a
private folder. Only a test that needs CUDA may be skipped, and none here does."""
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT
from inference.tools import gpu_check

RUN_SH = os.path.join(ROOT, "run.sh")
CUDA_LINE = "gpu-check needs CUDA: no CUDA device is visible\n"
# The pin the wheels must follow (requirements.txt), and the wheels tilelang cannot import without.
TILELANG_PIN = next(ln.split("==")[1].strip() for ln in open(os.path.join(ROOT, "requirements.txt"))
                    if ln.startswith("tilelang=="))
TILELANG_NEEDS = {"tilelang", "apache-tvm-ffi", "torch-c-dlpack-ext", "z3-solver"}


def run(cmd, env=None, timeout=600, drop=()):
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update({"PYTHON": sys.executable, **(env or {})})
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
    assert re.search(r"bench torch +batch  2: prefill 16 tokens", out)
    assert "tp, W = 2 vs W = 1 (torch kernels, gloo): ok" in out


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


def test_phase_budgets_fit_eight_minutes_and_match_the_docstring():
    budgets = {p.name: p.budget for p in gpu_check.PHASES}
    assert not set(budgets) & set(gpu_check.RESERVED)
    total = sum(budgets.values()) + sum(gpu_check.RESERVED.values()) + gpu_check.START_UP_SECONDS
    assert total <= gpu_check.TOTAL_SECONDS == 480
    table = gpu_check.__doc__.split("  phase       budget")[1].split("\n--budget")[0]
    rows = dict(re.findall(r"^  \(?([\w-]+)\)?\s+(\d+)(?:  |$)", table, re.M))
    assert {k: int(v) for k, v in rows.items()} == {**budgets, **gpu_check.RESERVED,
                                                    "start-up": gpu_check.START_UP_SECONDS, "total": total}
    proc = run([sys.executable, "-m", "inference.tools.gpu_check", "--help"])
    assert f"(default {sum(budgets.values())}, the phases' budgets summed)" in " ".join(proc.stdout.split())


# ---- without CUDA ----

def test_run_sh_gpu_check_without_cuda_prints_one_line_and_exits_2():
    proc = run(["bash", RUN_SH, "gpu-check"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and proc.stdout == CUDA_LINE and proc.stderr == "", proc.stdout + proc.stderr


@pytest.mark.parametrize("args,start", [
    (["--wheels", "/nonexistent/w"], "run.sh: error: gpu-check --wheels /nonexistent/w: no such folder"),
    (["--wheels=/nonexistent/w.tar.xz"], "run.sh: error: gpu-check --wheels /nonexistent/w.tar.xz: no such"),
    (["--wheels"], "run.sh: error: gpu-check --wheels needs a folder or a .tar.xz"),
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
    need = gpu_check._needed(TILELANG_REQUIRES, gpu_check.target_environment("3.12"), "tilelang")
    assert [n for n, _, _ in need] == ["apache-tvm-ffi", "torch-c-dlpack-ext", "cloudpickle", "ml-dtypes",
                                       "psutil", "tqdm", "z3-solver"]
    assert ("apache-tvm-ffi", "<0.1.13,>=0.1.11", "tilelang") in need
    need = gpu_check._needed(TILELANG_REQUIRES, gpu_check.target_environment("3.14"), "tilelang")
    assert "torch-c-dlpack-ext" not in [n for n, _, _ in need]
    roots = gpu_check._needed(gpu_check.project_requirements(), gpu_check.target_environment("3.12"), "r")
    names = [n for n, _, _ in roots]
    assert names[0] == "tilelang" and ("tilelang", f"=={TILELANG_PIN}", "r") in roots
    assert not {"torch", "numpy", "pytest", "hypothesis", "pytest-xdist"} & set(names)


def _fake_wheel(folder, name: str, version: str, body: str) -> str:
    """A minimal pure-Python wheel: module `name` with `body`, its dist-info."""
    fname = f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": body,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(os.path.join(folder, fname), "w", zipfile.ZIP_DEFLATED) as z:
        for f, text in files.items():
            z.writestr(f, text)
    return fname


def test_packed_wheels_install_into_a_private_folder(tmp_path):
    """A packed folder (wheels stored uncompressed inside, so that xz compresses the raw files) installs
    offline into the target, leaves torch out, and installs a second time only when the wheels change."""
    folder = tmp_path / "w"
    folder.mkdir()
    records = []
    for name, version in (("gpucheck_probe", "1.0"), ("torch", "0.0.1")):
        f = _fake_wheel(folder, name, version, "VALUE = 42\n")
        records.append({"file": f, "name": gpu_check.canonical(name), "version": version,
                        "requirement": f"{gpu_check.canonical(name)}=={version}"})
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    (folder / gpu_check.MANIFEST).write_text(json.dumps({"python_version": here, "wheels": records}))
    archive = gpu_check.pack_wheels(str(folder), records)
    assert archive == str(folder) + ".tar.xz"
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "inference.tools.gpu_check", "install-wheels", archive, "--target",
           str(site)]
    proc = run(cmd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch-0.0.1-py3-none-any.whl left out" in proc.stdout
    assert f"wheels: installed into {site}: gpucheck-probe 1.0" in proc.stdout
    assert "wheels: tilelang " in proc.stdout
    unpacked = tmp_path / "wheels" / "w" / records[0]["file"]
    with zipfile.ZipFile(unpacked) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
    probe = run([sys.executable, "-c", "import gpucheck_probe as p; print(p.VALUE, p.__file__)"],
                env={"PYTHONPATH": str(site)})
    assert probe.stdout.split()[0] == "42" and probe.stdout.split()[1].startswith(str(site)), probe.stderr
    assert not (site / "torch").exists()
    again = run(cmd)
    assert again.returncode == 0 and f"wheels: {site} already holds 1 of them" in again.stdout


# ---- the real wheels (downloaded from PyPI: CI has network) ----

@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-wheels") / "w"
    proc = run(["bash", RUN_SH, "wheels", str(folder)], timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    with open(folder / gpu_check.MANIFEST, encoding="utf-8") as f:
        return folder, json.load(f)


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
        missing = {n for n, _, _ in gpu_check._needed(requires, env, r["name"])} - set(got)
        assert not missing, f"{r['name']} needs {missing}"


# Run in a venv that sees the system's packages, with every system distribution other than torch, numpy and
# torch's own requirements (gpu_check.HOST_HAS) hidden: the GPU host the wheels are for.
HOST_ONLY = """
import importlib.abc, importlib.machinery, importlib.metadata as md, os, re, sys
venv = {venv!r}
hidden = set()
for d in md.distributions(path=[p for p in sys.path if "site-packages" in p and not p.startswith(venv)]):
    name = re.sub(r"[-_.]+", "-", (d.metadata["Name"] or "")).lower()
    if name in {host!r} or name.startswith("nvidia-"):
        continue
    for f in d.files or []:
        top = f.parts[0]
        if not top.endswith((".dist-info", ".data", ".pth")) and top != "..":
            hidden.add(top.split(".")[0])
hidden -= set(sys.stdlib_module_names)
own = [p for p in sys.path if p.startswith(venv)]
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
print(tilelang.__version__, tilelang.__file__)
"""


def test_wheels_install_offline_into_a_fresh_venv(wheels, tmp_path):
    folder, manifest = wheels
    venv = tmp_path / "venv"
    proc = run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    assert proc.returncode == 0, proc.stderr
    py = str(venv / "bin" / "python")
    files = [str(folder / r["file"]) for r in manifest["wheels"]]
    proc = run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(folder), "--no-deps",
                "--ignore-installed", *files], drop=("PIP_CONSTRAINT",))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code = HOST_ONLY.format(venv=str(venv), host=sorted(gpu_check.HOST_HAS))
    proc = run([py, "-c", code])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    version, where = proc.stdout.split()[-2:]
    assert version == TILELANG_PIN and where.startswith(str(venv))


def test_gpu_check_wheels_installs_into_the_private_folder(wheels, tmp_path):
    folder, manifest = wheels
    site = tmp_path / "site"
    proc = run(["bash", RUN_SH, "gpu-check", "--wheels", str(folder)],
               env={"CUDA_VISIBLE_DEVICES": "", "GPU_CHECK_SITE": str(site)})
    assert proc.returncode == 2 and proc.stdout.endswith(CUDA_LINE), proc.stdout + proc.stderr
    assert f"wheels: installed into {site}: " in proc.stdout and (site / ".wheels").is_file()
    # Every wheel, the host's own too: tilelang then imports from the private folder.
    everything = tmp_path / "all"
    proc = run([sys.executable, "-m", "inference.tools.gpu_check", "install-wheels", str(folder), "--target",
                str(everything), "--all"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"wheels: tilelang {TILELANG_PIN} imports from {everything}" in proc.stdout
    assert not (everything / "torch").exists() and not (everything / "numpy").exists()
    assert importlib.metadata.version("tilelang")       # the host's own install is untouched
