"""Resource detection (local, SLURM, Kubernetes, NVML), run ids, job/run UUIDs, args-derived attributes."""
import sys
import types
from argparse import Namespace


from megatron.core import telemetry as tel
from megatron.core.telemetry.resources import (
    detect_gpu_identity, detect_kubernetes_attributes, detect_resource_attributes, detect_slurm_attributes,
    physical_gpu_index, resolve_run_id, service_instance_id,
)
from megatron.core.telemetry.resources.gpu import reset_nvml_probe
from megatron.training import argument_utils
from telemetry_testutil import clean_telemetry  # noqa: F401


def test_uuid_vectors_from_spec(monkeypatch):
    assert tel.compute_job_uuids({}) == ("d2badfc7-0e4c-537b-b4ea-8785f79f8679", "b19cd435-659e-5816-b7eb-724bc636e47b")
    env = {"SLURM_CLUSTER_NAME": "eos", "SLURM_JOB_ID": "12345", "SLURM_RESTART_COUNT": "2",
           "TORCHELASTIC_RESTART_COUNT": "1"}
    assert tel.compute_job_uuids(env) == ("b65b814f-1489-5070-b0e3-b2b0e6a3f643", "d032fbad-d34b-54bf-93ab-b9892e36bb8f")
    # job_uuid survives a requeue, run_uuid does not
    job, run = tel.compute_job_uuids(env)
    job2, run2 = tel.compute_job_uuids({**env, "SLURM_RESTART_COUNT": "3"})
    assert job2 == job and run2 != run
    # array jobs key on the array job id and ignore SLURM_RESTART_COUNT
    arr = {"SLURM_JOB_ID": "500", "SLURM_ARRAY_JOB_ID": "499", "SLURM_ARRAY_TASK_ID": "1", "SLURM_RESTART_COUNT": "4"}
    import uuid
    assert tel.compute_job_uuids(arr) == (str(uuid.uuid5(uuid.NAMESPACE_URL, "nemo.lens.job/nocluster/499")),
                                          str(uuid.uuid5(uuid.NAMESPACE_URL, "nemo.lens.run/nocluster/499")))
    monkeypatch.setenv("SLURM_JOB_ID", "12345")
    assert tel.compute_job_uuids()[0] == tel.compute_job_uuids({"SLURM_JOB_ID": "12345"})[0]


def test_run_id_rules():
    assert resolve_run_id(" mine ", 8, {"SLURM_JOB_ID": "1"}) == "mine"
    assert resolve_run_id(None, 8, {"SLURM_JOB_ID": "777", "TORCHELASTIC_RUN_ID": "abc"}) == "777"
    a = resolve_run_id(None, 8, {"TORCHELASTIC_RUN_ID": "abc"})
    assert len(a) == 12 and a == resolve_run_id(None, 8, {"TORCHELASTIC_RUN_ID": "abc"})
    env = {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "node1", "MASTER_PORT": "29500", "WORLD_SIZE": "8"}
    b = resolve_run_id(None, 8, env)
    assert len(b) == 12 and b == resolve_run_id(None, 8, dict(env)) != resolve_run_id(None, 8, {**env, "MASTER_PORT": "1"})
    single = {resolve_run_id(None, 1, {}) for _ in range(3)}
    assert len(single) == 3 and all(len(x) == 12 for x in single)
    assert service_instance_id("r", 5) == "r-rank5"


def test_slurm_attributes():
    assert detect_slurm_attributes({"SLURM_JOB_NAME": "x"}) == {}
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "gpt", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2",
           "SLURM_NTASKS": "16", "SLURM_JOB_PARTITION": "batch", "SLURM_CLUSTER_NAME": "eos",
           "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2", "SLURM_RESTART_COUNT": "1", "SLURM_LOCALID": "0"}
    assert detect_slurm_attributes(env) == {
        "slurm.job.id": "42", "slurm.job.name": "gpt", "slurm.nodelist": "n[1-2]", "slurm.nnodes": "2",
        "slurm.ntasks": "16", "slurm.partition": "batch", "slurm.cluster.name": "eos", "slurm.array.job_id": "40",
        "slurm.array.task_id": "2", "slurm.restart_count": "1"}


def test_kubernetes_attributes():
    env = {"K8S_NAMESPACE": "ml", "K8S_POD_NAME": "p-0", "K8S_POD_UID": "u", "K8S_NODE_NAME": "n",
           "K8S_CONTAINER_NAME": "c", "K8S_JOB_NAME": "j"}
    assert detect_kubernetes_attributes(env) == {}
    env["KUBERNETES_SERVICE_HOST"] = "10.0.0.1"
    assert detect_kubernetes_attributes(env) == {
        "k8s.namespace.name": "ml", "k8s.pod.name": "p-0", "k8s.pod.uid": "u", "k8s.node.name": "n",
        "k8s.container.name": "c", "k8s.job.name": "j"}
    assert detect_kubernetes_attributes({"KUBERNETES_SERVICE_HOST": "h", "HOSTNAME": "pod-7"}) == {"k8s.pod.name": "pod-7"}


def test_detect_resource_attributes_with_env(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "h")
    monkeypatch.setenv("K8S_NAMESPACE", "ns")
    monkeypatch.setenv("DEPLOYMENT_ENV", "staging")
    attrs = detect_resource_attributes(probe_gpus=False)
    assert attrs["slurm.job.id"] == "9" and attrs["k8s.namespace.name"] == "ns"
    assert attrs["deployment.environment"] == "staging" and attrs["host.gpu.count"] == 0
    assert isinstance(attrs["process.pid"], int) and attrs["host.name"]


def _fake_pynvml(serial_fails=False):
    calls = []
    mod = types.ModuleType("pynvml")
    mod.nvmlInit = lambda: calls.append("init")
    mod.nvmlShutdown = lambda: calls.append("shutdown")
    mod.nvmlDeviceGetCount = lambda: 8
    mod.nvmlDeviceGetHandleByIndex = lambda i: calls.append(("handle", i)) or i
    mod.nvmlDeviceGetName = lambda h: b"NVIDIA H100"
    mod.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"

    def serial(h):
        if serial_fails:
            raise RuntimeError("not supported")
        return "SN1"

    mod.nvmlDeviceGetSerial = serial
    mod.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=b"00000000:1B:00.0")
    return mod, calls


def test_gpu_identity_with_fake_nvml(monkeypatch):
    mod, calls = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    assert detect_gpu_identity(2) == {"dl.gpu.index": 2, "dl.gpu.name": "NVIDIA H100", "dl.gpu.uuid": "GPU-2",
                                      "dl.gpu.serial": "SN1", "dl.gpu.pci_bus_id": "00000000:1B:00.0"}
    assert calls[0] == "init" and calls[-1] == "shutdown"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert detect_gpu_identity(1)["dl.gpu.index"] == 5
    assert detect_gpu_identity(2) == {}  # out of range
    assert physical_gpu_index(0, {"CUDA_VISIBLE_DEVICES": "GPU-abc"}) is None  # UUID/MIG entries
    mod2, _ = _fake_pynvml(serial_fails=True)
    monkeypatch.setitem(sys.modules, "pynvml", mod2)
    reset_nvml_probe()  # NVML is probed once per process and device: forget the first fake's answers
    assert "dl.gpu.serial" not in detect_gpu_identity(0) and "dl.gpu.uuid" in detect_gpu_identity(0)
    mod2.nvmlInit = lambda: (_ for _ in ()).throw(RuntimeError("no driver"))
    reset_nvml_probe()
    assert detect_gpu_identity(0) == {}


def _args(**kw):
    base = dict(local_rank=1, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=None,
                world_size=8, context_parallel_size=1, global_batch_size=64, seq_length=1024, num_layers=4,
                hidden_size=256, num_attention_heads=8, train_iters=None, micro_batch_size=2, ckpt_format="torch",
                fp16=False, bf16=True, rank=5, otel_enabled=True, otel_service_name=None, otel_span_groups=None)
    base.update(kw)
    return Namespace(**base)


def test_build_telemetry_resource_attrs_order(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml()[0])
    monkeypatch.setenv("SLURM_JOB_ID", "12345")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "eos")
    monkeypatch.setenv("NVRX_CYCLE", "3")
    monkeypatch.setenv("NVRX_INFRA_RANK", "")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    attrs = argument_utils.build_telemetry_resource_attrs(_args())
    assert list(attrs) == [
        "dl.local_rank", "dl.tensor_parallel.size", "dl.pipeline_parallel.size", "dl.data_parallel.size",
        "dl.batch_size", "dl.sequence_length", "megatron.num_layers", "megatron.hidden_size",
        "megatron.num_attention_heads", "megatron.micro_batch_size", "megatron.ckpt_format", "megatron.precision",
        "dl.gpu.index", "dl.gpu.name", "dl.gpu.uuid", "dl.gpu.serial", "dl.gpu.pci_bus_id",
        "slurm.job.id", "slurm.cluster", "nvrx.cycle", "slurm.torchelastic.restart_count",
        "nemo.lens.job_uuid", "nemo.lens.run_uuid"]
    assert attrs["dl.data_parallel.size"] == 2 and attrs["megatron.precision"] == "bf16"
    assert attrs["dl.gpu.index"] == 1 and attrs["nemo.lens.job_uuid"] == "b65b814f-1489-5070-b0e3-b2b0e6a3f643"
    assert argument_utils.build_telemetry_resource_attrs(_args(bf16=False, fp16=True))["megatron.precision"] == "fp16"
    assert argument_utils.build_telemetry_resource_attrs(_args(bf16=False))["megatron.precision"] == "fp32"


def test_worker_bootstrap(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml()[0])
    boot = argument_utils.build_otel_worker_bootstrap(_args(otel_span_groups="per_step,microbatch"))
    assert boot["enabled"] is True and boot["service_name"] == "megatron-lm"
    assert boot["span_groups"] == "checkpoint,evaluate,forward_backward,job,load_checkpoint,model_init,optimizer,step"
    assert boot["resolved_span_groups"] == sorted(tel.MegatronSpanGroup.resolve("per_step,microbatch"))
    assert (boot["rank"], boot["world_size"]) == (5, 8)
    assert boot["resource_attrs"] == argument_utils.build_telemetry_resource_attrs(_args())
    boot = argument_utils.build_otel_worker_bootstrap(_args(otel_enabled=False, otel_span_groups="layer"))
    assert boot["span_groups"] == "default" and boot["resource_attrs"] == {}
    assert argument_utils.build_otel_worker_bootstrap(_args(otel_span_groups="bogus"))["span_groups"] == "per_step"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    assert argument_utils.build_otel_worker_bootstrap(_args())["service_name"] is None
    assert argument_utils.build_otel_worker_bootstrap(_args(otel_service_name="cli"))["service_name"] == "cli"
    import pickle
    pickle.dumps(boot)
