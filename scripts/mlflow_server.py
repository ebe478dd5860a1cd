"""An MLflow tracking server for a team: PostgreSQL backend store, artifacts served from a folder, MLflow's login.

    python scripts/mlflow_server.py start --dir /srv/quantgate-mlflow [--host 0.0.0.0] [--port 5000] [--pg-port 5433]
    export MLFLOW_TRACKING_URI=... MLFLOW_TRACKING_USERNAME=... MLFLOW_TRACKING_PASSWORD=...  # printed by start
    python scripts/mlflow_server.py status --dir /srv/quantgate-mlflow
    python scripts/mlflow_server.py stop --dir /srv/quantgate-mlflow

`start` initialises a private PostgreSQL cluster in DIR/pg with Debian's binaries
(/usr/lib/postgresql/<version>/bin; `apt-get install postgresql`), listening on 127.0.0.1 only, with a
generated password for its superuser and for the `mlflow` role that owns the `mlflow` database and the
`mlflow_auth` database of MLflow's users (DIR/credentials.json; the cluster and its passwords are kept between
starts). It then starts `mlflow server --app-name basic-auth` (MLflow's own authentication, settings in
DIR/auth.ini) with that database as backend store, DIR/artifacts as artifact destination (served through the
server: clients never write there themselves), waits until /health answers, checks that a request without a
login is refused (401) and writes DIR/server.json. MLflow's admin user `admin` is made on the first start with a
generated password (DIR/admin_password); secret files are mode 0600 from their first byte. An account sees only
what it made or was granted (`--default-permission`, default NO_PERMISSIONS). `--no-auth` (no login) is for
127.0.0.1 only: binding another address without authentication is refused. PostgreSQL refuses to run as root: run
as root, the script runs the cluster as the `postgres` system user Debian's package creates, and DIR must be
reachable by that user (scripts/mlflow_pg.py).
`stop` stops MLflow (its whole process group) and PostgreSQL and checks that nothing of them is left.

Exit 0 on success; 2 with one line saying what is wrong (no stack trace).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its PostgreSQL half, beside it
from mlflow_pg import (PG_USER, Refused, alive, as_cluster_owner, ensure_database, free_port,  # noqa: E402
                       init_cluster, pg_bin, port_free, postmaster_pid, start_postgres, stop_postgres, wait_gone,
                       write_private)

DATABASE = ROLE = "mlflow"
AUTH_DATABASE = "mlflow_auth"  # MLflow's users and permissions, in the same cluster (one backup, no SQLite writers)
ADMIN, ADMIN_PASSWORD = "admin", "admin_password"  # MLflow's admin user, and the file in DIR with its password
PERMISSIONS = ("NO_PERMISSIONS", "READ", "USE", "EDIT", "MANAGE")  # MLflow's, mlflow/server/auth/permissions.py
HEALTH_TIMEOUT_S = 180
WORKER_START_S = 120  # uvicorn's default, 5 s, killed every worker in a loop on a 2-core machine at load 18


def loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return host == "localhost"


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (MLflow's server, its workers and helpers)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    members.append(int(entry.name))
    return members


def credentials(root: Path) -> dict:
    """Passwords of the cluster's superuser and the mlflow role, MLflow's Flask secret and its admin's password
    (DIR/admin_password, alone: what users read), made once and kept; a DIR from before the login gets the new ones."""
    path, admin = root / "credentials.json", root / ADMIN_PASSWORD
    creds = json.loads(path.read_text()) if path.is_file() else {}
    new = {"superuser": PG_USER, "superuser_password": secrets.token_urlsafe(24), "role": ROLE,
           "password": secrets.token_urlsafe(24), "database": DATABASE, "auth_database": AUTH_DATABASE,
           "flask_secret_key": secrets.token_urlsafe(32)}
    if set(new) - set(creds):
        creds = {**new, **creds}
        write_private(path, json.dumps(creds, indent=2))
    if not admin.is_file():
        write_private(admin, secrets.token_urlsafe(24) + "\n")
    return {**creds, "admin_password": admin.read_text().strip()}


def auth_config(root: Path, creds: dict, pg_port: int, default_permission: str) -> Path:
    """MLflow's basic-auth settings (MLFLOW_AUTH_CONFIG_PATH), written at every start (the PostgreSQL port may
    change); the admin's password reaches MLflow through its environment, not this file."""
    path = root / "auth.ini"
    write_private(path, f"[mlflow]\ndefault_permission = {default_permission}\nadmin_username = {ADMIN}\n"
                        f"database_uri = postgresql://{creds['role']}:{creds['password']}@127.0.0.1:{pg_port}/"
                        f"{creds['auth_database']}\nauthorization_function = "
                        "mlflow.server.auth:authenticate_request_basic_auth\n")
    return path


def stop_mlflow(pgid: int | None) -> None:
    if not pgid or not group_members(pgid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    if not wait_gone(lambda: not group_members(pgid), 30):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        wait_gone(lambda: not group_members(pgid), 10)


def start_mlflow(root: Path, host: str, port: int, creds: dict, pg_port: int, workers: int,
                 auth: Path | None) -> subprocess.Popen:
    mlflow = Path(sys.executable).with_name("mlflow")
    if not mlflow.is_file():
        mlflow = Path(shutil.which("mlflow") or "")
        if not mlflow.name:
            raise Refused("no `mlflow` command next to this Python nor on PATH: install quantgate first")
    (root / "artifacts").mkdir(exist_ok=True)
    env = {**os.environ,
           # in the environment, not on the command line: `ps` shows no password
           "MLFLOW_BACKEND_STORE_URI": f"postgresql://{creds['role']}:{creds['password']}@127.0.0.1:{pg_port}/{creds['database']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    login = []
    if auth is not None:
        env.update(MLFLOW_AUTH_CONFIG_PATH=str(auth), MLFLOW_AUTH_ADMIN_PASSWORD=creds["admin_password"],
                   MLFLOW_FLASK_SERVER_SECRET_KEY=creds["flask_secret_key"])
        login = ["--app-name", "basic-auth"]
    log = open(root / "mlflow.log", "a")  # noqa: SIM115 - the child keeps it
    try:
        return subprocess.Popen([str(mlflow), "server", "--artifacts-destination", str((root / "artifacts").resolve()),
                                 "--serve-artifacts", "--host", host, "--port", str(port), "--workers", str(workers),
                                 # a worker of the login app that starts slowly on a busy machine is not killed
                                 "--uvicorn-opts", f"--timeout-worker-healthcheck {WORKER_START_S}", *login],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, cwd=root)
    finally:
        log.close()


def wait_healthy(proc: subprocess.Popen, base: str, log: Path) -> None:
    deadline = time.time() + HEALTH_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
            raise Refused(f"mlflow server exited with {proc.returncode} ({tail[0] if tail else 'no output'}); see {log}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise Refused(f"mlflow server did not answer {base}/health within {HEALTH_TIMEOUT_S} s; see {log}")


def refuses_anonymous(base: str) -> bool:
    """A request without a login is answered 401 (/health is public, so the check asks for experiments)."""
    try:
        urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30).close()
    except urllib.error.HTTPError as err:
        return err.code == 401
    return False


def read_state(root: Path) -> dict | None:
    path = root / "server.json"
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return None


def cmd_start(args) -> int:
    root = args.dir.resolve()
    state = read_state(root)
    if state and (group_members(state.get("mlflow_pgid") or 0) or alive(postmaster_pid(root / "pg"))):
        raise Refused(f"a server already runs from {root} ({state.get('tracking_uri')}): `stop --dir {root}` first")
    if args.no_auth and not loopback(args.host):
        raise Refused(f"--host {args.host} with --no-auth: anyone who reaches it could move `production` or edit what "
                      "promotion compares against; drop --no-auth (MLflow's login), or bind 127.0.0.1")
    bin_dir = pg_bin()
    as_cluster_owner()  # fails early, before anything is made
    if not port_free(args.port, args.host):
        raise Refused(f"--port {args.port} is busy on {args.host}: choose another (or stop what listens there)")
    pg_port = args.pg_port or free_port()
    if args.pg_port and not port_free(pg_port):
        raise Refused(f"--pg-port {pg_port} is busy on 127.0.0.1: choose another")
    socket_path = f"{root}/pg/.s.PGSQL.{pg_port}"  # where start_postgres puts it; a Unix socket's path fits 107 bytes
    if len(socket_path.encode()) > 107:
        raise Refused(f"--dir {root} is too long a path: PostgreSQL's socket in it ({socket_path}) would take "
                      f"{len(socket_path.encode())} bytes, over the 107 a Unix socket's path can: choose a shorter one")
    root.mkdir(parents=True, exist_ok=True)
    began = time.time()
    creds = credentials(root)
    made = init_cluster(bin_dir, root, creds)
    pg_pid = start_postgres(bin_dir, root, pg_port)
    wildcard = args.host in ("0.0.0.0", "::")
    name = socket.getfqdn() if wildcard else f"[{args.host}]" if ":" in args.host else args.host
    local = "http://127.0.0.1" if wildcard else f"http://{name}"
    proc = None
    try:
        ensure_database(pg_port, creds)
        auth = None if args.no_auth else auth_config(root, creds, pg_port, args.default_permission)
        proc = start_mlflow(root, args.host, args.port, creds, pg_port, args.workers, auth)
        wait_healthy(proc, f"{local}:{args.port}", root / "mlflow.log")
        if auth is not None and not refuses_anonymous(f"{local}:{args.port}"):
            raise Refused(f"MLflow answered a request without a login although started with basic-auth; see "
                          f"{root / 'mlflow.log'}")
    except BaseException:
        if proc is not None:
            stop_mlflow(proc.pid)
        stop_postgres(bin_dir, root)
        raise
    uri = f"http://{name}:{args.port}"
    state = {"tracking_uri": uri, "host": args.host, "port": args.port, "auth": None if args.no_auth else "basic-auth",
             "pg_port": pg_port, "mlflow_pid": proc.pid, "mlflow_pgid": proc.pid, "postgres_pid": pg_pid, "postgres_bin": str(bin_dir), "cluster": str(root / "pg"),
             "artifacts": str(root / "artifacts"), "started_seconds": round(time.time() - began, 2),
             "cluster_created": made}
    (root / "server.json").write_text(json.dumps(state, indent=2) + "\n")
    print(f"mlflow_server: MLflow on {uri} (PostgreSQL {bin_dir.parent.name} on 127.0.0.1:{pg_port}, artifacts in "
          f"{root / 'artifacts'}), up in {state['started_seconds']} s")
    print(f"export MLFLOW_TRACKING_URI={uri}")
    if not args.no_auth:  # the password stays in its file, out of this output and any log of it
        print(f"export MLFLOW_TRACKING_USERNAME={ADMIN}")
        print(f'export MLFLOW_TRACKING_PASSWORD="$(cat {root / ADMIN_PASSWORD})"')
    return 0


def cmd_stop(args) -> int:
    root = args.dir.resolve()
    state = read_state(root) or {}
    ran = bool(state) or alive(postmaster_pid(root / "pg"))
    stop_mlflow(state.get("mlflow_pgid"))
    bin_dir = Path(state["postgres_bin"]) if state.get("postgres_bin") else None
    if bin_dir is None:
        with contextlib.suppress(Refused):
            bin_dir = pg_bin()
    stop_postgres(bin_dir, root)
    left = group_members(state.get("mlflow_pgid") or 0) if state.get("mlflow_pgid") else []
    if alive(postmaster_pid(root / "pg")):
        left.append(postmaster_pid(root / "pg"))
    if left:
        raise Refused(f"still running after stop: pids {', '.join(map(str, left))}")
    (root / "server.json").unlink(missing_ok=True)
    print(f"mlflow_server: stopped; nothing of {root} is running" if ran else f"mlflow_server: nothing ran from {root}")
    return 0


def cmd_status(args) -> int:
    root = args.dir.resolve()
    state = read_state(root)
    mlflow_up = bool(state and group_members(state.get("mlflow_pgid") or 0))
    pg_up = alive(postmaster_pid(root / "pg"))
    print(json.dumps({"mlflow": mlflow_up, "postgres": pg_up, **({"tracking_uri": state["tracking_uri"]} if state else {})}))
    return 0 if mlflow_up and pg_up else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start PostgreSQL and the MLflow server (made on first start)")
    start.add_argument("--dir", type=Path, required=True, help="holds the cluster (pg/), artifacts/, logs, server.json")
    start.add_argument("--host", default="127.0.0.1", help="address MLflow binds (default 127.0.0.1; 0.0.0.0: every "
                       "interface, then a team reaches it; only with MLflow's login)")
    start.add_argument("--port", type=int, default=5000, help="MLflow's port (default 5000)")
    start.add_argument("--no-auth", action="store_true", help="no login (127.0.0.1 only): anyone on this machine can "
                       "change runs and the registry")
    start.add_argument("--default-permission", choices=PERMISSIONS, default="NO_PERMISSIONS",
                       help="what an account may do with what it neither made nor was granted (default: nothing)")
    start.add_argument("--pg-port", type=int, default=None, help="PostgreSQL's port on 127.0.0.1 (default: a free one)")
    start.add_argument("--workers", type=int, default=2, help="MLflow server worker processes (default 2)")
    start.set_defaults(func=cmd_start)
    for name, func in (("stop", cmd_stop), ("status", cmd_status)):
        p = sub.add_parser(name)
        p.add_argument("--dir", type=Path, required=True)
        p.set_defaults(func=func)
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except Refused as err:
        print(f"mlflow_server {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mlflow_server {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
