"""The two commands and the files behind them agree: pyproject, environment.yml, Makefile, CI."""

import ast
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parent.parent


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def environment_pip_list() -> list[str]:
    """The entries under `- pip:` in environment.yml (with PyYAML if present, else by hand)."""
    text = (REPO / "environment.yml").read_text()
    try:
        import yaml
    except ImportError:
        return _pip_list_by_hand(text)
    for dep in yaml.safe_load(text)["dependencies"]:
        if isinstance(dep, dict) and "pip" in dep:
            return [str(x) for x in dep["pip"]]
    raise AssertionError("environment.yml has no pip section")


def _pip_list_by_hand(text: str) -> list[str]:
    entries, indent = [], None
    for line in text.splitlines():
        stripped = line.split("#")[0].rstrip()
        if not stripped:
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            if stripped.strip() == "- pip:":
                indent = depth
        elif depth > indent and stripped.strip().startswith("- "):
            entries.append(stripped.strip()[2:].strip())
        else:
            break
    return entries


def normalize(requirement: str) -> str:
    """'Torch >= 2.6' -> 'torch>=2.6' (PEP 503 name, no spaces)."""
    requirement = requirement.replace(" ", "")
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    return re.sub(r"[-_.]+", "-", name).lower() + requirement[len(name):]


def test_pip_list_parser_by_hand_agrees_with_yaml():
    text = (REPO / "environment.yml").read_text()
    assert _pip_list_by_hand(text) == environment_pip_list()


def test_environment_yml_installs_what_pyproject_declares():
    project = pyproject()["project"]
    entries = environment_pip_list()
    editable = [e for e in entries if e.startswith("-e")]
    assert len(editable) == 1, entries
    match = re.fullmatch(r"-e\s+\.\[([a-z,\s]+)\]", editable[0])
    assert match, f"the package itself, with its extras: {editable[0]!r}"
    extras = [x.strip() for x in match.group(1).split(",")]
    assert "course" in extras
    expected = list(project["dependencies"])
    for extra in extras:
        expected += project["optional-dependencies"][extra]
    listed = [normalize(e) for e in entries if not e.startswith("-")]
    assert sorted(listed) == sorted(normalize(r) for r in expected)
    assert len(listed) == len(set(listed))  # nothing twice


def test_environment_python_satisfies_requires_python():
    text = (REPO / "environment.yml").read_text()
    version = re.search(r"-\s*python\s*=\s*(\d+)\.(\d+)", text)
    assert version, "environment.yml pins a python version"
    floor = re.fullmatch(r">=\s*(\d+)\.(\d+)", pyproject()["project"]["requires-python"])
    assert tuple(map(int, version.groups())) >= tuple(map(int, floor.groups()))


def makefile_rules() -> dict[str, list[str]]:
    """target -> recipe lines (tab-indented lines after `target: ...`)."""
    rules: dict[str, list[str]] = {}
    current = None
    for line in (REPO / "Makefile").read_text().splitlines():
        if line.startswith("\t") and current is not None:
            rules[current].append(line.strip())
            continue
        match = re.match(r"^([A-Za-z0-9_.$()/-]+)\s*:(?!=)", line)
        current = match.group(1) if match else None
        if current is not None:
            rules[current] = []
    return rules


def test_makefile_has_lab_and_test_targets():
    rules = makefile_rules()
    text = (REPO / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", text, re.M).group(1).split()
    assert {"lab", "test"} <= set(phony)
    test_recipe = " ".join(rules["test"])
    assert re.search(r"-m pytest\b", test_recipe)
    assert re.search(r"\btests\b", test_recipe)
    assert re.search(r"--nbval\b", test_recipe) and re.search(r"\bnotebooks\b", test_recipe)
    lab_recipe = " ".join(rules["lab"])
    assert re.search(r"-m jupyterlab\b|\bjupyter[ -]lab\b", lab_recipe), lab_recipe
    assert "notebooks" in lab_recipe


@pytest.mark.skipif(shutil.which("make") is None, reason="`make` is not installed")
def test_make_test_would_run_pytest_on_tests_and_notebooks():
    # -n prints the commands (the install step's too) without running any of them.
    env = {**os.environ, "MAKEFLAGS": ""}
    proc = subprocess.run(["make", "-n", "test"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    commands = [line for line in proc.stdout.splitlines() if "pytest" in line]
    assert len(commands) == 1, proc.stdout
    assert re.search(r"-m pytest tests notebooks --nbval\b", commands[0]), commands[0]


def test_ci_runs_make_test():
    script = REPO / ".ci" / "run"
    assert os.access(script, os.X_OK), ".ci/run must be executable"
    lines = [line.strip() for line in script.read_text().splitlines()]
    assert lines[0].startswith("#!")
    assert "set -euo pipefail" in lines or "set -e" in lines  # a failing test fails CI
    # The README's test command, perhaps with extra pytest options (PYTEST_ARGS=...).
    assert any(line == "make test" or line.startswith("make test PYTEST_ARGS=") for line in lines)


def test_readme_gives_exactly_the_two_commands():
    readme = REPO / "README.md"
    assert readme.exists(), "README.md is missing"
    text = readme.read_text()
    # Commands are what is in code: fenced blocks and `inline code` (prose may say "make sure").
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
    code = "\n".join(fenced + inline)
    assert re.search(r"^\s*make lab\b", code, re.M), "README shows `make lab`"
    assert re.search(r"^\s*make test\b", code, re.M), "README shows `make test`"
    targets = set(re.findall(r"\bmake\s+([a-z][\w-]*)", code))
    assert targets == {"lab", "test"}, f"README's commands use make targets {sorted(targets)}"


# --- the README's lab command and its example, run for real -----------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:  # not listening yet (refused), or too slow to answer
        return False


@pytest.mark.skipif(shutil.which("make") is None, reason="`make` is not installed")
def test_make_lab_starts_jupyterlab_as_whoever_runs_it(tmp_path):
    """`make lab` with options passed through, as the user the tests run as: as root (CI, a
    container) JupyterLab starts only with --allow-root, which the Makefile adds then only.
    Its file browser shows the repository: the notebooks send the learner to exercises/."""
    port, token = free_port(), "zerolab-test"
    env = {**os.environ, "MAKEFLAGS": "", "JUPYTER_RUNTIME_DIR": str(tmp_path)}
    # -o: take the environment as installed; this test must not install anything.
    command = ["make", "-o", ".venv/.installed", "lab",
               f"LAB_ARGS=--no-browser --port {port} --ServerApp.port_retries=0 "
               f"--IdentityProvider.token={token}"]
    log = tmp_path / "lab.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: ended as one below
    try:
        deadline = time.monotonic() + 300  # JupyterLab starts in seconds; a loaded box, slower
        while not answers(f"http://127.0.0.1:{port}/api") and proc.poll() is None:
            assert time.monotonic() < deadline, f"no server after 300 s:\n{log.read_text()}"
            time.sleep(1)
        assert proc.poll() is None, f"make lab stopped:\n{log.read_text()}"
        assert answers(f"http://127.0.0.1:{port}/api/contents/exercises?token={token}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    started = log.read_text()
    command_line = next(line for line in started.splitlines() if "-m jupyterlab" in line)
    assert f"--no-browser --port {port}" in command_line
    assert ("--allow-root" in command_line) == (os.geteuid() == 0), command_line
    assert "Running as root is not recommended" not in started


def test_readme_example_runs_as_a_saved_script(tmp_path):
    """The README's example, saved to a file and run with python, prints a line per rank: its
    loss, its model-state bytes by kind and the bytes it sent; and the README quotes those
    lines as they come (the bytes exactly; the loss is a float of this machine's)."""
    blocks = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.M | re.S)
    assert len(blocks) == 1, "the README has one Python example"
    script = tmp_path / "taste.py"
    script.write_text(blocks[0])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    line = re.compile(r"rank (\d): loss ([\d.]+), holds (\{.*\}), sent ([\d,]+) bytes")
    printed = proc.stdout.strip().splitlines()
    assert len(printed) == 2, proc.stdout  # world_size=2: one line per rank
    for rank, text in enumerate(printed):
        m = line.fullmatch(text)
        assert m and int(m[1]) == rank, text
        state, sent = ast.literal_eval(m[3]), int(m[4].replace(",", ""))
        assert set(state) == {"params", "grads", "optimizer"}
        assert all(isinstance(v, int) and v > 0 for v in state.values())
        assert sent > 0
    quoted = [t for t in (REPO / "README.md").read_text().splitlines() if line.fullmatch(t)]
    assert [line.sub(r"\1 \3 \4", t) for t in quoted] == [
        line.sub(r"\1 \3 \4", t) for t in printed], "the README quotes what the example prints"


def test_files_that_read_one_shared_launch_are_handed_to_one_worker():
    """`make test` runs the files on several workers (pytest-xdist); conftest's scheduler hands
    out groups. A launch shared by files of two groups would run once in each worker."""
    import conftest

    source = (REPO / "tests" / "conftest.py").read_text()
    shared = re.findall(r'@pytest\.fixture\(scope="session"\)\ndef (\w+)', source)
    assert len(shared) >= 4, shared
    for name in shared:
        readers = [f for f in sorted((REPO / "tests").glob("test_*.py"))
                   if re.search(rf"\b{name}\b", f.read_text())]
        groups = {conftest._group(str(f.relative_to(REPO))) for f in readers}
        assert len(readers) >= 1 and len(groups) == 1, (name, [f.name for f in readers], groups)
    # and a notebook's cells stay together, in one kernel
    assert conftest._group("notebooks/05_zero3.ipynb") == "05_zero3"
