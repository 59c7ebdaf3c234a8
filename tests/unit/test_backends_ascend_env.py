"""``raylora doctor --cluster``'s checks of one node, fed fake Ascend nodes: each problem in, its verdict and fix out.

The command outputs below follow the shape of ``npu-smi info``, ``npu-smi info -t board`` and ``hccn_tool -ip -g`` as
Ascend's documents and public logs show them; none was captured on hardware here.
"""

import os
import stat

import pytest

from raylora.backends import ascend_env
from raylora.backends.ascend_env import RELEASES, findings, node_facts, socket_ifname_matches

NPU_SMI = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.6                   Version: 23.0.6                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B2               | OK            | 92.1        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3396 / 65536         |
+===========================+===============+====================================================+
| 1     910B2               | {health}      | 90.4        41                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3396 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | 124528        | python3                  | 17400                   |
+===========================+===============+====================================================+
"""
BOARD = "NPU ID : 0\nSoftware Version : 23.0.6\nFirmware Version : 7.1.0.5.220\n"
HOME = "/usr/local/Ascend/ascend-toolkit/latest"


def node(**changes) -> dict:
    """A healthy Atlas 800T A2 node as :func:`node_facts` reports it (2 NPUs for brevity), with ``changes``."""
    facts = {
        "host": "npu-node-1",
        "torch": "2.6.0+cpu",
        "torch_npu": "2.6.0.post3",
        "env": {"ASCEND_HOME_PATH": HOME},
        "cann_home": HOME,
        "cann_version": "8.3.RC1",
        "interfaces": {"lo": ["127.0.0.1", "::1"], "enp189s0f0": ["192.168.0.11"], "docker0": ["172.17.0.1"]},
        "devices": [0, 1],
        "npu_smi": (0, NPU_SMI.format(health="OK           ")),
        "npu_board": (0, BOARD),
        "device_ips": {i: (0, f"ipaddr:10.0.0.{i + 1}\nnetmask:255.255.255.0\n") for i in (0, 1)},
    }
    return facts | changes


def test_a_healthy_node_has_no_problem_and_says_what_it_has():
    rows, problems = findings(node(), {"HCCL_CONNECT_TIMEOUT": "1800"}, npu_nodes=4)
    assert problems == []
    rows = dict(rows)
    assert rows["torch_npu"] == "2.6.0.post3" and rows["CANN"] == f"8.3.RC1 ({HOME})"
    assert rows["NPU driver"] == "23.0.6" and rows["NPU firmware"] == "7.1.0.5.220"
    assert rows["NPUs"] == "0 910B2 OK, 1 910B2 OK"  # the process table's "0 0 ..." row is no chip
    assert rows["NPU 1 NIC"] == "10.0.0.2"
    assert rows["HCCL_CONNECT_TIMEOUT"] == "1800 (from the job's backend.hccl)"


def test_a_socket_ifname_that_names_no_nic_of_the_node_is_refused_with_its_nics():
    """Issue #40: `socket_ifname: eth` on hosts whose NICs are enp*: HCCL finds no interface, found after the timeout."""
    _, problems = findings(node(), {"HCCL_CONNECT_TIMEOUT": "1800", "HCCL_SOCKET_IFNAME": "eth"}, npu_nodes=4)
    assert len(problems) == 1
    assert problems[0].startswith("HCCL_SOCKET_IFNAME=eth selects no network interface with an address")
    assert "enp189s0f0 192.168.0.11" in problems[0] and "set backend.hccl.socket_ifname" in problems[0]
    _, problems = findings(node(env={"ASCEND_HOME_PATH": HOME, "HCCL_SOCKET_IFNAME": "eth"}), {}, npu_nodes=4)
    assert "change HCCL_SOCKET_IFNAME where Ray starts here" in problems[0]  # the node's own variable
    assert findings(node(), {"HCCL_SOCKET_IFNAME": "enp"}, npu_nodes=4)[1] == []


@pytest.mark.parametrize(
    "value,chosen",
    [
        ("enp", ["enp189s0f0"]),
        ("eth,enp", ["enp189s0f0"]),
        ("=enp189s0f0", ["enp189s0f0"]),
        ("=enp", []),  # exact names only
        ("^docker,lo", ["enp189s0f0"]),
        ("^=lo,docker0,enp189s0f0", []),
        ("^enp", ["lo", "docker0"]),
    ],
)
def test_socket_ifname_takes_cann_s_four_forms(value, chosen):
    interfaces = {"lo": ["127.0.0.1"], "enp189s0f0": ["192.168.0.11"], "docker0": ["172.17.0.1"]}
    assert sorted(socket_ifname_matches(value, interfaces)) == sorted(chosen)


def test_a_socket_ifname_matching_only_an_interface_without_address_is_refused():
    interfaces = {"lo": ["127.0.0.1"], "enp1s0": [], "bond0": ["10.1.0.5"]}
    _, problems = findings(node(interfaces=interfaces), {"HCCL_SOCKET_IFNAME": "enp"}, npu_nodes=2)
    assert "enp1s0 (no address)" in problems[0]


def test_an_if_ip_that_is_not_the_node_s_is_refused():
    _, problems = findings(node(), {"HCCL_IF_IP": "192.168.0.12"}, npu_nodes=4)
    assert problems[0].startswith("HCCL_IF_IP=192.168.0.12 is no address of this node")
    assert "it differs per node" in problems[0] and "set backend.hccl.if_ip" in problems[0]
    assert findings(node(env={"HCCL_IF_IP": "192.168.0.11", **node()["env"]}), {}, npu_nodes=4)[1] == []


@pytest.mark.parametrize("value", ["60", "9000", "30m", ""])
def test_a_connect_timeout_cann_refuses_is_refused(value):
    _, problems = findings(node(env={**node()["env"], "HCCL_CONNECT_TIMEOUT": value}), {}, npu_nodes=1)
    assert problems == [
        f"HCCL_CONNECT_TIMEOUT={value} is not a whole number of seconds from 120 to 7200, as CANN requires: "
        "change HCCL_CONNECT_TIMEOUT where Ray starts here"
    ]


def test_torch_that_torch_npu_was_not_built_for_is_refused():
    _, problems = findings(node(torch="2.7.1"), {}, npu_nodes=1)
    assert problems == [
        "torch_npu 2.6.0.post3 is built for torch 2.6.0, and this node has torch 2.7.1: pip install "
        "'torch==2.6.0', or the torch_npu release for your torch (docs/ascend.md#versions)"
    ]
    assert findings(node(torch="2.6.0"), {}, npu_nodes=1)[1] == []  # a local suffix (+cpu) is no mismatch


def test_torch_npu_without_cann_is_reported_as_that_mismatch_not_as_an_unsourced_script():
    """Issue #40: with torch_npu installed and CANN missing, `import torch` fails; the user got 'is set_env.sh
    sourced?' instead of the mismatch."""
    rows, problems = findings(node(env={}, cann_home=None, cann_version=None), {}, npu_nodes=1)
    assert dict(rows)["CANN"] == "not found"
    assert len(problems) == 1
    assert problems[0].startswith("torch_npu 2.6.0.post3 is installed but this node has no CANN toolkit")
    assert "`import torch` fails here" in problems[0] and "install CANN 8.3.RC1" in problems[0]


def test_cann_installed_but_not_sourced_where_ray_started_is_said_so():
    _, problems = findings(node(env={}), {}, npu_nodes=1)
    assert problems[0].startswith(f"CANN is installed at {HOME} but its set_env.sh was not sourced")


def test_a_cann_other_than_torch_npu_s_is_refused_and_a_build_suffix_is_not():
    _, problems = findings(node(cann_version="8.2.RC1"), {}, npu_nodes=1)
    assert problems[0].startswith("torch_npu 2.6.0.post3 is released for CANN 8.3.RC1 (Ascend's version table)")
    assert findings(node(cann_version="8.3.RC1.beta1"), {}, npu_nodes=1)[1] == []


def test_a_torch_npu_release_not_in_the_table_is_said_and_its_torch_still_checked():
    rows, problems = findings(node(torch_npu="2.6.0.post9", cann_version="9.9.0"), {}, npu_nodes=1)
    assert dict(rows)["torch_npu's CANN"].startswith("2.6.0.post9 is not in raylora's table")
    assert problems == []
    assert "built for torch 2.6.0" in findings(node(torch_npu="2.6.0.post9", torch="2.5.1"), {}, 1)[1][0]


def test_npus_without_torch_npu_are_refused_and_a_cpu_node_is_not():
    _, problems = findings(node(torch_npu=None), {}, npu_nodes=1)
    assert problems[0].startswith("this node has NPUs (/dev/davinci*) but torch_npu is not installed")
    cpu = node(torch_npu=None, env={}, cann_home=None, cann_version=None, devices=[], npu_smi=None, npu_board=None,
               device_ips=None)  # fmt: skip
    rows, problems = findings(cpu, {}, npu_nodes=0)
    assert problems == [] and dict(rows)["npu-smi"] == "not found"


def test_npu_smi_failing_and_a_chip_not_ok_are_refused():
    _, problems = findings(node(npu_smi=(-1, "dcmi module initialize failed. ret is -8005\n")), {}, npu_nodes=1)
    assert problems[0].startswith("`npu-smi info` failed (exit -1: dcmi module initialize failed. ret is -8005)")
    _, problems = findings(node(npu_smi=(0, NPU_SMI.format(health="Warning      "))), {}, npu_nodes=1)
    assert problems == ["NPU 1 (910B2) reports health Warning in `npu-smi info`: fix or leave out that card before "
                        "training"]  # fmt: skip


def test_npus_without_their_own_nic_address_matter_once_the_job_spans_nodes():
    device_ips = {0: (0, "ipaddr:10.0.0.1\nnetmask:255.255.255.0\n"), 1: (0, "")}
    rows, problems = findings(node(device_ips=device_ips), {}, npu_nodes=1)
    assert dict(rows)["NPU 1 NIC"] == "no address" and problems == []
    _, problems = findings(node(device_ips=device_ips), {}, npu_nodes=4)
    assert problems[0].startswith("NPU(s) 1 have no NIC address (`hccn_tool -i N -ip -g`)")


def test_the_cann_version_is_read_from_the_toolkit_s_install_info(tmp_path, monkeypatch):
    info = tmp_path / "latest" / "aarch64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC2\ninnerversion=V100R001C18SPC001B236\n")
    assert ascend_env.cann_version(tmp_path / "latest") == "8.0.RC2"
    assert ascend_env.cann_version(tmp_path) is None
    monkeypatch.setattr(ascend_env, "CANN_DEFAULTS", (tmp_path / "absent", tmp_path / "latest"))
    assert ascend_env.cann_home({}) == str(tmp_path / "latest")
    assert ascend_env.cann_home({"ASCEND_TOOLKIT_HOME": "/opt/cann"}) == "/opt/cann"


def test_every_table_row_pairs_a_torch_npu_with_its_own_torch():
    assert all(ascend_env.release(npu) == torch for npu, (torch, _) in RELEASES.items())


def _script(folder, name, text):
    path = folder / name
    path.write_text(f"#!/bin/sh\n{text}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_node_facts_gathers_the_node_s_tools_and_environment(tmp_path, monkeypatch):
    """The gathering itself, on a fake node: tools on PATH, device files, CANN's variables (no hardware)."""
    _script(tmp_path, "npu-smi", 'if [ "$2" = "-t" ]; then echo "Firmware Version : 7.1.0.5.220"; else echo '
            '"| npu-smi 23.0.6   Version: 23.0.6 |"; fi')  # fmt: skip
    hccn = _script(tmp_path, "hccn_tool", 'echo "ipaddr:10.0.0.$(($2 + 1))"')
    devices = tmp_path / "dev"
    devices.mkdir()
    for name in ("davinci0", "davinci1", "davinci_manager"):
        (devices / name).touch()
    home = tmp_path / "cann"
    (home / "x86_64-linux").mkdir(parents=True)
    (home / "x86_64-linux" / "ascend_toolkit_install.info").write_text("version=8.3.RC1\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(home))
    monkeypatch.setenv("HCCL_IF_IP", "127.0.0.1")
    monkeypatch.setattr(ascend_env, "DEVICES", devices)
    monkeypatch.setattr(ascend_env, "HCCN_TOOL", hccn)
    facts = node_facts()
    assert facts["devices"] == [0, 1] and facts["cann_version"] == "8.3.RC1"
    assert facts["env"]["HCCL_IF_IP"] == "127.0.0.1" and facts["env"]["ASCEND_HOME_PATH"] == str(home)
    assert "127.0.0.1" in facts["interfaces"]["lo"]
    assert facts["npu_smi"][0] == 0 and "Version: 23.0.6" in facts["npu_smi"][1]
    assert facts["npu_board"] == (0, "Firmware Version : 7.1.0.5.220\n")
    assert facts["device_ips"] == {0: (0, "ipaddr:10.0.0.1\n"), 1: (0, "ipaddr:10.0.0.2\n")}
    rows = dict(findings(facts, {}, npu_nodes=1)[0])
    assert rows["NPU firmware"] == "7.1.0.5.220" and rows["NPU 1 NIC"] == "10.0.0.2"
