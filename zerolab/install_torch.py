"""Install torch into the course's environment: the build that fits this machine, said first.

    python zerolab/install_torch.py --python .venv/bin/python [--torch "REQUIREMENT [OPTIONS]"]

`make lab` and `make test` run this before anything else is installed, so it is run by path
and imports the standard library only (zerolab's own __init__ imports torch).

What it installs, the first rule that holds:

1. torch already imports in that Python (the system's, seen through --system-site-packages):
   kept, nothing downloaded.
2. --torch given (the Makefile's TORCH=...): `pip install` exactly that, options included
   (`TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"`).
3. An NVIDIA driver (`nvidia-smi` on PATH): `torch` from pip's default index, which on Linux
   is PyPI's CUDA build.
4. Linux without a driver: torch==2.13.0 from PyTorch's CPU index, the CPU build; where that
   index cannot be reached, from pip's default index, said in one line (PyPI's Linux torch is
   the CUDA build: ten times the download, and it runs on a CPU too).
5. Elsewhere (macOS): torch==2.13.0 from pip's default index, where it has no CUDA libraries.

Before pip starts it prints what it is about to download and roughly how big; after, which
build came (pip may find a build elsewhere first, e.g. a wheel on disk named by --find-links).
"""

from __future__ import annotations

import argparse
import platform
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PINNED = "torch==2.13.0"  # the version the course's stored outputs were made with
# Rough sizes, measured for torch 2.13.0 with Python 3.11: Linux x86_64's CPU build is a 192 MB
# wheel plus ~10 MB of dependencies and takes ~0.8 GB installed; PyPI's Linux wheel is 527 MB and
# brings 2.2 GB of NVIDIA libraries and triton (2.7 GB in all), ~5 GB installed; PyPI's macOS
# wheel is 111 MB.
CPU_BUILD = "the CPU build: about 0.2 GB to download, 0.8 GB installed"
CUDA_BUILD = "the CUDA build: about 2.7 GB to download, 5 GB installed"
MACOS_BUILD = "the macOS build: about 0.1 GB to download"


@dataclass(frozen=True)
class Plan:
    """What to install: `pip install <pip_args>`, and what to say first."""

    pip_args: list[str]
    says: str  # what is about to be downloaded, and roughly how big
    notice: str | None = None  # the fallback, when PyPI's index stands in for PyTorch's


def has_nvidia_driver() -> bool:
    """An NVIDIA driver installs nvidia-smi; its presence is the sign (as PyTorch's own docs)."""
    return shutil.which("nvidia-smi") is not None


def why_unreachable(url: str, timeout: float = 5.0) -> str | None:
    """Why `url` gives no answer (no name, refused, timed out, an HTTP error), or None: it
    answers. Only the headers are read; proxies are taken from the environment, as pip does."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return None
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code} {e.reason}"
    except urllib.error.URLError as e:
        return str(e.reason)
    except OSError as e:  # a timeout while reading the headers
        return str(e) or type(e).__name__


def choose(torch: str, driver: bool, system: str,
           unreachable: Callable[[str], str | None], cpu_index: str = CPU_INDEX) -> Plan:
    """The install for this machine (rules 2-5 of the module docstring). `unreachable(url)` is
    `why_unreachable`, asked only where the CPU index is wanted: a test passes its own."""
    if torch.strip():
        args = shlex.split(torch)
        return Plan(args, f"TORCH={torch!r} as given (its size depends on what it names)")
    if driver:
        return Plan(["torch"], "an NVIDIA driver is here (nvidia-smi), so torch from pip's "
                               f"default index; PyPI's, on Linux, is {CUDA_BUILD}")
    if system == "Darwin":
        return Plan([PINNED], f"{PINNED} from pip's default index, {MACOS_BUILD}")
    if system != "Linux":
        return Plan([PINNED], f"{PINNED} from pip's default index")
    reason = unreachable(f"{cpu_index}/torch/")
    if reason is None:
        return Plan([PINNED, "--index-url", cpu_index],
                    f"no NVIDIA driver (no nvidia-smi), so {PINNED} from PyTorch's CPU index "
                    f"{cpu_index}, {CPU_BUILD}")
    return Plan([PINNED], f"{PINNED} from pip's default index; PyPI's, on Linux, is {CUDA_BUILD}",
                notice=f"PyTorch's CPU index {cpu_index} cannot be reached ({reason}): "
                       f"torch comes from pip's default index instead")


def torch_in(python: str) -> str | None:
    """torch's version and build as `python` imports it ('2.13.0+cpu (CPU build)'), or None."""
    probe = ("import torch; print(torch.__version__, '(CUDA ' + torch.version.cuda + ' build)' "
             "if torch.version.cuda else '(CPU build)')")
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerolab/install_torch.py", description=__doc__.split("\n")[0])
    p.add_argument("--python", required=True, help="the environment's python")
    p.add_argument("--torch", default="", help="what to install instead (pip arguments)")
    p.add_argument("--cpu-index", default=CPU_INDEX, help="PyTorch's CPU index (tests: a fake)")
    a = p.parse_args(argv)

    found = torch_in(a.python)
    if found:
        print(f"torch {found} is already there for {a.python}: kept, nothing to download")
        return 0
    plan = choose(a.torch, has_nvidia_driver(), platform.system(), why_unreachable, a.cpu_index)
    if plan.notice:
        print(plan.notice)
    print(f"Installing torch: {plan.says}")
    command = [a.python, "-m", "pip", "install", *plan.pip_args]
    print("  " + shlex.join(command), flush=True)
    status = subprocess.run(command).returncode
    if status != 0:
        print(f"installing torch failed (pip exited with {status}); to choose another build: "
              f"make lab TORCH=\"torch==VERSION --index-url URL\"", file=sys.stderr)
        return status
    found = torch_in(a.python)
    if not found:
        print(f"pip installed {shlex.join(plan.pip_args)}, but {a.python} cannot import torch",
              file=sys.stderr)
        return 1
    print(f"Installed torch {found}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
