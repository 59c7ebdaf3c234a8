"""The Ray Serve application: the HTTP ingress (:mod:`raylora.serve.ingress`) bound to the model deployment
(:class:`~raylora.serve.replica.LLMServer`).

``build_app(cfg)`` returns the application; ``app_builder`` lets ``serve run`` / ``serve deploy`` build it
from a Serve config file (``configs/serve/*.yaml``).
"""

from ray import serve

from raylora.backends import replica_plan
from raylora.config import JobConfig, load_config, to_dict
from raylora.serve.ingress import Ingress
from raylora.serve.replica import LLMServer


def build_app(cfg: JobConfig):
    """The Serve application for ``cfg``: the ingress bound to ``serve.replicas`` model replicas.

    Raises:
        BackendError: the configured device is absent.
    """
    options = replica_plan(cfg.backend, cfg.serve.cpus_per_replica)
    model = serve.deployment(LLMServer).options(
        name="LLMServer", num_replicas=cfg.serve.replicas, ray_actor_options=options,
        max_ongoing_requests=max(64, 4 * cfg.serve.max_batch_size), health_check_period_s=5,
    )  # fmt: skip
    return Ingress.bind(to_dict(cfg), model.bind(to_dict(cfg)))


def app_builder(args: dict):
    """``serve run raylora.serve.app:app_builder config=CONFIG.yaml [overrides='a=1 b=2']`` entry point."""
    unknown = set(args) - {"config", "overrides"}
    if "config" not in args or unknown:
        raise ValueError(f"app_builder takes config=PATH and optionally overrides='k=v ...'; got {sorted(args)}")
    overrides = args.get("overrides", "")
    return build_app(load_config(args["config"], overrides.split() if isinstance(overrides, str) else list(overrides)))
