"""--async-save on a rank whose GPU is not cuda:0: the staging thread's device, streams and events (CPU proxy).

CUDA is replaced by a recorder (``torch.cuda.*`` monkeypatched) that logs which thread calls what on which
device and stream; the copies themselves run on the CPU. The real copies on two GPUs are checked by
tests/gpu/test_gpu_async_save.py and the kit's ``async_save_2gpu`` stage.
"""
import threading

import pytest
import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.training import async_checkpointing

RANK_DEVICE = 1  # the GPU of local rank 1


class _Recorder:
    """A stand-in for torch.cuda that logs (thread name, call, details) in call order."""

    def __init__(self):
        self.log = []
        self.lock = threading.Lock()
        self.current_device = {}  # thread ident -> device, as CUDA keeps it per thread (0 when never set)
        recorder = self

        class Stream:
            def __init__(self, device=None, name="side"):
                self.device = recorder.device_of_thread() if device is None else device
                self.name = name
                recorder.add("Stream", self.device, name)

            def wait_event(self, event):
                recorder.add("wait_event", self.device, event.recorded_on)

            def synchronize(self):
                recorder.add("stream_synchronize", self.device, self.name)

        class Event:
            def __init__(self):
                self.recorded_on = None

            def record(self, stream=None):
                stream = stream or Stream(recorder.device_of_thread(), "current")
                self.recorded_on = (stream.device, stream.name)
                recorder.add("event_record", stream.device, stream.name)

            def synchronize(self):
                recorder.add("event_synchronize", *self.recorded_on)

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                recorder.add("stream_enter", self.stream.device, self.stream.name)

            def __exit__(self, *exc):
                recorder.add("stream_exit", self.stream.device, self.stream.name)

        self.Stream, self.Event, self.StreamContext = Stream, Event, StreamContext

    def device_of_thread(self):
        return self.current_device.get(threading.get_ident(), 0)

    def add(self, call, device, detail=None):
        with self.lock:
            self.log.append((threading.current_thread().name, call, device, detail))

    def set_device(self, device):
        self.current_device[threading.get_ident()] = device
        self.add("set_device", device)

    def calls(self, name):
        return [entry for entry in self.log if entry[1] == name]


@pytest.fixture
def fake_cuda(monkeypatch):
    recorder = _Recorder()
    recorder.current_device[threading.get_ident()] = RANK_DEVICE  # the training thread runs on its GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", recorder.device_of_thread)
    monkeypatch.setattr(torch.cuda, "set_device", recorder.set_device)
    monkeypatch.setattr(torch.cuda, "Stream", recorder.Stream)
    monkeypatch.setattr(torch.cuda, "Event", recorder.Event)
    monkeypatch.setattr(torch.cuda, "stream", recorder.StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: recorder.Stream(recorder.device_of_thread() if device is None else device,
                                                            "current"))
    real_empty = torch.empty

    def empty_unpinned(*args, pin_memory=False, **kwargs):  # no pinned allocator without CUDA
        recorder.add("host_buffer", None, pin_memory)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty_unpinned)
    monkeypatch.setattr(async_checkpointing, "_HOST_BUFFERS", {})
    return recorder


def test_staging_thread_copies_on_the_ranks_device_and_waits_on_its_copy_stream(fake_cuda, monkeypatch, tmp_path):
    saved = {}

    def record_save(staged, checkpoint_dir, process_group=None):
        fake_cuda.add("dcp_save", None)
        saved.update({item.key: item.data.clone() for item in staged})

    monkeypatch.setattr(async_checkpointing.serialization, "save", record_save)
    sources = {"weight": torch.arange(12.0).reshape(3, 4), "bias": torch.full((4,), 7.0)}
    sharded = [ShardedTensor(key, value, value.shape, (0,) * value.dim()) for key, value in sources.items()]

    writer = async_checkpointing.AsyncTorchDistWriter(sharded, str(tmp_path), None, {}, iteration=5)
    assert writer.wait() is None
    log = fake_cuda.log
    writer_thread = "async-ckpt-5"

    # The training thread marks where its own GPU's stream stands when the save is scheduled.
    assert [e for e in log if e[1] == "event_record" and e[0] != writer_thread] == [
        ("MainThread", "event_record", RANK_DEVICE, "current")]
    # The writer thread makes the rank's GPU current before any other CUDA call it makes.
    own = [e for e in log if e[0] == writer_thread]
    assert own[0] == (writer_thread, "set_device", RANK_DEVICE, None), own
    assert fake_cuda.calls("set_device") == [own[0]]
    # Its copy stream is on that GPU, waits for the training stream, and is the stream the copies run on.
    (stream,) = [e for e in own if e[1] == "Stream" and e[3] == "side"]
    assert stream[2] == RANK_DEVICE
    assert (writer_thread, "wait_event", RANK_DEVICE, (RANK_DEVICE, "current")) in own
    assert (writer_thread, "stream_enter", RANK_DEVICE, "side") in own
    assert all(e[3] is True for e in fake_cuda.calls("host_buffer")), "host buffers must be pinned"
    # The host waits for an event recorded on that copy stream after the copies, before anything is written.
    save_at = own.index((writer_thread, "dcp_save", None, None))
    exit_at = own.index((writer_thread, "stream_exit", RANK_DEVICE, "side"))
    waits = [i for i, e in enumerate(own) if e[1] in ("event_synchronize", "stream_synchronize")]
    assert waits and exit_at < waits[-1] < save_at
    assert own[waits[-1]][1:] == ("event_synchronize", RANK_DEVICE, "side")
    assert not [e for e in own if e[2] == 0], "nothing of the writer thread may touch GPU 0"
    for key, value in sources.items():
        assert torch.equal(saved[key], value)


def test_without_cuda_nothing_cuda_is_called(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def forbidden(*args, **kwargs):
        raise AssertionError("a CUDA call without CUDA")

    for name in ("set_device", "Stream", "Event", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    assert async_checkpointing.staging_device() is None
    sharded = [ShardedTensor("w", torch.ones(2, 2), (2, 2), (0, 0))]
    writer = async_checkpointing.AsyncTorchDistWriter(sharded, str(tmp_path), None, {}, iteration=1)
    assert writer.wait() is None
    assert (tmp_path / ".metadata").is_file()
