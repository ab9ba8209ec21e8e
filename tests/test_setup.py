"""The two commands and the files behind them agree: pyproject, environment.yml, Makefile, CI."""

import os
import re
import shutil
import subprocess
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
    assert "jupyter lab" in lab_recipe or "jupyter-lab" in lab_recipe
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
    assert "make test" in lines


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
