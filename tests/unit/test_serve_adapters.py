import json
import shutil
from pathlib import Path

import mlflow
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from raylora.models import tiny_model
from raylora.registry import AdapterError, check_name, list_registered, register
from raylora.serve.adapters import fetch_registered, install, list_local, local_adapter
from raylora.serve.compat import check_compatible


def save_adapter(folder: Path, model=None, **lora) -> Path:
    """A real peft LoRA adapter of ``model`` (default: a fresh tiny Llama) saved into ``folder``."""
    model = model if model is not None else tiny_model("llama")
    options = {"r": 4, "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"} | lora
    safe = options.pop("safe_serialization", True)
    get_peft_model(model, LoraConfig(**options)).save_pretrained(folder, safe_serialization=safe)
    return folder


def wide_llama(layers: int = 2, hidden: int = 32):
    """A tiny Llama whose shapes differ from ``tiny_model("llama")`` (hidden 64, 2 layers)."""
    config = LlamaConfig(
        vocab_size=259, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    model.name_or_path = "tiny-wide"  # what peft records as base_model_name_or_path
    return model


def assert_error(excinfo, status: int, code: str, *words: str) -> None:
    error = excinfo.value
    assert (error.status, error.code) == (status, code), str(error)
    for word in words:
        assert word in str(error), f"{word!r} missing from: {error}"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return save_adapter(tmp_path_factory.mktemp("trained") / "adapter")


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama")


@pytest.fixture
def adapter_root(tmp_path, adapter) -> Path:
    root = tmp_path / "adapters"
    shutil.copytree(adapter, root / "alpha")
    return root


@pytest.fixture(scope="module")
def store(tmp_path_factory, adapter) -> tuple[str, str]:
    """An MLflow SQLite store with one run that logged ``adapter`` as its ``adapter`` artifact folder."""
    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("adapters", artifact_location=(folder / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    client.log_artifacts(run_id, str(adapter), artifact_path="adapter")
    client.log_artifact(run_id, str(adapter / "adapter_config.json"), artifact_path="not-an-adapter")
    client.set_terminated(run_id)
    return uri, run_id


@pytest.mark.parametrize("name", ["a", "0", "my-adapter_v1.2", "x..y", "-", "A" * 64])
def test_check_name_accepts_plain_names(name):
    assert check_name(name) == name


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../x", "/etc/passwd", "a/b", "a\\b", ".hidden", "A" * 65, "adaptér", "名前", "a b", "a\n"]
)
def test_check_name_refuses_paths_hidden_and_odd_names(name, adapter_root):
    with pytest.raises(AdapterError) as excinfo:
        check_name(name)
    assert_error(excinfo, 400, "invalid_adapter_name", "expected 1 to 64 ASCII letters")
    with pytest.raises(AdapterError) as excinfo:
        local_adapter(adapter_root, name)
    assert excinfo.value.code == "invalid_adapter_name"


def test_local_adapter_resolves_inside_root(adapter_root):
    assert local_adapter(adapter_root, "alpha") == (adapter_root / "alpha").resolve()


def test_missing_adapter_is_404_naming_the_expected_folder(adapter_root):
    (adapter_root / "empty").mkdir()
    for name in ("nope", "empty"):
        with pytest.raises(AdapterError) as excinfo:
            local_adapter(adapter_root, name)
        assert_error(excinfo, 404, "adapter_not_found", str(adapter_root.resolve() / name), "adapter_config.json")


def test_symlinks_leading_outside_root_are_refused_and_not_listed(adapter_root, adapter, tmp_path):
    outside = shutil.copytree(adapter, tmp_path / "outside")
    (adapter_root / "evil").symlink_to(outside, target_is_directory=True)
    (adapter_root / "dangling").symlink_to(tmp_path / "missing", target_is_directory=True)
    sneaky = adapter_root / "sneaky"
    sneaky.mkdir()
    (sneaky / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    shutil.copy(outside / "adapter_config.json", sneaky)
    (adapter_root / "alias").symlink_to(adapter_root / "alpha", target_is_directory=True)  # stays inside: fine
    for name in ("evil", "dangling", "sneaky"):
        with pytest.raises(AdapterError) as excinfo:
            local_adapter(adapter_root, name)
        assert_error(excinfo, 400, "adapter_outside_root", "outside the adapter root")
    assert list_local(adapter_root) == ["alias", "alpha"]


def test_list_local_skips_hidden_invalid_and_incomplete_entries(adapter_root, adapter, tmp_path):
    for name in ("beta", ".hidden", ".registry/beta/1", "bad name"):
        shutil.copytree(adapter, adapter_root / name)
    (adapter_root / "no-weights").mkdir()
    shutil.copy(adapter / "adapter_config.json", adapter_root / "no-weights")
    (adapter_root / "notes.txt").write_text("not an adapter")
    assert list_local(adapter_root) == ["alpha", "beta"]
    assert list_local(tmp_path / "absent") == []


def test_compatible_adapter_returns_its_config(adapter_root, base):
    config = check_compatible(local_adapter(adapter_root, "alpha"), base, max_rank=4)
    assert config["peft_type"] == "LORA" and config["r"] == 4


def test_rank_above_max_is_422_naming_the_setting(adapter_root, base):
    with pytest.raises(AdapterError) as excinfo:
        check_compatible(local_adapter(adapter_root, "alpha"), base, max_rank=2)
    assert_error(excinfo, 422, "adapter_incompatible", "r=4", "max_rank=2", "serve.max_lora_rank")


def test_rank_pattern_counts_towards_the_rank_limit(tmp_path, base):
    folder = save_adapter(tmp_path / "a", rank_pattern={"layers.1.self_attn.q_proj": 16})
    check_compatible(folder, base, max_rank=16)
    with pytest.raises(AdapterError) as excinfo:
        check_compatible(folder, base, max_rank=8)
    assert_error(excinfo, 422, "adapter_incompatible", "r=16")


def test_adapter_of_another_shape_is_422_naming_module_and_shapes(tmp_path, base):
    folder = save_adapter(tmp_path / "wide", wide_llama())
    with pytest.raises(AdapterError) as excinfo:
        check_compatible(folder, base, max_rank=64)
    assert_error(
        excinfo, 422, "adapter_incompatible", "model.layers.0.self_attn.q_proj.lora_A.weight", "expected [4, 64]",
        "found [4, 32]", "tiny-wide",
    )  # fmt: skip


def test_adapter_of_a_deeper_model_is_422_naming_the_missing_module(tmp_path, base):
    folder = save_adapter(tmp_path / "deep", wide_llama(layers=3, hidden=64))
    with pytest.raises(AdapterError) as excinfo:
        check_compatible(folder, base, max_rank=64)
    assert_error(excinfo, 422, "adapter_incompatible", "model.layers.2.self_attn.q_proj is not a linear")


@pytest.mark.parametrize(
    "lora",
    [
        {"use_dora": True},
        {"lora_bias": True},
        {"target_modules": ["q_proj", "embed_tokens"], "modules_to_save": ["lm_head"]},
        {"safe_serialization": False},
    ],
    ids=["dora", "lora-bias", "embedding-and-modules-to-save", "bin-weights"],
)
def test_peft_adapter_variants_fit_their_base_model(tmp_path, base, lora):
    folder = save_adapter(tmp_path / "variant", **lora)
    assert local_adapter(folder.parent, "variant") == folder.resolve()
    check_compatible(folder, base, max_rank=8)


def test_quantised_linears_are_checked_by_their_features_not_weight_shape(adapter, base):
    class PackedLinear(torch.nn.Linear):
        """Stands for a quantised linear: two int4 values per byte, so weight.shape is not [out, in]."""

        def __init__(self, linear: torch.nn.Linear) -> None:
            super().__init__(linear.in_features, linear.out_features, bias=False)
            self.weight = torch.nn.Parameter(torch.zeros(self.out_features, self.in_features // 2), requires_grad=False)

    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.q_proj = PackedLinear(layer.self_attn.q_proj)
    check_compatible(adapter, model, max_rank=4)


def test_a_peft_wrapped_model_is_accepted(adapter):
    check_compatible(adapter, PeftModel.from_pretrained(tiny_model("llama"), adapter), max_rank=4)


def test_non_lora_adapter_is_422(adapter_root, base):
    config_file = adapter_root / "alpha" / "adapter_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"peft_type": "IA3"}))
    with pytest.raises(AdapterError) as excinfo:
        check_compatible(adapter_root / "alpha", base, max_rank=4)
    assert_error(excinfo, 422, "adapter_incompatible", "peft_type 'IA3'")


def test_list_registered_is_empty_on_a_fresh_store(tmp_path):
    assert list_registered(f"sqlite:///{tmp_path / 'fresh.db'}") == []


def test_register_list_fetch_and_load(store, adapter, tmp_path, monkeypatch):
    uri, run_id = store
    monkeypatch.chdir(tmp_path)  # MLflow's default store would appear here as mlflow.db if it were used
    assert register(uri, "reg-a", f"runs:/{run_id}/adapter") == 1
    assert register(uri, "reg-a", f"runs:/{run_id}/adapter") == 1  # the same adapter again: its version
    client = mlflow.MlflowClient(uri)
    second = client.create_run(client.get_run(run_id).info.experiment_id).info.run_id
    client.log_artifacts(second, str(adapter), artifact_path="adapter")
    assert register(uri, "reg-a", f"runs:/{second}/adapter") == 2
    mlflow.MlflowClient(uri).create_registered_model("sklearn-thing")
    assert "reg-a" in list_registered(uri) and "sklearn-thing" not in list_registered(uri)

    root = tmp_path / "adapters"
    fetched = fetch_registered(uri, "reg-a", root)
    assert fetched == (root / ".registry" / "reg-a" / "2").resolve()
    loaded = PeftModel.from_pretrained(tiny_model("llama"), fetched)
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in get_peft_model_state_dict(loaded).items())
    assert fetch_registered(uri, "reg-a", root) == fetched
    assert sorted(p.name for p in (root / ".registry").iterdir()) == ["reg-a"]  # no temporary folder left
    assert list_local(root) == [] and not (tmp_path / "mlflow.db").exists()

    for name in ("unknown", "sklearn-thing"):
        with pytest.raises(AdapterError) as excinfo:
            fetch_registered(uri, name, root)
        assert_error(excinfo, 404, "adapter_not_found", name, "raylora.kind=lora-adapter")


def test_register_refuses_bad_sources_and_foreign_models(store):
    uri, run_id = store
    sources = {
        "/some/folder": "expected a runs:/",
        f"runs:/{run_id}/not-an-adapter": "expected adapter_config.json and adapter_model.safetensors",
        f"runs:/{run_id}/missing": "holds nothing",
        "runs:/0123456789abcdef/adapter": "0123456789abcdef",
    }
    for source, reason in sources.items():
        with pytest.raises(AdapterError) as excinfo:
            register(uri, "reg-bad", source)
        assert_error(excinfo, 400, "invalid_adapter_source", reason)
    mlflow.MlflowClient(uri).create_registered_model("foreign")
    with pytest.raises(AdapterError) as excinfo:
        register(uri, "foreign", f"runs:/{run_id}/adapter")
    assert_error(excinfo, 409, "adapter_exists", "not a LoRA adapter")


def test_install_from_a_local_folder(adapter_root, adapter, base):
    installed = install(adapter_root, "beta", str(adapter), tracking_uri=None)
    assert installed == (adapter_root / "beta").resolve()
    assert list_local(adapter_root) == ["alpha", "beta"]
    assert (installed / "adapter_model.safetensors").read_bytes() == (
        adapter / "adapter_model.safetensors"
    ).read_bytes()
    check_compatible(installed, base, max_rank=4)
    assert [p.name for p in adapter_root.iterdir() if p.name.startswith(".")] == []


def test_install_from_mlflow_uris(adapter_root, store, tmp_path, monkeypatch):
    uri, run_id = store
    monkeypatch.chdir(tmp_path)
    register(uri, "reg-install", f"runs:/{run_id}/adapter")
    assert install(adapter_root, "from-run", f"runs:/{run_id}/adapter", uri).name == "from-run"
    assert install(adapter_root, "from-registry", "models:/reg-install/latest", uri).name == "from-registry"
    assert list_local(adapter_root) == ["alpha", "from-registry", "from-run"]
    PeftModel.from_pretrained(tiny_model("llama"), adapter_root / "from-registry")
    assert not (tmp_path / "mlflow.db").exists()


def test_install_of_an_existing_name_is_409(adapter_root, adapter):
    with pytest.raises(AdapterError) as excinfo:
        install(adapter_root, "alpha", str(adapter), tracking_uri=None)
    assert_error(excinfo, 409, "adapter_exists", "alpha")


def test_install_refuses_unusable_sources_with_the_reason(adapter_root, adapter, store, tmp_path, monkeypatch):
    uri, run_id = store
    not_lora = shutil.copytree(adapter, tmp_path / "ia3")
    (not_lora / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    linked = shutil.copytree(adapter, tmp_path / "linked")
    (linked / "extra.json").symlink_to(tmp_path / "ia3" / "adapter_config.json")
    (tmp_path / "empty").mkdir()
    sources = {
        str(tmp_path / "absent"): ("not a folder", uri),
        str(tmp_path / "empty"): ("lacks adapter_config.json", uri),
        str(not_lora): ("peft_type 'IA3'", uri),
        str(linked): ("symlink", uri),
        "s3://bucket/adapter": ("unsupported scheme", uri),
        f"runs:/{run_id}/adapter": ("no MLflow store is configured", None),
        "runs:/0123456789abcdef/adapter": ("0123456789abcdef", uri),
        "models:/never-registered/1": ("never-registered", uri),
    }
    for source, (reason, tracking_uri) in sources.items():
        with pytest.raises(AdapterError) as excinfo:
            install(adapter_root, "new", source, tracking_uri)
        assert_error(excinfo, 400, "invalid_adapter_source", reason)
    assert sorted(p.name for p in adapter_root.iterdir()) == ["alpha"]  # nothing half-installed
    run = tmp_path / "run"  # found by use: a training run's whole folder was copied, checkpoints and all, then refused
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "big.bin").write_bytes(b"0" * 1000)
    copies = []
    monkeypatch.setattr(shutil, "copytree", lambda *a, **k: copies.append(a))
    with pytest.raises(AdapterError) as excinfo:
        install(adapter_root, "new", str(run), None)
    assert_error(excinfo, 400, "invalid_adapter_source", "lacks adapter_config.json")
    assert copies == []
    with pytest.raises(AdapterError) as excinfo:
        install(adapter_root, "../escape", str(adapter), tracking_uri=None)
    assert excinfo.value.code == "invalid_adapter_name"
