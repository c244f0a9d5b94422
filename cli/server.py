"""A ComfyUI server driven over HTTP: one this module starts headless in a hermetic base directory, or one running.

Shared by the ``run`` command, the integration tests (tests/comfy_server.py) and the benchmarks.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from ..checkpoints.safe_write import commit, starts_with, temp_beside
from .errors import CommandError, InputError, one_line

PACK_DIR = Path(__file__).resolve().parent.parent  # the repository root is the pack
REGISTRY_FOLDER_NAME = "comfyui-lowvram-dit"  # where Registry / Manager installs put the pack
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae", "vae_approx", "loras", "clip_vision")
LOG_MARKER = b"# comfyui_lowvram_dit: ComfyUI log: "
STARTUP_NOTE_S = 3.0  # seconds between progress lines while ComfyUI starts


class RunError(CommandError):
    """A run that cannot go on; the message says what to do (exit code 1)."""


class RunInputError(RunError, InputError):
    """A run refused before it starts: the workflow, an option or the URL given cannot be used (exit code 2)."""


class _HttpRedirectsOnly(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to another http(s) URL (urllib's own also follows ftp)."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, f"redirect to a non-http URL refused: {newurl[:200]}",
                                         headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


@functools.cache
def _opener() -> urllib.request.OpenerDirector:
    """The one opener every request goes through: http(s) only, redirects too (built on first use)."""
    return urllib.request.build_opener(_HttpRedirectsOnly)


def check_url(url: str) -> str:
    """``url`` without a trailing slash when it is an http(s) URL with a host; RunInputError naming it otherwise
    (urllib would also open file:, ftp: and data: URLs)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        parts, port_ok = None, False
    if parts is None or parts.scheme.lower() not in ("http", "https") or not parts.hostname or not port_ok:
        raise RunInputError(f"--url {url[:200]!r}: not an http(s) URL of a ComfyUI; give its address, e.g. "
                            "http://127.0.0.1:8188")
    return url.rstrip("/")


PORT_ATTEMPTS = 3  # ComfyServer.start: ports tried when another server takes the chosen one first
PORT_IN_USE = re.compile(r"address already in use|Errno 98|error while attempting to bind", re.IGNORECASE)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen) -> None:
    """Terminate a child process, killing it if it does not exit within 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def prepare_base_dir(base: Path, pack_folder: str = REGISTRY_FOLDER_NAME,
                     extra_custom_nodes: dict[str, Path] | None = None) -> Path:
    """A ComfyUI base directory with the pack (and ``extra_custom_nodes``) linked into ``custom_nodes``; returns
    the pack's link, the path ComfyUI names it by in its log."""
    for sub in ("custom_nodes", "input", "output", "user", "temp", *(f"models/{f}" for f in MODEL_FOLDERS)):
        (base / sub).mkdir(parents=True, exist_ok=True)
    for name, target in {pack_folder: PACK_DIR, **(extra_custom_nodes or {})}.items():
        link = base / "custom_nodes" / name
        if link.is_symlink() and link.resolve() != Path(target).resolve():
            link.unlink()  # a reused base folder's link to another or a deleted checkout: ComfyUI would load that one
        if not link.exists():  # a real folder of that name is left as it is
            link.symlink_to(target, target_is_directory=True)
    return base / "custom_nodes" / pack_folder


def open_log(log_path: Path, cmd: list[str]) -> BinaryIO:
    """ComfyUI's log file, new and open for writing; it starts with a marker line, the proof that lets a later run
    replace it (checkpoints.safe_write: a link or a file of the user's at that name is refused)."""
    tmp, logf = temp_beside(log_path)
    try:
        logf.write(LOG_MARKER + shlex.join(cmd).encode("utf-8", "replace") + b"\n")
        logf.flush()
        commit(tmp, log_path, starts_with(LOG_MARKER, len(LOG_MARKER)))
    except BaseException:
        logf.close()
        raise
    return logf


def comfyui_command(comfyui_path: Path, base_dir: Path, python: str | None = None, cpu: bool = False,
                    extra_args: list[str] | None = None) -> list[str]:
    """ComfyUI's command line: headless (an empty front-end root unless one is given, so no front-end package is
    needed or version-checked), no paid-API nodes, an in-memory database, everything under ``base_dir``."""
    extra = list(extra_args or [])
    if not any(a.startswith("--front-end-root") for a in extra):
        (base_dir / "web").mkdir(parents=True, exist_ok=True)
        extra += ["--front-end-root", str(base_dir / "web")]
    return [python or sys.executable, str(comfyui_path / "main.py"), "--base-directory", str(base_dir),
            "--disable-auto-launch", "--database-url", "sqlite:///:memory:", "--disable-api-nodes",
            *(["--cpu"] if cpu else []), *extra]


def launch(cmd: list[str], comfyui_path: Path, log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` in the ComfyUI checkout, its output going to a new ``log_path`` (see open_log)."""
    with open_log(log_path, cmd) as logf:  # the child keeps its own handle
        return subprocess.Popen(cmd, cwd=comfyui_path, stdout=logf, stderr=subprocess.STDOUT,
                                env={**(env or os.environ), "PYTHONUNBUFFERED": "1"})


def pack_import_problems(log: str, pack_dir: Path) -> list[str]:
    """Log lines saying ComfyUI failed to import or register the pack at ``pack_dir``."""
    path = re.escape(str(pack_dir))
    rx = re.compile("|".join([
        rf"\(IMPORT FAILED\): {path}\s*$", rf"Cannot import {path} module", rf"Error while calling comfy_entrypoint "
        rf"in {path}\b", rf"comfy_entrypoint in {path} (is not callable|did not return)", rf"Skip {path} module"]))
    return [line for line in log.splitlines() if rx.search(line)]


def execution_error(entry: dict) -> str:
    """Why a finished prompt failed, from its history entry: node, exception and traceback tail ("" if it did not)."""
    for kind, msg in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            tb = "".join(msg.get("traceback", []))[-3000:]
            return (f"node {msg.get('node_id')} ({msg.get('node_type')}) raised {msg.get('exception_type')}: "
                    f"{str(msg.get('exception_message', '')).strip()}" + (f"\n{tb}" if tb else ""))
        if kind == "execution_interrupted":
            return f"prompt interrupted at node {msg.get('node_id')} ({msg.get('node_type')})"
    return ""


class ComfyServer:
    """A ComfyUI at ``url``. ``proc`` and ``log_path`` are set for one started here (``ComfyServer.start``, a
    context manager that stops it); failures raise ``error`` (the tests pass AssertionError)."""

    def __init__(self, url: str, proc: subprocess.Popen | None = None, log_path: Path | None = None,
                 base_dir: Path | None = None, pack_dir: Path | None = None,
                 error: type[Exception] = RunError) -> None:
        self.url, self.proc, self.log_path = check_url(url), proc, log_path
        self.base_dir, self.pack_dir, self.error = base_dir, pack_dir, error

    @classmethod
    def start(cls, comfyui_path: Path, base_dir: Path, *, python: str | None = None, cpu: bool = False,
              extra_args: list[str] | None = None, env: dict[str, str] | None = None, timeout: float = 300.0,
              progress: Callable[[str], None] | None = None, pack_dir: Path | None = None,
              error: type[Exception] = RunError) -> ComfyServer:
        """Start ComfyUI on a free loopback port and wait until it answers; ``with`` it to stop it again.

        ``progress`` gets a line every few seconds while ComfyUI starts (elapsed time and its last log line). The
        port is free when chosen, but another process (another ComfyUI started at the same moment) may bind it
        before this one does: a server that answers there with another command line is not taken for this one,
        and this one is started again on another port."""
        if not (comfyui_path / "main.py").is_file():
            raise error(f"{comfyui_path}: no main.py here; point --comfyui (or COMFYUI_PATH) at a ComfyUI checkout")
        log_path = base_dir / "comfyui.log"  # each attempt replaces it
        for _ in range(PORT_ATTEMPTS):
            port = free_port()
            cmd = comfyui_command(comfyui_path, base_dir, python, cpu,
                                  ["--listen", "127.0.0.1", "--port", str(port), *(extra_args or [])])
            server = cls(f"http://127.0.0.1:{port}", launch(cmd, comfyui_path, log_path, env), log_path, base_dir,
                         pack_dir, error)
            try:
                if server._wait_ready(timeout, progress):
                    return server
            except BaseException:
                server.stop()
                raise
            server.stop()
            if progress is not None:
                progress(f"  another server took port {port} first; starting ComfyUI on another port")
        raise error(f"another server took the port chosen for ComfyUI {PORT_ATTEMPTS} times in a row; try again")

    def _wait_ready(self, timeout: float, progress: Callable[[str], None] | None) -> bool:
        """Wait until this server answers: True; False when another server holds its port (one answers there whose
        command line, which ComfyUI's /system_stats lists, names another base folder; or this one exits, unable to
        bind it)."""
        t0 = time.monotonic()
        next_note = t0 + STARTUP_NOTE_S
        while (answer := self.request("GET", "/system_stats", timeout=2, quiet=True))[0] != 200:
            if self.proc.poll() is not None:
                if PORT_IN_USE.search(self.log_tail()):
                    return False
                raise self.error(f"ComfyUI exited at startup (rc={self.proc.returncode}); log:\n{self.log_tail()}")
            now = time.monotonic()
            if now > t0 + timeout:
                raise self.error(f"ComfyUI did not answer within {timeout:.0f} s; log:\n{self.log_tail()}")
            if progress is not None and now >= next_note:
                next_note = now + STARTUP_NOTE_S
                last = next((ln for ln in reversed(self.log_text().splitlines()) if ln.strip()), "")
                progress(f"  ComfyUI starting ({now - t0:.0f} s){': ' + last.strip()[:100] if last else ''}")
            time.sleep(0.25)
        argv = answer[1].get("system", {}).get("argv") if isinstance(answer[1], dict) else None
        if isinstance(argv, list) and str(self.base_dir) not in argv:  # each server started here has its own base
            return False
        if progress is not None:
            progress(f"ComfyUI ready in {time.monotonic() - t0:.1f} s")
        return True

    def __enter__(self) -> ComfyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the server if it was started here."""
        if self.proc is not None:
            stop_process(self.proc)

    @property
    def pid(self) -> int | None:
        """The server's process id (for memory probes), None for a server not started here."""
        return self.proc.pid if self.proc is not None else None

    def log_text(self) -> str:
        """The server log so far ("" for a server not started here)."""
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def log_tail(self, n: int = 6000) -> str:
        return self.log_text()[-n:]

    def request(self, method: str, route: str, body: Any = None, timeout: float = 60,
                quiet: bool = False) -> tuple[int, Any]:
        """One HTTP request: (status, parsed JSON, text or None); HTTP errors are returned, not raised, and so are
        connection errors (status 0) when ``quiet``."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + route, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with _opener().open(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read() if exc.fp is not None else b""
        except (OSError, ValueError) as exc:  # refused, unreachable, timed out, not HTTP at all
            if not quiet:
                reason = getattr(exc, "reason", None) or exc
                why = one_line(reason) if isinstance(reason, BaseException) else str(reason)[:300]
                raise self.error(f"no ComfyUI answered {method} {self.url}{route} ({why}); start ComfyUI there, or "
                                 "give --url the address it listens on") from None
            return 0, None
        try:
            return status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")

    def get(self, route: str, timeout: float = 60) -> Any:
        """GET a JSON route; anything but 200 raises ``error``."""
        status, body = self.request("GET", route, timeout=timeout)
        if status != 200:
            raise self.error(f"{self.url}: GET {route} -> HTTP {status} ({body!r:.300}); is a ComfyUI listening "
                             "there?")
        return body

    def object_info(self, node: str | None = None, timeout: float = 120) -> dict:
        """``/object_info`` for every node, or the info of ``node`` ({} if this ComfyUI does not know it)."""
        info = self.get("/object_info" if node is None else f"/object_info/{node}", timeout)
        if not isinstance(info, dict):
            raise self.error(f"{self.url} answered GET /object_info with something other than ComfyUI's node list "
                             f"({type(info).__name__}); is a ComfyUI listening there? Check --url")
        return info if node is None else info.get(node, {})

    def post_prompt(self, api: dict, client_id: str | None = None) -> tuple[int, dict]:
        """POST an API-format graph to ``/prompt``; returns (HTTP status, JSON reply)."""
        status, body = self.request("POST", "/prompt", {"prompt": api, "client_id": client_id or uuid.uuid4().hex})
        return status, body if isinstance(body, dict) else {"raw": body}

    def queue(self, api: dict, client_id: str | None = None) -> str:
        """Queue an API-format graph; returns its prompt id, raises ``error`` naming the node errors if refused."""
        status, reply = self.post_prompt(api, client_id)
        if status != 200:
            raise self.error(f"ComfyUI rejected the prompt (HTTP {status}): "
                             f"{json.dumps(reply.get('node_errors') or reply, indent=1)[:4000]}")
        if not isinstance(reply.get("prompt_id"), str):
            raise self.error(f"{self.url} accepted the prompt but sent no prompt id ({str(reply)[:300]}); is a "
                             "ComfyUI listening there? Check --url")
        return reply["prompt_id"]

    def history(self, prompt_id: str) -> dict | None:
        """The ``/history`` entry of a prompt (None while ComfyUI has none)."""
        body = self.get(f"/history/{prompt_id}")
        entry = body.get(prompt_id) if isinstance(body, dict) else None
        return entry if isinstance(entry, dict) else None

    def wait(self, prompt_id: str, timeout: float, on_tick: Callable[[], None] | None = None,
             interrupt: bool = False) -> dict:
        """Poll until the prompt finished (successfully or not); returns its history entry. Past ``timeout`` it
        raises ``error`` (``interrupt``: after interrupting the prompt)."""
        deadline = time.monotonic() + timeout
        while True:
            entry = self.history(prompt_id)
            if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
                return entry
            if self.proc is not None and self.proc.poll() is not None:
                raise self.error(f"ComfyUI exited (rc={self.proc.returncode}) while running the prompt; log:\n"
                                 f"{self.log_tail()}")
            if time.monotonic() > deadline:
                if interrupt:
                    self.interrupt()
                raise self.error(f"prompt {prompt_id} did not finish within {timeout:.0f} s"
                                 f"{' (interrupted)' if interrupt else ''}; log tail:\n{self.log_tail(3000)}")
            if on_tick:
                on_tick()
            time.sleep(0.1)

    def run(self, api: dict, timeout: float = 600) -> dict:
        """Queue ``api`` and wait for it; returns its history entry, raises ``error`` if it failed."""
        entry = self.wait(self.queue(api), timeout, interrupt=True)
        if entry["status"]["status_str"] != "success":
            raise self.error(execution_error(entry) or f"prompt failed: {json.dumps(entry['status'])[:2000]}")
        return entry

    def interrupt(self) -> None:
        """Interrupt the running prompt."""
        self._post("/interrupt", {})

    def free(self) -> None:
        """Ask ComfyUI to unload models and free memory (applied before its next prompt)."""
        self._post("/free", {"unload_models": True, "free_memory": True})

    def _post(self, route: str, body: dict) -> None:
        status, reply = self.request("POST", route, body)
        if status != 200:
            raise self.error(f"POST {route} -> HTTP {status}: {reply!r:.2000}")
