"""Where the server finds LoRA adapters, safely: an adapter root folder and the MLflow model registry.

The OpenAI ``model`` field of a request names either the base model or an adapter. Adapter names are
checked before they touch the file system, so a request can never reach outside the adapter root::

    <adapter_root>/
        <name>/                         peft save_pretrained output, installed by POST /v1/adapters
            adapter_config.json
            adapter_model.safetensors   (or adapter_model.bin)
        .registry/<name>/<version>/     MLflow registered adapters, downloaded once and reused
        .tmp-*/                         downloads and copies in progress (renamed into place when whole)

Registered adapters are MLflow registered models tagged ``raylora.kind = lora-adapter`` whose versions
point at a run artifact folder (``runs:/<run_id>/adapter``). Every failure is an :class:`AdapterError`
carrying the HTTP status and a short code the server answers with.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mlflow import MlflowClient

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
REGISTRY_CACHE = ".registry"
KIND_TAG = "raylora.kind"
KIND = "lora-adapter"
MLFLOW_SCHEMES = ("runs:/", "models:/")

_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
# peft's saved keys: "base_model.model.<module>.<part>", <module> named as in the base model.
_LORA_KEY = re.compile(
    r"(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_magnitude_vector"
    r"|lora_embedding_A|lora_embedding_B)"
)


class AdapterError(Exception):
    """An adapter that cannot be named, found, installed or served; the message says why and how to fix it.

    Attributes:
        status: the HTTP status to answer with (400 bad name or source, 404 unknown, 409 exists,
            422 incompatible with the served model).
        code: a short machine-readable code, e.g. ``adapter_not_found``.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def __reduce__(self):  # crosses Ray process boundaries with its status and code
        return AdapterError, (self.status, self.code, str(self))


def check_name(name: str) -> str:
    """Return ``name`` if it is safe as an adapter name and a folder name.

    Args:
        name: 1 to 64 ASCII letters, digits, ``.``, ``_`` or ``-``, not starting with ``.`` (which
            rules out ``..``, hidden folders, ``/`` and absolute paths).
    Returns:
        ``name`` unchanged.
    Raises:
        AdapterError: 400 ``invalid_adapter_name``.
    """
    if isinstance(name, str) and _NAME.fullmatch(name):
        return name
    suggestion = re.sub(r"[^A-Za-z0-9._-]", "-", str(name)).lstrip(".")[:64] or "my-adapter"
    raise AdapterError(
        400,
        "invalid_adapter_name",
        f"adapter name {str(name)[:80]!r} is not allowed: expected 1 to 64 ASCII letters, digits, '.', '_' or '-', "
        f"not starting with '.'. Use a name such as {suggestion!r}.",
    )


def local_adapter(root: Path, name: str) -> Path:
    """The folder of adapter ``name`` in ``root``, resolved and guaranteed to lie inside ``root``.

    Args:
        root: the adapter root (``serve.adapter_root``).
        name: the adapter name, checked with :func:`check_name`.
    Returns:
        The resolved folder, holding ``adapter_config.json`` and the adapter weights.
    Raises:
        AdapterError: 400 for a bad name or a symlink leading outside ``root`` (never followed);
            404 ``adapter_not_found`` when the folder or its files are missing.
    """
    base = root.resolve()
    folder = root / check_name(name)
    files = [folder, folder / CONFIG, *(folder / w for w in WEIGHTS)]
    escaping = [p for p in files if (p.exists() or p.is_symlink()) and not _inside(p, base)]
    if escaping:
        raise AdapterError(
            400,
            "adapter_outside_root",
            f"adapter {name!r}: {escaping[0]} is a link to {escaping[0].resolve()}, outside the adapter root {base}. "
            f"Copy the adapter into {base / name} instead of linking to it.",
        )
    if not _adapter_files(folder):
        raise AdapterError(
            404,
            "adapter_not_found",
            f"no adapter named {name!r}: expected a folder {base / name} holding {CONFIG} and {WEIGHTS[0]} "
            f"(or {WEIGHTS[1]}). Install it with POST /v1/adapters or copy a peft save_pretrained folder there.",
        )
    return folder.resolve()


def list_local(root: Path) -> list[str]:
    """Sorted names of the servable adapters in ``root`` (empty when ``root`` does not exist).

    Entries with invalid or hidden names (the ``.registry`` cache, unfinished ``.tmp-*`` copies), links
    leading outside ``root`` and folders without adapter files are skipped.
    """
    if not root.is_dir():
        return []
    names = []
    for entry in sorted(root.iterdir()):
        try:
            local_adapter(root, entry.name)
        except AdapterError:
            continue
        names.append(entry.name)
    return names


def check_compatible(adapter_dir: Path, model: torch.nn.Module, max_rank: int) -> dict[str, Any]:
    """Check, from the adapter's config and tensor shapes only, that it can be applied to ``model``.

    No weight is read into memory: safetensors headers (or a memory-mapped ``.bin``) give the shapes.
    Expected shapes, for a module with ``in_features`` / ``out_features`` (``num_embeddings`` /
    ``embedding_dim`` for embeddings) and the module's rank ``r`` (``r`` or its ``rank_pattern`` entry):
    ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``, ``lora_B.bias`` and DoRA's magnitude ``[out]``;
    other saved tensors (``modules_to_save``) must match the base model's tensor of the same name.

    Args:
        adapter_dir: a peft adapter folder.
        model: the served base model (a ``PeftModel`` wrapping it is accepted too). Quantised linear
            layers are fine: their ``in_features`` / ``out_features`` are used, never ``weight.shape``.
        max_rank: the largest rank served (``serve.max_lora_rank``).
    Returns:
        The adapter's ``adapter_config.json`` as a dict.
    Raises:
        AdapterError: 422 ``adapter_incompatible`` when the adapter is not LoRA, its rank exceeds
            ``max_rank``, or a tensor names a module the model lacks or has the wrong shape.
    """
    config = _lora_config(adapter_dir)
    _check_rank(adapter_dir, config, max_rank)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = dict(base.named_modules())
    shapes = _tensor_shapes(_adapter_files(adapter_dir)[1])
    problems = [p for key, shape in shapes.items() if (p := _tensor_problem(key, shape, modules, config))]
    if not shapes or problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        found = problems[0] + more if problems else "no tensors at all"
        raise AdapterError(
            422,
            "adapter_incompatible",
            f"adapter {adapter_dir.name!r} does not fit the served model {type(base).__name__}: {found}. It was "
            f"trained on base model {config.get('base_model_name_or_path') or '(not recorded)'}; serve it with "
            "that base model, or retrain it on this one.",
        )
    return config


def list_registered(tracking_uri: str) -> list[str]:
    """Sorted names of the MLflow registered models tagged ``raylora.kind = lora-adapter``.

    Names that are not valid adapter names (:func:`check_name`) are left out, since no request could
    select them. Returns an empty list when the store holds none.
    """
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    names, token = [], None
    while True:
        page = client.search_registered_models(filter_string=f"tags.`{KIND_TAG}` = '{KIND}'", page_token=token)
        names += [m.name for m in page if _NAME.fullmatch(m.name)]
        token = page.token
        if not token:
            return sorted(names)


def fetch_registered(tracking_uri: str, name: str, root: Path) -> Path:
    """Download the latest version of registered adapter ``name`` into ``root/.registry/<name>/<version>``.

    The download goes to a temporary folder in ``root/.registry`` and is renamed into place once whole
    and checked, so a crash never leaves half an adapter behind; a version already there is reused.

    Args:
        tracking_uri: the MLflow store (an absolute ``sqlite:////...`` path or a server URL).
        name: the registered model name, checked with :func:`check_name`.
        root: the adapter root.
    Returns:
        The resolved adapter folder.
    Raises:
        AdapterError: 400 bad name or failed download; 404 unknown name, a registered model that is not
            tagged as an adapter, or one without versions; 422 when the artifacts are not a LoRA adapter.
    """
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    version = _latest_adapter_version(client, check_name(name))
    dest = root / REGISTRY_CACHE / name / str(version)
    if not _adapter_files(dest):
        with _staging(root / REGISTRY_CACHE) as tmp:
            folder = _download(tracking_uri, client.get_model_version_download_uri(name, version), tmp)
            _lora_config(folder)
            dest.parent.mkdir(parents=True, exist_ok=True)
            _publish(folder, dest)  # a concurrent fetch may publish first; its copy is the same version
    return dest.resolve()


def register(tracking_uri: str, name: str, source: str) -> int:
    """Register an adapter logged as a run artifact as a new version of registered model ``name``.

    The registered model (created when missing) and the version are tagged ``raylora.kind = lora-adapter``.

    Args:
        tracking_uri: the MLflow store.
        name: the registered model name, checked with :func:`check_name`.
        source: ``runs:/<run_id>/<artifact_path>`` of a folder holding ``adapter_config.json``.
    Returns:
        The new version number.
    Raises:
        AdapterError: 400 bad name, a source that is not a ``runs:/`` URI or holds no adapter;
            409 when ``name`` is a registered model that is not a LoRA adapter.
    """
    import mlflow

    check_name(name)
    client = mlflow.MlflowClient(tracking_uri)
    run_id = _logged_adapter_run(client, source)
    _ensure_registered_model(client, name)
    return int(client.create_model_version(name, source, run_id=run_id, tags={KIND_TAG: KIND}).version)


def install(root: Path, name: str, source: str, tracking_uri: str | None) -> Path:
    """Install an adapter as ``root/name`` (``POST /v1/adapters``), atomically.

    The source is copied (or downloaded) into a hidden temporary folder in ``root``, checked to be a
    LoRA adapter, then renamed to ``root/name``: a half-copied adapter is never visible.

    Args:
        root: the adapter root (created when missing).
        name: the new adapter's name, checked with :func:`check_name`.
        source: an MLflow URI (``runs:/<run_id>/<path>``, ``models:/<name>/<version>``,
            ``models:/<name>@<alias>``, ``models:/<name>/latest``) or a local adapter folder, such as a
            training run's ``outputs/<run>/adapter``. A local folder must not contain symlinks.
        tracking_uri: the MLflow store; required for MLflow sources.
    Returns:
        The resolved installed folder.
    Raises:
        AdapterError: 400 bad name or unusable source (the message gives the reason); 409 when an
            adapter named ``name`` already exists.
    """
    dest = root / check_name(name)
    _refuse_existing(dest)
    with _staging(root) as tmp:
        folder = _stage_source(source, tmp, tracking_uri)
        try:
            _lora_config(folder)
        except AdapterError as e:
            raise AdapterError(400, "invalid_adapter_source", f"source {source!r} is not usable: {e}") from None
        if not _publish(folder, dest):
            _refuse_existing(dest)
    return dest.resolve()


def _inside(path: Path, base: Path) -> bool:
    """Whether ``path``, with every link followed, lies strictly inside ``base`` (a resolved folder)."""
    resolved = path.resolve()
    return resolved != base and resolved.is_relative_to(base)


def _adapter_files(folder: Path) -> list[Path]:
    """``[config, weights]`` of an adapter folder, or ``[]`` when either file is missing."""
    weights = [folder / w for w in WEIGHTS if (folder / w).is_file()]
    return [folder / CONFIG, weights[0]] if (folder / CONFIG).is_file() and weights else []


def _lora_config(folder: Path) -> dict[str, Any]:
    """The parsed ``adapter_config.json`` of a complete LoRA adapter folder.

    Raises:
        AdapterError: 422 ``adapter_incompatible`` when files are missing, the config is not JSON, or
            ``peft_type`` is not ``LORA``.
    """
    if not _adapter_files(folder):
        found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "nothing, it is not a folder"
        raise _not_lora(f"{folder} lacks {CONFIG} or {WEIGHTS[0]} ({WEIGHTS[1]}); found {found}")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise _not_lora(f"{folder / CONFIG} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else None
        raise _not_lora(f"{folder / CONFIG} has peft_type {found!r}, not 'LORA'")
    return config


def _not_lora(problem: str) -> AdapterError:
    """The 422 error for a folder that is not a peft LoRA adapter."""
    return AdapterError(
        422,
        "adapter_incompatible",
        f"not a LoRA adapter: {problem}. Expected a peft LoRA save_pretrained folder (e.g. a training run's "
        "outputs/<run>/adapter).",
    )


def _check_rank(adapter_dir: Path, config: dict[str, Any], max_rank: int) -> None:
    """Refuse an adapter whose largest rank (``r`` or any ``rank_pattern`` entry) exceeds ``max_rank``."""
    rank = max([config["r"], *(config.get("rank_pattern") or {}).values()])
    if rank > max_rank:
        raise AdapterError(
            422,
            "adapter_incompatible",
            f"adapter {adapter_dir.name!r} has LoRA rank r={rank}, above this server's max_rank={max_rank}. "
            f"Raise serve.max_lora_rank to at least {rank}, or retrain with lora.rank <= {max_rank}.",
        )


def _tensor_shapes(weights: Path) -> dict[str, list[int]]:
    """``{tensor name: shape}`` of an adapter weights file, without reading the tensors' data."""
    if weights.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:
            return {key: list(f.get_slice(key).get_shape()) for key in f.keys()}
    # mmap leaves the data on disk; weights_only refuses pickled code in an uploaded file.
    state = torch.load(weights, map_location="cpu", mmap=True, weights_only=True)
    return {key: list(tensor.shape) for key, tensor in state.items()}


def _tensor_problem(
    key: str, shape: list[int], modules: dict[str, torch.nn.Module], config: dict[str, Any]
) -> str | None:
    """What is wrong with one saved tensor against the base model's modules, or ``None`` when it fits."""
    from peft.utils.other import get_pattern_key

    name = key.removeprefix("base_model.model.")
    lora = _LORA_KEY.fullmatch(name)
    if lora is None:  # modules_to_save copies, saved under the base model's own tensor names
        owner, _, attr = name.rpartition(".")
        owner = owner.removesuffix(".base_layer")
        expected = getattr(modules[owner], attr, None) if owner in modules else None
        if not isinstance(expected, torch.Tensor):
            return f"tensor {key} has no counterpart {owner}.{attr} in the base model"
        return None if list(expected.shape) == shape else f"{name}: expected {list(expected.shape)}, found {shape}"
    module = modules.get(lora["module"])
    dims = _dims(module) if module is not None else None
    if dims is None:
        return f"module {lora['module']} is not a linear or embedding layer of the base model"
    pattern = config.get("rank_pattern") or {}
    rank = pattern.get(get_pattern_key(pattern.keys(), lora["module"]), config["r"])
    expected = _expected_shape(lora["part"], dims, rank)
    return None if expected == shape else f"{lora['module']}.{lora['part']}: expected {expected}, found {shape}"


def _dims(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` sizes of a linear (quantised or peft-wrapped too) or embedding layer, else ``None``."""
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return module.in_features, module.out_features
    if isinstance(module, torch.nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return None


def _expected_shape(part: str, dims: tuple[int, int], rank: int) -> list[int]:
    """The shape peft gives LoRA tensor ``part`` on a layer of ``dims = (in, out)`` at ``rank``."""
    n_in, n_out = dims
    return {
        "lora_A.weight": [rank, n_in],
        "lora_embedding_A": [rank, n_in],
        "lora_B.weight": [n_out, rank],
        "lora_embedding_B": [n_out, rank],
        "lora_B.bias": [n_out],
        "lora_magnitude_vector": [n_out],
    }[part]


@contextmanager
def _staging(parent: Path) -> Iterator[Path]:
    """A fresh hidden folder in ``parent`` (same file system, so renaming out of it is atomic), removed on exit."""
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(folder: Path, dest: Path) -> bool:
    """Rename ``folder`` to ``dest`` in one step; ``False`` when ``dest`` appeared meanwhile."""
    try:
        os.rename(folder, dest)
    except OSError:
        if dest.exists():
            return False
        raise
    return True


def _refuse_existing(dest: Path) -> None:
    """Raise 409 ``adapter_exists`` when ``dest`` (or a link of that name) exists."""
    if dest.exists() or dest.is_symlink():
        raise AdapterError(
            409,
            "adapter_exists",
            f"an adapter named {dest.name!r} already exists in {dest.parent}. Choose another name, or delete "
            f"{dest} first to replace it.",
        )


def _stage_source(source: str, tmp: Path, tracking_uri: str | None) -> Path:
    """Bring ``source`` (MLflow URI or local folder) into ``tmp``; returns the folder holding it."""
    if source.startswith(MLFLOW_SCHEMES):
        if tracking_uri is None:
            raise AdapterError(
                400,
                "invalid_adapter_source",
                f"source {source!r} is an MLflow URI but no MLflow store is configured. Set tracking.uri "
                "(an absolute sqlite:////... path or a server URL), or give a local adapter folder.",
            )
        return _download(tracking_uri, source, tmp)
    if "://" in source:
        raise AdapterError(
            400,
            "invalid_adapter_source",
            f"source {source!r} has an unsupported scheme: expected runs:/<run_id>/<path>, "
            "models:/<name>/<version>, or a local adapter folder.",
        )
    return _copy_local(Path(source).expanduser().absolute(), tmp / "adapter")


def _copy_local(src: Path, dst: Path) -> Path:
    """Copy the adapter folder ``src`` to ``dst``; returns ``dst``.

    Raises:
        AdapterError: 400 when ``src`` is not a folder or contains symlinks (copying them would let an
            adapter read files from anywhere on the server).
    """
    if not src.is_dir():
        raise AdapterError(
            400,
            "invalid_adapter_source",
            f"source {str(src)!r} is not a folder on the server. Give the adapter folder written by training "
            "(outputs/<run>/adapter) or an MLflow URI.",
        )
    links = [p for p in (src, *src.rglob("*")) if p.is_symlink()]
    if links:
        raise AdapterError(
            400,
            "invalid_adapter_source",
            f"source {str(src)!r} contains the symlink {links[0]}; adapters are installed from real files only. "
            "Copy the files it points to into the folder.",
        )
    shutil.copytree(src, dst)
    return dst


def _download(tracking_uri: str, uri: str, dst: Path) -> Path:
    """Download MLflow artifacts ``uri`` into ``dst``; returns the downloaded folder.

    ``models:/`` URIs are resolved here with a client bound to ``tracking_uri``: MLflow 3.17's own
    resolution ignores the ``tracking_uri`` / ``registry_uri`` given to ``download_artifacts`` and
    opens the process-wide default store (a ``mlflow.db`` in the working folder) instead.

    Raises:
        AdapterError: 400 ``invalid_adapter_source`` when MLflow cannot resolve or download ``uri``.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        location = _models_uri_location(mlflow.MlflowClient(tracking_uri), uri) if uri.startswith("models:/") else uri
        downloaded = mlflow.artifacts.download_artifacts(location, dst_path=str(dst), tracking_uri=tracking_uri)
    except MlflowException as e:
        raise AdapterError(
            400,
            "invalid_adapter_source",
            f"cannot download {uri!r} from the MLflow store {tracking_uri}: {e.message}. Check the run id, "
            "artifact path or registered model name and version (mlflow ui lists them).",
        ) from None
    return Path(downloaded)


def _models_uri_location(client: MlflowClient, uri: str) -> str:
    """Where the artifacts of ``models:/<name>/<version|latest>``, ``models:/<name>@<alias>`` or
    ``models:/<model_id>`` are stored, looked up in ``client``'s store."""
    from mlflow.store.artifact.utils.models import get_model_name_and_version

    found = get_model_name_and_version(client, uri)
    if len(found) == 1:  # models:/<model_id>: an MLflow 3 logged model rather than a registered one
        return client.get_logged_model(found[0]).artifact_location
    return client.get_model_version_download_uri(*found)


def _latest_adapter_version(client: MlflowClient, name: str) -> int:
    """The newest version number of registered adapter ``name``.

    Raises:
        AdapterError: 404 ``adapter_not_found`` for an unknown name, a registered model not tagged
            ``raylora.kind = lora-adapter``, or one without versions.
    """
    from mlflow.exceptions import MlflowException

    try:
        tagged = client.get_registered_model(name).tags.get(KIND_TAG) == KIND
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        tagged = False
    newest = ["version_number DESC"]
    versions = client.search_model_versions(f"name = '{name}'", order_by=newest, max_results=1) if tagged else []
    if not versions:
        raise AdapterError(
            404,
            "adapter_not_found",
            f"no registered adapter named {name!r} in the MLflow store: expected a registered model tagged "
            f"{KIND_TAG}={KIND} with at least one version. Register one with raylora.serve.adapters.register "
            "(source runs:/<run_id>/adapter).",
        )
    return int(versions[0].version)


def _logged_adapter_run(client: MlflowClient, source: str) -> str:
    """The run id of ``source`` (``runs:/<run_id>/<path>``), checked to hold an adapter config and weights.

    Raises:
        AdapterError: 400 ``invalid_adapter_source`` for another scheme, an unknown run, or a path
            without ``adapter_config.json`` and adapter weights.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository

    if not source.startswith("runs:/"):
        problem = "expected a runs:/<run_id>/<artifact_path> URI"
    else:
        try:
            run_id, path = RunsArtifactRepository.parse_runs_uri(source)
            logged = sorted(f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(run_id, path))
        except MlflowException as e:
            problem = e.message
        else:
            if CONFIG in logged and set(WEIGHTS) & set(logged):
                return run_id
            problem = f"it holds {logged or 'nothing'}, expected {CONFIG} and {WEIGHTS[0]} (or {WEIGHTS[1]})"
    raise AdapterError(
        400,
        "invalid_adapter_source",
        f"cannot register {source!r} as an adapter: {problem}. Log the adapter folder as a run artifact first "
        "(e.g. MlflowClient.log_artifacts(run_id, 'outputs/<run>/adapter', 'adapter')).",
    )


def _ensure_registered_model(client: MlflowClient, name: str) -> None:
    """Create registered model ``name`` tagged as an adapter, or check an existing one is an adapter.

    Raises:
        AdapterError: 409 ``adapter_exists`` when ``name`` is a registered model of another kind.
    """
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, tags={KIND_TAG: KIND})
        return
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    if client.get_registered_model(name).tags.get(KIND_TAG) != KIND:
        raise AdapterError(
            409,
            "adapter_exists",
            f"the MLflow registered model {name!r} exists and is not a LoRA adapter (no tag {KIND_TAG}={KIND}). "
            "Register the adapter under another name.",
        )
