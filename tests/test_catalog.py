"""Built-in model catalog: names, paths, assembly with sha256 check, helpful errors."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from specdec import catalog
from specdec.errors import ModelNotFoundError


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fake_spec(tmp_path, monkeypatch, content: bytes, sha: str | None = None):
    chunks = []
    for i in range(3):
        chunk = tmp_path / f"part{i}.bin"
        chunk.write_bytes(content[i * len(content) // 3:(i + 1) * len(content) // 3])
        chunks.append(chunk)
    spec = catalog.ModelSpec("fake", "fake.gguf", "a fake", (("fake-part1", "1.0"),),
                             sha or hashlib.sha256(content).hexdigest(), chat=False)
    monkeypatch.setitem(catalog.CATALOG, "fake", spec)
    monkeypatch.setattr(catalog, "chunk_files", lambda s: chunks)
    return spec


def test_home_follows_the_environment(home):
    assert catalog.specdec_home() == home
    spec = catalog.lookup("qwen2.5-coder-1.5b")
    assert catalog.model_path(spec) == home / "models" / spec.filename


def test_unknown_name_lists_the_built_ins():
    with pytest.raises(ModelNotFoundError, match="qwen2.5-coder-1.5b"):
        catalog.resolve("llama-9000")


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        catalog.resolve(tmp_path / "model.gguf")


def test_missing_packages_say_how_to_install(home, monkeypatch):
    spec = catalog.ModelSpec("ghost", "ghost.gguf", "x", (("specdec-no-such-pkg-1", "1.0"),
                                                         ("specdec-no-such-pkg-2", "1.0")), "0" * 64, False)
    monkeypatch.setitem(catalog.CATALOG, "ghost", spec)
    with pytest.raises(ModelNotFoundError) as err:
        catalog.resolve("ghost")
    assert "pip install specdec-no-such-pkg-1==1.0 specdec-no-such-pkg-2==1.0" in str(err.value)
    assert "specdec fetch ghost" in str(err.value)


def test_assembly_checks_and_stamps(home, tmp_path, monkeypatch):
    content = bytes(range(256)) * 1000
    spec = fake_spec(tmp_path, monkeypatch, content)
    path = catalog.resolve("fake", progress=False)
    assert path.read_bytes() == content and catalog.is_assembled(spec)
    path.write_bytes(content[:-1])           # changed after the check: no longer trusted
    assert not catalog.is_assembled(spec)


def test_checksum_mismatch_is_refused(home, tmp_path, monkeypatch):
    spec = fake_spec(tmp_path, monkeypatch, b"x" * 1000, sha="0" * 64)
    with pytest.raises(ModelNotFoundError, match="sha256"):
        catalog.resolve("fake", progress=False)
    assert not catalog.model_path(spec).exists()


def test_real_packages_are_found_without_importing_them():
    spec = catalog.lookup("qwen2.5-coder-0.5b")
    try:
        files = catalog.chunk_files(spec)
    except ModelNotFoundError:
        pytest.skip("packages of qwen2.5-coder-0.5b not installed")
    assert len(files) == len(spec.packages) and all(Path(f).is_file() for f in files)
    assert [f.name for f in files] == sorted(f.name for f in files)
