"""Ray workers of a test's verl run forked from one process that imported their heavy modules once.

Every Ray actor of a verl run (the TaskRunner, the transfer queue, the reward and agent-loop
workers, the load balancer, the trainer ranks, the vLLM server) starts as a fresh Python that
imports torch, tensordict, transformers and Ray again: ~5 s of a core each, about ten a run. Ray
runs a worker through its runtime environment's ``py_executable``; here that is this file as a
client (``python -S``, standard library only): it hands its argument vector, environment, working
directory and standard streams to the zygote (this file as a server, started with the run's
environment), which forks a child that becomes the worker, ``default_worker.py`` run as
``__main__`` exactly as Ray would run it. The child reports its own pid when it registers, so Ray
signals and kills the real worker; the client exits with the child's status, and a client that
dies takes its child with it (the zygote sees the connection close). The zygote starts with the
run's environment and imports none of the modules that read the settings Ray gives each worker
(verl, vLLM, Ray and the plugin are imported by each worker after the fork, with its own
environment); torch's thread count, read when torch loads, is set again from the worker's
``OMP_NUM_THREADS``.

Test infrastructure: a verl run a user starts spawns its workers as Ray does.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import struct
import sys

# What each worker would import for itself before its first task; none of them reads a worker's
# own settings at import. Not Ray: a worker forked with Ray imported could not connect to Ray's
# control store ("Failed to connect to GCS").
PRELOAD = ("torch", "tensordict", "transformers", "torch._inductor.lowering", "openai", "datasets", "pandas")
_HEADER = struct.Struct("!I")
ZYGOTE_READY = "zygote ready"
# This file: the server's and the client's script.
SCRIPT = os.path.abspath(__file__)


def _send_message(connection: socket.socket, payload: bytes, fds=()) -> None:
    socket.send_fds(connection, [_HEADER.pack(len(payload)) + payload], list(fds))


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the other side closed")
        data += chunk
    return data


# --- the client: what Ray execs as the worker's interpreter -------------------------------------

def client(socket_path: str, worker_argv: list[str]) -> int:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(socket_path)
    request = json.dumps({"argv": worker_argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    _send_message(connection, request, fds=(0, 1, 2))
    (status,) = _HEADER.unpack(_receive_exactly(connection, _HEADER.size))
    return status


# --- the server ------------------------------------------------------------------------------------

def _become_worker(request: dict, fds: list[int]) -> None:
    """In the forked child: take the client's streams, environment and directory, run the worker."""
    import runpy

    from run_as_main import exit_as_main  # beside this file, first on the zygote's sys.path

    # A process group of its own, as Ray starts a worker: Ray's cleanup kills a worker's whole group,
    # which would otherwise be the zygote's (seen: an idle task worker's exit took down every worker).
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = list(request["argv"])
    # As a fresh ``python default_worker.py`` would have it: the script's directory first, then the
    # worker's PYTHONPATH (Ray may add to it), then the interpreter's own.
    extra = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path and path not in sys.path]
    sys.path[0:1] = [os.path.dirname(os.path.abspath(sys.argv[0])), *extra]
    exit_as_main(lambda: runpy.run_path(sys.argv[0], run_name="__main__"))


def serve(socket_path: str, preload=PRELOAD) -> None:
    import importlib
    import signal

    for module in preload:
        try:
            importlib.import_module(module)
        except ImportError:
            pass  # not installed: the workers that need it import it themselves, as they would anyway
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> its client's connection

    def stop(signum, frame):
        # Each worker is in a group of its own: a kill of the zygote's group would not reach it.
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    print(f"{ZYGOTE_READY}: {socket_path}", flush=True)
    while True:
        for key, _ in selector.select(timeout=0.2):
            if key.fileobj is listener:
                connection, _ = listener.accept()
                fds = []
                try:
                    size_and_payload, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
                    (size,) = _HEADER.unpack(size_and_payload[:_HEADER.size])
                    payload = size_and_payload[_HEADER.size:]
                    payload += _receive_exactly(connection, size - len(payload))
                    pid = os.fork()
                except (OSError, struct.error) as failed:
                    # That client only (it died while asking, or no process could be forked): it
                    # sees its connection close and exits 1; the other workers run on.
                    print(f"zygote: a request failed: {failed!r}", file=sys.stderr, flush=True)
                    for fd in fds:
                        os.close(fd)
                    connection.close()
                    continue
                if pid == 0:
                    selector.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    connection.close()
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    _become_worker(json.loads(payload), fds)
                for fd in fds:
                    os.close(fd)
                children[pid] = connection
                selector.register(connection, selectors.EVENT_READ, pid)
            else:  # a client's connection closed: the client is gone, so is its worker
                pid = key.data
                selector.unregister(key.fileobj)
                key.fileobj.close()
                if children.pop(pid, None) is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        while True:  # reap every exited worker, also those whose client went first
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = children.pop(pid, None)
            if connection is not None:
                code = os.waitstatus_to_exitcode(status)
                try:
                    connection.sendall(_HEADER.pack(code if code >= 0 else 128 - code))
                except OSError:
                    pass
                selector.unregister(connection)
                connection.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1], sys.argv[2:]))
