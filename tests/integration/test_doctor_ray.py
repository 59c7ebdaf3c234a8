"""`raylora doctor` finds a running cluster (``raylora doctor --cluster`` on two nodes: test_train_cluster.py)."""

from raylora.cli import main


def test_doctor_reaches_a_running_ray_cluster(session_address, monkeypatch, capsys):
    """The module's shared cluster: the doctor only asks whether its address answers, and leaves it running."""
    assert session_address.startswith("127.0.0.1:")
    monkeypatch.setenv("RAY_ADDRESS", session_address)
    assert main(["doctor"]) == 0
    assert f"{session_address} reachable" in capsys.readouterr().out
