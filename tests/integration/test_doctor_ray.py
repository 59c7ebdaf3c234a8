import ray

from raylora.cli import main


def test_doctor_reaches_a_running_ray_cluster(monkeypatch, capsys):
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=1)
    try:
        address = ray.get_runtime_context().gcs_address
        assert address.startswith("127.0.0.1:")
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert main(["doctor"]) == 0
        assert f"{address} reachable" in capsys.readouterr().out
    finally:
        ray.shutdown()
