"""A small local server speaking the ModelArts v2 training-job API, standing in for the cluster.

The real ``huaweicloudsdkmodelarts`` client talks to it (``with_endpoints([server.url])``). It checks the
SDK's AK/SK request signature (SDK-HMAC-SHA256) the way the API gateway does, and answers errors with
ModelArts' body shape ``{"error_code", "error_msg"}``. Each created job runs its ``algorithm.command``
as local processes, one per node (``spec.resource.node_count``), with the environment ModelArts gives a
training container: ``MA_NUM_HOSTS``, ``MA_TASK_NAME``, ``MA_CURRENT_IP``, ``MA_NUM_GPUS``, ``MA_LOG_DIR``,
``MA_JOB_DIR``, ``VC_TASK_INDEX``, ``VC_WORKER_NUM``, ``VC_WORKER_HOSTS`` (every host is 127.0.0.1 here), plus
the job's own ``algorithm.environments``. Nothing of the test process's environment leaks in except
``PATH``/``HOME``/``LANG``/``PYTHONPATH``/``VIRTUAL_ENV``/``TMPDIR``; a job's processes see only their own
container's processes through psutil (tests/support/modelarts_container), so `ray stop` ends only that task's node.

Phases move as on ModelArts: Creating → Pending → Running → Completed | Failed, or Terminating →
Terminated after a stop, or Abnormal (secondary phase Lost) when the test kills a job mid-way with
``crash(job_id)`` or a ``crash_on_log(text)`` rule; ``lose_node_on_log(text, task)`` kills one task's
container (a node lost under a multi-node job) and lets the others decide how the job ends. A task's container
is every process with its environment, as Ray's daemons leave the task's process group. Endpoints: create,
show, search (list), logs preview (the last ``preview_limit`` bytes, with ``current_size``/``full_size``),
stop (``actions``), delete, events.
Error codes are representative: APIGW.0301 (signature), ModelArts.0103 (project), ModelArts.2702
(invalid body), ModelArts.2628 (no such job).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import hmac
import json
import os
import re
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlparse

import psutil

_PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR")
# First on every job process's PYTHONPATH: a container's view of the machine's processes (see its docstring).
_CONTAINER_VIEW = Path(__file__).resolve().parent / "modelarts_container"
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class FakeJob:
    id: str
    body: dict
    workdir: Path
    create_time: int = field(default_factory=lambda: int(time.time() * 1000))
    phase: str = "Creating"
    secondary_phase: str = "Creating"
    start_time: int | None = None
    end_time: int | None = None
    processes: list[subprocess.Popen] = field(default_factory=list)
    exit_codes: list[int | None] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    stop_requested: bool = False
    crashed: bool = False

    @property
    def node_count(self) -> int:
        return int(self.body["spec"]["resource"].get("node_count", 1))

    @property
    def tasks(self) -> list[str]:
        return [f"worker-{i}" for i in range(self.node_count)]

    def log_path(self, task: str) -> Path:
        return self.workdir / "logs" / f"{task}.log"

    def set_phase(self, phase: str, secondary: str | None = None) -> None:
        self.phase, self.secondary_phase = phase, secondary or phase
        self.events.append({"time": dt.datetime.now(dt.timezone.utc).isoformat(), "level": "Info",
                            "source": "Job", "message": f"Training job phase changed to {self.phase}"
                            + (f" ({self.secondary_phase})" if self.secondary_phase != self.phase else "")})

    def to_json(self) -> dict:
        now = int(time.time() * 1000)
        duration = None if self.start_time is None else (self.end_time or now) - self.start_time
        statuses = [{"task": t, "exit_code": rc, "message": ""} for t, rc in zip(self.tasks, self.exit_codes)
                    if rc is not None]
        return {"kind": "job",
                "metadata": {**self.body["metadata"], "id": self.id, "create_time": self.create_time,
                             "user_name": "vimeflow-test"},
                "status": {"phase": self.phase, "secondary_phase": self.secondary_phase, "duration": duration,
                           "start_time": self.start_time, "tasks": self.tasks if self.start_time else [],
                           "task_statuses": statuses},
                "algorithm": self.body.get("algorithm", {}), "spec": self.body["spec"]}


class ModelArtsServer:
    def __init__(self, workdir: Path, *, ak: str, sk: str, project_id: str, creating_s: float = 0.2,
                 pending_s: float = 0.2, preview_limit: int = 5 * 1024 * 1024):
        self.workdir, self.ak, self.sk, self.project_id = Path(workdir), ak, sk, project_id
        self.creating_s, self.pending_s, self.preview_limit = creating_s, pending_s, preview_limit
        self.jobs: dict[str, FakeJob] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every authenticated request
        self._crash_rules: list[list] = []  # [text, remaining, task killed (None: the whole job)]
        self.fail_next = 0  # answer this many authenticated requests with 503, as an overloaded gateway does
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    # ------------------------------------------------------------ test controls

    def crash(self, job_id: str) -> None:
        """Kill the job's processes as a lost node would, and report Abnormal (secondary phase Lost)."""
        job = self.jobs[job_id]
        job.crashed = True
        _kill(job)

    def crash_on_log(self, text: str, times: int = 1) -> None:
        """Crash the next ``times`` running jobs whose log shows ``text``."""
        with self._lock:
            self._crash_rules.append([text, times, None])

    def lose_node_on_log(self, text: str, task: str, times: int = 1) -> None:
        """Kill the container of `task` (e.g. "worker-1") in the next ``times`` running jobs whose log shows
        ``text``; the job goes on with its other tasks, as ModelArts' does when one node of it is lost."""
        with self._lock:
            self._crash_rules.append([text, times, task])

    def wait_for_phase(self, job_id: str, phases: set[str], timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while self.jobs[job_id].phase not in phases:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {self.jobs[job_id].phase}, wanted {phases}")
            time.sleep(0.02)
        return self.jobs[job_id].phase

    def close(self) -> None:
        for job in self.jobs.values():
            _kill(job)
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------ job lifecycle

    def create(self, body: dict) -> FakeJob:
        try:
            name = body["metadata"]["name"]
            command = body["algorithm"]["command"]
            body["algorithm"]["engine"]["image_url"]
            body["spec"]["resource"]["flavor_id"]
        except (KeyError, TypeError) as exc:
            raise ApiError(400, "ModelArts.2702", f"Invalid request body: missing field {exc}") from None
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name) or not command.strip():
            raise ApiError(400, "ModelArts.2702", f"Invalid job name or empty command: {name!r}")
        job_id = str(uuid.uuid4())
        job = FakeJob(job_id, body, self.workdir / job_id)
        (job.workdir / "logs").mkdir(parents=True)
        job.set_phase("Creating")
        self.jobs[job_id] = job
        threading.Thread(target=self._run, args=(job,), daemon=True).start()
        return job

    def _env(self, job: FakeJob, index: int) -> dict[str, str]:
        env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
        env.update({str(k): str(v) for k, v in (job.body["algorithm"].get("environments") or {}).items()})
        env.update(MA_NUM_HOSTS=str(job.node_count), MA_TASK_NAME="worker", MA_CURRENT_IP="127.0.0.1",
                   MA_NUM_GPUS="0", MA_LOG_DIR=str(job.workdir / "logs"), MA_JOB_DIR=str(job.workdir),
                   VC_TASK_INDEX=str(index), VC_WORKER_NUM=str(job.node_count),
                   VC_WORKER_HOSTS=",".join(["127.0.0.1"] * job.node_count))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_CONTAINER_VIEW), env.get("PYTHONPATH")) if p)
        return env

    def _run(self, job: FakeJob) -> None:
        time.sleep(self.creating_s)
        if not job.stop_requested:
            job.set_phase("Pending", "Queuing")
            time.sleep(self.pending_s)
        if not job.stop_requested:
            cwd = job.body["algorithm"].get("working_dir")
            cwd = cwd if cwd and Path(cwd).is_dir() else job.workdir
            for i, task in enumerate(job.tasks):
                with open(job.log_path(task), "wb") as out:
                    job.processes.append(subprocess.Popen(["/bin/sh", "-c", job.body["algorithm"]["command"]],
                                                          cwd=cwd, env=self._env(job, i), stdout=out,
                                                          stderr=subprocess.STDOUT, start_new_session=True))
            job.start_time = int(time.time() * 1000)
            job.set_phase("Running")
            while any(p.poll() is None for p in job.processes) and not job.stop_requested:
                self._apply_crash_rules(job)
                time.sleep(0.02)
        _kill(job)
        job.exit_codes = [p.returncode for p in job.processes]
        job.end_time = int(time.time() * 1000)
        if job.crashed:
            job.set_phase("Abnormal", "Lost")
        elif job.stop_requested:
            job.set_phase("Terminated")
        elif all(rc == 0 for rc in job.exit_codes):
            job.set_phase("Completed")
        else:
            job.set_phase("Failed")

    def _apply_crash_rules(self, job: FakeJob) -> None:
        with self._lock:
            for rule in self._crash_rules:
                text, remaining, task = rule
                if remaining > 0 and any(text.encode() in job.log_path(t).read_bytes() for t in job.tasks):
                    rule[1] -= 1
                    if task is None:
                        self.crash(job.id)
                    else:
                        _kill(job, [job.tasks.index(task)])
                    return

    def job(self, job_id: str) -> FakeJob:
        if job_id not in self.jobs:
            raise ApiError(404, "ModelArts.2628", f"Training job {job_id} does not exist")
        return self.jobs[job_id]

    def stop(self, job_id: str) -> FakeJob:
        job = self.job(job_id)
        if job.phase in ("Completed", "Failed", "Terminated", "Abnormal"):
            raise ApiError(400, "ModelArts.2714", f"Training job {job_id} is {job.phase} and cannot be stopped")
        job.stop_requested = True
        job.set_phase("Terminating")
        return job

    def log_preview(self, job_id: str, task: str) -> dict:
        job = self.job(job_id)
        if task not in job.tasks or not job.log_path(task).exists():
            raise ApiError(404, "ModelArts.2822", f"No log for task {task} of training job {job_id}")
        data = job.log_path(task).read_bytes()
        tail = data[-self.preview_limit:]
        return {"content": tail.decode("utf-8", errors="replace"), "current_size": len(tail),
                "full_size": len(data)}

    # ------------------------------------------------------------ auth

    def verify_signature(self, method: str, raw_path: str, headers, body: bytes) -> None:
        """The API gateway's check of the SDK's SDK-HMAC-SHA256 signature (see huaweicloudsdkcore.signer)."""
        auth = headers.get("Authorization", "")
        m = re.fullmatch(r"SDK-HMAC-SHA256 Access=([^,]+), SignedHeaders=([^,]+), Signature=([0-9a-f]+)", auth)
        if not m:
            raise ApiError(401, "APIGW.0301", "Incorrect IAM authentication information: Authorization missing")
        access, signed, signature = m.groups()
        url = urlparse(raw_path)
        uri = "/".join(quote(part, safe="~") for part in unquote(url.path).split("/"))
        uri = uri if uri.endswith("/") else uri + "/"
        query = "&".join(f"{quote(k, safe='~')}={quote(v, safe='~')}"
                         for k, v in sorted(parse_qsl(url.query, keep_blank_values=True)))
        canonical_headers = "".join(f"{h}:{(headers.get(h) or '').strip()}\n" for h in signed.split(";"))
        payload = hashlib.sha256(body).hexdigest() if body else _EMPTY_SHA256
        canonical = "\n".join([method, uri, query, canonical_headers, signed, payload])
        to_sign = "\n".join(["SDK-HMAC-SHA256", headers.get("X-Sdk-Date", ""),
                             hashlib.sha256(canonical.encode()).hexdigest()])
        expected = hmac.new(self.sk.encode(), to_sign.encode(), hashlib.sha256).hexdigest()
        if access != self.ak or not hmac.compare_digest(signature, expected):
            raise ApiError(401, "APIGW.0301",
                           "Incorrect IAM authentication information: verify aksk signature fail")


def _kill(job: FakeJob, tasks: list[int] | None = None) -> None:
    """End tasks of a job as ModelArts ends a container: every process of it, the daemons it started too (a Ray
    node's raylet leaves the task's process group). A container's processes are those with its environment."""
    indices = range(len(job.processes)) if tasks is None else tasks
    containers = {(str(job.workdir), str(i)) for i in indices}
    ours = {job.processes[i].pid for i in indices}  # reaped by Popen below, which then keeps their exit codes
    victims = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            env = proc.environ()
            if (env.get("MA_JOB_DIR"), env.get("VC_TASK_INDEX")) in containers:
                proc.kill()
                if proc.pid not in ours:
                    victims.append(proc)
    for i in indices:
        job.processes[i].wait()
    psutil.wait_procs(victims, timeout=30)


_ROUTES = [
    ("POST", r"/v2/(?P<project>[^/]+)/training-jobs", "create"),
    ("POST", r"/v2/(?P<project>[^/]+)/training-job-searches", "search"),
    ("GET", r"/v2/(?P<project>[^/]+)/training-jobs/(?P<job>[^/]+)", "show"),
    ("DELETE", r"/v2/(?P<project>[^/]+)/training-jobs/(?P<job>[^/]+)", "delete"),
    ("POST", r"/v2/(?P<project>[^/]+)/training-jobs/(?P<job>[^/]+)/actions", "action"),
    ("GET", r"/v2/(?P<project>[^/]+)/training-jobs/(?P<job>[^/]+)/events", "events"),
    ("GET", r"/v2/(?P<project>[^/]+)/training-jobs/(?P<job>[^/]+)/tasks/(?P<task>[^/]+)/logs/preview", "logs"),
]


def _make_handler(server: ModelArtsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _reply(self, status: int, body: dict | None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                path = urlparse(self.path).path
                for method, pattern, name in _ROUTES:
                    m = re.fullmatch(pattern, path)
                    if m and method == self.command:
                        break
                else:
                    raise ApiError(404, "ModelArts.0001", f"No API {self.command} {path}")
                server.verify_signature(self.command, self.path, self.headers, body)
                if m["project"] != server.project_id:
                    raise ApiError(403, "ModelArts.0103", "The project ID does not match the token")
                server.requests.append((self.command, path))
                if server.fail_next > 0:
                    server.fail_next -= 1
                    raise ApiError(503, "ModelArts.0010", "Service temporarily unavailable, retry later")
                status, reply = self._dispatch(name, m.groupdict(), json.loads(body) if body else {})
                self._reply(status, reply)
            except ApiError as exc:
                self._reply(exc.status, {"error_code": exc.code, "error_msg": exc.message})

        def _dispatch(self, name: str, params: dict, body: dict) -> tuple[int, dict | None]:
            if name == "create":
                return 201, server.create(body).to_json()
            if name == "search":
                items = [j.to_json() for j in server.jobs.values()]
                return 200, {"total": len(items), "count": len(items), "limit": 50, "offset": 0, "items": items}
            if name == "show":
                return 200, server.job(params["job"]).to_json()
            if name == "delete":
                job = server.job(params["job"])
                job.stop_requested = True
                _kill(job)
                del server.jobs[job.id]
                return 202, None
            if name == "action":
                if body.get("action_type") != "terminate":
                    raise ApiError(400, "ModelArts.2702", f"Unsupported action_type {body.get('action_type')!r}")
                return 202, server.stop(params["job"]).to_json()
            if name == "events":
                events = server.job(params["job"]).events
                return 200, {"total": len(events), "offset": 0, "limit": 50, "order": "asc", "events": events}
            return 200, server.log_preview(params["job"], params["task"])

        do_GET = do_POST = do_DELETE = _handle

    return Handler
