"""Hang report: each rank's heartbeat in the job's c10d store, kept by a daemon thread; stalled ranks named, stacks dumped.

How it works (``--hang-report-seconds N``; ``HangMonitor``):

- every rank runs one daemon thread that, every ``interval`` seconds (N/5, between 0.2 and 10 s), writes
  its heartbeat to the job's c10d store (the default process group's store; for a ``TCPStore`` the
  thread opens its own client connection to it, so a call of its own that hangs never holds the
  connection the training's store calls use): a beat counter, the wall time, the iteration, section and
  phase the training loop published (``megatron/core/progress.py``: attribute writes on the hot path,
  no store I/O there), and what the main thread is blocked in, read from its Python stack at beat time
  (the innermost ``torch.distributed`` collective and the process group it was given, named after
  ``parallel_state``'s groups; for the wait of an asynchronous collective, ``PROGRESS.comm``; on NCCL also the flight recorder's unfinished collectives, when
  ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is set);
- a rank whose main thread has not moved (same frame, same instruction, same iteration and phase) for
  one interval is *waiting*; only a waiting rank reads the other ranks' heartbeats (so a healthy job
  costs one small ``set`` per rank and interval, and the store's host no reads);
- a rank whose beat counter has not changed for N seconds, as the waiting rank observed it on its own
  clock, is *stalled*: its process is stopped or dead or its heartbeat thread cannot run. A rank busy in
  a long checkpoint save or evaluation keeps beating, so it is never named;
- each waiting rank then prints ONE block (one write) beginning ``hang report:`` naming the stalled
  ranks (node, pid, how long ago last seen, iteration, phase), what it is itself blocked in, and the
  file with every thread's Python stack of its own process; and calls ``on_report`` (the training glue
  emits the ``megatron.hang_report`` span event and counts ``megatron.training.hang_reports``). The next
  report comes only after the rank made progress again;
- when the store itself stops answering for N seconds (its host, rank 0 under a plain ``env://``
  launch, is stopped), the report says so and names the host rank. A call to a stopped host blocks
  (TCPStore's client retries past its timeout), so a second thread, the store watch, times the
  heartbeat thread's call in flight.

``StartupWatch`` covers the start: while ``init_process_group`` has not returned after N seconds, the rank
says which address and port it waits on and, through keys each rank writes to the same store as soon
as it can reach it, which ranks have not joined yet (or that no store answers there).

Clocks: "last seen" uses the stalled rank's own wall time of its last beat (exact on one node, skewed by
the nodes' clock difference across nodes); the decision uses only the waiting rank's monotonic clock.
"""
import datetime
import json
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.console import write_line
from megatron.core.progress import PROGRESS, phase_label

__all__ = ["HangMonitor", "StartupWatch", "HangReport", "blocked_in", "write_stacks", "monitor_interval",
           "store_prefix", "flight_recorder_lines"]

_C10D_FILES = None
_TORCH_DIR = os.path.dirname(torch.__file__)


def monitor_interval(seconds: float) -> float:
    """Beat period (s) for a threshold of ``seconds``: a fifth of it, between 0.2 and 10 s."""
    return min(max(seconds / 5.0, 0.2), 10.0)


def store_prefix() -> str:
    """Key prefix of this launch's heartbeats: torchrun's agent store outlives a restart, so the restart
    count is part of it (a new attempt never reads the beats of the last one)."""
    return f"megatron_hang/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _c10d_files():
    global _C10D_FILES
    if _C10D_FILES is None:
        from torch.distributed import distributed_c10d

        _C10D_FILES = {distributed_c10d.__file__}
    return _C10D_FILES


def _group_label(group) -> str:
    """``parallel_state``'s name of ``group`` (``data parallel``, ...) and its global ranks, else ``world``
    for the default group, else its ranks."""
    if group is None:
        return "world"
    from megatron.core import parallel_state

    names = (("tensor model parallel", lambda: parallel_state.get_tensor_model_parallel_group()),
             ("pipeline model parallel", lambda: parallel_state.get_pipeline_model_parallel_group()),
             ("data parallel", lambda: parallel_state.get_data_parallel_group()),
             ("data parallel with context parallel",
              lambda: parallel_state.get_data_parallel_group(with_context_parallel=True)),
             ("context parallel", lambda: parallel_state.get_context_parallel_group()),
             ("expert model parallel", lambda: parallel_state.get_expert_model_parallel_group()),
             ("model parallel", lambda: parallel_state.get_model_parallel_group()),
             ("embedding", lambda: parallel_state.get_embedding_group()))
    label = "world" if group is dist.GroupMember.WORLD else "group"
    for name, getter in names:
        try:
            if getter() is group:
                label = name
                break
        except Exception:  # not initialised, or a group this layout does not have
            continue
    try:
        ranks = dist.get_process_group_ranks(group)
        return f"{label} (ranks {', '.join(str(r) for r in ranks[:16])}{', ...' if len(ranks) > 16 else ''})"
    except Exception:
        return label


def _where(frame) -> str:
    code = frame.f_code
    path = code.co_filename
    try:
        path = os.path.relpath(path)
    except ValueError:
        pass
    return f"{path}:{frame.f_lineno} in {code.co_name}"


def blocked_in(frame) -> Dict[str, Optional[str]]:
    """What the thread whose innermost frame is ``frame`` is blocked in: ``collective`` (the public
    ``torch.distributed`` function on its stack, e.g. ``all_reduce``), ``group`` (the process group it
    was passed, labelled) and ``where`` (the innermost frame outside torch: ``file:line in function``).
    Values are None where not found (no collective on the stack: an asynchronous one is waited on in
    the caller's frame, which ``where`` names)."""
    collective = group = where = None
    c10d = _c10d_files()
    f = frame
    while f is not None:
        code = f.f_code
        if code.co_filename in c10d:
            # The outermost public function of a nested call (all_gather_object -> all_gather) wins.
            if not code.co_name.startswith("_") and code.co_name != "wrapper":
                collective = code.co_name
                try:
                    group = f.f_locals.get("group")
                except Exception:
                    group = None
        elif not code.co_filename.startswith(_TORCH_DIR):
            where = _where(f)
            break
        f = f.f_back
    return {"collective": collective, "group": _group_label(group) if collective else None, "where": where}


def _pg_label_by_name(name: str) -> str:
    """Our label of the process group c10d calls ``name`` (the flight recorder records names), else the name."""
    try:
        from torch.distributed import distributed_c10d

        for group, pg_name in distributed_c10d._world.pg_names.items():
            if pg_name == name:
                return _group_label(group)
    except Exception:
        pass
    return name


def flight_recorder_lines(entries, limit: int = 8) -> List[str]:
    """``name on group G (seq N, state)`` for the flight-recorder ``entries`` (dicts with ``profiling_name``,
    ``process_group`` = (name, description), ``collective_seq_id``, ``state``) that have not completed,
    the last ``limit`` of them."""
    out = []
    for entry in entries:
        if entry.get("state") == "completed":
            continue
        name, desc = (tuple(entry.get("process_group") or ("?", "undefined")) + ("undefined",))[:2]
        group = _pg_label_by_name(str(name)) if desc in (None, "", "undefined") else f"{desc} ({name})"
        out.append(f"{entry.get('profiling_name', '?')} on group {group} "
                   f"(seq {entry.get('collective_seq_id', '?')}, {entry.get('state', '?')})")
    return out[-limit:]


def _nccl_unfinished() -> List[str]:
    """The NCCL flight recorder's collectives that have not completed (``TORCH_NCCL_TRACE_BUFFER_SIZE`` or
    ``TORCH_FR_BUFFER_SIZE`` > 0), see :func:`flight_recorder_lines`; [] without CUDA, NCCL or a trace
    buffer. (gloo records too, but leaves every entry ``scheduled``: no use for finding the unfinished.)"""
    if not (torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"):
        return []
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
    sizes = (os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", ""), os.environ.get("TORCH_FR_BUFFER_SIZE", ""))
    if dump is None or not any(size.strip().isdigit() and int(size) > 0 for size in sizes):
        return []
    try:
        # The flight recorder's own pickle of this process's records (not data from elsewhere).
        entries = pickle.loads(dump(includeCollectives=True, includeStackTraces=False, onlyActive=True)).get(
            "entries", [])
    except Exception:
        return []
    return flight_recorder_lines(entries)


def write_stacks(path: str, header: str = "") -> str:
    """Write every thread's Python stack of this process (``sys._current_frames``, with thread names) to
    ``path``; returns the path written (falls back to the working directory, then the temp directory,
    when ``path``'s folder cannot be written)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sys._current_frames()
    text = [header] if header else []
    for ident, frame in frames.items():
        text.append(f"--- thread {names.get(ident, '?')} (ident {ident}) ---")
        text.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
    body = "\n".join(text) + "\n"
    import tempfile

    for candidate in (path, os.path.join(os.getcwd(), os.path.basename(path)),
                      os.path.join(tempfile.gettempdir(), os.path.basename(path))):
        try:
            os.makedirs(os.path.dirname(os.path.abspath(candidate)), exist_ok=True)
            with open(candidate, "w") as f:
                f.write(body)
            return os.path.abspath(candidate)
        except OSError:
            continue
    return "(could not be written)"


class HangReport:
    """What one report said (passed to ``on_report``): ``iteration`` (this rank's), ``stalled_ranks``,
    ``phase`` (the first stalled rank's last phase), ``seconds`` (since it was last seen), ``text``
    (the printed block), ``stack_file``."""

    def __init__(self, iteration, stalled_ranks, phase, seconds, text, stack_file):
        self.iteration, self.stalled_ranks, self.phase = iteration, stalled_ranks, phase
        self.seconds, self.text, self.stack_file = seconds, text, stack_file


def _base_store(store):
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _open_client(host: str, port: int, timeout_s: float):
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class HangMonitor:
    """The heartbeat thread of one rank (see the module docstring).

    Args:
        rank, world_size: this process's global rank and the world size.
        seconds: N of ``--hang-report-seconds`` (> 0).
        report_dir: folder for the stack files (``--save``, else the TensorBoard folder, else the
            working directory).
        store: the store to beat in; default the default process group's (call after
            ``init_process_group``).
        on_report: called with a :class:`HangReport` from the monitor's thread after the block is printed.
        interval: beat period in seconds (default :func:`monitor_interval`).
        store_host_rank: the rank whose process serves the store (0 under ``env://``; None under
            torchrun's agent store, which the agent serves).
    """

    def __init__(self, rank: int, world_size: int, seconds: float, report_dir: Optional[str] = None, store=None,
                 on_report: Optional[Callable[[HangReport], None]] = None, interval: Optional[float] = None,
                 store_host_rank: Optional[int] = 0):
        if seconds <= 0:
            raise ValueError(f"--hang-report-seconds must be > 0 for a hang monitor, got {seconds}")
        self.rank, self.world_size, self.seconds = rank, world_size, float(seconds)
        self.interval = interval if interval is not None else monitor_interval(self.seconds)
        self.report_dir = report_dir or os.getcwd()
        self.on_report = on_report
        self.store_host_rank = store_host_rank
        self._store_source = store
        self._store = None
        self._address = None
        self._main_ident = threading.main_thread().ident
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._beat = self._published = 0
        self._stop = threading.Event()
        self._thread = None
        self._signature = None
        self._waiting_since = None
        self._observing = False
        self._seen: Dict[int, dict] = {}
        self._last_change: Dict[int, float] = {}
        self._reported = self._store_reported = False
        self._store_ok = time.monotonic()
        self._io_since = None
        self._state = None
        self._watchdog = None
        self._lock, self._report_lock = threading.Lock(), threading.Lock()
        self._error_logged = False
        self.reports: List[HangReport] = []

    @property
    def beats(self) -> int:
        """Heartbeats written to the store so far (a test waits for one sampled after its own write)."""
        return self._published

    # -- store ----------------------------------------------------------------------------------
    def _connect(self):
        store = self._store_source
        if store is None:
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()
        base = _base_store(store)
        if isinstance(base, dist.TCPStore):
            # Own connection: a call of ours that hangs must not hold the one the training's store calls use.
            self._address = (base.host, base.port)
            store = _open_client(base.host, base.port, max(min(self.seconds / 2.0, 30.0), 1.0))
        self._store = dist.PrefixStore(store_prefix() + "beat/", store)

    def _read(self, ranks):
        keys = [str(r) for r in ranks]
        if hasattr(self._store, "multi_get"):
            return self._store.multi_get(keys)
        return [self._store.get(key) for key in keys]

    # -- thread ---------------------------------------------------------------------------------
    def start(self) -> "HangMonitor":
        """Connect to the store, publish the first beat, start the daemon thread; returns self."""
        self._connect()
        self._tick()
        self._thread = threading.Thread(target=self._run, name="megatron-hang-monitor", daemon=True)
        self._thread.start()
        # A store call to a stopped host blocks (TCPStore's client retries past its timeout): a second
        # thread watches how long the heartbeat thread's store call has been in flight.
        self._watchdog = threading.Thread(target=self._watch_store, name="megatron-hang-store-watch", daemon=True)
        self._watchdog.start()
        return self

    def stop(self) -> None:
        """Stop the thread (returns within about one store timeout)."""
        self._stop.set()
        for thread in (self._thread, self._watchdog):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=self.interval + 5.0)
        self._thread = self._watchdog = None

    def _watch_store(self):
        while not self._stop.wait(self.interval):
            since = self._io_since
            if since is not None and time.monotonic() - since >= self.seconds:
                self._store_failed(time.monotonic(), None)

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self._tick()
            except Exception as error:  # the monitor must never stop training
                if not self._error_logged:
                    self._error_logged = True
                    write_line(f"hang monitor (rank {self.rank}): {type(error).__name__}: {error}; heartbeats go on",
                               sys.stderr)

    def _sample(self):
        frame = sys._current_frames().get(self._main_ident)
        iteration, section, phase = PROGRESS.iteration, PROGRESS.section, PROGRESS.phase
        state = {"n": self._beat, "t": time.time(), "it": iteration, "ph": phase_label(section, phase),
                 "host": self._host, "pid": self._pid}
        if frame is not None:
            state.update(blocked_in(frame))
            comm = PROGRESS.comm  # an asynchronous collective's wait (no torch.distributed frame on the stack)
            if state["collective"] is None and comm is not None:
                state["collective"], state["group"] = comm[0], _group_label(comm[1])
            signature = (id(frame), frame.f_lasti, iteration, section, phase)
        else:
            signature = None
        if signature is not None and signature == self._signature:  # waiting: what NCCL has not finished
            nccl = _nccl_unfinished()
            if nccl:
                state["nccl"] = nccl
        return state, signature

    def _tick(self):
        now = time.monotonic()
        self._beat += 1
        state, signature = self._sample()
        self._state = state
        self._io_since = now
        try:
            if self._store is None:
                self._connect()
            self._store.set(str(self.rank), json.dumps(state))
            self._published += 1
            if signature is None or signature != self._signature:
                self._signature, self._waiting_since = signature, now
                self._observing, self._reported = False, False
            else:
                self._observe(now)
            self._store_ok = time.monotonic()
            self._store_reported = False
        except Exception as error:
            self._store = None  # reconnect next time
            self._store_failed(time.monotonic(), error)
        finally:
            self._io_since = None

    def _observe(self, now):
        peers = [r for r in range(self.world_size) if r != self.rank]
        present = [r for r in peers if r in self._seen or self._store.check([str(r)])]
        values = dict(zip(present, self._read(present))) if present else {}
        fresh = not self._observing
        self._observing = True
        for r in peers:
            raw = values.get(r)
            beat = json.loads(raw) if raw is not None else None
            previous = self._seen.get(r)
            if fresh or r not in self._last_change or (beat is not None and (
                    previous is None or beat["n"] != previous["n"])):
                self._last_change[r] = now
            if beat is not None:
                self._seen[r] = beat
        stalled = [r for r in peers if now - self._last_change[r] >= self.seconds]
        if not stalled:
            self._reported = False
        elif not self._reported:
            self._reported = True
            self._report(stalled, now)

    def _store_failed(self, now, error):
        """The store has not answered (``error``: the call's exception; None: a call still in flight)."""
        with self._lock:
            if now - self._store_ok < self.seconds or self._store_reported:
                return
            self._store_reported = True
        where = f"{self._address[0]}:{self._address[1]}" if self._address else "the job's store"
        host = (f"rank {self.store_host_rank}'s process serves it" if self.store_host_rank is not None
                else "torchrun's agent serves it")
        stalled = [self.store_host_rank] if self.store_host_rank is not None and self.store_host_rank != self.rank \
            else []
        cause = "a call still waits" if error is None else \
            f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        note = f"the c10d store at {where} has not answered for {now - self._store_ok:.0f} s ({host}; {cause})"
        self._report(stalled, now, note=note)

    # -- report ---------------------------------------------------------------------------------
    def _describe(self, rank: int, now_wall: float) -> str:
        beat = self._seen.get(rank)
        if beat is None and rank == self.store_host_rank and self._store_reported:
            return f"  rank {rank}: its heartbeat could not be read (the store its process serves does not answer)"
        if beat is None:
            return f"  rank {rank}: no heartbeat seen (it never started, or stopped before its first beat)"
        text = (f"  rank {rank} (node {beat['host']}, pid {beat['pid']}): last seen {max(now_wall - beat['t'], 0):.0f} s "
                f"ago in iteration {beat['it']}, phase {beat['ph']}")
        if beat.get("collective"):
            text += f", in {beat['collective']} on group {beat['group']}"
        return text

    def _report(self, stalled: List[int], now: float, note: Optional[str] = None) -> None:
        with self._report_lock:  # the heartbeat thread and the store watch may both report
            self._report_locked(stalled, now, note)

    def _report_locked(self, stalled: List[int], now: float, note: Optional[str]) -> None:
        now_wall = time.time()
        state = self._state
        waited = now - (self._waiting_since if self._waiting_since is not None else now)
        head = (f"hang report: {len(stalled)} rank(s) stopped reporting for {self.seconds:g} s or more "
                f"(--hang-report-seconds): {', '.join(str(r) for r in stalled) or 'unknown'}")
        lines = [head]
        if note:
            lines.append(f"  {note}")
        lines += [self._describe(r, now_wall) for r in stalled]
        blocked = f"  waiting: rank {self.rank} (node {self._host}, pid {self._pid}) has not moved for {waited:.0f} s " \
                  f"in iteration {state['it']}, phase {state['ph']}"
        if state.get("collective"):
            blocked += f", blocked in {state['collective']} on group {state['group']}"
        if state.get("where"):
            blocked += f" (at {state['where']})"
        lines.append(blocked)
        for entry in state.get("nccl", []):
            lines.append(f"  NCCL collective not finished on rank {self.rank}: {entry}")
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = os.path.join(self.report_dir, f"hang_report_rank{self.rank}_pid{self._pid}_{stamp}.txt")
        stack_file = write_stacks(path, header="\n".join(lines))
        lines.append(f"  Python stacks of every thread of rank {self.rank}: {stack_file}")
        text = "\n".join(lines)
        write_line(text)
        first = self._seen.get(stalled[0]) if stalled else None
        report = HangReport(state["it"], list(stalled), first["ph"] if first else "unknown",
                            max(now_wall - first["t"], 0.0) if first else self.seconds, text, stack_file)
        self.reports.append(report)
        if self.on_report is not None:
            try:
                self.on_report(report)
            except Exception as error:
                write_line(f"hang monitor (rank {self.rank}): reporting to telemetry failed: "
                           f"{type(error).__name__}: {error}", sys.stderr)


class StartupWatch:
    """Context manager around ``init_process_group``: after ``seconds`` without it returning, print one
    ``hang report:`` line naming the address and port waited on and the ranks that have not joined.

    Each rank's watch thread connects to the store at ``host:port`` (``MASTER_ADDR``/``MASTER_PORT``: the
    store ``env://`` rendezvous uses; rank 0's process or torchrun's agent serves it) as its own client
    and writes ``joined/<rank>``, so ranks that reached start-up are known even while the process group
    waits for the rest. Without an answer there, the line says so (rank 0 has not started it, or the
    address is wrong)."""

    def __init__(self, rank: int, world_size: int, seconds: float, host: Optional[str], port: Optional[int],
                 backend: str):
        self.rank, self.world_size, self.seconds = rank, world_size, float(seconds)
        self.host, self.port, self.backend = host, port, backend
        self._done = threading.Event()
        self._thread = None
        self.message: Optional[str] = None

    def __enter__(self):
        if self.seconds > 0 and self.world_size > 1:
            self._thread = threading.Thread(target=self._run, name="megatron-startup-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        self._done.set()
        return False

    def _client(self, timeout_s):
        if not self.host or not self.port:
            return None
        try:
            return dist.PrefixStore(store_prefix() + "joined/", _open_client(self.host, int(self.port), timeout_s))
        except Exception:
            return None

    def _run(self):
        started = time.monotonic()
        client = self._client(self.seconds)
        if client is not None:
            try:
                client.set(str(self.rank), json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
            except Exception:
                client = None
        if self._done.wait(max(self.seconds - (time.monotonic() - started), 0.0)):
            return
        where = f"{self.host}:{self.port}" if self.host else "an address this launch does not name (MASTER_ADDR unset)"
        head = (f"hang report: rank {self.rank} (node {socket.gethostname()}, pid {os.getpid()}) has waited "
                f"{time.monotonic() - started:.0f} s to initialise the process group ({self.backend}, world size "
                f"{self.world_size}) at {where}")
        if client is None:
            text = (f"{head}; no c10d store answers there: rank 0 (whose process serves it, unless torchrun's agent "
                    "does) has not started yet, or MASTER_ADDR/MASTER_PORT point elsewhere")
        else:
            try:
                missing = [r for r in range(self.world_size) if not client.check([str(r)])]
            except Exception:
                missing = None
            if missing is None:
                text = f"{head}; the store there stopped answering"
            elif missing:
                shown = ", ".join(str(r) for r in missing[:32]) + (", ..." if len(missing) > 32 else "")
                text = f"{head}; ranks not joined yet: {shown} ({len(missing)} of {self.world_size})"
            else:
                text = f"{head}; every rank has reached start-up (the process group's own rendezvous is slow)"
        if self._done.is_set():
            return
        self.message = text
        write_line(text)
