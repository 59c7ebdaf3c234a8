import ctypes
import datetime
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from raylora.backends import Backend, BackendError, cpu, cuda, npu, resolve_backend, store_timeout_s
from raylora.config import BackendArgs, HcclArgs

# the HCCL variables CANN documents that raylora may set (HCCL_ALGO is real but must stay unset)
DOCUMENTED = {"HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE", "HCCL_IF_IP", "HCCL_SOCKET_IFNAME"}


@pytest.fixture
def fake_npu(monkeypatch):
    """An NPU host as far as everything but the device itself can tell."""

    def set_soc(soc, bf16_supported=None):
        monkeypatch.setattr(npu, "probe", lambda: (True, f"torch_npu with 8 NPU(s), {soc}"))
        monkeypatch.setattr(npu, "soc_name", lambda: soc)
        fake = types.SimpleNamespace()  # torch.npu as torch_npu makes it; older releases lack is_bf16_supported
        if bf16_supported is not None:
            fake.is_bf16_supported = lambda: bf16_supported
        monkeypatch.setattr(torch, "npu", fake, raising=False)

    return set_soc


def test_cpu_is_chosen_when_nothing_else_is_present(monkeypatch):
    for name in cpu.PRIMITIVE_CACHES:
        monkeypatch.delenv(name, raising=False)
    b = resolve_backend(BackendArgs())
    fast, _ = cpu.bf16_is_fast()
    assert (b.name, b.dist_backend, b.ray_resource, b.amp_dtype, b.needs_grad_scaler) == (
        "cpu",
        "gloo",
        "CPU",
        torch.bfloat16 if fast else None,
        False,
    )
    assert b.detected_by.startswith("auto:") and "torch_npu is not installed" in b.detected_by
    assert b.torch_device() == torch.device("cpu")
    assert b.scaling(2) == {"num_workers": 2, "use_gpu": False, "resources_per_worker": {"CPU": 1.0}}
    assert b.env == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "256"}
    assert b.visible_devices_env is None
    assert b.peak_memory_mb() > 10


def test_cpu_workers_bound_onednn_primitive_caches_unless_the_environment_does(monkeypatch):
    """bench/preference.py: oneDNN's and ideep's caches of 1,024 primitives each grew a DPO worker 30 MB a step."""
    from raylora.backends import planned_backend, worker_plan

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    wanted = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "64"}
    assert planned_backend(BackendArgs(device="cpu")).env == wanted
    assert worker_plan(BackendArgs(device="cpu"), 2, 1.0)[2] == wanted
    assert resolve_backend(BackendArgs(device="cpu")).env == wanted


def _resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(getattr(ctypes.CDLL(None), "malloc_trim", None) is None, reason="glibc's heap only")
def test_a_cpu_step_hands_freed_heap_pages_back():
    """Freed blocks inside the heap (below a block still in use) stay resident until trimmed."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 * 1024, 3200  # 200 MB in blocks glibc serves from its heap (below its mmap threshold)
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks[:-1]:
        libc.free(b)
    before = _resident_mb()
    resolve_backend(BackendArgs(device="cpu")).release_freed_memory()
    after = _resident_mb()
    libc.free(blocks[-1])
    assert before - after > 150, (before, after)


def test_cpu_precision_can_be_chosen():
    assert resolve_backend(BackendArgs(device="cpu", precision="bf16")).amp_dtype is torch.bfloat16
    b = resolve_backend(BackendArgs(device="cpu", precision="fp16"))
    assert (b.amp_dtype, b.needs_grad_scaler) == (torch.float16, True)


@pytest.fixture
def cpu_probe(monkeypatch, tmp_path):
    """A CPU with the given /proc/cpuinfo flags and GEMM speeds (GFLOP/s per dtype); the probe cache cleared."""

    def set_cpu(flags, gflops):
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: {' '.join(flags)}\n" if flags is not None else "")
        monkeypatch.setattr(cpu, "CPUINFO", info if flags is not None else tmp_path / "absent")
        timed = []

        def fake_gemm(dtypes, size=1024, repeats=8):
            timed.extend(dtypes)
            return [gflops[d] for d in dtypes]

        monkeypatch.setattr(cpu, "gemm_gflops", fake_gemm)
        cpu.bf16_is_fast.cache_clear()
        return timed

    yield set_cpu
    cpu.bf16_is_fast.cache_clear()


@pytest.mark.parametrize(
    "flags,gflops,dtype,timed",
    [
        (["fpu", "avx512f", "avx512_bf16"], {torch.float32: 215, torch.bfloat16: 900}, torch.bfloat16, True),
        (["fpu", "amx_bf16", "amx_tile"], {torch.float32: 200, torch.bfloat16: 1800}, torch.bfloat16, True),
        (["fpu", "avx512_bf16"], {torch.float32: 200, torch.bfloat16: 250}, None, True),  # flags, but slow units
        (["fpu", "avx2", "fma"], {torch.float32: 200, torch.bfloat16: 900}, None, False),  # no flags: not even timed
        (None, {torch.float32: 100, torch.bfloat16: 400}, torch.bfloat16, True),  # no cpuinfo (macOS): timed
    ],
)
def test_cpu_auto_precision_is_probed(cpu_probe, flags, gflops, dtype, timed):
    calls = cpu_probe(flags, gflops)
    b = resolve_backend(BackendArgs(device="cpu"))
    assert b.amp_dtype is dtype and not b.needs_grad_scaler
    assert bool(calls) is timed
    assert b.precision_by.startswith(f"auto: {b.precision} (")
    if timed:
        assert f"bf16 {gflops[torch.bfloat16]} vs fp32 {gflops[torch.float32]} GFLOP/s" in b.precision_by
    assert resolve_backend(BackendArgs(device="cpu", precision="fp32")).amp_dtype is None


def test_the_gemm_probe_measures_something():
    fp32, bf16 = cpu.gemm_gflops((torch.float32, torch.bfloat16), size=128, repeats=2)
    assert fp32 > 0 and bf16 > 0 and all(map(math.isfinite, (fp32, bf16)))


def test_npu_asked_for_without_torch_npu_says_how_to_install():
    with pytest.raises(BackendError) as err:
        resolve_backend(BackendArgs(device="npu"))
    message = str(err.value)
    assert "torch_npu is not installed" in message
    assert "pip install 'raylora[npu]'" in message and "set_env.sh" in message


def test_cuda_asked_for_without_gpu_is_refused():
    with pytest.raises(BackendError, match="sees no CUDA device"):
        resolve_backend(BackendArgs(device="cuda"))


def test_auto_prefers_npu(fake_npu):
    fake_npu("Ascend910B2")
    b = resolve_backend(BackendArgs())
    assert (b.name, b.dist_backend, b.ray_resource, b.visible_devices_env) == (
        "npu",
        "hccl",
        "NPU",
        "ASCEND_RT_VISIBLE_DEVICES",
    )
    assert "Ascend910B2" in b.detected_by
    assert b.scaling(8, cpus_per_worker=2) == {
        "num_workers": 8,
        "use_gpu": False,
        "resources_per_worker": {"CPU": 2, "NPU": 1},
    }


@pytest.mark.parametrize(
    "soc,dtype,scaler",
    [
        ("Ascend910B1", torch.bfloat16, False),
        ("Ascend910B4", torch.bfloat16, False),
        ("Ascend910_9391", torch.bfloat16, False),
        ("Ascend910A", torch.float16, True),
        ("Ascend910ProA", torch.float16, True),
        ("Ascend910B", torch.float16, True),  # the older 910-class SoC named exactly so, not an Atlas A2
        ("Ascend310P3", torch.float16, True),
    ],
)
def test_npu_autocast_follows_the_soc_where_torch_npu_cannot_say(fake_npu, soc, dtype, scaler):
    fake_npu(soc)
    b = resolve_backend(BackendArgs(device="npu"))
    assert (b.amp_dtype, b.needs_grad_scaler) == (dtype, scaler)
    assert b.precision_by.startswith(f"auto: {b.precision} ({soc} is")
    assert b.precision_by.endswith("Atlas A2 or later, by its name)")


@pytest.mark.parametrize("supported,dtype", [(True, torch.bfloat16), (False, torch.float16)])
def test_npu_autocast_asks_torch_npu_first(fake_npu, supported, dtype):
    fake_npu("Ascend910B2", bf16_supported=supported)  # torch_npu's answer wins over the SoC's name
    b = resolve_backend(BackendArgs(device="npu"))
    assert b.amp_dtype is dtype
    assert b.precision_by == f"auto: {b.precision} (torch.npu.is_bf16_supported() is {supported} on Ascend910B2)"


def test_bf16_on_910a_is_refused(fake_npu):
    fake_npu("Ascend910A")
    with pytest.raises(BackendError, match="Ascend910A has no bf16.*backend.precision=fp16"):
        resolve_backend(BackendArgs(device="npu", precision="bf16"))


def test_hccl_env_holds_only_documented_variables(fake_npu):
    fake_npu("Ascend910B3")
    args = BackendArgs(
        device="npu", hccl=HcclArgs(connect_timeout=600, buffsize=400, if_ip="10.0.0.2", exec_timeout=1200)
    )
    env = resolve_backend(args).env
    assert env == {
        "HCCL_CONNECT_TIMEOUT": "600",
        "HCCL_EXEC_TIMEOUT": "1200",
        "HCCL_BUFFSIZE": "400",
        "HCCL_IF_IP": "10.0.0.2",
    }
    assert npu.hccl_env(BackendArgs()) == {"HCCL_CONNECT_TIMEOUT": "1800"}
    assert set(env) <= DOCUMENTED


def test_hccl_variables_the_config_leaves_unset_are_left_to_the_environment(monkeypatch):
    """Review: raylora's default connect timeout overrode the one the environment set."""
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "900")
    monkeypatch.setenv("HCCL_IF_IP", "10.0.0.7")  # a node's own: never sent from here unless the config sets it
    assert npu.hccl_env(BackendArgs(hccl=HcclArgs(buffsize=400))) == {
        "HCCL_CONNECT_TIMEOUT": "900",
        "HCCL_BUFFSIZE": "400",
    }
    explicit = BackendArgs(hccl=HcclArgs(connect_timeout=600, if_ip="10.0.0.2"))  # what the config sets wins
    assert npu.hccl_env(explicit) == {"HCCL_CONNECT_TIMEOUT": "600", "HCCL_IF_IP": "10.0.0.2"}


@pytest.mark.parametrize("value", ["30m", "60", "9000"])
def test_a_connect_timeout_cann_refuses_in_the_environment_is_refused(monkeypatch, value):
    """Review, issue #40: HCCL_CONNECT_TIMEOUT from the environment was passed to every worker unchecked."""
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", value)
    with pytest.raises(BackendError, match=f"HCCL_CONNECT_TIMEOUT={value} is not a whole number of seconds from 120"):
        npu.hccl_env(BackendArgs())
    assert npu.hccl_env(BackendArgs(hccl=HcclArgs(connect_timeout=600))) == {"HCCL_CONNECT_TIMEOUT": "600"}
    with pytest.raises(BackendError, match="HCCL_CONNECT_TIMEOUT"):
        store_timeout_s({"HCCL_CONNECT_TIMEOUT": value})


@pytest.mark.parametrize(
    "soc,timeout,refused",
    [
        ("Ascend910A", 0, True),  # 0 means "never" on Atlas A2 and later only
        ("Ascend910ProB", 17341, True),
        ("Ascend310P3", 0, True),
        ("Ascend910A", 1800, False),
        ("Ascend910B3", 0, False),
        ("Ascend910_9391", 2147483647, False),
    ],
)
def test_exec_timeout_is_held_to_the_soc_s_range(fake_npu, soc, timeout, refused):
    fake_npu(soc)
    args = BackendArgs(device="npu", precision="fp16", hccl=HcclArgs(exec_timeout=timeout))
    if refused:
        with pytest.raises(BackendError, match=f"exec_timeout={timeout}: on {soc} .* from 1 to 17340 s"):
            resolve_backend(args)
    else:
        assert resolve_backend(args).env["HCCL_EXEC_TIMEOUT"] == str(timeout)


def test_torch_npu_without_cann_is_reported_as_that_mismatch(monkeypatch, tmp_path):
    """Issue #40: the probe said 'is CANN's set_env.sh sourced?' where CANN is missing altogether."""
    from raylora.backends import ascend_env

    monkeypatch.setattr(npu.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(npu.importlib.metadata, "version", lambda name: "2.6.0.post3")

    def broken(name):
        raise RuntimeError("Failed to load the backend extension: torch_npu")

    monkeypatch.setattr(npu.importlib, "import_module", broken)
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    monkeypatch.setattr(ascend_env, "CANN_DEFAULTS", (tmp_path / "absent",))
    ok, how = npu.probe()
    assert not ok and "no CANN toolkit was found: torch_npu 2.6.0.post3 needs CANN 8.3.RC1" in how
    assert "sourced" not in how


def test_the_grouped_sweep_s_process_group_loads_torch_npu_before_hccl(monkeypatch):
    """Issue #40: init_process_group("hccl") worked only while torch_npu auto-loaded with torch."""
    import raylora.backends as backends

    calls = []
    monkeypatch.setattr(npu.importlib, "import_module", lambda name: calls.append(("import", name)))
    monkeypatch.setattr(backends.dist, "init_process_group", lambda *a, **kw: calls.append(("init", a, kw)))
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "3600")
    backends.init_process_group("hccl", "file:///tmp/store", 1, 4)
    timeout = datetime.timedelta(seconds=3620)
    assert calls == [
        ("import", "torch_npu"),
        ("init", ("hccl",), {"init_method": "file:///tmp/store", "rank": 1, "world_size": 4, "timeout": timeout}),
    ]
    calls.clear()
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT")
    backends.init_process_group("gloo", "file:///tmp/store", 0, 2)
    assert calls == [("init", ("gloo",), {"init_method": "file:///tmp/store", "rank": 0, "world_size": 2,
                                          "timeout": datetime.timedelta(seconds=1800)})]  # fmt: skip

    def broken(name):
        raise ImportError("libhccl.so: cannot open shared object file")

    monkeypatch.setattr(npu.importlib, "import_module", broken)
    with pytest.raises(BackendError, match="HCCL needs torch_npu, which does not import .*libhccl.so"):
        backends.init_process_group("hccl", "file:///tmp/store", 0, 2)


def test_every_grad_scaler_comes_from_the_backend():
    """Issue #40: torch_npu's own scaler (which clears the chip's overflow flag) only reaches the training loops if no
    module makes its own GradScaler."""
    package = Path(__file__).resolve().parents[2] / "raylora"
    makers = [str(f.relative_to(package)) for f in package.rglob("*.py") if "GradScaler(" in f.read_text()]
    assert sorted(makers) == ["backends/base.py", "backends/npu.py"]
    users = [str(f.relative_to(package)) for f in package.rglob("*.py") if ".grad_scaler()" in f.read_text()]
    assert sorted(users) == ["train/group.py", "train/loop.py", "train/quickstart.py"]


def test_compile_on_npu_is_warned_of():
    from raylora.backends import planned_backend

    assert "TorchAir" in planned_backend(BackendArgs(device="npu")).compile_warning()
    assert "beta" in planned_backend(BackendArgs(device="npu")).compile_warning()
    assert planned_backend(BackendArgs(device="cpu")).compile_warning() is None


def test_an_accelerator_workers_device_is_the_one_ray_assigned(monkeypatch):
    """Review: every worker took index local_rank, but an NPU worker sees only its own card (index 0)."""
    import ray
    import ray.train.torch

    cuda = Backend("cuda", "test", "nccl", "GPU", "CUDA_VISIBLE_DEVICES", torch.bfloat16, False)
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert cuda.torch_device() == torch.device("cuda", 0)  # outside Ray
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert cuda.torch_device() == torch.device("cuda", 0)  # a plain actor (Serve replica): Ray Train's call refuses
    monkeypatch.setattr(ray.train.torch, "get_device", lambda: torch.device("cuda", 3))
    assert cuda.torch_device() == torch.device("cuda", 3)
    assert made_current == [torch.device("cuda", 0)] * 2 + [torch.device("cuda", 3)]


def test_a_broken_torch_npu_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(npu.importlib.util, "find_spec", lambda name: object())

    def broken(name):
        raise OSError("libhccl.so: cannot open shared object file")

    monkeypatch.setattr(npu.importlib, "import_module", broken)
    ok, how = npu.probe()
    assert not ok and "libhccl.so" in how and "set_env.sh" in how


def test_cuda_backend_shape(monkeypatch):
    monkeypatch.setattr(cuda, "probe", lambda: (True, "fake"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: including_emulation)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    b = resolve_backend(BackendArgs())
    assert (b.name, b.dist_backend, b.ray_resource, b.visible_devices_env) == (
        "cuda",
        "nccl",
        "GPU",
        "CUDA_VISIBLE_DEVICES",
    )
    assert (b.amp_dtype, b.needs_grad_scaler) == (torch.float16, True)
    assert b.precision_by == "auto: fp16 (torch.cuda.is_bf16_supported(including_emulation=False) is False)"
    resources = {"CPU": 2, "GPU": 1}  # train.cpus_per_worker holds on GPUs too (it was dropped: 1 CPU each)
    assert b.scaling(4, cpus_per_worker=2) == {"num_workers": 4, "use_gpu": True, "resources_per_worker": resources}
    assert b.collective_problem(torch.bfloat16) is None and b.ddp_device_ids(torch.device("cuda", 3)) == [3]


def test_collectives_without_bf16_say_why(fake_npu, monkeypatch):
    assert resolve_backend(BackendArgs(device="cpu")).collective_problem(torch.bfloat16) is None  # gloo reduces bf16
    fake_npu("Ascend910A")
    problem = resolve_backend(BackendArgs(device="npu")).collective_problem(torch.bfloat16)
    assert "Atlas A2" in problem and "Ascend910A" in problem
    assert resolve_backend(BackendArgs(device="npu")).collective_problem(torch.float16) is None
    fake_npu("Ascend910B3")
    assert resolve_backend(BackendArgs(device="npu")).collective_problem(torch.bfloat16) is None
    monkeypatch.setattr(cuda, "probe", lambda: (True, "fake"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 7, 8))
    assert "NCCL 2.7.8" in resolve_backend(BackendArgs(device="cuda")).collective_problem(torch.bfloat16)


def test_the_planned_backend_needs_no_device_and_leaves_the_soc_check_to_the_worker():
    from raylora.backends import planned_backend, worker_plan

    plan = planned_backend(BackendArgs(device="npu", hccl=HcclArgs(buffsize=400)))
    assert (plan.name, plan.detected_by, plan.dist_backend, plan.ray_resource) == ("npu", "planned", "hccl", "NPU")
    assert plan.env == {"HCCL_CONNECT_TIMEOUT": "1800", "HCCL_BUFFSIZE": "400"}
    assert plan.collective_problem(torch.bfloat16) is None
    assert worker_plan(BackendArgs(device="npu"), 2, 4.0) == (
        "hccl", {"num_workers": 2, "use_gpu": False, "resources_per_worker": {"CPU": 4.0, "NPU": 1}},
        {"HCCL_CONNECT_TIMEOUT": "1800"},
    )  # fmt: skip


def test_doctor_rows_come_from_the_backend(fake_npu, monkeypatch):
    rows = dict(resolve_backend(BackendArgs(device="cpu")).describe(2))
    assert rows["dist backend"] == "gloo" and rows["ray worker resources"] == "{'CPU': 1.0}"
    assert not any(k.startswith("HCCL_") for k in rows)
    fake_npu("Ascend910B3")
    monkeypatch.setenv("HCCL_IF_IP", "10.0.0.9")
    rows = dict(resolve_backend(BackendArgs(device="npu")).describe(8))
    assert rows["device"].startswith("npu (asked for: torch_npu with 8 NPU(s), Ascend910B3")
    assert rows["ray worker resources"] == "{'CPU': 1.0, 'NPU': 1}"
    assert rows["HCCL_IF_IP"] == "10.0.0.9" and rows["HCCL_CONNECT_TIMEOUT"] == "1800"
    assert [k for k, _ in npu.install_rows()] == ["torch_npu", "CANN"]


def test_vllm_placement_follows_the_device():
    from raylora.backends import planned_backend

    gpu = planned_backend(BackendArgs(device="cuda")).vllm_placement(2, 4.0)
    assert gpu["placement_group_config"] == {"bundles": [{"GPU": 1}]} and "accelerator_config" not in gpu
    npu_plan = planned_backend(BackendArgs(device="npu")).vllm_placement(2, 4.0)
    assert npu_plan["deployment_config"]["ray_actor_options"] == {"num_cpus": 4.0, "resources": {"NPU": 1}}
    assert npu_plan["accelerator_config"] == {"kind": "cpu"}
    assert planned_backend(BackendArgs(device="cpu")).vllm_problem().startswith("serve.engine=vllm needs")
    assert planned_backend(BackendArgs(device="cuda")).vllm_problem() is None


def test_probe_order_is_npu_cuda_cpu():
    from raylora.backends import PROBE_ORDER

    assert [m.NAME for m in PROBE_ORDER] == ["npu", "cuda", "cpu"]
    assert cpu.probe()[0] is True


def test_importing_raylora_never_imports_torch_npu():
    code = (
        "import sys, raylora.backends, raylora.models, raylora.cli, raylora.doctor\n"
        "from raylora.config import BackendArgs\n"
        "raylora.backends.resolve_backend(BackendArgs())\n"
        "assert 'torch_npu' not in sys.modules and 'torchair' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_profiler_wrapper_same_schedule_on_npu(fake_npu, monkeypatch, tmp_path):
    """On NPU the wrapper builds torch_npu.profiler's profile with the schedule torch.profiler gets elsewhere."""
    import types

    from raylora.backends.base import PROFILE_SCHEDULE

    made = {}
    fake = types.SimpleNamespace(
        ProfilerActivity=types.SimpleNamespace(CPU="cpu-activity", NPU="npu-activity"),
        schedule=lambda **kw: ("schedule", kw),
        tensorboard_trace_handler=lambda folder: ("handler", folder),
        profile=lambda **kw: made.update(kw) or "npu-profiler",
    )
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(profiler=fake))
    fake_npu("Ascend910B2")
    assert resolve_backend(BackendArgs()).profiler(tmp_path / "p") == "npu-profiler"
    assert made["activities"] == ["cpu-activity", "npu-activity"]
    assert made["schedule"] == ("schedule", PROFILE_SCHEDULE)
    assert made["on_trace_ready"] == ("handler", str(tmp_path / "p"))


def test_cpu_profiler_writes_trace_and_top_operators(tmp_path):
    prof = resolve_backend(BackendArgs(device="cpu")).profiler(tmp_path / "p")
    a = torch.randn(64, 64)
    with prof:
        for _ in range(6):
            (a @ a).sum()
            prof.step()
    assert (tmp_path / "p" / "trace.json").stat().st_size > 0
    assert "aten::mm" in (tmp_path / "p" / "top_operators.txt").read_text()


def test_compile_backend_is_torchair_on_npu(fake_npu, monkeypatch):
    import types

    fake = types.SimpleNamespace(
        CompilerConfig=lambda: "config", get_npu_backend=lambda compiler_config: ("ge", compiler_config)
    )
    monkeypatch.setitem(sys.modules, "torchair", fake)
    fake_npu("Ascend910B2")
    assert resolve_backend(BackendArgs()).compile_backend() == ("ge", "config")
    assert resolve_backend(BackendArgs(device="cpu")).compile_backend() == "inductor"


def test_a_hook_the_collectives_cannot_carry_is_refused_before_any_worker_starts(fake_npu, monkeypatch):
    from raylora.comm.hooks import check_hook
    from raylora.config import ConfigError, JobConfig, TrainArgs
    from raylora.train import fit as fit_module

    fake_npu("Ascend910A")
    with pytest.raises(BackendError, match=r"train.comm_hook=bf16 .* hccl .*Atlas A2.*Ascend910A.*comm_hook=fp16"):
        check_hook(TrainArgs(comm_hook="bf16"), resolve_backend(BackendArgs(device="npu")))
    check_hook(TrainArgs(comm_hook="fp16"), resolve_backend(BackendArgs(device="npu")))
    cfg = JobConfig()
    cfg.train.comm_hook, cfg.train.num_workers = "bf16", 2
    monkeypatch.setattr(fit_module, "ensure_ray", lambda: pytest.fail("the cluster was touched"))
    with pytest.raises(ConfigError, match="backend.device: train.comm_hook=bf16"):  # listed with the empty sources
        fit_module.fit(cfg)


def _backend(name, amp, scaler):
    return Backend(name, "test", "gloo", name.upper(), None, amp, scaler)


def test_autocast_comes_from_the_backend_and_is_off_in_fp32():
    with _backend("cpu", torch.bfloat16, False).autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with _backend("cpu", None, False).autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_grad_scaler_is_torch_npus_own_on_an_fp16_npu_and_torchs_elsewhere(monkeypatch):
    class NpuScaler(torch.amp.GradScaler):
        def __init__(self, enabled):
            self.made_with = enabled

    amp = type(sys)("torch_npu.npu.amp")
    amp.GradScaler = NpuScaler
    for name, module in {"torch_npu": type(sys)("torch_npu"), "torch_npu.npu": type(sys)("torch_npu.npu"),
                         "torch_npu.npu.amp": amp}.items():  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    scaler = _backend("npu", torch.float16, True).grad_scaler()
    assert isinstance(scaler, NpuScaler) and scaler.made_with is True
    cpu_scaler = _backend("cpu", torch.bfloat16, False).grad_scaler()
    assert type(cpu_scaler) is torch.amp.GradScaler and not cpu_scaler.is_enabled()


def test_the_ranks_store_waits_as_long_as_hccl_may_take_to_connect():
    assert store_timeout_s({}) == 1800  # Ray's default
    assert store_timeout_s({"HCCL_CONNECT_TIMEOUT": "3600"}) == 3620  # HCCL waits 20 s past its timeout
    assert store_timeout_s({"HCCL_CONNECT_TIMEOUT": "7200"}) == 7220
    assert store_timeout_s({"HCCL_CONNECT_TIMEOUT": "600"}) == 1800
