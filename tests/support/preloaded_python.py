"""A Python process that has imported the heavy third-party modules once and forks one child per
script, so no script pays torch's and transformers' imports again (most of a vLLM script's start).

Only modules that no fork patch touches are preloaded (never vllm, verl, megatron or this
package), so a child still imports a patched copy ahead of the installed one, as a fresh
interpreter would. The ``"vllm"`` server (``shared("vllm")``, for the scripts that load patched
vLLM files) preloads vLLM's configuration modules too, having checked that they import no module a
vLLM fork patch edits; vLLM's import-time settings (its logging) are then the server's.

A child runs as ``python -c SCRIPT`` does: ``__name__ == "__main__"``, the given paths first on
``sys.path`` and in ``PYTHONPATH``, the given environment, its own stdout and stderr.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

# Third-party modules the scripts import and that take most of their start-up time.
PRELOADED = ("torch", "numpy", "transformers", "transformers.configuration_utils", "transformers.modeling_utils",
             "openai", "networkx", "sympy", "click", "fastapi", "aiohttp", "pydantic", "omegaconf", "hydra", "ray")
# Upstreams the fork patches edit: a child must import them itself, patched copy first.
NEVER_PRELOADED = ("vllm", "verl", "megatron", "zero_mismatch_plugin")
# What the "vllm" server adds: ~3 s of each vLLM script's start, none of it a patched file.
VLLM_UNPATCHED = ("vllm.config", "vllm.engine.arg_utils")


def vllm_patched_modules() -> list[str]:
    """The module names of every file a vLLM fork patch edits."""
    from zero_mismatch_plugin import fork_patches

    files = [f for patch in fork_patches.load_manifest().for_upstream("vllm") for f in patch.files]
    return sorted({f.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for f in files})


def _run_child(request: dict) -> None:
    """In the forked child: become ``python -c script`` with the request's paths and environment."""
    import builtins
    import importlib

    from support.run_as_main import exit_as_main

    written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], written),
                            (2, request["stderr"], written)):
        os.dup2(os.open(path, flags), fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0:0] = request["path_first"]
    importlib.invalidate_caches()
    os.chdir(request["cwd"])
    sys.argv = ["-c", *request["args"]]
    exit_as_main(lambda: exec(compile(request["script"], "<string>", "exec"),
                              {"__name__": "__main__", "__builtins__": builtins}))


def preload(also=(), patched=()) -> list[str]:
    """Import PRELOADED, then ``also``; what is now imported that the scripts must import
    themselves: an upstream of NEVER_PRELOADED that ``also`` does not name, or a module of
    ``patched`` (the server refuses to start if this is not empty)."""
    import importlib

    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    for name in also:
        importlib.import_module(name)
    own = {name.split(".")[0] for name in also}
    leaked = sorted({m.split(".")[0] for m in sys.modules} & (set(NEVER_PRELOADED) - own))
    return leaked + sorted(set(patched) & set(sys.modules))


def serve() -> None:
    """The server: preload, then answer ``start`` (fork a child) and ``wait`` (its exit code) requests,
    one JSON line each, on stdin / the original stdout. Its one argument: the flavour's JSON,
    {"also": modules to preload after PRELOADED, "patched": modules they must not have imported}."""
    flavour = json.loads(sys.argv[1])
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a stray print must not corrupt the replies
    leaked = preload(flavour["also"], flavour["patched"])
    if leaked:
        raise SystemExit(f"preloading imported {leaked}, which the scripts must import themselves")
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "start":
            pid = os.fork()
            if pid == 0:
                _run_child(request)
            replies.write(json.dumps({"pid": pid}) + "\n")
        elif request["op"] == "wait":
            _, status = os.waitpid(request["pid"], 0)
            replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


class PreloadedPython:
    """The client: ``run`` and ``start``/``wait`` mirror ``subprocess.run`` / ``Popen`` for ``python -c``."""

    def __init__(self, flavour: str = "plain"):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        also, patched = (VLLM_UNPATCHED, vllm_patched_modules()) if flavour == "vllm" else ((), ())
        self._server = subprocess.Popen([sys.executable, "-c", "from support.preloaded_python import serve; serve()",
                                         json.dumps({"also": also, "patched": patched})],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._outputs = tempfile.TemporaryDirectory(prefix="preloaded-python-")
        self._count = 0
        assert self._reply(timeout=300) == {"ready": True}

    def _reply(self, timeout: float | None) -> dict:
        ready, _, _ = select.select([self._server.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"the preloaded Python server exited ({self._server.wait()})")
        return json.loads(line)

    def _request(self, request: dict, timeout: float | None = None) -> dict:
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        return self._reply(timeout)

    def start(self, script: str, *args: str, path_first=(), env: dict | None = None, cwd=None) -> dict:
        """Fork a child running ``script``; a handle for :meth:`wait`."""
        self._count += 1
        out = Path(self._outputs.name) / str(self._count)
        handle = {"stdout": f"{out}.out", "stderr": f"{out}.err", "args": list(map(str, args))}
        paths = [*map(str, path_first), str(TESTS)]
        environment = dict(os.environ if env is None else env)  # as subprocess takes it: the whole environment
        environment["PYTHONPATH"] = os.pathsep.join([*paths, environment.get("PYTHONPATH", "")])
        reply = self._request({"op": "start", "script": script, "path_first": paths, "env": environment,
                               "cwd": str(cwd or os.getcwd()), **handle})
        return {**handle, "pid": reply["pid"], "script": script}

    def wait(self, handle: dict, timeout: float = 300) -> subprocess.CompletedProcess:
        try:
            reply = self._request({"op": "wait", "pid": handle["pid"]}, timeout)
        except TimeoutError:
            os.kill(handle["pid"], signal.SIGKILL)
            self._reply(None)
            raise subprocess.TimeoutExpired(["python", "-c", handle["script"]], timeout) from None
        return subprocess.CompletedProcess(["python", "-c", handle["script"], *handle["args"]], reply["returncode"],
                                           Path(handle["stdout"]).read_text(), Path(handle["stderr"]).read_text())

    def run(self, script: str, *args: str, path_first=(), env: dict | None = None, timeout: float = 300):
        return self.wait(self.start(script, *args, path_first=path_first, env=env), timeout)

    def close(self) -> None:
        if self._server.poll() is None:
            self._server.stdin.close()
            self._server.wait(timeout=60)
        self._outputs.cleanup()


_SHARED: dict[str, PreloadedPython] = {}


def shared(flavour: str = "plain") -> PreloadedPython:
    """This process's server of ``flavour`` ("plain", or "vllm" for scripts that load patched vLLM
    files): started on first use (a few seconds), closed when the process exits."""
    if flavour not in ("plain", "vllm"):
        raise ValueError(f"unknown flavour {flavour!r}: 'plain' or 'vllm'")
    if flavour not in _SHARED:
        _SHARED[flavour] = PreloadedPython(flavour)
        atexit.register(_SHARED[flavour].close)
    return _SHARED[flavour]


def run_script(script: str, *path_first, env: dict | None = None, timeout: float = 300,
               flavour: str = "plain") -> subprocess.CompletedProcess:
    """``python -c script`` (dedented) with ``path_first`` ahead on the path and ``env`` added to this
    process's environment, forked from :func:`shared` (``flavour``)."""
    return shared(flavour).run(textwrap.dedent(script), path_first=path_first, env={**os.environ, **(env or {})},
                               timeout=timeout)
