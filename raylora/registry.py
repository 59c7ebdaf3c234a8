"""The MLflow model registry as a source of LoRA adapters: register, list, resolve and download them.

Registered adapters are MLflow registered models tagged ``raylora.kind = lora-adapter`` whose versions
point at a run artifact folder (``runs:/<run_id>/adapter``). Training and sweeps register adapters here;
the server lists and fetches them. Every failure is an :class:`AdapterError` carrying the HTTP status and
a short code the server answers with.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient

# mlflow is imported inside the functions that use it: it costs about 1.2 s to import (0.6 s after Ray Serve), and the
# serve ingress and replicas (and tune's config checks) import this module for AdapterError and check_name, needing
# mlflow only when tracking is on and a registered adapter is listed or fetched.

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
KIND_TAG = "raylora.kind"
KIND = "lora-adapter"

_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")


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


def list_registered(tracking_uri: str) -> list[str]:
    """Sorted names of the MLflow registered models tagged ``raylora.kind = lora-adapter``.

    Names that are not valid adapter names (:func:`check_name`) are left out, since no request could
    select them. Returns an empty list when the store holds none.
    """
    import mlflow  # mlflow: see the note at the top

    client = mlflow.MlflowClient(tracking_uri)
    names, token = [], None
    while True:
        page = client.search_registered_models(filter_string=f"tags.`{KIND_TAG}` = '{KIND}'", page_token=token)
        names += [m.name for m in page if _NAME.fullmatch(m.name)]
        token = page.token
        if not token:
            return sorted(names)


def register(tracking_uri: str, name: str, source: str) -> int:
    """Register an adapter logged as a run artifact as a version of registered model ``name``.

    The registered model (created when missing) and the version are tagged ``raylora.kind = lora-adapter``.
    Registering the same ``source`` again (a resumed sweep that had finished) returns its version, not a new one.

    Args:
        tracking_uri: the MLflow store.
        name: the registered model name, checked with :func:`check_name`.
        source: ``runs:/<run_id>/<artifact_path>`` of a folder holding ``adapter_config.json``.
    Returns:
        The version number.
    Raises:
        AdapterError: 400 bad name, a source that is not a ``runs:/`` URI or holds no adapter;
            409 when ``name`` is a registered model that is not a LoRA adapter.
    """
    import mlflow  # mlflow: see the note at the top

    check_name(name)
    client = mlflow.MlflowClient(tracking_uri)
    run_id = _logged_adapter_run(client, source)
    _ensure_registered_model(client, name)
    for version in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        if version.source == source:
            return int(version.version)
    return int(client.create_model_version(name, source, run_id=run_id, tags={KIND_TAG: KIND}).version)


def download(tracking_uri: str, uri: str, dst: Path) -> Path:
    """Download MLflow artifacts ``uri`` into ``dst``; returns the downloaded folder.

    ``models:/`` URIs are resolved here with a client bound to ``tracking_uri``: MLflow 3.17's own
    resolution ignores the ``tracking_uri`` / ``registry_uri`` given to ``download_artifacts`` and
    opens the process-wide default store (a ``mlflow.db`` in the working folder) instead.

    Raises:
        AdapterError: 400 ``invalid_adapter_source`` when MLflow cannot resolve or download ``uri``.
    """
    import mlflow  # mlflow: see the note at the top
    from mlflow.exceptions import MlflowException  # mlflow: see the note at the top

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
    from mlflow.store.artifact.utils.models import get_model_name_and_version  # mlflow: see the note at the top

    found = get_model_name_and_version(client, uri)
    if len(found) == 1:  # models:/<model_id>: an MLflow 3 logged model rather than a registered one
        return client.get_logged_model(found[0]).artifact_location
    return client.get_model_version_download_uri(*found)


def latest_version(tracking_uri: str, name: str) -> tuple[int, str]:
    """The newest version of registered adapter ``name``: its number and where its artifacts are.

    Raises:
        AdapterError: 404 ``adapter_not_found`` for an unknown name, a registered model not tagged
            ``raylora.kind = lora-adapter``, or one without versions.
    """
    import mlflow  # mlflow: see the note at the top
    from mlflow.exceptions import MlflowException  # mlflow: see the note at the top

    client = mlflow.MlflowClient(tracking_uri)
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
            f"{KIND_TAG}={KIND} with at least one version. Register one with raylora.registry.register "
            "(source runs:/<run_id>/adapter).",
        )
    version = int(versions[0].version)
    return version, client.get_model_version_download_uri(name, version)


def _logged_adapter_run(client: MlflowClient, source: str) -> str:
    """The run id of ``source`` (``runs:/<run_id>/<path>``), checked to hold an adapter config and weights.

    Raises:
        AdapterError: 400 ``invalid_adapter_source`` for another scheme, an unknown run, or a path
            without ``adapter_config.json`` and adapter weights.
    """
    from mlflow.exceptions import MlflowException  # mlflow: see the note at the top
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository  # mlflow: see the note at the top

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
    from mlflow.exceptions import MlflowException  # mlflow: see the note at the top

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


def registered_version(tracking_uri: str, uri: str) -> tuple[str, int, str | None]:
    """``models:/<name>/<version>`` (or ``/latest``) as ``(name, version, run id)``: the version that exists.

    Raises:
        AdapterError: 400 for another URI shape or a bad name; 404 ``adapter_not_found`` for an unknown name or
            a version the registry does not hold (its versions named).
    """
    import mlflow  # mlflow: see the note at the top
    from mlflow.exceptions import MlflowException  # mlflow: see the note at the top

    parts = uri.removeprefix("models:/").split("/")
    if not uri.startswith("models:/") or len(parts) != 2 or not parts[1]:
        raise AdapterError(
            400, "invalid_adapter_source", f"{uri!r} is not models:/NAME/VERSION (or models:/NAME/latest)"
        )
    name, version = check_name(parts[0]), parts[1]
    if version == "latest":
        version = str(latest_version(tracking_uri, name)[0])
    client = mlflow.MlflowClient(tracking_uri)
    try:
        found = client.get_model_version(name, version)
    except MlflowException:
        held = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
        raise AdapterError(404, "adapter_not_found", f"{uri}: the registry holds no version {version} of {name!r} "
                           f"(versions: {', '.join(map(str, held)) or 'none'})") from None  # fmt: skip
    return name, int(found.version), found.run_id
