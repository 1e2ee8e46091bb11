"""``pip install userwise[loader]`` into a trainer image keeps the image's torch.

An image's torch is its own build: a CUDA build with a local label (``2.7.0+cu126``) or
NGC's pre-release snapshot (``2.8.0a0+<commit>.nv25.05``), on no index the installer
reads. The test makes a fresh environment holding a stand-in of that torch, then installs
the real userwise wheel with the [loader] extra from local wheels only (no network):
stand-ins of every other requirement at its floor, and a newer torch inside the range
that the resolver could take instead. pip and uv both keep the installed torch (they
accept an installed pre-release that the range admits). A torch below the floor is
replaced, unless the image's torch is passed as a constraint: then pip refuses
(docs/install.md gives that command)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.metadata import floor, pyproject, requirements
from tests.support.wheels import build_userwise_wheel, stand_in_wheel

pytestmark = pytest.mark.slow

NEWER_TORCH = "2.13.0"  # inside the range, newer than every image torch below
UV = Path(sys.executable).parent / "uv"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """(the userwise wheel, a find-links folder of stand-ins: the core's and the loader's
    requirements at their floors, and a newer torch)."""
    d = tmp_path_factory.mktemp("wheels")
    wheel = build_userwise_wheel(d / "build")
    links = d / "links"
    for reqs in requirements(pyproject(), ["loader"]).values():
        for r in reqs:
            stand_in_wheel(links, r.name, floor(r))
    stand_in_wheel(links, "torch", NEWER_TORCH)
    return wheel, links


def _env() -> dict:
    """No pip or uv configuration from outside the test (an index, find-links, a cache)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
    return env


def image(tmp_path, torch_version: str) -> Path:
    """A fresh environment (no pip) holding a stand-in of the image's torch; its python."""
    venv = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    own = stand_in_wheel(tmp_path / "image-wheels", "torch", torch_version)
    install(py, "uv", [str(own)], links=None)
    assert installed(py, "torch") == torch_version
    return py


def install(py: Path, tool: str, args: list[str], links: Path | None) -> subprocess.CompletedProcess:
    where = ["--no-index"] + (["--find-links", str(links)] if links else [])
    if tool == "pip":
        cmd = [sys.executable, "-m", "pip", "--python", str(py), "install", *where, *args]
    else:
        cmd = [str(UV), "pip", "install", "--no-config", "--no-cache", "--python", str(py), *where, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if links is None:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def installed(py: Path, name: str) -> str | None:
    # -I: not the checkout's userwise.egg-info in the working directory
    r = subprocess.run([str(py), "-I", "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


@pytest.mark.parametrize("tool", ["pip", "uv"])
@pytest.mark.parametrize("torch_version", ["2.8.0a0+5228986c39.nv25.5", "2.7.0+cu126"], ids=["ngc", "cuda-build"])
def test_install_keeps_the_image_torch(tmp_path, wheels, tool, torch_version):
    wheel, links = wheels
    py = image(tmp_path, torch_version)
    r = install(py, tool, [f"{wheel}[loader]"], links)
    assert r.returncode == 0, r.stdout + r.stderr
    assert installed(py, "torch") == torch_version
    assert installed(py, "userwise") == wheel.name.split("-")[1]
    assert installed(py, "numba") == "0.60"  # the extra was resolved: its other requirement came in


def test_a_torch_below_the_floor_is_replaced_unless_constrained(tmp_path, wheels):
    """2.6.0a0 (a snapshot before 2.6.0) is outside torch>=2.6: a plain install replaces it;
    with the installed torch as a constraint pip stops with an error instead."""
    wheel, links = wheels
    old = "2.6.0a0+ecf3bae40a.nv25.1"
    py = image(tmp_path, old)
    pin = tmp_path / "torch.txt"
    pin.write_text(f"torch=={installed(py, 'torch')}\n")
    r = install(py, "pip", [f"{wheel}[loader]", "-c", str(pin)], links)
    assert r.returncode != 0 and "torch" in (r.stdout + r.stderr)
    assert installed(py, "torch") == old and installed(py, "userwise") is None
    r = install(py, "pip", [f"{wheel}[loader]"], links)
    assert r.returncode == 0, r.stdout + r.stderr
    assert installed(py, "torch") == NEWER_TORCH
