"""Sessions over the packages of the monorepo.

    nox -l                                  list sessions
    nox -s tests                            cpu tier of every package (+ compile with nvcc, + gpu with CUDA)
    nox -s "tests(package='tk-quant')"      one package
    nox -s compile | bench | lint | build | integration | demo

On a machine without an NVIDIA GPU, torch is pinned to the CPU build (shared/constraints-cpu.txt), so
no multi-GB CUDA wheel is downloaded.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess

import nox

ROOT = pathlib.Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
KERNEL_PACKAGES = [p for p in PACKAGES if p != "tk-core"]
HAS_GPU = shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_venv = "yes"
# uv builds a session's environment in seconds where pip takes a minute or more (torch from a local wheel, tilelang,
# the editable packages); nox falls back to virtualenv + pip where uv is missing. uv does not read pip's
# configuration: the wheel directory and the certificate bundle are passed on, and bytecode is compiled at install
# (the environment may set PYTHONDONTWRITEBYTECODE, and importing torch and tilelang uncompiled costs seconds).
nox.options.default_venv_backend = "uv|virtualenv"
for _pip_var, _uv_var in (("PIP_FIND_LINKS", "UV_FIND_LINKS"), ("PIP_CERT", "SSL_CERT_FILE")):
    if os.environ.get(_pip_var):
        os.environ.setdefault(_uv_var, os.environ[_pip_var])
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")


def _env() -> dict:
    env = {}
    if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
        env["CUDA_HOME"] = "/usr/local/cuda"
    return env


def _install(session: nox.Session, *packages: str) -> None:
    """Installs torch (pinned to the CPU build where there is no GPU), tk-core and ``packages``."""
    pins = [] if HAS_GPU else ["-c", str(ROOT / "shared" / "constraints-cpu.txt")]
    paths = dict.fromkeys(["tk-core", *packages])
    session.install(*pins, *[f"-e{ROOT / 'packages' / p}[test]" for p in paths])


def _pytest(session: nox.Session, *args: str) -> None:
    # pytest exits 5 when every test of a selection is deselected (e.g. a package with no compile tests)
    session.run("python", "-m", "pytest", *args, *session.posargs, env=_env(), success_codes=[0, 5])


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """cpu tier, plus the compile tier where nvcc exists and the gpu tier where CUDA exists."""
    _install(session, package)
    _pytest(session, f"packages/{package}", "-m", "not benchmark", "-n", "auto", "-p", "no:cacheprovider")


@nox.session
@nox.parametrize("package", PACKAGES)
def compile(session: nox.Session, package: str) -> None:
    """Compile tier only: every kernel variant for sm_90a and sm_100a, no GPU needed."""
    _install(session, package)
    _pytest(session, f"packages/{package}", "-m", "compile", "-n", "auto")


def _gpu_slug() -> str:
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    match = re.search(r"([A-Z]+\d+)", name.stdout.splitlines()[0] if name.stdout else "")
    return match.group(1).lower() if match else "gpu"


@nox.session
@nox.parametrize("package", KERNEL_PACKAGES)
def bench(session: nox.Session, package: str) -> None:
    """Benchmarks (GPU): pytest-benchmark JSON to shared/benchmarks/<gpu>/<package>.json."""
    if not HAS_GPU:
        session.skip("benchmarks need an NVIDIA GPU")
    _install(session, package)
    out = ROOT / "shared" / "benchmarks" / _gpu_slug() / f"{package}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    _pytest(session, f"packages/{package}", "-m", "benchmark", "--run-benchmark", f"--benchmark-json={out}")


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def build(session: nox.Session) -> None:
    """A wheel and an sdist per package, each with its own version; then one wheel into a clean venv."""
    session.install("build")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in PACKAGES:
        session.run("python", "-m", "build", "--outdir", str(dist), str(ROOT / "packages" / package))
    wheels = sorted(p.name for p in dist.glob("*.whl"))
    session.log("built: " + ", ".join(wheels))
    assert len(wheels) == len(PACKAGES), wheels
    # Install one kernel package from its wheel into a fresh venv: it must pull tk-core (from dist/),
    # torch and tilelang, and nothing else of ours.
    venv = ROOT / ".nox" / "wheel-check"
    shutil.rmtree(venv, ignore_errors=True)
    session.run("python", "-m", "venv", str(venv))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    pins = [] if HAS_GPU else ["-c", str(ROOT / "shared" / "constraints-cpu.txt")]
    session.run(*pip, *pins, "--find-links", str(dist), "tk-transpose", external=True)
    listing = session.run(str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json", external=True, silent=True)
    names = {p["name"].lower() for p in json.loads(listing)}
    ours = sorted(n for n in names if n.startswith("tk-"))
    assert ours == ["tk-core", "tk-transpose"], ours
    assert {"torch", "tilelang"} <= names, names
    session.run(str(venv / "bin" / "python"), "-c", "import tk_transpose, torch; "
                "x = torch.arange(6.).view(2, 3); assert torch.equal(tk_transpose.transpose(x), x.t())", external=True)
    session.log(f"clean venv has {len(names)} distributions; ours: {ours}")


@nox.session
def integration(session: nox.Session) -> None:
    """Flows across packages (tests-integration/)."""
    _install(session, *KERNEL_PACKAGES)
    _pytest(session, "tests-integration", "-m", "not benchmark")


@nox.session
def demo(session: nox.Session) -> None:
    """Every op on realistic shapes: GPU kernels where there is a GPU, CPU references otherwise."""
    _install(session, *KERNEL_PACKAGES)
    session.run("python", str(ROOT / "shared" / "demo.py"), *session.posargs, env=_env())
