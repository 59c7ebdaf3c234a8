"""serve.engine=vllm: the Ray Serve LLM config raylora builds, every refusal, and the lazy vLLM import.

vLLM is not installed here, so ``ray.serve.llm`` does not import; Ray's config classes do (from
``ray.llm._internal``), and the dicts are validated with the real ``LLMConfig`` they feed.
"""

import ast
import asyncio
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
from fastapi import HTTPException

from raylora.backends import BackendError, planned_backend
from raylora.config import BackendArgs, JobConfig
from raylora.serve import vllm
from raylora.serve.vllm import LocalAdapterLoader, build_vllm_app, check_vllm_config, vllm_llm_config


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A servable job: a local Hugging Face folder (no conversion) and an empty local adapter root."""
    monkeypatch.delenv("RAYLORA_API_KEY", raising=False)
    monkeypatch.delenv("RAYLORA_ADMIN_KEY", raising=False)
    folder = tmp_path / "SmolLM2-135M"
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 8192}
    (folder / "config.json").write_text(json.dumps(config))
    cfg = JobConfig()
    cfg.model.name_or_path = str(folder)
    cfg.model.dtype = "bfloat16"
    cfg.data.cutoff_len = 512
    cfg.serve.adapter_root = str(tmp_path / "adapters")
    cfg.serve.replicas = 2
    cfg.serve.cpus_per_replica = 2.0
    return cfg


def on(device: str):
    """The backend the driver plans for ``backend.device=<device>`` (no device needed)."""
    return planned_backend(BackendArgs(device=device))


def adapter(root, name):
    (root / name).mkdir(parents=True)
    (root / name / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (root / name / "adapter_model.safetensors").write_bytes(b"\0" * 16)


def test_cuda_config_gives_the_gpu_to_rays_engine_workers(job, tmp_path):
    assert vllm_llm_config(job, on("cuda")) == {
        "model_loading_config": {"model_id": "SmolLM2-135M", "model_source": str(tmp_path / "SmolLM2-135M")},
        "engine_kwargs": {
            "dtype": "bfloat16",
            "max_model_len": 512 + 256,
            "max_num_seqs": 16,
            "enable_lora": True,
            "max_lora_rank": 64,
            "max_loras": 8,
            "override_generation_config": {"max_new_tokens": 256},
        },
        "lora_config": {"max_num_adapters_per_replica": 8},
        "deployment_config": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 2.0}},
        "placement_group_config": {"bundles": [{"GPU": 1}]},
    }


def test_npu_config_gives_the_npu_to_the_replica_and_keeps_the_engine_in_it(job):
    cfg = vllm_llm_config(job, on("npu"))
    assert cfg["deployment_config"] == {
        "num_replicas": 2,
        "ray_actor_options": {"num_cpus": 2.0, "resources": {"NPU": 1}},
    }
    assert cfg["accelerator_config"] == {"kind": "cpu"}
    assert cfg["placement_group_config"] == {"bundles": [{"CPU": 1}]}
    assert cfg["engine_kwargs"]["enable_lora"] and cfg["lora_config"] == {"max_num_adapters_per_replica": 8}


def test_context_length_stays_within_the_models_positions(job, tmp_path):
    (tmp_path / "SmolLM2-135M" / "config.json").write_text(json.dumps({"max_position_embeddings": 600}))
    assert vllm_llm_config(job, on("cuda"))["engine_kwargs"]["max_model_len"] == 600


def test_a_cloud_adapter_root_goes_to_rays_own_loader(job):
    job.serve.adapter_root = "s3://bucket/adapters"
    assert vllm_llm_config(job, on("npu"))["lora_config"] == {
        "max_num_adapters_per_replica": 8,
        "dynamic_lora_loading_path": "s3://bucket/adapters",
    }


@pytest.mark.parametrize("backend", ["cuda", "npu"])
@pytest.mark.parametrize("root", ["local", "s3://bucket/adapters"])
def test_configs_pass_ray_serve_llms_own_validation(job, backend, root):
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    if root != "local":
        job.serve.adapter_root = root
    llm = LLMConfig(**vllm_llm_config(job, on(backend)))
    assert llm.model_id == "SmolLM2-135M"
    # cuda: Ray's GPU kind (engine workers on the GPU bundle); npu: the cpu kind, engine inside the replica
    assert llm.accelerator_config.kind == {"cuda": "gpu", "npu": "cpu"}[backend]
    assert llm.lora_config.max_num_adapters_per_replica == 8
    assert llm.lora_config.dynamic_lora_loading_path == (None if root == "local" else root)
    assert llm.multiplex_config().max_num_models_per_replica == 8
    assert llm.max_request_context_length == 768


def test_ray_refuses_a_local_dynamic_lora_path_so_raylora_never_passes_one(job):
    from pydantic import ValidationError
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    cfg = vllm_llm_config(job, on("cuda"))
    with pytest.raises(ValidationError, match="lora_config"):
        LLMConfig(**{**cfg, "lora_config": {"dynamic_lora_loading_path": job.serve.adapter_root}})


def test_a_servable_job_has_no_problems(job):
    assert check_vllm_config(job, on("cuda")) == []
    assert check_vllm_config(job, on("npu")) == []


def test_the_cpu_backend_is_refused(job):
    (cpu,) = check_vllm_config(job, on("cpu"))
    assert "serve.engine=hf" in cpu and "backend.device" in cpu


@pytest.mark.parametrize("quantization", ["w8a8", "w8a8-smoothquant"])
def test_load_time_quantisation_is_refused_with_what_vllm_supports(job, quantization):
    job.serve.quantization = quantization
    (problem,) = check_vllm_config(job, on("npu"))
    assert problem.startswith(f"serve.quantization={quantization}")
    assert "compressed-tensors" in problem and "msModelSlim" in problem and "serve.quantization=none" in problem


def test_4bit_adapters_dora_and_a_rank_vllm_rejects_are_refused(job):
    job.serve.adapter_bits = 4
    job.serve.max_lora_rank = 48
    job.lora.use_dora = True
    bits, rank, dora = check_vllm_config(job, on("cuda"))
    assert bits.startswith("serve.adapter_bits=4") and "serve.adapter_bits=16" in bits
    assert rank.startswith("serve.max_lora_rank=48") and "set serve.max_lora_rank=64" in rank
    assert "DoRA" in dora and "lora.use_dora=false" in dora
    job.serve.max_lora_rank = 1000
    assert "lora.rank ≤ 512" in check_vllm_config(job, on("cuda"))[1]


def test_api_and_admin_keys_are_refused_rather_than_ignored(job, monkeypatch):
    job.serve.api_key = "secret"
    (problem,) = check_vllm_config(job, on("cuda"))
    assert "serve.api_key" in problem and "checks no API key" in problem
    job.serve.api_key = None
    monkeypatch.setenv("RAYLORA_API_KEY", "from-env")
    monkeypatch.setenv("RAYLORA_ADMIN_KEY", "admin")
    api, admin = check_vllm_config(job, on("cuda"))
    assert "RAYLORA_API_KEY" in api and "POST /v1/adapters" in admin


def test_adapter_roots_vllm_cannot_read_are_refused(job, tmp_path):
    job.serve.adapter_root = "hdfs://cluster/adapters"
    (problem,) = check_vllm_config(job, on("cuda"))
    assert "s3://, gs://, abfss://, azure://" in problem
    (tmp_path / "a-file").write_text("x")
    job.serve.adapter_root = str(tmp_path / "a-file")
    assert check_vllm_config(job, on("cuda")) == [
        f"serve.adapter_root={tmp_path / 'a-file'} is a file; it must be a folder of adapters"
    ]


def test_models_vllm_cannot_load_are_refused(job, tmp_path):
    job.model.name_or_path = "tiny-llama"
    (tiny,) = check_vllm_config(job, on("cuda"))
    assert "tiny random model" in tiny and "serve.engine=hf" in tiny
    job.model.name_or_path = str(tmp_path / "missing")
    (missing,) = check_vllm_config(job, on("cuda"))
    assert "does not exist" in missing
    colon = tmp_path / "a:b"
    colon.mkdir()
    (colon / "config.json").write_text("{}")
    job.model.name_or_path = str(colon)
    (problem,) = check_vllm_config(job, on("cuda"))
    assert "'a:b'" in problem and "<base>:<adapter>" in problem
    int8 = tmp_path / "exported"
    int8.mkdir()
    (int8 / "config.json").write_text("{}")
    (int8 / "raylora_int8.json").write_text("{}")
    job.model.name_or_path = str(int8)
    (problem,) = check_vllm_config(job, on("cuda"))
    assert "raylora's int8 export" in problem and "serve.engine=hf" in problem


def test_every_problem_is_listed_at_once_and_the_config_refuses_to_build(job):
    job.serve.quantization = "w8a8"
    job.serve.api_key = "k"
    job.model.name_or_path = "tiny-qwen2"
    problems = check_vllm_config(job, on("cpu"))
    assert len(problems) == 4
    with pytest.raises(ValueError, match="cannot serve this job") as e:
        vllm_llm_config(job, on("cpu"))
    assert all(p in str(e.value) for p in problems)


@pytest.mark.parametrize(
    ("blocked", "backend", "hint"),
    [
        ("vllm", "cuda", 'pip install "ray[llm]=='),
        ("vllm", "npu", "vllm-ascend"),
        ("ray.serve.llm", "cuda", 'pip install "ray[llm]=='),
    ],
)
def test_build_names_the_install_when_vllm_or_ray_serve_llm_is_missing(job, monkeypatch, blocked, backend, hint):
    if blocked != "vllm":
        monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, blocked, None)  # makes `import <blocked>` raise ImportError
    converted = []
    monkeypatch.setattr(vllm, "model_folder", lambda args: converted.append(args))
    with pytest.raises(BackendError, match="serve.engine=vllm needs vLLM and ray.serve.llm") as e:
        build_vllm_app(job, on(backend))
    assert hint in str(e.value) and "serve.engine=hf" in str(e.value)
    assert converted == []  # nothing is converted before the import is known to work


def test_the_ray_llm_pin_is_read_from_rays_metadata():
    assert vllm._pinned_vllm()[0].isdigit()


@pytest.fixture
def fake_serve_llm(monkeypatch):
    """``vllm`` and ``ray.serve.llm`` as far as build_vllm_app can tell: it records what it is given."""
    built = {}

    class LLMServer:
        async def __init__(self, llm_config, *, engine_cls=None, model_downloader=None):
            self.args = (llm_config, engine_cls, model_downloader)

    serve_llm = types.ModuleType("ray.serve.llm")
    serve_llm.LLMConfig = lambda **kwargs: kwargs
    serve_llm.build_openai_app = lambda args: built.setdefault("app", args)
    deployment = types.ModuleType("ray.serve.llm.deployment")
    deployment.LLMServer = LLMServer
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "ray.serve.llm", serve_llm)
    monkeypatch.setitem(sys.modules, "ray.serve.llm.deployment", deployment)
    return LLMServer


def test_build_serves_a_local_adapter_root_through_raylora_s_loader(job, fake_serve_llm, tmp_path):
    app = build_vllm_app(job, on("cuda"))
    (llm,) = app["llm_configs"]
    server_cls = llm.pop("server_cls")
    assert llm == vllm_llm_config(job, on("cuda"))
    assert issubclass(server_cls, fake_serve_llm)

    server = server_cls.__new__(server_cls)
    asyncio.run(server.__init__("the-llm-config"))
    llm_config, engine_cls, downloader = server.args
    assert (llm_config, engine_cls) == ("the-llm-config", None)
    loader = downloader(download_timeout_s=30.0, max_tries=3)  # how Ray's LLMServer builds it
    assert isinstance(loader, LocalAdapterLoader) and loader.root == tmp_path / "adapters"


def test_build_leaves_a_cloud_adapter_root_to_ray(job, fake_serve_llm):
    job.serve.adapter_root = "gs://bucket/adapters"
    (llm,) = build_vllm_app(job, on("npu"))["llm_configs"]
    assert "server_cls" not in llm and llm["lora_config"]["dynamic_lora_loading_path"] == "gs://bucket/adapters"


def test_local_loader_returns_rays_disk_config_for_an_adapter(tmp_path):
    adapter(tmp_path, "support-bot")
    loader = LocalAdapterLoader(str(tmp_path), download_timeout_s=30.0, max_tries=3)
    disk = asyncio.run(loader.load_model_from_config("SmolLM2-135M:support-bot", None))
    assert type(disk).__name__ == "DiskMultiplexConfig"
    assert (disk.model_id, disk.local_path) == ("SmolLM2-135M:support-bot", str((tmp_path / "support-bot").resolve()))


@pytest.mark.parametrize(("model_id", "status"), [("base:missing", 404), ("base:../etc", 400), ("base:a:b", 400)])
def test_local_loader_answers_unknown_or_unsafe_names_with_http_errors(tmp_path, model_id, status):
    adapter(tmp_path, "ok")
    with pytest.raises(HTTPException) as e:
        asyncio.run(LocalAdapterLoader(str(tmp_path)).load_model_from_config(model_id, None))
    assert e.value.status_code == status


def test_rays_llm_server_still_takes_the_injected_loader():
    """Guards the Ray-internal seam build_vllm_app relies on, read from the installed source (it needs vLLM to import)."""
    spec = importlib.util.find_spec("ray.llm._internal.serve.core.server.llm_server")
    tree = ast.parse(Path(spec.origin).read_text())
    (server,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMServer"]
    init = next(n for n in server.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "__init__")
    assert [a.arg for a in init.args.kwonlyargs] == ["engine_cls", "model_downloader"]
    loader = next(n for n in server.body if isinstance(n, ast.FunctionDef) and n.name == "_init_multiplex_loader")
    calls = [
        n for n in ast.walk(loader) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "model_downloader_cls"
    ]
    assert [sorted(k.arg for k in c.keywords) for c in calls] == [["download_timeout_s", "max_tries"]]


@pytest.mark.parametrize(
    ("key", "value"),
    [("engine_threads", 1), ("batch_wait_ms", 1.0), ("max_prefill_tokens", 128), ("max_prompt_tokens", 100),
     ("adapter_group_size", 64), ("smoothquant_alpha", 0.8), ("calibration_rows", 8), ("max_schema_chars", 1000)],
)  # fmt: skip
def test_keys_only_the_hf_engine_reads_are_refused_under_vllm_with_the_reason(job, key, value):
    assert getattr(job.serve, key) != value
    setattr(job.serve, key, value)
    problems = check_vllm_config(job, on("cuda"))
    assert f"serve.{key}={value}: only serve.engine=hf reads it, so vLLM would silently ignore it" in "\n".join(
        problems
    )
