"""One node's Ascend software and networking, for ``raylora doctor --cluster``.

:func:`node_facts` runs on the node (a Ray task pinned to it) and gathers what is there: torch and torch_npu versions,
the CANN toolkit and its version, the HCCL and Ascend variables, the host's network interfaces, and what ``npu-smi``
and ``hccn_tool`` say. It imports neither torch_npu nor CANN's libraries: torch_npu installed without CANN breaks
``import torch`` itself, and that node's report must say so. :func:`findings` turns the facts into report rows and
problems, each problem naming its fix; each check takes its inputs (environment, interfaces, command outputs), so tests
feed it fake nodes. Nothing here has run on an Ascend host (docs/ascend.md).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path

import psutil

# torch_npu release -> (the torch it is built for, the CANN it is released with): Ascend's version table, the active
# releases (github.com/Ascend/pytorch, COMPATIBILITY.en.md, "TorchNPU version mapping table"; docs/ascend.md#versions)
RELEASES: dict[str, tuple[str, str]] = {
    "2.12.0": ("2.12.0", "9.1.0"),
    "2.11.0": ("2.11.0", "9.1.0"),
    "2.10.0.post4": ("2.10.0", "9.1.0"),
    "2.9.0.post6": ("2.9.0", "9.1.0"),
    "2.7.1.post8": ("2.7.1", "9.1.0"),
    "2.9.0.post2": ("2.9.0", "9.0.0"),
    "2.8.0.post4": ("2.8.0", "9.0.0"),
    "2.7.1.post4": ("2.7.1", "9.0.0"),
    "2.9.0": ("2.9.0", "8.5.0"),
    "2.8.0.post2": ("2.8.0", "8.5.0"),
    "2.7.1.post2": ("2.7.1", "8.5.0"),
    "2.6.0.post5": ("2.6.0", "8.5.0"),
    "2.8.0": ("2.8.0", "8.3.RC1"),
    "2.7.1": ("2.7.1", "8.3.RC1"),
    "2.6.0.post3": ("2.6.0", "8.3.RC1"),
    "2.1.0.post17": ("2.1.0", "8.3.RC1"),
    "2.6.0": ("2.6.0", "8.2.RC1"),
    "2.5.1.post1": ("2.5.1", "8.2.RC1"),
    "2.1.0.post13": ("2.1.0", "8.2.RC1"),
    "2.5.1": ("2.5.1", "8.1.RC1"),
    "2.4.0.post4": ("2.4.0", "8.1.RC1"),
    "2.3.1.post6": ("2.3.1", "8.1.RC1"),
    "2.1.0.post12": ("2.1.0", "8.1.RC1"),
    "2.4.0.post2": ("2.4.0", "8.0.0"),
    "2.3.1.post4": ("2.3.1", "8.0.0"),
    "2.1.0.post10": ("2.1.0", "8.0.0"),
}
HOME_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")  # set by CANN's set_env.sh
# where CANN installs by default: ascend-toolkit/latest up to 8.3, cann from 8.5
CANN_DEFAULTS = (Path("/usr/local/Ascend/ascend-toolkit/latest"), Path("/usr/local/Ascend/cann"))
HCCN_TOOL = Path("/usr/local/Ascend/driver/tools/hccn_tool")  # the driver's; often not on PATH
DEVICES = Path("/dev")  # davinci0, davinci1, ...: one file per NPU the driver exposes
CONNECT_TIMEOUT_RANGE = (120, 7200)  # CANN: HCCL_CONNECT_TIMEOUT is an integer number of seconds in [120, 7200]
TOOL_TIMEOUT_S = 20

Outcome = tuple[int, str]  # a command's exit status and its output
Report = tuple[list[tuple[str, str]], list[str]]  # rows (item, finding) and problems, each naming its fix


def node_facts() -> dict:
    """What this node has, as plain data (a Ray task's result): see the module's docstring."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("HCCL_", "ASCEND_"))}
    home = cann_home(env)
    devices = sorted(int(p.name.removeprefix("davinci")) for p in DEVICES.glob("davinci[0-9]*"))
    npu_smi = shutil.which("npu-smi")
    hccn = shutil.which("hccn_tool") or (str(HCCN_TOOL) if HCCN_TOOL.exists() else None)
    return {
        "host": socket.gethostname(),
        "torch": _version("torch"),
        "torch_npu": _version("torch_npu"),
        "env": env,
        "cann_home": home,
        "cann_version": cann_version(Path(home)) if home else None,
        "interfaces": {
            name: [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addrs in psutil.net_if_addrs().items()
        },
        "devices": devices,
        "npu_smi": _run([npu_smi, "info"]) if npu_smi else None,
        "npu_board": _run([npu_smi, "info", "-t", "board", "-i", "0"]) if npu_smi and devices else None,
        "device_ips": {i: _run([hccn, "-i", str(i), "-ip", "-g"]) for i in devices} if hccn else None,
    }


def findings(facts: dict, job_env: Mapping[str, str], npu_nodes: int) -> Report:
    """The report rows and problems of one node's :func:`node_facts`.

    Args:
        job_env: the HCCL variables a job sends its workers (they override the node's own).
        npu_nodes: how many nodes of the cluster have NPUs (device NICs matter from 2).
    """
    rows, problems = [("host", facts["host"])], []
    for found in (
        versions(facts["torch"], facts["torch_npu"], facts["env"], facts["cann_home"], facts["cann_version"],
                 bool(facts["devices"])),
        chips(facts["npu_smi"], facts["npu_board"]),
        hccl(facts["env"], job_env, facts["interfaces"]),
        device_nics(facts["device_ips"], npu_nodes > 1),
    ):  # fmt: skip
        rows += found[0]
        problems += found[1]
    return rows, problems


def versions(
    torch: str | None, torch_npu: str | None, env: Mapping[str, str], home: str | None, cann: str | None, npus: bool
) -> Report:
    """torch, torch_npu and CANN against :data:`RELEASES`: torch_npu X.Y.Z needs torch X.Y.Z, and the CANN it was
    released with; torch_npu without CANN breaks ``import torch``. ``npus``: the node has NPU device files."""
    rows = [
        ("torch", torch or "not installed"),
        ("torch_npu", torch_npu or "not installed"),
        ("CANN", f"{cann or 'version file not found'} ({home})" if home else "not found"),
    ]
    problems = []
    if torch_npu is None:
        if npus:
            problems.append(
                "this node has NPUs (/dev/davinci*) but torch_npu is not installed: install the torch_npu release "
                "built for its torch and CANN (docs/ascend.md#versions), after sourcing CANN's set_env.sh"
            )
        return rows, problems
    torch_needed, cann_needed = RELEASES.get(torch_npu, (release(torch_npu), None))
    if torch is None or release(torch) != torch_needed:
        problems.append(
            f"torch_npu {torch_npu} is built for torch {torch_needed}, and this node has torch {torch or 'missing'}: "
            f"pip install 'torch=={torch_needed}', or the torch_npu release for your torch (docs/ascend.md#versions)"
        )
    wanted = f"CANN {cann_needed}" if cann_needed else "the CANN it was released with"
    if home is None:
        problems.append(
            f"torch_npu {torch_npu} is installed but this node has no CANN toolkit ({' and '.join(HOME_VARS)} "
            f"unset, nothing at {' or '.join(map(str, CANN_DEFAULTS))}), so `import torch` fails here (torch loads "
            f"torch_npu, which needs CANN's libraries): install {wanted} and source its set_env.sh before "
            "`ray start`, or uninstall torch_npu"
        )
    elif not any(env.get(k) for k in HOME_VARS):
        problems.append(
            f"CANN is installed at {home} but its set_env.sh was not sourced where Ray started on this node "
            f"({HOME_VARS[0]} is unset): source it (/usr/local/Ascend/ascend-toolkit/set_env.sh or "
            "/usr/local/Ascend/cann/set_env.sh) and restart Ray here"
        )
    elif cann_needed and cann and _series(cann) != _series(cann_needed):
        problems.append(
            f"torch_npu {torch_npu} is released for CANN {cann_needed} (Ascend's version table), and this node has "
            f"CANN {cann}: install the torch_npu release for CANN {cann}, or {wanted} (docs/ascend.md#versions)"
        )
    if cann_needed is None:
        rows.append(("torch_npu's CANN", f"{torch_npu} is not in raylora's table: see docs/ascend.md#versions"))
    return rows, problems


def chips(npu_smi: Outcome | None, board: Outcome | None) -> Report:
    """Driver version, chips and their health from ``npu-smi info``; firmware from ``npu-smi info -t board -i 0``."""
    if npu_smi is None:
        return [("npu-smi", "not found")], []
    code, out = npu_smi
    if code != 0:
        first = out.strip().splitlines()[0] if out.strip() else "no output"
        return [("npu-smi", f"failed (exit {code})")], [
            f"`npu-smi info` failed (exit {code}: {first}): the NPU driver is not loaded, or this user cannot open "
            "/dev/davinci*; check the driver and firmware install"
        ]
    driver = re.search(r"Version:\s*(\S+)", out)
    firmware = re.search(r"Firmware Version\s*:\s*(\S+)", board[1]) if board and board[0] == 0 else None
    # a chip's first line: "| 0     910B2     | OK     | ..."; its name holds a letter (the process table's do not)
    found = re.findall(r"^\|\s*(\d+)\s+([0-9A-Za-z_-]*[A-Za-z][0-9A-Za-z_-]*)\s+\|\s*([A-Za-z]+)\s+\|", out, re.M)
    rows = [
        ("NPU driver", driver.group(1) if driver else "not in npu-smi's output"),
        ("NPU firmware", firmware.group(1) if firmware else "not read"),
        ("NPUs", ", ".join(f"{i} {name} {health}" for i, name, health in found) or "none listed"),
    ]
    problems = [
        f"NPU {i} ({name}) reports health {health} in `npu-smi info`: fix or leave out that card before training"
        for i, name, health in found
        if health != "OK"
    ]
    return rows, problems


def hccl(node_env: Mapping[str, str], job_env: Mapping[str, str], interfaces: Mapping[str, list[str]]) -> Report:
    """The HCCL variables in effect for a job's workers (the job's over the node's) and whether
    ``HCCL_CONNECT_TIMEOUT`` is valid and ``HCCL_IF_IP`` / ``HCCL_SOCKET_IFNAME`` name an address / NIC of this node.

    Args:
        interfaces: NIC name -> its addresses (``psutil.net_if_addrs()``).
    """
    effect = {k: (v, "this node's environment") for k, v in node_env.items() if k.startswith("HCCL_")}
    effect |= {k: (v, "the job's backend.hccl") for k, v in job_env.items()}
    rows = [(k, f"{v} (from {where})") for k, (v, where) in sorted(effect.items())]
    problems = []

    def fix(var: str, key: str) -> str:
        where = effect[var][1]
        return f"set backend.hccl.{key}" if where.startswith("the job") else f"change {var} where Ray starts here"

    listed = ", ".join(f"{name} {' '.join(a) or '(no address)'}" for name, a in sorted(interfaces.items()))
    if "HCCL_CONNECT_TIMEOUT" in effect and (why := connect_timeout_problem(effect["HCCL_CONNECT_TIMEOUT"][0])):
        problems.append(f"{why}: {fix('HCCL_CONNECT_TIMEOUT', 'connect_timeout')}")
    if "HCCL_IF_IP" in effect:
        ip = effect["HCCL_IF_IP"][0]
        if not any(ip in addresses for addresses in interfaces.values()):
            problems.append(
                f"HCCL_IF_IP={ip} is no address of this node ({listed}): HCCL cannot reach the root rank through it; "
                f"{fix('HCCL_IF_IP', 'if_ip')} to this node's own address (it differs per node), or unset it"
            )
    if "HCCL_SOCKET_IFNAME" in effect:
        value = effect["HCCL_SOCKET_IFNAME"][0]
        if not [name for name in socket_ifname_matches(value, interfaces) if interfaces[name]]:
            problems.append(
                f"HCCL_SOCKET_IFNAME={value} selects no network interface with an address on this node ({listed}): "
                f"HCCL would find no NIC to connect through; {fix('HCCL_SOCKET_IFNAME', 'socket_ifname')} to the "
                "prefix of the NIC the nodes reach each other on (openEuler and Ubuntu hosts name them enp*, eno*, "
                "bond*), or leave it unset for HCCL to pick"
            )
    return rows, problems


def socket_ifname_matches(value: str, interfaces: Mapping[str, list[str]]) -> list[str]:
    """The interfaces ``HCCL_SOCKET_IFNAME=value`` lets HCCL use, as CANN documents its forms: ``eth,enp`` (NICs
    whose names start so), ``=eth0,enp0`` (exactly these), ``^eth`` (all but those starting so), ``^=eth0`` (all but
    these)."""
    exclude = value.startswith("^")
    value = value.removeprefix("^")
    exact = value.startswith("=")
    names = [n for n in value.removeprefix("=").split(",") if n]

    def named(nic: str) -> bool:
        return any(nic == n if exact else nic.startswith(n) for n in names)

    return [nic for nic in interfaces if named(nic) != exclude]


def connect_timeout_problem(value: str) -> str | None:
    """Why ``HCCL_CONNECT_TIMEOUT=value`` is not one CANN accepts (whole seconds, 120-7200); ``None`` if it is."""
    low, high = CONNECT_TIMEOUT_RANGE
    if not value.strip().isdigit() or not low <= int(value) <= high:
        return f"HCCL_CONNECT_TIMEOUT={value} is not a whole number of seconds from {low} to {high}, as CANN requires"
    return None


def device_nics(device_ips: Mapping[int, Outcome] | None, several_nodes: bool) -> Report:
    """Each NPU's own NIC address (``hccn_tool -i N -ip -g``), through which HCCL reaches the NPUs of other nodes;
    a card without one is a problem once the job spans ``several_nodes``."""
    if device_ips is None:
        return [("hccn_tool", "not found")], []
    rows, missing = [], []
    for index, (code, out) in sorted(device_ips.items()):
        ip = re.search(r"ipaddr:\s*(\S+)", out) if code == 0 else None
        rows.append((f"NPU {index} NIC", ip.group(1) if ip else "no address"))
        if ip is None:
            missing.append(str(index))
    if missing and several_nodes:
        return rows, [
            f"NPU(s) {', '.join(missing)} have no NIC address (`hccn_tool -i N -ip -g`), and HCCL reaches the NPUs of "
            "other nodes through them: configure them with hccn_tool as the server's network guide describes"
        ]
    return rows, []


def cann_home(env: Mapping[str, str]) -> str | None:
    """The CANN toolkit folder: the one set_env.sh exported in ``env``, else a default install that exists."""
    for var in HOME_VARS:
        if env.get(var):
            return env[var]
    return next((str(p) for p in CANN_DEFAULTS if p.exists()), None)


def cann_version(home: Path) -> str | None:
    """CANN's version from ``<home>/<arch>-linux/ascend_toolkit_install.info`` (its ``version=`` line, as torch_npu's
    own ``collect_env`` reads it); ``None`` where there is no such file."""
    for info in sorted(home.glob("*-linux/ascend_toolkit_install.info")):
        for line in info.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "version" and value.strip():
                return value.strip()
    return None


def release(version: str) -> str:
    """``X.Y.Z`` of a version string (``2.6.0.post3`` -> ``2.6.0``, ``2.6.0+cpu`` -> ``2.6.0``)."""
    found = re.match(r"\d+\.\d+\.\d+", version)
    return found.group() if found else version


def _series(cann: str) -> str:
    """A CANN release without its build suffix (``8.0.RC2.beta1`` -> ``8.0.RC2``)."""
    return ".".join(cann.split(".")[:3])


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(args: list[str]) -> Outcome:
    """``args``' exit status and output (stdout, then stderr); a tool that hangs or cannot start is a failure."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, str(e)
    return done.returncode, done.stdout + done.stderr
