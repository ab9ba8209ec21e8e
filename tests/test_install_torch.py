"""zerolab/install_torch.py, which `make lab` and `make test` run first: which torch it installs
(NVIDIA driver present / absent / PyTorch's CPU index unreachable), what it says first, and its
failures. No network: the driver is a fake nvidia-smi on PATH, the index a local HTTP server or
a refused port, and the environment's Python a shell script whose pip only records its call."""

from __future__ import annotations

import ast
import functools
import http.server
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from zerolab import install_torch
from zerolab.install_torch import CPU_INDEX, PINNED, choose, why_unreachable

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "zerolab" / "install_torch.py"


def no_probe(url: str) -> str | None:
    raise AssertionError(f"the CPU index was probed ({url}) where it is not wanted")


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no request log on the test's stderr
        pass


@pytest.fixture
def cpu_index(tmp_path):
    """A stand-in for PyTorch's CPU index: an HTTP server on this machine with a torch/ page."""
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text("<a>torch-2.13.0+cpu-...whl</a>")
    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def refused() -> str:
    """A URL nobody answers: a port just freed on this machine (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- the choice, rule by rule ----------------------------------------------------------------


def test_no_driver_on_linux_takes_the_cpu_build_from_pytorchs_cpu_index():
    asked = []
    plan = choose("", driver=False, system="Linux", unreachable=lambda u: asked.append(u))
    assert asked == [f"{CPU_INDEX}/torch/"]
    assert plan.pip_args == [PINNED, "--index-url", CPU_INDEX]
    assert plan.notice is None
    assert "CPU build" in plan.says and "GB to download" in plan.says


def test_cpu_index_unreachable_falls_back_to_the_default_index_and_says_so():
    plan = choose("", driver=False, system="Linux",
                  unreachable=lambda url: "Name or service not known")
    assert plan.pip_args == [PINNED]  # pip's own index: no --index-url
    assert plan.notice == (f"PyTorch's CPU index {CPU_INDEX} cannot be reached (Name or service "
                           f"not known): torch comes from pip's default index instead")
    assert "CUDA build" in plan.says and "GB to download" in plan.says


def test_a_driver_takes_torch_from_the_default_index_without_probing():
    plan = choose("", driver=True, system="Linux", unreachable=no_probe)
    assert plan.pip_args == ["torch"]
    assert "NVIDIA driver" in plan.says and "CUDA build" in plan.says


def test_torch_given_is_installed_as_given_options_included():
    given = "torch==2.6.0 --index-url https://example.invalid/whl/cu126"
    for driver in (False, True):
        plan = choose(given, driver=driver, system="Linux", unreachable=no_probe)
        assert plan.pip_args == ["torch==2.6.0", "--index-url", "https://example.invalid/whl/cu126"]
        assert plan.notice is None and given in plan.says


def test_macos_takes_the_pinned_torch_from_the_default_index():
    plan = choose("", driver=False, system="Darwin", unreachable=no_probe)
    assert plan.pip_args == [PINNED] and "macOS build" in plan.says


# --- the signs it reads: nvidia-smi on PATH, an index that answers ---------------------------


def test_driver_is_seen_by_nvidia_smi_on_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert not install_torch.has_nvidia_driver()
    executable(bin_dir / "nvidia-smi", "#!/bin/sh\nexit 0\n")
    assert install_torch.has_nvidia_driver()


def test_why_unreachable_names_what_went_wrong(cpu_index, refused):
    assert why_unreachable(f"{cpu_index}/torch/") is None
    assert why_unreachable(f"{cpu_index}/nothing-here/").startswith("HTTP 404")
    assert "refused" in why_unreachable(f"{refused}/torch/").lower()


# --- the script as make runs it: by path, with the environment's python ----------------------

# A Python without torch until its pip has run: pip records its arguments and "installs" torch
# (a marker file), unless FAKE_PIP_STATUS says it fails or FAKE_PIP_NO_TORCH that nothing came.
FAKE_PYTHON = """#!/bin/sh
marker="${0%/*}/torch-installed"  # no dirname: PATH is the fake bin/ alone
if [ "$1" = "-m" ]; then
  shift
  echo "fake pip: $*"
  [ -n "$FAKE_PIP_NO_TORCH" ] || : > "$marker"
  exit "${FAKE_PIP_STATUS:-0}"
fi
[ -e "$marker" ] || exit 1
echo "2.13.0+cpu (CPU build)"
"""


def run_script(tmp_path: Path, *args: str, driver: bool, **env: str):
    bin_dir = tmp_path / "bin"  # the whole PATH: a real nvidia-smi elsewhere stays unseen
    bin_dir.mkdir(exist_ok=True)
    if driver:
        executable(bin_dir / "nvidia-smi", "#!/bin/sh\nexit 0\n")
    python = executable(tmp_path / "python", FAKE_PYTHON)
    return subprocess.run([sys.executable, str(SCRIPT), "--python", str(python), *args],
                          env={"PATH": str(bin_dir), **env}, capture_output=True, text=True,
                          timeout=60)


def test_script_without_driver_and_index_unreachable_says_the_fallback(tmp_path, refused):
    proc = run_script(tmp_path, "--cpu-index", refused, driver=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"PyTorch's CPU index {refused} cannot be reached (")
    assert lines[0].endswith("torch comes from pip's default index instead")
    assert lines[1].startswith(f"Installing torch: {PINNED} from pip's default index")
    assert lines[3] == f"fake pip: pip install {PINNED}"
    assert lines[-1] == "Installed torch 2.13.0+cpu (CPU build)"


def test_script_without_driver_takes_the_cpu_index_that_answers(tmp_path, cpu_index):
    proc = run_script(tmp_path, "--cpu-index", cpu_index, driver=False)
    assert proc.returncode == 0, proc.stderr
    assert "cannot be reached" not in proc.stdout
    assert f"fake pip: pip install {PINNED} --index-url {cpu_index}" in proc.stdout


def test_script_with_driver_installs_torch_from_the_default_index(tmp_path, refused):
    proc = run_script(tmp_path, "--cpu-index", refused, driver=True)
    assert proc.returncode == 0, proc.stderr
    assert "cannot be reached" not in proc.stdout  # the index is not even asked
    assert "fake pip: pip install torch\n" in proc.stdout


def test_script_keeps_a_torch_that_is_there(tmp_path, refused):
    (tmp_path / "torch-installed").touch()
    proc = run_script(tmp_path, "--cpu-index", refused, driver=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("torch 2.13.0+cpu (CPU build) is already there for ")
    assert "kept, nothing to download" in proc.stdout and "fake pip" not in proc.stdout


def test_script_reports_a_failed_pip(tmp_path, refused):
    proc = run_script(tmp_path, "--cpu-index", refused, driver=False, FAKE_PIP_STATUS="3")
    assert proc.returncode == 3
    assert "installing torch failed (pip exited with 3)" in proc.stderr
    assert 'make lab TORCH="torch==VERSION --index-url URL"' in proc.stderr


def test_script_reports_a_torch_that_does_not_import_after_pip(tmp_path, refused):
    proc = run_script(tmp_path, "--cpu-index", refused, driver=False, FAKE_PIP_NO_TORCH="1")
    assert proc.returncode == 1
    assert f"pip installed {PINNED}, but " in proc.stderr
    assert proc.stderr.rstrip().endswith("cannot import torch")


def test_script_imports_the_standard_library_only():
    """It runs before torch is installed, by path: zerolab's package (which imports torch) and
    anything pip has not installed yet are out of reach."""
    tree = ast.parse(SCRIPT.read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module}
    assert names and names <= set(sys.stdlib_module_names) | {"__future__"}, names


@pytest.mark.skipif(shutil.which("make") is None, reason="`make` is not installed")
def test_makefile_hands_torch_to_the_script():
    given = "torch==2.6.0 --index-url https://example.invalid/whl/cu126"
    env = {**os.environ, "MAKEFLAGS": ""}
    # -n prints the install's commands without running them; -B: as if nothing were installed.
    proc = subprocess.run(["make", "-n", "-B", ".venv/.installed", f"TORCH={given}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (f'.venv/bin/python zerolab/install_torch.py --python .venv/bin/python '
            f'--torch "{given}"') in proc.stdout.splitlines()
