"""An MLflow tracking server for a team: PostgreSQL backend store, artifacts served from a folder.

    python scripts/mlflow_server.py start --dir /srv/quantgate-mlflow [--port 5000] [--pg-port 5433]
    export MLFLOW_TRACKING_URI=http://127.0.0.1:5000     # printed by start; then record, gate, fetch use it
    python scripts/mlflow_server.py status --dir /srv/quantgate-mlflow
    python scripts/mlflow_server.py stop --dir /srv/quantgate-mlflow

`start` initialises a private PostgreSQL cluster in DIR/pg with Debian's binaries
(/usr/lib/postgresql/<version>/bin; `apt-get install postgresql`), listening on 127.0.0.1 only, with a
generated password for its superuser and for the `mlflow` role that owns the `mlflow` database
(DIR/credentials.json, mode 0600; the cluster and its passwords are kept between starts). It then
starts `mlflow server` with that database as backend store, DIR/artifacts as artifact destination
(served through the server: clients never write there themselves), waits until /health answers and
writes DIR/server.json. PostgreSQL refuses to run as root: run as root, the script runs the cluster
as the `postgres` system user Debian's package creates, and DIR must be reachable by that user.
`stop` stops MLflow (its whole process group) and PostgreSQL and checks that nothing of them is left.

Exit 0 on success; 2 with one line saying what is wrong (no stack trace).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PG_ROOT = Path("/usr/lib/postgresql")
PG_USER = "postgres"  # the system user Debian's postgresql package creates
DATABASE = ROLE = "mlflow"
HEALTH_TIMEOUT_S = 180


class Refused(Exception):
    """What went wrong, in one line for the user."""


def pg_bin() -> Path:
    """Debian's newest PostgreSQL binaries (/usr/lib/postgresql/<version>/bin)."""
    found = sorted((p for p in PG_ROOT.glob("*/bin") if (p / "initdb").is_file() and (p / "pg_ctl").is_file()),
                   key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    if not found:
        raise Refused(f"PostgreSQL is not installed (no {PG_ROOT}/<version>/bin/initdb): apt-get install postgresql")
    return found[-1]


def as_cluster_owner() -> list[str]:
    """The command prefix that runs PostgreSQL's tools as a user it accepts (never root)."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        raise Refused(f"running as root, but there is no {PG_USER!r} system user to run PostgreSQL as "
                      "(apt-get install postgresql creates it)") from None
    runuser = shutil.which("runuser")
    if runuser is None:
        raise Refused("running as root, but `runuser` (util-linux) is missing: PostgreSQL refuses to run as root")
    return [runuser, "-u", PG_USER, "--"]


def chown_to_cluster_owner(path: Path) -> None:
    if os.geteuid() == 0:
        entry = pwd.getpwnam(PG_USER)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def run(cmd: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if out.returncode != 0:
        detail = (out.stderr or out.stdout).strip().splitlines()
        raise Refused(f"{what} failed (exit {out.returncode}): {detail[-1] if detail else 'no output'}")
    return out


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie is gone for our purposes
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


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


def postmaster_pid(data: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((data / "postmaster.pid").read_text().splitlines()[0])
    return None


def credentials(root: Path) -> dict:
    """Passwords of the cluster's superuser and the mlflow role, made once and kept (mode 0600)."""
    path = root / "credentials.json"
    if path.is_file():
        return json.loads(path.read_text())
    creds = {"superuser": PG_USER, "superuser_password": secrets.token_urlsafe(24),
             "role": ROLE, "password": secrets.token_urlsafe(24), "database": DATABASE}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(creds, f, indent=2)
    return creds


def init_cluster(bin_dir: Path, root: Path, creds: dict) -> bool:
    """initdb DIR/pg unless a cluster is already there; True when it was made now."""
    data = root / "pg"
    if (data / "PG_VERSION").is_file():
        return False
    if data.exists() and any(data.iterdir()):
        raise Refused(f"{data} exists, is not empty and holds no PostgreSQL cluster: remove it or choose another --dir")
    data.mkdir(mode=0o700, exist_ok=True)
    chown_to_cluster_owner(data)
    prefix = as_cluster_owner()
    if prefix and subprocess.run([*prefix, "test", "-w", str(data)], capture_output=True).returncode != 0:
        raise Refused(f"the {PG_USER} user cannot write {data}: a folder above it is not searchable by other users "
                      "(chmod o+x it, or choose a --dir elsewhere, e.g. under /srv)")
    pwfile = root / "pg.pwfile"  # read by initdb, then removed
    pwfile.write_text(creds["superuser_password"] + "\n")
    pwfile.chmod(0o600)
    chown_to_cluster_owner(pwfile)
    try:
        run([*prefix, str(bin_dir / "initdb"), "-D", str(data), "-U", PG_USER, f"--pwfile={pwfile}",
             "--auth-local=scram-sha-256", "--auth-host=scram-sha-256", "--encoding=UTF8", "--no-instructions"],
            "initdb")
    finally:
        pwfile.unlink(missing_ok=True)
    return True


def start_postgres(bin_dir: Path, root: Path, pg_port: int) -> int:
    data = root / "pg"
    if alive(postmaster_pid(data)):
        raise Refused(f"PostgreSQL already runs on {data} (pid {postmaster_pid(data)}): `stop --dir {root}` first")
    if not port_free(pg_port):
        raise Refused(f"--pg-port {pg_port} is busy on 127.0.0.1: choose another")
    log = root / "postgres.log"
    log.touch()
    chown_to_cluster_owner(log)
    # TCP on 127.0.0.1 only; the Unix socket in the cluster's own folder (not /var/run/postgresql)
    options = f"-c listen_addresses=127.0.0.1 -p {pg_port} -c unix_socket_directories={data}"
    run([*as_cluster_owner(), str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60",
         "start"], f"PostgreSQL start (see {log})")
    return postmaster_pid(data) or 0


def ensure_database(pg_port: int, creds: dict) -> None:
    """The mlflow role and the database it owns (psycopg, as the cluster's superuser over 127.0.0.1)."""
    try:
        import psycopg
        from psycopg import sql
    except ImportError:
        raise Refused("the psycopg driver MLflow needs for PostgreSQL is missing: "
                      "pip install -c constraints.txt -e . (psycopg[binary])") from None
    try:
        conn = psycopg.connect(host="127.0.0.1", port=pg_port, user=creds["superuser"],
                               password=creds["superuser_password"], dbname="postgres", connect_timeout=10)
    except psycopg.Error as err:
        raise Refused(f"could not connect to PostgreSQL on 127.0.0.1:{pg_port} as {creds['superuser']}: "
                      f"{str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}") from None
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (creds["role"],))
            if cur.fetchone() is None:
                cur.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                    sql.Identifier(creds["role"]), sql.Literal(creds["password"])))
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (creds["database"],))
            if cur.fetchone() is None:
                cur.execute(sql.SQL("CREATE DATABASE {} OWNER {} ENCODING 'UTF8'").format(
                    sql.Identifier(creds["database"]), sql.Identifier(creds["role"])))
    finally:
        conn.close()


def stop_postgres(bin_dir: Path | None, root: Path) -> None:
    data = root / "pg"
    pid = postmaster_pid(data)
    if not alive(pid):
        return
    if bin_dir is not None:
        subprocess.run([*as_cluster_owner(), str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "60",
                        "stop"], capture_output=True, text=True)
    if alive(pid):  # pg_ctl gone or stuck: the postmaster stops its children on SIGINT (fast shutdown)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
        wait_gone(lambda: not alive(pid), 30)


def wait_gone(done, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if done():
            return True
        time.sleep(0.2)
    return done()


def stop_mlflow(pgid: int | None) -> None:
    if not pgid or not group_members(pgid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    if not wait_gone(lambda: not group_members(pgid), 30):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        wait_gone(lambda: not group_members(pgid), 10)


def start_mlflow(root: Path, port: int, creds: dict, pg_port: int, workers: int) -> subprocess.Popen:
    mlflow = Path(sys.executable).with_name("mlflow")
    if not mlflow.is_file():
        mlflow = Path(shutil.which("mlflow") or "")
        if not mlflow.name:
            raise Refused("no `mlflow` command next to this Python nor on PATH: install quantgate first")
    if not port_free(port):
        raise Refused(f"--port {port} is busy on 127.0.0.1: choose another (or stop what listens there)")
    (root / "artifacts").mkdir(exist_ok=True)
    env = {**os.environ,
           # in the environment, not on the command line: `ps` shows no password
           "MLFLOW_BACKEND_STORE_URI": f"postgresql://{creds['role']}:{creds['password']}@127.0.0.1:{pg_port}/{creds['database']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    log = open(root / "mlflow.log", "a")  # noqa: SIM115 - the child keeps it
    try:
        return subprocess.Popen([str(mlflow), "server", "--artifacts-destination", str((root / "artifacts").resolve()),
                                 "--serve-artifacts", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, cwd=root)
    finally:
        log.close()


def wait_healthy(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.time() + HEALTH_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
            raise Refused(f"mlflow server exited with {proc.returncode} ({tail[0] if tail else 'no output'}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise Refused(f"mlflow server did not answer http://127.0.0.1:{port}/health within {HEALTH_TIMEOUT_S} s; see {log}")


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
    bin_dir = pg_bin()
    as_cluster_owner()  # fails early, before anything is made
    if not port_free(args.port):
        raise Refused(f"--port {args.port} is busy on 127.0.0.1: choose another (or stop what listens there)")
    pg_port = args.pg_port or free_port()
    if args.pg_port and not port_free(pg_port):
        raise Refused(f"--pg-port {pg_port} is busy on 127.0.0.1: choose another")
    root.mkdir(parents=True, exist_ok=True)
    began = time.time()
    creds = credentials(root)
    made = init_cluster(bin_dir, root, creds)
    pg_pid = start_postgres(bin_dir, root, pg_port)
    proc = None
    try:
        ensure_database(pg_port, creds)
        proc = start_mlflow(root, args.port, creds, pg_port, args.workers)
        wait_healthy(proc, args.port, root / "mlflow.log")
    except BaseException:
        if proc is not None:
            stop_mlflow(proc.pid)
        stop_postgres(bin_dir, root)
        raise
    uri = f"http://127.0.0.1:{args.port}"
    state = {"tracking_uri": uri, "port": args.port, "pg_port": pg_port, "mlflow_pid": proc.pid, "mlflow_pgid": proc.pid,
             "postgres_pid": pg_pid, "postgres_bin": str(bin_dir), "cluster": str(root / "pg"),
             "artifacts": str(root / "artifacts"), "started_seconds": round(time.time() - began, 2),
             "cluster_created": made}
    (root / "server.json").write_text(json.dumps(state, indent=2) + "\n")
    print(f"mlflow_server: MLflow on {uri} (PostgreSQL {bin_dir.parent.name} on 127.0.0.1:{pg_port}, artifacts in "
          f"{root / 'artifacts'}), up in {state['started_seconds']} s")
    print(f"export MLFLOW_TRACKING_URI={uri}")
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
    start.add_argument("--port", type=int, default=5000, help="MLflow's port on 127.0.0.1 (default 5000)")
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
