"""The Serve config file the project ships is valid for `serve run` / `serve deploy` and builds the app."""

from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from raylora.serve.app import app_builder

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_serve_config_validates_and_names_a_job_config():
    path = ROOT / "configs" / "serve" / "smollm2_serve_cpu.serve.yaml"
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    (app,) = schema.applications
    assert app.import_path == "raylora.serve.app:app_builder" and app.route_prefix == "/"
    assert schema.http_options.host == "127.0.0.1"
    assert (ROOT / app.args["config"]).is_file()


def test_app_builder_builds_the_two_deployments(monkeypatch):
    monkeypatch.chdir(ROOT)
    app = app_builder({"config": "configs/tiny_serve_cpu.yaml", "overrides": "serve.replicas=2 serve.max_adapters=3"})
    ingress = app._bound_deployment
    assert ingress.name == "Ingress"
    model = ingress.init_args[1]._bound_deployment  # the bound LLMServer
    assert model.name == "LLMServer" and model.num_replicas == 2
    assert model.ray_actor_options["num_cpus"] == 1
    assert ingress.init_args[0]["serve"]["max_adapters"] == 3
